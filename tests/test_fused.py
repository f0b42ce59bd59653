"""The fused rule: its parts in isolation, and each part's contribution on the real model."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from capd.calibrate import calibrate, write_gates
from capd.catalog import Capability
from capd.evaluation import evaluate, score_table
from capd.fixtures import load_fixtures
from capd.fused import Lexicon, fit_head, in_class_similarity, words
from capd.models import load_manifests, manifest_for
from capd.report_html import render
from capd.router import Router, example_texts
from capd.service import Service
from capd.settings import Settings, default_taps
from capd.taps import load_tap_config

CORE = Path(__file__).resolve().parents[1] / "taps" / "core"


def test_words_drop_filler_and_strip_suffixes() -> None:
    assert words("Can you please list the running containers?") == ["list", "runn", "container"]
    assert words("a I to") == []


def test_lexicon_prefers_the_document_that_names_the_product() -> None:
    lexicon = Lexicon([["query a postgres table"], ["read a file from disk"], ["query a mysql table"]])
    scores = lexicon.scores(["postgres query please", "nothing relevant here"])
    assert scores[0].argmax() == 0 and scores[0, 0] > scores[0, 2] > 0  # "query" counts for both; "postgres" decides
    assert not scores[1].any()
    assert lexicon.matches("postgres query", 0) == sorted(words("postgres query"))


def test_in_class_similarity_is_tightness_of_each_capability() -> None:
    rng = np.random.default_rng(0)
    centre = rng.normal(size=16)
    tight = centre + 0.05 * rng.normal(size=(4, 16))
    loose = rng.normal(size=(4, 16))
    vectors = np.vstack([tight, loose, rng.normal(size=(1, 16))]).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    mu = in_class_similarity(vectors, np.array([0] * 4 + [1] * 4 + [2]), 3)
    assert mu[0] > 0.9 > mu[1]
    assert mu[2] == 1.0  # one example: nothing to compare with


def test_head_handles_one_and_two_capabilities() -> None:
    x = np.array([[1, 0], [0.9, 0.1], [0, 1], [0.1, 0.9]], dtype=np.float32)
    weight, bias = fit_head(x, np.array([0, 0, 1, 1]), 3)  # capability 2 has no examples
    logits = x @ weight + bias
    assert (logits.argmax(axis=1) == [0, 0, 1, 1]).all()
    single_w, single_b = fit_head(x, np.array([1, 1, 1, 1]), 2)
    assert ((x @ single_w + single_b).argmax(axis=1) == 1).all()


def test_examples_are_triggers_plus_description_and_name_for_fused_only() -> None:
    capability = Capability(name="issue-tracking", tap=CORE, path=CORE, triggers=("file a bug",),
                            description="Track issues")
    assert example_texts(capability, "anchor", ["learned one"]) == ("file a bug",)
    assert example_texts(capability, "capd", ["learned one"]) == ("file a bug", "learned one")
    assert example_texts(capability, "fused", ["learned one"]) == ("file a bug", "Track issues", "issue tracking",
                                                                   "learned one")
    assert example_texts(dataclasses.replace(capability, triggers=()), "fused") == ()  # never auto-routed


def _top1(router: Router, fixtures: list[Any]) -> float:
    table = score_table(router, fixtures)
    winner, _, _ = table.gate_inputs()
    right = table.expected[np.arange(len(winner)), winner] & table.positive
    return float(right.sum() / table.positive.sum())


@pytest.fixture(scope="module")
def fused_core(model_settings: Settings) -> Service:
    return Service(dataclasses.replace(model_settings, taps=default_taps(), rule="fused")).start()


@pytest.fixture(scope="module")
def core_fixtures() -> list[Any]:
    return load_fixtures(sorted((CORE / "fixtures").glob("*.jsonl")))


def test_each_part_adds_to_top1_on_the_shipped_tap(fused_core: Service, model_settings: Settings,
                                                    core_fixtures: list[Any]) -> None:
    """Measured on taps/core with the bundled model: anchor 0.869, fused 0.959 (see the quality report)."""
    anchor = Service(dataclasses.replace(model_settings, taps=default_taps(), rule="anchor")).start()
    router = fused_core.router
    head = router.head
    assert head is not None
    full = _top1(router, core_fixtures)
    ablations = {}
    for label, variant in {"no head": dataclasses.replace(head, mix=0.0),
                           "no bm25": dataclasses.replace(head, lexical_weight=0.0),
                           "nearest examples only": dataclasses.replace(head, mix=0.0, lexical_weight=0.0)}.items():
        router.head = variant
        try:
            ablations[label] = _top1(router, core_fixtures)
        finally:
            router.head = head
    baseline = _top1(anchor.router, core_fixtures)
    assert full >= 0.95
    assert full > ablations["no head"] and full > ablations["no bm25"]
    # descriptions and names as examples: nearest examples alone already beat triggers alone
    assert ablations["nearest examples only"] > baseline


def test_fused_default_gates_route_and_abstain(fused_core: Service) -> None:
    router = fused_core.router
    assert router.gates.default.threshold == manifest_for(fused_core.settings).fused_threshold
    hit = router.route("show me the open pull requests on our github repo")
    assert (hit.decision, hit.capability) == ("activate", "github")
    assert hit.score is not None and hit.margin is not None and hit.candidates[0][0] == "github"
    miss = router.route("thanks, that looks great")
    assert miss.decision == "abstain" and miss.reason
    assert router.discover("postgres")[0][0] == "postgres"
    explained = router.explain("list the tables in the postgres database", limit=1)[0]
    assert explained["name"] == "postgres" and words("postgres")[0] in explained["words"]


def test_calibrate_fused_and_write_keeps_the_other_rules_gates(fused_core: Service, core_fixtures: list[Any],
                                                               tmp_path: Path) -> None:
    report = calibrate(fused_core.router, core_fixtures)
    point = report["recommended"]
    assert report["rule"] == "fused" and point["top_k"] == 3
    assert report["fit"]["null_fpr"] <= 0.05 and report["fit"]["fired_wrong"] <= 0.03
    tap = tmp_path / "tap"
    (tap / "capabilities").mkdir(parents=True)
    write_gates(tap, {"threshold": 0.4, "margin": 0.05, "top_k": 2}, "all-minilm-l6-v2", "capd")
    write_gates(tap, point, "all-minilm-l6-v2", "fused")
    written = tomllib.loads((tap / "capd.toml").read_text())
    assert written["gates"]["threshold"] == 0.4 and written["gates"]["top_k"] == 2
    assert written["gates"]["fused"] == {"threshold": point["threshold"], "margin": point["margin"]}
    config, problems = load_tap_config(tap)
    assert not problems and config is not None
    assert config.gates_for("fused") == {"threshold": point["threshold"], "margin": point["margin"]}
    assert config.gates_for("capd")["threshold"] == 0.4


def test_manifest_carries_fused_gates(model_settings: Settings) -> None:
    manifest = load_manifests(model_settings.models_dir)["all-minilm-l6-v2"]
    assert manifest.gates_for("fused") == {"threshold": 0.01, "margin": 0.0, "top_k": 3}
    assert manifest.gates_for("anchor") == manifest.gates


def test_eval_and_html_report_on_the_fused_scale(fused_core: Service, core_fixtures: list[Any]) -> None:
    result, table, outcome = evaluate(fused_core.router, core_fixtures)
    assert result["rule"] == "fused" and result["top1"] >= 0.95 and table.levels is not None
    page = render(result, table, outcome, "core, fused")
    edges = [float(e) for e in re.findall(r"in \[(-?[0-9.]+), ", page)]
    assert "rule fused" in page and min(edges) < -0.1  # drawn on the level scale (a cosine plot starts at -0.1)
