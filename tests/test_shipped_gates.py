"""The shipped tap's fused gates: fitted by `capd calibrate` on `taps/core/calibration/`, a set
of messages apart from the regression fixtures in `taps/core/fixtures/`, and measured on those
fixtures, which they never saw. Real model, real tap."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from capd.calibrate import calibrate
from capd.encoder import Encoder
from capd.evaluation import evaluate
from capd.fixtures import load_fixtures
from capd.service import Service
from capd.settings import Settings

CORE = Path(__file__).resolve().parent.parent / "taps" / "core"
LIMITS = {"max_null_fpr": 0.05, "max_wrong": 0.02}  # the tap's [floors.fused] (fixtures/floors.toml), as calibrated


def _rows(folder: str) -> list[Any]:
    return load_fixtures(sorted((CORE / folder).glob("*.jsonl")))


def test_the_calibration_set_is_apart_from_the_regression_fixtures(real_encoder: Encoder) -> None:
    calibration, fixtures = _rows("calibration"), _rows("fixtures")
    names = {p.name for p in (CORE / "capabilities").iterdir() if p.is_dir()}
    positives = [f for f in calibration if f.expect]
    assert {name for f in positives for name in f.expect} <= names
    assert all(sum(f.expect == (name,) for f in positives) >= 5 for name in names)  # every capability
    assert sum(not f.expect for f in calibration) >= 60  # nulls of every kind the fixtures have
    similarity = real_encoder.embed([f.message for f in calibration]) @ \
        real_encoder.embed([f.message for f in fixtures]).T
    assert float(similarity.max()) < 0.9  # no near copy (measured 0.87: two different <system-reminder> blocks)


def test_the_shipped_gates_are_what_calibrate_fits_on_the_calibration_set(fused_core: Service) -> None:
    """`capd calibrate --tap taps/core --fixtures taps/core/calibration/*.jsonl --rule fused
    --max-null-fpr 0.05 --max-wrong 0.02 --no-vetoes --write` wrote taps/core/capd.toml (the tap
    ships no vetoes.jsonl: on its fixtures they cost fired_right and let more nulls through)."""
    shipped = tomllib.loads((CORE / "capd.toml").read_text(encoding="utf-8"))["gates"]["fused"]
    assert not (CORE / "vetoes.jsonl").exists()
    point = calibrate(fused_core.router, _rows("calibration"), **LIMITS, vetoes=False)["recommended"]
    assert point is not None
    assert {k: point[k] for k in ("threshold", "margin", "coverage")} == pytest.approx(
        {k: shipped[k] for k in ("threshold", "margin", "coverage")})
    assert shipped["abstain_corpus"] is True and point["abstain_corpus"] is True


def test_the_shipped_gates_meet_the_goal_on_fixtures_they_never_saw(fused_core: Service) -> None:
    """Measured: fired_right 0.823, fired_wrong 0.004, null_fpr 0.024, top1 0.954 (406 rows),
    against 0.631 / 0 / 0.048 with the auto gates a tap without capd.toml gets (the abstain corpus on, as
    the tap has it)."""
    fixtures = _rows("fixtures")
    shipped, _, _ = evaluate(fused_core.router, fixtures)
    assert shipped["fired_right"] >= 0.80 and shipped["top1"] >= 0.90
    assert shipped["fired_wrong"] <= 0.03 and shipped["null_fpr"] <= 0.05
    auto = fused_core.fit_auto_gates()
    assert auto is not None
    without, _, _ = evaluate(fused_core.router, fixtures, auto.threshold, auto.margin, auto.coverage)
    assert shipped["fired_right"] >= without["fired_right"] + 0.15
    assert np.isclose(shipped["threshold"], -0.37)  # the tap's gates were in force, not the auto gates


def test_capd_test_takes_the_rule(model_settings: Settings) -> None:
    """`capd test --rule fused` measures a tap as a daemon with `rule = "fused"` routes it."""
    from click.testing import CliRunner

    from capd.cli import main

    result = CliRunner().invoke(main, ["test", str(CORE), "--rule", "fused", "--json",
                                       "--data-dir", str(model_settings.data_dir)])
    report = json.loads(result.stdout)["taps"][0]
    metrics = report["metrics"]
    assert metrics["fired_right"] >= 0.80 and metrics["top1"] >= 0.90  # the default rule: 0.486 / 0.870
    # and the tap holds fused to floors of its own (fixtures/floors.toml [floors.fused]), which it meets
    assert report["floors_table"] == "floors.fused" and result.exit_code == 0, report["checks"]
    assert {c["name"]: c["bound"] for c in report["checks"]}["fired_right"] == 0.80
