"""Tuning the model on a tap's own examples (capd/tuning.py): the recipe's pieces, the cache
by content hash, the daemon's background tuning and swap, and — on the real model — that the
tuned model separates unseen messages of a tap's capabilities better than the untuned one."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import capd.onnx_export as onnx_export
import capd.tuned_models as tuned_models
import capd.tuner as tuner_module
from benchmarks.quality.tune_trial import hard_batches
from capd.catalog import Catalog
from capd.cli import main
from capd.encoder import Encoder
from capd.errors import CapdError
from capd.index import SyncReport
from capd.service import Service
from capd.settings import Settings
from capd.taps import load_catalog
from capd.tuned_models import MARKER, is_tuned, prune, tuned_dir
from capd.tuner import target_for
from capd.tuning import Batcher, batches, groups_for, pairs, publish, tuning_key
from tests.conftest import isolated_data_dir
from tests.taputil import octomind_tap, write_capability

TRIGGERS = {
    "postgres": ["run a SQL query on the database", "show the tables in postgres",
                 "which rows changed in the orders table", "explain this slow query",
                 "create an index on the users table"],
    "docker": ["start a container from this image", "list running containers", "build the docker image",
               "show the logs of the web container", "stop every container"],
    "calendar": ["schedule a meeting with Ana tomorrow", "what is on my calendar today", "move my 3pm call to Friday",
                 "find a free slot next week", "cancel the standup on Monday"],
}
UNSEEN = {  # paraphrases that are no capability's trigger
    "postgres": ["count the customers in the db", "select everything from invoices where total is over 100"],
    "docker": ["restart the nginx container", "pull the latest redis image and run it"],
    "calendar": ["book a call with the team on Thursday", "am I free at noon"],
}


def write_tap(root: Path, triggers: dict[str, list[str]] = TRIGGERS) -> Path:
    for name, texts in triggers.items():
        write_capability(root, name, texts)
    return root


# -- the recipe's pieces (no model) --------------------------------------------------------


NEIGHBOURS = [[(i + d) % 6 for d in (1, 2, 3, 4, 5)] for i in range(6)]  # for the research harness's batcher


@pytest.mark.parametrize("batcher", [batches, partial(hard_batches, neighbours=NEIGHBOURS)],
                         ids=["random", "hard"])
def test_batches_never_hold_a_capability_twice_and_keep_every_pair(batcher: Batcher) -> None:
    groups = [(f"c{i}", [f"c{i} example {j}" for j in range(2 + i)]) for i in range(6)]
    items = pairs(groups, 3, random.Random(0))
    assert all(a != b and a.split()[0] == b.split()[0] for _, a, b in items)
    assert len(items) == sum(len(t) * min(3, len(t) - 1) for _, t in groups)
    planned = batcher(items, 4, random.Random(1))
    assert sorted(p for b in planned for p in b) == sorted(items)
    for batch in planned:
        assert 1 <= len(batch) <= 4
        assert len({label for label, _, _ in batch}) == len(batch)


def test_key_follows_the_examples_not_their_order(tmp_path: Path) -> None:
    groups = groups_for(load_catalog([write_tap(tmp_path / "tap")]))
    assert [name for name, _ in groups] == ["calendar", "docker", "postgres"]
    assert all(len(texts) == 6 for _, texts in groups)  # five triggers and the name
    key = tuning_key("sha", groups)
    assert tuning_key("sha", list(reversed(groups))) == key
    assert tuning_key("other-weights", groups) != key
    edited = [(n, [*t[:-1], t[-1] + "!"]) if n == "docker" else (n, t) for n, t in groups]
    assert tuning_key("sha", edited) != key
    # two taps in either order: the same key, so the same training data in the same order
    first, second = write_tap(tmp_path / "a", {"zebra": TRIGGERS["docker"]}), write_tap(tmp_path / "b", TRIGGERS)
    both = groups_for(load_catalog([first, second]))
    assert both == groups_for(load_catalog([second, first])) and both[-1][0] == "zebra"


def test_a_tuning_finished_twice_keeps_the_first_copy(tmp_path: Path) -> None:
    """Two processes tuning one key: the later one drops its copy, never deletes one in use."""
    out = tuned_dir(tmp_path, "k")
    out.parent.mkdir(parents=True)
    out.mkdir()
    (out / "model.safetensors").write_text("interrupted copy, no marker", encoding="utf-8")
    for n in (1, 2):
        scratch = tmp_path / "tuned" / f".k.{n}.tmp"
        scratch.mkdir()
        (scratch / "model.safetensors").write_text(f"weights {n}", encoding="utf-8")
        (scratch / MARKER).write_text("{}", encoding="utf-8")
        publish(scratch, out)
        assert not scratch.exists()
    assert is_tuned(out) and (out / "model.safetensors").read_text(encoding="utf-8") == "weights 1"


def fake_models(data_dir: Path, keys: list[str]) -> list[Path]:
    """Complete-looking tuned models (weights, marker, an ONNX export dir), oldest first."""
    from capd.model_weights import sha256_file
    from capd.onnx_export import onnx_dir

    made = []
    for key in keys:
        directory = tuned_dir(data_dir, key)
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(f"weights {key}".encode())
        (directory / MARKER).write_text("{}", encoding="utf-8")
        onnx_dir(data_dir, sha256_file(directory / "model.safetensors")).mkdir(parents=True)
        made.append(directory)
        time.sleep(0.01)
    return made


@contextlib.contextmanager
def held_elsewhere(directory: Path) -> Iterator[None]:
    """Another process routing with the tuned model in ``directory`` (it holds InUse)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        yield
    finally:
        holder.kill()
        holder.wait()


