"""The routing-quality report (``make quality``) on taps/core with the real model: its held-out
figures are what ``capd calibrate`` reports, absent eval sets are skipped with a line, and the
markdown carries every section."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from benchmarks.quality import run as quality
from benchmarks.quality.report import render
from capd.calibrate import calibrate, folds_of, split
from capd.encoder import Encoder
from capd.fixtures import load_fixtures, tap_fixture_files
from capd.service import Service
from capd.settings import Settings
from capd.text import routed_key

CORE = quality.ROOT / "taps" / "core"


@dataclass(frozen=True)
class Report:
    result: dict[str, Any]
    markdown: str
    scratch: Path  # the run's data directories


@pytest.fixture(scope="module")
def report(real_encoder: Encoder, tmp_path_factory: pytest.TempPathFactory) -> Report:
    absent = tmp_path_factory.mktemp("no-evalsets") / "evalsets"
    scratch = tmp_path_factory.mktemp("quality")
    result = quality.measure(["snips7", "core"], absent, feedback_sets=["core"], encoder=real_encoder,
                             scratch=scratch, timed=20, tune=False)
    return Report(result, render(result, tmp_path_factory.mktemp("results")), scratch)


@pytest.mark.slow
@pytest.mark.parametrize("rule", quality.RULES)
def test_held_out_figures_are_what_calibrate_reports(report: Report, rule: str, model_settings: Settings,
                                                     real_encoder: Encoder) -> None:
    result = report.result
    # the report's own data directory: its vector cache and fitted heads make this quick
    settings = replace(model_settings, taps=(CORE,), rule=rule, data_dir=report.scratch / "shared")
    service = Service(settings, encoder=real_encoder).start()
    fixtures = load_fixtures(tap_fixture_files(CORE))
    try:
        expected = calibrate(service.router, fixtures)
        offsets = calibrate(service.router, fixtures, offsets=True) if rule == "fused" else None
        examples = calibrate(service.router, fixtures, rebuild=service.router_with_examples,
                             add_examples=True) if rule == "fused" else None
        chosen = calibrate(service.router, fixtures, rebuild=service.router_with_examples) if rule == "fused" else None
    finally:
        service.close()
    measured = result["sets"]["core"]["rules"][rule]
    if offsets is not None:  # `capd calibrate --offsets`
        assert measured["calibrated_offsets"]["held_out"] == offsets["held_out"]
        assert measured["calibrated_offsets"]["gates"] == offsets["recommended"]
        assert measured["calibrated_offsets"]["offsets"] == len(offsets["offsets"]) > 0
    else:
        assert "calibrated_offsets" not in measured
    if examples is not None:  # `capd calibrate --examples`
        assert measured["calibrated_examples"]["held_out"] == examples["held_out"]
        assert measured["calibrated_examples"]["fit"] == examples["fit"]
        assert measured["calibrated_examples"]["gates"] == examples["recommended"]
        assert measured["calibrated_examples"]["examples"] == examples["examples"]["fit_rows"] > 0
    else:
        assert "calibrated_examples" not in measured
    if chosen is not None:  # plain `capd calibrate`: the summary's figures (with examples where they pay)
        default = measured["calibrated_default"]
        assert default["examples_added"] == (chosen["examples"] is not None)
        assert (default["held_out"], default["gates"]) == (chosen["held_out"], chosen["recommended"])
        assert chosen["add_examples"] == {"without": expected["recommended"]["fired_right"],
                                          "with": examples["recommended"]["fired_right"]}
    assert measured["calibrated"]["held_out"] == expected["held_out"]
    assert measured["calibrated"]["fit"] == expected["fit"]
    assert measured["calibrated"]["gates"] == expected["recommended"]  # the abstain corpus choice included
    assert measured["abstain_corpus"] == expected["abstain_corpus"]
    held = measured["calibrated"]["held_out"]
    assert held["positives"] + held["nulls"] == expected["rows"]["held_out"]
    assert measured["all_rows"]["all"]["n"] == expected["rows"]["fit"] + expected["rows"]["held_out"]
    assert measured["default"]["gates"] == result["manifest"]["gates"][rule]


@pytest.mark.slow
def test_markdown_has_every_section(report: Report) -> None:
    result, markdown = report.result, report.markdown
    assert list(result["sets"]) == ["core"]
    assert result["skipped"] and "snips7: skipped" in result["skipped"][0]
    assert "- snips7: skipped" in markdown
    before = result["sets"]["core"]["rules"]["anchor"]["calibrated"]["held_out"]
    after = result["sets"]["core"]["rules"]["fused"]["calibrated"]["held_out"]
    summary = next(line for line in markdown.splitlines() if line.startswith("| core | "))
    assert f"{before['fired_right']:.3f} → {after['fired_right']:.3f}" in summary
    assert f"{after['positives']} / {after['nulls']}" in summary
    for label in ("**anchor, calibrated on fit part**", "**fused, calibrated on fit part**", "fit (tuned on)",
                  "all rows (tuned on: ceiling)", "anchor, production gates", "fused, manifest default gates"):
        assert label in markdown
    for heading in ("## Summary", "## Learning from corrections", "## Cost of the fused rule", "## What we tried"):
        assert heading in markdown
    offsets = markdown.split("## Per-capability offsets")[1].split("\n## ")[0]
    assert f"| core | {after['positives']} / {after['nulls']} " in offsets and "| core | fused | " in offsets
    assert "not measured by this script" in markdown
    assert result["sets"]["core"]["timing"]["fused"]["score_ms"] > 0


@pytest.mark.slow
def test_feedback_loop_learns_from_the_fit_part_only(report: Report) -> None:
    result, markdown = report.result, report.markdown
    if not result["learning_available"]:
        assert "Not available" in markdown
        return
    loop = result["sets"]["core"]["feedback"]
    rule = result["sets"]["core"]["rules"]["fused"]
    fused = rule["calibrated_no_vetoes"]  # the loop learns its own vetoes, so it starts without the fixtures'
    assert rule["vetoes"] > 0 and "| core | fused | " in markdown.split("## The tap's vetoes")[1]
    assert loop["before"] == fused["held_out"]  # the same router and gates before learning
    assert 0 < loop["learned"] <= loop["corrected"] + loop["refused"] <= loop["routed"] == fused["fit"]["n"]
    assert loop["refit_traffic"]["routed"] == (fused["fit"]["n"] + 1) // 2  # (b) learns from alternate rows only
    assert loop["refused"] > 0  # fit-part nulls that activated something were disabled: learned abstains
    assert loop["after_same_gates"]["positives"] == fused["held_out"]["positives"]
    assert "| core | " in markdown.split("## Learning from corrections")[1]


def test_core_cal_is_calibrated_on_the_calibration_files_and_held_out_on_the_fixtures(tmp_path: Path) -> None:
    (evalset,), _ = quality.find_sets([quality.CORE_CAL], tmp_path / "absent", report=True)
    calibration = load_fixtures(evalset.fixture_files)
    fixture_rows = load_fixtures(tap_fixture_files(CORE))
    assert {p.parent.name for p in evalset.fixture_files} == {"calibration"} and calibration and fixture_rows
    fit_part, _ = split(calibration)  # what `capd calibrate --fixtures taps/core/calibration/...` fits on
    with evalset.file_split() as fixtures:
        fit, held = split(fixtures)
        folds = folds_of(fixtures)
    assert [fixtures[i] for i in fit[:len(fit_part)]] == [calibration[i] for i in fit_part]
    held_rows = [fixtures[i] for i in held]
    assert all(row in fixture_rows for row in held_rows)
    # a fixture row fitted on instead routes as the text of a calibration row it joins
    fitted_keys = {routed_key(calibration[i].message) for i in fit_part}
    moved = [f for f in fixture_rows if f not in held_rows]
    assert all(routed_key(f.message) in fitted_keys for f in moved)
    assert len(split(fixtures)[1]) != len(held)  # the split is the shipped one again
    assert (folds_of(fixtures) == folds).all()  # folds are never moved
    # research harnesses split by hash (some salt it): the set is the report's alone
    found, skipped = quality.find_sets([quality.CORE_CAL], tmp_path / "absent")
    assert not found and "only in the quality report" in skipped[0]
