"""The shared eval sets run through `capd eval` and `capd calibrate`; the anchor rule reproduces
the figures measured independently for issue 6 (bundled MiniLM, gates 0.45 / 0.08).

Reads ../shared/evalsets in place (never copied); skips cleanly when it is absent.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from capd.calibrate import calibrate
from capd.evaluation import evaluate
from capd.fixtures import load_fixtures
from capd.service import Service
from capd.settings import Settings

EVALSETS = Path(__file__).resolve().parents[2] / "shared" / "evalsets"

# set -> (top1, fired_right at 0.45 / 0.08), as the issue reports them (two decimals)
ANCHOR = {
    "clinc150_intent": (0.83, 0.59),
    "clinc150_domain": (0.89, 0.57),
    "hwu64_scenario_oos": (0.82, 0.45),
    "snips7": (0.84, 0.29),
}

pytestmark = pytest.mark.skipif(not EVALSETS.is_dir(), reason="../shared/evalsets is not present")


@pytest.mark.parametrize("name", sorted(ANCHOR))
def test_anchor_reproduces_measured_baseline(name: str, model_settings: Settings) -> None:
    settings = replace(model_settings, taps=(EVALSETS / name / "tap",), rule="anchor")
    service = Service(settings).start()
    fixtures = load_fixtures([EVALSETS / name / "dev.jsonl"])
    result, _, _ = evaluate(service.router, fixtures, threshold=0.45, margin=0.08)
    top1, fired_right = ANCHOR[name]
    assert result["top1"] == pytest.approx(top1, abs=0.006)
    assert result["fired_right"] == pytest.approx(fired_right, abs=0.006)
    report = calibrate(service.router, fixtures)
    point = report["recommended"]
    assert point is not None
    assert report["fit"]["null_fpr"] in (None, 0.0) or report["fit"]["null_fpr"] <= 0.05
    assert report["fit"]["fired_wrong"] <= 0.03
    # Calibration finds at least what the production gates give on the rows it was fitted on.
    assert report["fit"]["fired_right"] >= fired_right - 0.02


def test_healthcare_splits(model_settings: Settings) -> None:
    root = EVALSETS / "healthcare"
    service = Service(replace(model_settings, taps=(root / "tap",))).start()
    for split in ("train.jsonl", "validation.jsonl"):
        result, _, _ = evaluate(service.router, load_fixtures([root / split]))
        assert result["n"] == result["positives"] + result["nulls"] and result["top1"] is not None
        assert set(result["per_kind"]) <= {"positive", "negative", "ambiguous"}