HOLDER = """
import sys, time
from pathlib import Path
from capd.tuned_models import InUse
hold = InUse(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(60)
"""
ROOT = Path(__file__).resolve().parent.parent


def test_prune_keeps_the_most_recent_and_their_onnx_exports(tmp_path: Path) -> None:
    fake_models(tmp_path, [f"k{i}" for i in range(5)])
    (tmp_path / "tuned" / f".k9.{os.getpid()}.tmp").mkdir()  # a tuning run in progress is left alone
    removed = prune(tmp_path, "k0", retain=3)
    assert sorted(p.name for p in removed) == ["k1", "k2"]
    assert sorted(p.name for p in (tmp_path / "tuned").iterdir()) == [f".k9.{os.getpid()}.tmp", "k0", "k3", "k4"]
    assert len(list((tmp_path / "onnx").iterdir())) == 3


def test_prune_spares_a_model_another_process_routes_with(tmp_path: Path) -> None:
    """A long-running daemon's model, older than the last 3 used: newer tunings by other
    processes on the data directory removed it from under the daemon."""
    k0, k1, *_ = fake_models(tmp_path, [f"k{i}" for i in range(5)])
    with held_elsewhere(k0):
        assert tuned_models.listing(tmp_path)[-1] == {**tuned_models.listing(tmp_path)[-1], "key": "k0", "in_use": True}
        assert sorted(p.name for p in prune(tmp_path, "k4", retain=2)) == ["k1", "k2"]
        assert is_tuned(k0) and len(list((tmp_path / "onnx").iterdir())) == 3
    assert not k1.exists() and [r["in_use"] for r in tuned_models.listing(tmp_path)] == [False] * 3
    assert sorted(p.name for p in prune(tmp_path, "k4", retain=2)) == ["k0"]  # let go of: an old model like any


def test_letting_go_of_a_model_marks_it_used(tmp_path: Path) -> None:
    k0, _ = fake_models(tmp_path, ["k0", "k1"])
    hold = tuned_models.InUse(k0)
    time.sleep(0.01)
    hold.release()
    assert [r["key"] for r in tuned_models.listing(tmp_path)] == ["k0", "k1"]
    hold.release()  # twice is harmless


