"""Auto gates (capd/autogates.py) with the deterministic encoder: out-of-fold scoring, caching,
precedence. Their effect with the real model is in tests/test_fused.py."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from capd import autogates, fused, models
from capd.encoder import Embedded, HashEncoder
from capd.service import Service
from capd.settings import load_settings
from tests.conftest import SettingsFactory
from tests.taputil import write_capability

TRIGGERS = {
    "docker": ["list running containers", "restart the web container", "build a docker image",
               "show container logs", "remove stopped containers", "pull the latest image"],
    "postgres": ["run a sql query", "show database tables", "describe the users table",
                 "count rows in orders", "vacuum the database", "list postgres schemas"],
    "github": ["open a pull request", "list open issues", "review the latest pull request",
               "merge the branch", "create a github issue", "show failing checks"],
    "weather": ["what is the weather today", "will it rain tomorrow", "forecast for the weekend",
                "how hot is it outside", "is it windy now", "weather in paris"],
}


def _tap(root: Path) -> Path:
    for name, triggers in TRIGGERS.items():
        write_capability(root, name, triggers)
    write_capability(root, "lonely", ["lonely"])  # its name is its trigger: one example
    return root


def _examples(service: Service) -> autogates.Examples:
    assert service.index is not None and service.router.head is not None and service.router.head.tokens is not None
    examples = autogates.examples_of(service.index, service.router.head, service.router.encoder.embed_tokens)
    assert examples is not None and examples.embed_tokens is not None
    return examples


def test_every_example_is_scored_by_a_head_that_never_saw_it(settings_factory: SettingsFactory, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[set[str], list[str]]] = []
    score = autogates._score

    def recording(head: Any, examples: autogates.Examples, rows: np.ndarray, vectors: Any,
                  texts: Sequence[str], tokens: Any) -> Any:
        seen.append(({examples.texts[i] for i in rows}, list(texts)))
        return score(head, examples, rows, vectors, texts, tokens)

    with closing(Service(settings_factory(taps=(_tap(tmp_path / "tap"),), rule="fused")).start()) as service:
        examples = _examples(service)
        monkeypatch.setattr(autogates, "_score", recording)
        rows, fused_rows, levels, coverage = autogates.out_of_fold(examples)
    lonely = examples.names.index("lonely")
    assert sorted(rows.tolist()) == np.flatnonzero(examples.labels != lonely).tolist()  # its only example stays in
    assert fused_rows.shape == levels.shape == (len(rows), len(examples.names))
    assert coverage.shape == (len(rows),) and not np.isnan(coverage).any()  # every winner was re-scored
    assert len(seen) == autogates.AUTO_FOLDS
    for trained_on, scored in seen:
        assert scored and not trained_on & set(scored)


def test_folds_stop_once_enough_examples_are_scored(settings_factory: SettingsFactory, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fitted: list[int] = []
    head = autogates._head

    def counting(examples: autogates.Examples, rows: np.ndarray) -> Any:
        fitted.append(len(rows))
        return head(examples, rows)

    with closing(Service(settings_factory(taps=(_tap(tmp_path / "tap"),), rule="fused")).start()) as service:
        examples = _examples(service)
        monkeypatch.setattr(autogates, "_head", counting)
        every, *_ = autogates.out_of_fold(examples)
        monkeypatch.setattr(autogates, "AUTO_MIN_SCORED", 5)  # the first fold alone scores more than 5
        first, fused_rows, levels, coverage = autogates.out_of_fold(examples)
    assert len(fitted) == autogates.AUTO_FOLDS + 1  # all five folds, then the first alone
    assert 5 <= len(first) < len(every) and set(first.tolist()) < set(every.tolist())
    assert fused_rows.shape == levels.shape == (len(first), len(examples.names)) and coverage.shape == (len(first),)
    assert fitted[-1] == len(examples.labels) - len(first)  # its head was fitted on everything else


def test_auto_gates_are_cached_by_the_examples(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    calls: list[int] = []
    encoder = HashEncoder()

    def embed_corpus(corpus: Sequence[str]) -> Embedded:
        calls.append(len(corpus))
        return encoder.embed_tokens(corpus)

    corpus = ["thanks, that was great", "hello there", "the build log says error 137", "who won the match"]
    with closing(Service(settings_factory(taps=(_tap(tmp_path / "tap"),), rule="fused")).start()) as service:
        examples = _examples(service)
    cache = tmp_path / "cache"
    first = autogates.auto_gates(examples, corpus, embed_corpus, "key-1", cache)
    assert first.point is not None and calls == [len(corpus)] and len(list(cache.glob("*.auto.json"))) == 1
    assert autogates.auto_gates(examples, corpus, embed_corpus, "key-1", cache) == first
    assert calls == [len(corpus)]  # read back, not refitted
    autogates.auto_gates(examples, corpus, embed_corpus, "key-2", cache)
    assert len(calls) == 2  # other examples: fitted again


def test_auto_gates_are_fitted_again_when_fused_scoring_changes(settings_factory: SettingsFactory, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A capd whose fused scores changed without its heads changing (the second stage reading 16
    examples instead of 32) must not read back auto gates fitted on the old scores."""
    calls: list[int] = []
    encoder = HashEncoder()

    def embed_corpus(corpus: Sequence[str]) -> Embedded:
        calls.append(len(corpus))
        return encoder.embed_tokens(corpus)

    corpus = ["thanks, that was great", "who won the match"]
    with closing(Service(settings_factory(taps=(_tap(tmp_path / "tap"),), rule="fused")).start()) as service:
        examples = _examples(service)
    cache = tmp_path / "cache"
    autogates.auto_gates(examples, corpus, embed_corpus, "key", cache)
    monkeypatch.setattr(fused, "RESCORE_EXAMPLES", fused.RESCORE_EXAMPLES + 1)
    autogates.auto_gates(examples, corpus, embed_corpus, "key", cache)
    assert len(calls) == 2 and len(list(cache.glob("*.auto.json"))) == 2


