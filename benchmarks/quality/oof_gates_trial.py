"""Research harness: can the fit part tell when calibrated gates are worse than the auto gates?

Run: ``.venv/bin/python -m benchmarks.quality.oof_gates_trial [--sets a,b] [--folds 5]`` (about a
minute; untuned model, fused rule).

On a small fixture set ``capd calibrate`` fits its gates to the few rows that happen to be in the
fit part: on healthcare (11 fit nulls) the calibrated gates are worse held out than the auto gates
the tap gets without calibration (:mod:`capd.autogates`, fitted on the tap's own examples and no
fixture row). The variant: calibrate keeps its gates only when they beat the auto gates on the fit
part, measured fairly. The auto gates never saw a fixture row, so their fit-part figures are
unbiased; the calibrated gates' are the pooled out-of-fold figures of gates calibrated on the other
folds (``--folds`` folds of the fit part). Both are scored as ``capd calibrate`` scores (the fit
part's nulls as the tap's vetoes, no row vetoed by its own copy). Printed per set: the calibrated
gates' out-of-fold figures and the auto gates' on the fit part, then both on the held-out part.
Written to ``benchmarks/results/oof_gates_trial.json`` (with the calibrated gates' fit figures,
tuned on).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from benchmarks.quality.run import LIMITS, Bench, EvalSet, folds_trial, gated
from capd.calibrate import Variants, fit_gates, fitted_router, grid_for, score_variants
from capd.evaluation import apply_gates


def out_of_fold(variants: Variants, fit_rows: np.ndarray, folds: int) -> dict[str, float | None]:
    """fired_right / fired_wrong / null_fpr of the fit part, each fold decided by gates calibrated
    on the other folds (a fold without a feasible point fires nothing)."""
    grid = grid_for("fused")
    fold = np.arange(len(fit_rows)) % folds
    fired = {"right": 0, "wrong": 0, "null": 0}
    positive = next(iter(variants[False].values())).positive
    for k in range(folds):
        fitted = fit_gates(variants, fit_rows[fold != k], grid, LIMITS["max_null_fpr"], LIMITS["max_wrong"])
        if fitted.point is None:
            continue
        outcome = apply_gates(fitted.tables[fitted.point.top_k].subset(fit_rows[fold == k]),
                              fitted.point.threshold, fitted.point.margin, fitted.point.coverage)
        is_positive = positive[fit_rows[fold == k]]
        fired["right"] += int((outcome.fired & is_positive & outcome.correct).sum())
        fired["wrong"] += int((outcome.fired & is_positive & ~outcome.correct).sum())
        fired["null"] += int((outcome.fired & ~is_positive).sum())
    positives, nulls = int(positive[fit_rows].sum()), int((~positive[fit_rows]).sum())
    return {"fired_right": fired["right"] / max(positives, 1), "fired_wrong": fired["wrong"] / max(positives, 1),
            "null_fpr": fired["null"] / nulls if nulls else None}


def figures(m: dict[str, Any]) -> str:
    null = m.get("null_fpr")
    return f"{m['fired_right']:.3f} / {m['fired_wrong']:.3f} / " + ("—" if null is None else f"{null:.3f}")


def run_set(bench: Bench, evalset: EvalSet, folds: int) -> dict[str, Any]:
    with bench.fused_set(evalset) as on:
        auto = on.service.fit_auto_gates()
        router, _, _ = fitted_router(on.service.router, on.fixtures, on.vectors, on.tokens)
        variants = score_variants(router, on.fixtures, on.vectors, on.tokens, grid_for("fused"))
    fitted = fit_gates(variants, on.fit_rows, grid_for("fused"), LIMITS["max_null_fpr"], LIMITS["max_wrong"])
    point = fitted.point
    row: dict[str, Any] = {"set": evalset.name, "calibrated_oof": out_of_fold(variants, on.fit_rows, folds)}
    if point is not None:
        row["calibrated_fit"] = gated(fitted.tables[point.top_k], on.fit_rows, point)
        row["calibrated_held_out"] = gated(fitted.tables[point.top_k], on.held_rows, point)
    if auto is not None:
        table = variants[auto.abstain_corpus][auto.top_k]
        row["auto_fit"] = gated(table, on.fit_rows, auto)
        row["auto_held_out"] = gated(table, on.held_rows, auto)
    print(f"{evalset.name:20s} fit part: calibrated (out of fold) {figures(row['calibrated_oof'])}, auto "
          + (figures(row["auto_fit"]) if "auto_fit" in row else "none") + "; held out: calibrated "
          + (figures(row["calibrated_held_out"]) if point is not None else "none") + ", auto "
          + (figures(row["auto_held_out"]) if "auto_fit" in row else "none"), flush=True)
    return row


def main(argv: list[str]) -> dict[str, Any]:
    return folds_trial(argv, __doc__, "oof_gates_trial", run_set)


if __name__ == "__main__":
    main(sys.argv[1:])