def test_remove_takes_a_key_or_its_unique_start_and_refuses_a_model_in_use(tmp_path: Path) -> None:
    fake_models(tmp_path, ["ab12", "ab34", "cd56"])
    assert tuned_models.remove(tmp_path, "cd") == tuned_dir(tmp_path, "cd56")
    assert not tuned_dir(tmp_path, "cd56").exists() and len(list((tmp_path / "onnx").iterdir())) == 2
    with pytest.raises(CapdError, match="names 2 tuned models"):
        tuned_models.remove(tmp_path, "ab")
    for missing in ("cd56", "", "zz", "../tuned"):
        with pytest.raises(CapdError, match="no tuned model"):
            tuned_models.remove(tmp_path, missing)
    with held_elsewhere(tuned_dir(tmp_path, "ab12")):
        with pytest.raises(CapdError, match="in use by a running capd process"):
            tuned_models.remove(tmp_path, "ab12")
        assert is_tuned(tuned_dir(tmp_path, "ab12"))
    assert tuned_models.remove(tmp_path, "ab12").name == "ab12"
    assert sorted(p.name for p in (tmp_path / "tuned").iterdir()) == ["ab34"]  # its lock files went too


def test_prune_racing_another_process_neither_warns_nor_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Two processes pruning one data directory: the one that finds a model already gone said
    "cannot remove the superseded tuned model … No such file" and left the rest in place."""
    for i in range(5):
        directory = tuned_dir(tmp_path, f"k{i}")
        directory.mkdir(parents=True)
        (directory / MARKER).write_text("{}", encoding="utf-8")
        time.sleep(0.01)
    real = shutil.rmtree
    beaten: list[str] = []

    def other_process_first(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).name == "k1" and not beaten:  # the other process removes it between listing and here
            beaten.append(Path(path).name)
            real(path)
        real(path, *args, **kwargs)

    monkeypatch.setattr(tuned_models.shutil, "rmtree", other_process_first)
    assert sorted(p.name for p in prune(tmp_path, "k0", retain=2)) == ["k1", "k2", "k3"]
    assert beaten == ["k1"] and "cannot remove" not in caplog.text
    assert sorted(p.name for p in (tmp_path / "tuned").iterdir()) == ["k0", "k4"]


def test_tune_list_shows_the_tuned_models_and_marks_the_taps_own(tmp_path: Path, model_settings: Settings) -> None:
    tap = write_tap(tmp_path / "tap")
    settings = replace(isolated_data_dir(model_settings, tmp_path), taps=(tap,), tune=True)
    wanted = target_for(settings, load_catalog([tap])).key
    for i, key in enumerate(["older", wanted]):
        directory = tuned_dir(settings.data_dir, key)
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"w" * 1000)
        (directory / MARKER).write_text(json.dumps({"capabilities": 3, "examples": 18, "steps": 9 + i}))
        time.sleep(0.01)
    (settings.data_dir / "tuned" / ".k.123.tmp").mkdir()  # not a model
    args = ["tune", "--list", "--tap", str(tap), "--data-dir", str(settings.data_dir)]
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["tuned"]
    assert [(r["key"], r["current"], r["steps"]) for r in rows] == [(wanted, True, 10), ("older", False, 9)]
    assert rows[0]["bytes"] > 1000
    assert sorted(p.name for p in (settings.data_dir / "tuned").iterdir()) == sorted([".k.123.tmp", "older", wanted])
    text = CliRunner().invoke(main, args).stdout
    assert text.startswith(f"* {wanted}") and "3 capabilities, 18 examples, 9 steps" in text


def test_tune_remove_removes_what_it_names_and_reports_what_it_cannot(tmp_path: Path) -> None:
    fake_models(tmp_path, ["ab12", "cd34"])
    args = ["tune", "--data-dir", str(tmp_path), "--json"]
    result = CliRunner().invoke(main, [*args, "--remove", "ab", "--remove", "nope"])
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {"data_dir": str(tmp_path), "removed": [str(tuned_dir(tmp_path, "ab12"))],
                                         "errors": [f"no tuned model 'nope' in {tmp_path / 'tuned'} "
                                                    "(capd tune --list shows them)"]}
    assert "no tuned model 'nope'" in result.stderr
    result = CliRunner().invoke(main, ["tune", "--data-dir", str(tmp_path), "--remove", "cd34"])
    assert result.exit_code == 0 and result.stdout == f"removed {tuned_dir(tmp_path, 'cd34')}\n"
    assert CliRunner().invoke(main, [*args, "--remove", "x", "--list"]).exit_code == 2


def test_tune_list_shows_what_interrupted_runs_left_and_remove_takes_it(tmp_path: Path) -> None:
    """A tuning run killed while saving leaves ``.KEY.PID.tmp`` (a model's size) that only the next
    tuning run swept: --list did not show it and --remove could not name it."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    fake_models(tmp_path, ["ab12"])
    dead = tmp_path / "tuned" / f".ab34.{int(gone.stdout)}.tmp"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"w" * 5000)
    running = tmp_path / "tuned" / f".cd56.{os.getpid()}.tmp"
    running.mkdir()
    args = ["tune", "--data-dir", str(tmp_path)]
    listed = json.loads(CliRunner().invoke(main, [*args, "--list", "--json"]).stdout)
    assert [r["key"] for r in listed["tuned"]] == ["ab12"]
    assert [(r["name"], r["bytes"], r["running"]) for r in listed["leftovers"]] == [
        (dead.name, 5000, False), (running.name, 0, True)]
    text = CliRunner().invoke(main, [*args, "--list"]).stdout
    assert f"capd tune --remove {dead.name}" in text and "a tuning run in progress" in text
    result = CliRunner().invoke(main, [*args, "--remove", dead.name, "--remove", running.name])
    assert result.exit_code == 1 and f"removed {dead}" in result.stdout
    assert "being written by a running tuning run" in result.stderr
    assert not dead.exists() and running.exists() and is_tuned(tuned_dir(tmp_path, "ab12"))