def test_auto_gates_carry_over_until_enough_capabilities_changed(settings_factory: SettingsFactory,
                                                                 tmp_path: Path) -> None:
    calls: list[int] = []
    encoder = HashEncoder()

    def embed_corpus(corpus: Sequence[str]) -> Embedded:
        calls.append(len(corpus))
        return encoder.embed_tokens(corpus)

    with closing(Service(settings_factory(taps=(_tap(tmp_path / "tap"),), rule="fused")).start()) as service:
        examples = _examples(service)
    corpus, cache = ["hello there", "who won the match"], tmp_path / "cache"
    basis = {f"cap-{i}": "v1" for i in range(100)}
    fitted = autogates.auto_gates(examples, corpus, embed_corpus, "k0", cache, "model-a", basis)
    assert calls == [2] and fitted.basis == basis and fitted.point is not None
    two_changed = basis | {"cap-0": "v2", "cap-100": "new"}  # 2 of 100 = 2%: carried over, counted from the fit
    carried = autogates.auto_gates(examples, corpus, embed_corpus, "k1", cache, "model-a", two_changed, fitted)
    assert calls == [2] and carried == fitted
    restart = autogates.auto_gates(examples, corpus, embed_corpus, "k1", cache, "model-a", two_changed)
    assert restart == fitted  # read back with the fit it came from
    three_changed = two_changed | {"cap-1": "v2"}  # 3 of 100 since the fit, though one since the last edit
    refitted = autogates.auto_gates(examples, corpus, embed_corpus, "k2", cache, "model-a", three_changed, carried)
    assert calls == [2, 2] and refitted.basis == three_changed
    other_model = autogates.auto_gates(examples, corpus, embed_corpus, "k3", cache, "model-b", three_changed, refitted)
    assert calls == [2, 2, 2] and other_model.model == "model-b"  # a tuned model has its own scale: refitted
    assert autogates.changed_share({}, {"a": "1"}) == 1.0


def test_a_restart_after_an_edit_reuses_what_the_reload_fitted(settings_factory: SettingsFactory,
                                                               tmp_path: Path) -> None:
    """A capability added by a reload takes its folder's place in the catalog, not the last one, so
    the catalog a restart builds is the same and finds the head and auto gates the reload fitted."""
    tap = _tap(tmp_path / "tap")
    settings = settings_factory(taps=(tap,), rule="fused")
    with closing(Service(settings).start()) as service:
        write_capability(tap, "aardvark", ["feed the aardvark", "where is the aardvark", "weigh the aardvark"])
        service.reload([tap / "capabilities" / "aardvark" / "config.toml"])
        live_names, live_key = service.router.head.names, service.router.head.key  # type: ignore[union-attr]
        live_gates = service.auto_gates
    heads = sorted(p.name for p in (settings.data_dir / "heads").iterdir())
    with closing(Service(settings).start()) as service:
        assert service.router.head is not None
        assert (service.router.head.names, service.router.head.key) == (live_names, live_key)
        assert live_names[0] == "aardvark" and service.auto_gates == live_gates
    assert sorted(p.name for p in (settings.data_dir / "heads").iterdir()) == heads  # nothing new fitted


def test_a_taps_gates_and_the_settings_override_the_auto_gates(settings_factory: SettingsFactory,
                                                               tmp_path: Path) -> None:
    tap = _tap(tmp_path / "tap")
    settings = settings_factory(taps=(tap,), rule="fused")
    with closing(Service(settings).start()) as service:
        auto = service.auto_gates
        assert auto is not None
        assert service.router.gates.default.threshold == auto.threshold
        assert service.router.gates.default.margin == auto.margin
    (tap / "capd.toml").write_text("model = \"hash\"\n[gates.fused]\nthreshold = 0.25\nmargin = 0.5\n")
    with closing(Service(dataclasses.replace(settings, data_dir=tmp_path / "d2")).start()) as service:
        assert service.router.gates.for_tap(tap.absolute()).threshold == 0.25
    with closing(Service(dataclasses.replace(settings, data_dir=tmp_path / "d3", threshold=0.5)).start()) as service:
        assert service.router.gates.for_tap(tap.absolute()).threshold == 0.5