def test_tune_list_says_when_a_marker_has_no_training_summary(tmp_path: Path) -> None:
    """It printed "None capabilities, None examples, None steps"."""
    fake_models(tmp_path, ["ab12"])
    (tuned_dir(tmp_path, "ab12") / MARKER).write_text("{}")
    text = CliRunner().invoke(main, ["tune", "--data-dir", str(tmp_path), "--list"]).stdout
    assert "no training summary in its marker" in text and "None" not in text


def test_tune_list_creates_no_data_directory(tmp_path: Path) -> None:
    """A listing only reads: with a mistyped --data-dir it created the folder and a weights stamp in it."""
    typo = tmp_path / "typo"
    result = CliRunner().invoke(main, ["tune", "--list", "--tap", str(octomind_tap(tmp_path / "tap")),
                                       "--data-dir", str(typo)])
    assert result.exit_code == 0 and "no tuned model for these taps yet" in result.output, result.output
    assert not typo.exists()


# -- the real model -----------------------------------------------------------------------------


def separation(encoder: Encoder, groups: list[tuple[str, list[str]]]) -> float:
    """Mean over unseen messages of (top-3 cosine to their own capability's examples − the best
    other capability's)."""
    examples = {name: encoder.embed(texts) for name, texts in groups}
    gaps = []
    for name, messages in UNSEEN.items():
        for vector in encoder.embed(messages):
            scores = {n: float(np.sort(e @ vector)[-3:].mean()) for n, e in examples.items()}
            gaps.append(scores[name] - max(s for n, s in scores.items() if n != name))
    return float(np.mean(gaps))


@pytest.fixture(scope="module")
def tuned_service(model_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("tuning")
    settings = replace(isolated_data_dir(model_settings, root), taps=(write_tap(root / "tap"),), tune=True,
                       rule="fused")
    service = Service(settings).start()  # no sessions: tunes in the foreground
    yield service
    service.close()


@pytest.mark.slow
def test_tuned_model_separates_unseen_messages_better(tuned_service: Service, real_encoder: Encoder) -> None:
    state = tuned_service.tuning
    assert state.status == "ready" and state.key is not None and state.seconds is not None
    assert is_tuned(Path(state.model or ""))
    assert tuned_service.health()["model"] != real_encoder.model_id
    assert tuned_service.router.encoder.model_id == tuned_service.health()["model"]
    groups = groups_for(tuned_service.catalog_now())
    before, after = separation(real_encoder, groups), separation(tuned_service.router.encoder, groups)
    assert after > before + 0.05, (before, after)
    assert tuned_service.gate_model == "all-minilm-l6-v2+tuned"  # its gates are kept apart in capd.toml


@pytest.mark.slow
def test_a_restart_reuses_the_tuned_model(tuned_service: Service) -> None:
    again = Service(tuned_service.settings).start()
    try:
        assert again.tuning.status == "ready" and again.tuning.key == tuned_service.tuning.key
        assert again.tuning.seconds is None  # nothing trained
        assert again.health()["model"] == tuned_service.health()["model"]
        assert again.route("restart the nginx container").decision.candidates[0][0] == "docker"
    finally:
        again.close()


@pytest.mark.slow
def test_daemon_serves_while_tuning_then_swaps_and_retunes_after_an_edit(
        model_settings: Settings, real_encoder: Encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuner_module, "TUNE_DELAY", 0.1)

    def no_export(*_: object) -> None:  # in this process only: the tuning child exports, at its low priority
        raise AssertionError("the daemon exported a tuned model to ONNX itself (torch, ~600 MB kept)")

    monkeypatch.setattr(onnx_export, "export", no_export)
    tap = write_tap(tmp_path / "tap", {n: t[:4] for n, t in TRIGGERS.items()})  # not the module's tap: tunes afresh
    settings = replace(isolated_data_dir(model_settings, tmp_path), taps=(tap,), tune=True)
    service = Service(settings, sessions=True).start()
    mid_switch: list[dict[str, object]] = []  # what health said while a switch re-embedded, before publishing
    publish = Service._publish

    def watched(self: Service, catalog: Catalog) -> SyncReport:
        if self is service and self._snapshot is not None and self.encoder is not self.router.encoder:
            mid_switch.append({"served": self.router.encoder.model_id, **self.health()})
        return publish(self, catalog)

    monkeypatch.setattr(Service, "_publish", watched)
    try:
        assert service.tuning.status == "tuning"  # start() did not wait for it
        assert service.health()["model"] == real_encoder.model_id
        assert service.route("list running containers", "s1").decision.decision in ("activate", "abstain")
        first = wait_for(service, lambda s: s.tuning.status == "ready")
        # health said "ready" with the new key while the switch was still re-embedding (README: ready
        # means routing uses it); it now tells what the served snapshot routes with
        assert mid_switch and all(h["model"] == h["served"] == real_encoder.model_id for h in mid_switch)
        assert all(h["tuning"]["status"] == "tuning" and h["tuning"]["key"] is None  # type: ignore[index]
                   for h in mid_switch)
        mid_switch.clear()
        assert service.health()["model"] != real_encoder.model_id and ":onnx:" in service.health()["model"]
        assert service.route("list running containers", "s1").decision.capability == "docker"

        write_capability(tap, "docker", [*TRIGGERS["docker"][:4], "remove dangling images"])
        service.reload()
        second = wait_for(service, lambda s: s.tuning.status == "ready" and s.tuning.key != first)
        assert mid_switch and all(h["tuning"]["key"] == first and h["model"] == h["served"]  # type: ignore[index]
                                  for h in mid_switch)
        assert second != first and is_tuned(tuned_dir(settings.data_dir, first))  # the last few are kept
        assert "remove dangling images" in service.router.index.triggers("docker")
        assert service.health()["tuning"]["key"] == second
    finally:
        service.close()


def wait_for(service: Service, done: Callable[[Service], bool], timeout: float = 240.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done(service):
            return str(service.tuning.key)
        assert service.tuning.status != "failed", service.tuning.error
        time.sleep(0.2)
    raise AssertionError(f"tuning did not finish in {timeout} s: {service.tuning}")


@pytest.mark.slow
def test_cli_tune_reports_the_cached_model(tuned_service: Service) -> None:
    settings = tuned_service.settings
    result = CliRunner().invoke(main, ["tune", "--tap", str(settings.taps[0]), "--data-dir", str(settings.data_dir),
                                       "--json"])
    assert result.exit_code == 0, result.output
    state = json.loads(result.output)
    assert state["status"] == "ready" and state["key"] == tuned_service.tuning.key and state["seconds"] is None


def test_cli_tune_fails_clearly_with_nothing_to_tune(tmp_path: Path, model_settings: Settings) -> None:
    tap = tmp_path / "tap"
    write_capability(tap, "only", ["a single capability cannot be contrasted"])
    data = isolated_data_dir(model_settings, tmp_path).data_dir
    result = CliRunner().invoke(main, ["tune", "--tap", str(tap), "--data-dir", str(data)])
    assert result.exit_code == 1
    assert "nothing to tune on" in result.output


def test_tune_list_never_advises_a_tuning_that_would_refuse(tmp_path: Path, model_settings: Settings) -> None:
    """One capability: --list said "no tuned model for these taps yet (KEY): capd tune", and
    `capd tune` then failed with "nothing to tune on"."""
    tap = tmp_path / "tap"
    write_capability(tap, "only", ["a single capability cannot be contrasted", "nor can two of its triggers"])
    data = isolated_data_dir(model_settings, tmp_path).data_dir
    args = ["tune", "--list", "--tap", str(tap), "--data-dir", str(data)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == "no tuned model for these taps: nothing to tune on: fewer than two capabilities " \
                            "with two or more examples\n"
    assert json.loads(CliRunner().invoke(main, [*args, "--json"]).stdout)["wanted"] is None


def test_cli_tune_says_the_hash_model_cannot_be_tuned_and_still_lists(tmp_path: Path) -> None:
    """`capd tune --model hash` said only "tuning did not complete: off", and `--list` failed
    with "model 'hash' is built in and has no files" instead of listing the data directory."""
    tap = write_tap(tmp_path / "tap")
    fake_models(tmp_path / "data", ["ab12"])
    args = ["tune", "--model", "hash", "--tap", str(tap), "--data-dir", str(tmp_path / "data")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert "the built-in hash model cannot be tuned" in result.stderr
    assert json.loads(CliRunner().invoke(main, [*args, "--json"]).stdout)["error"].startswith("the built-in hash")
    listed = CliRunner().invoke(main, [*args, "--list", "--json"])
    assert listed.exit_code == 0, listed.output
    assert [(r["key"], r["current"]) for r in json.loads(listed.stdout)["tuned"]] == [("ab12", False)]


def test_hard_batches_fill_a_batch_with_the_nearest_capabilities() -> None:
    items = [(label, f"c{label} a{j}", f"c{label} b{j}") for label in range(6) for j in range(2)]
    for batch in hard_batches(items, 3, random.Random(0), NEIGHBOURS)[:2]:  # every capability still pending
        seed = batch[0][0]
        assert [label for label, _, _ in batch] == [seed, *NEIGHBOURS[seed][:2]]


def test_a_key_set_aside_twice_in_one_second_keeps_both(tmp_path: Path) -> None:
    """The second rename found the first set-aside's name taken and failed: the unusable model
    stayed in place (a restart within the second after a failed tuning adopted it again)."""
    model = tuned_dir(tmp_path, "k")
    asides = []
    for text in ("first", "second"):
        model.mkdir(parents=True)
        (model / "weights").write_text(text)
        asides.append(tuned_models.set_aside(model, "it gives NaN"))
    assert None not in asides and not model.exists()
    assert [(a / "weights").read_text() for a in asides if a is not None] == ["first", "second"]