def test_no_auto_gates_are_fitted_where_every_tap_sets_its_own(settings_factory: SettingsFactory,
                                                                tmp_path: Path) -> None:
    """They would gate nothing: the start skips them (and their cost), ``fit_auto_gates`` still gives
    them for comparisons, and a reload that leaves a tap without gates of its own fits them."""
    tap = _tap(tmp_path / "tap")
    settings = settings_factory(taps=(tap,), rule="fused")
    with closing(Service(settings).start()) as service:
        fitted = service.auto_gates
    assert fitted is not None
    own = tap / "capd.toml"
    own.write_text("model = \"hash\"\n[gates.fused]\nthreshold = 0.25\nmargin = 0.5\n")
    settings = dataclasses.replace(settings, data_dir=tmp_path / "d2")
    with closing(Service(settings).start()) as service:
        assert service.auto_gates is None and not list((settings.data_dir / "heads").glob("*.auto.json"))
        assert service.router.gates.for_tap(tap.absolute()).threshold == 0.25
        assert service.fit_auto_gates() == fitted and service.auto_gates is None  # compared, not installed
        own.write_text("model = \"hash\"\n[gates.fused]\nthreshold = 0.25\n")  # no margin of its own
        service.reload([own])
        assert service.auto_gates == fitted and service.router.gates.for_tap(tap.absolute()).threshold == 0.25
    own.write_text("model = \"another-model\"\n[gates.fused]\nthreshold = 0.25\nmargin = 0.5\n")
    with closing(Service(dataclasses.replace(settings, data_dir=tmp_path / "d3")).start()) as service:
        assert service.auto_gates == fitted  # gates calibrated for another model gate nothing here


def test_auto_gates_can_be_turned_off(tmp_path: Path) -> None:
    settings = load_settings(env={"CAPD_AUTO_GATES": "false", "HOME": str(tmp_path)})
    assert settings.auto_gates is False
    assert load_settings(env={"HOME": str(tmp_path)}).auto_gates is True


def test_no_auto_gates_over_the_head_budget(settings_factory: SettingsFactory, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a head (a huge catalog) there is nothing to refit per fold: the manifest's point applies."""
    with closing(Service(settings_factory(taps=(_tap(tmp_path / "tap"),), rule="fused")).start()) as service:
        examples = _examples(service)
    assert autogates.choose(examples, ["hello there"], HashEncoder().embed_tokens(["hello there"])) is not None
    monkeypatch.setattr("capd.fused.HEAD_BUDGET", len(examples.labels))
    assert autogates.choose(examples, ["hello there"], HashEncoder().embed_tokens(["hello there"])) is None


@pytest.mark.parametrize("platform", ["linux", "without sched_getaffinity"])
def test_fits_while_serving_leave_a_core_to_routing(settings_factory: SettingsFactory, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch, platform: str) -> None:
    """A start fits with every BLAS thread; a reload that replaces a served snapshot fits the head
    and the auto gates with one core fewer (at least one), which the routes served meanwhile keep.
    Where ``os.sched_getaffinity`` does not exist (macOS), the cores are counted by ``os.cpu_count``."""
    import scipy.optimize  # noqa: F401  (the head's fit loads it, and its own BLAS pool: counted from the start)
    from threadpoolctl import threadpool_info

    cores = len(os.sched_getaffinity(0))
    if platform != "linux":
        monkeypatch.delattr(os, "sched_getaffinity")
        cores = os.cpu_count() or 1

    from capd import fused

    def blas_threads() -> list[int]:
        return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]

    seen: list[list[int]] = []
    fit = fused.fit_head

    def recording_fit(*args: Any) -> Any:
        seen.append(blas_threads())
        return fit(*args)

    monkeypatch.setattr(fused, "fit_head", recording_fit)
    everyone = blas_threads()
    tap = _tap(tmp_path / "tap")
    with closing(Service(settings_factory(taps=(tap,), rule="fused")).start()) as service:
        at_start, seen[:] = list(seen), []
        write_capability(tap, "aardvark", ["feed the aardvark", "where is the aardvark", "weigh the aardvark"])
        service.reload([tap / "capabilities" / "aardvark" / "config.toml"])
    assert everyone and at_start and all(threads == everyone for threads in at_start)
    spare = [min(n, max(1, cores - 1)) for n in everyone]  # one core left to routing
    assert len(seen) == 6 and all(threads == spare for threads in seen)  # the head and 5 folds
    assert blas_threads() == everyone  # restored afterwards


def test_a_manifests_coverage_gate_stays_under_the_auto_gates(settings_factory: SettingsFactory, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto gates fit threshold and margin only; the coverage gate still comes from the manifest
    (it was replaced by the auto point's coverage, always 0: no coverage gate)."""
    monkeypatch.setattr(models, "HASH_MANIFEST", dataclasses.replace(models.HASH_MANIFEST, fused_coverage=0.4))
    with closing(Service(settings_factory(taps=(_tap(tmp_path / "tap"),), rule="fused")).start()) as service:
        auto = service.auto_gates
        assert auto is not None and auto.coverage == 0.0
        gates = service.router.gates.default
    assert (gates.threshold, gates.margin, gates.coverage) == (auto.threshold, auto.margin, 0.4)
