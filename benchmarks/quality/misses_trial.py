"""Research harness: only the fit part's misranked positives as examples (``capd calibrate --examples``
adds every fit row expecting one capability).

Run: ``.venv/bin/python -m benchmarks.quality.misses_trial [--sets a,b]`` (untuned model, fused rule).
A fit row expecting one capability joins the examples only when the tap as it routes ranks another
capability first (in-sample: the tap does not hold the row, so nothing leaks); the gates are then
fitted out of fold as ``--examples`` fits them (:func:`capd.calibrate_examples.out_of_fold`).
Printed per set, as one JSON line, held-out top1 / fired_right / fired_wrong / null_fpr for the
shipped calibration, ``--examples`` and this; written to ``benchmarks/results/misses_trial.json``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from benchmarks.quality.run import LIMITS, Bench, EvalSet, folds_trial, gated
from capd.calibrate import fit_gates, fitted_router, grid_for, score_variants
from capd.calibrate_examples import ExamplePlan, out_of_fold, plan_examples


def run_set(bench: Bench, evalset: EvalSet, folds: int) -> dict[str, Any]:
    grid = grid_for("fused")
    row: dict[str, Any] = {"set": evalset.name}
    with bench.fused_set(evalset) as on:
        fixtures, fit_rows, held_rows, vectors, tokens = on.fixtures, on.fit_rows, on.held_rows, on.vectors, on.tokens
        router, _, _ = fitted_router(on.service.router, fixtures, vectors, tokens)
        plain = score_variants(router, fixtures, vectors, tokens, grid)
        every = plan_examples(router.catalog, fixtures, add=True)
        assert every is not None
        table = plain[False][grid.top_ks[0]]
        winners = table.gate_inputs()[0]
        misses = np.array([i for i in every.rows if not table.expected[i, winners[i]]], dtype=int)
        plans = {"examples": every, "misses": ExamplePlan(every.kept, misses, every.dropped, added=False)}
        variants = {"shipped": plain}
        for name, plan in plans.items():
            variants[name], _ = out_of_fold(on.service.router_with_examples, plan, fixtures, vectors, tokens, grid,
                                            vetoes=True)
        for name, scored in variants.items():
            point = fit_gates(scored, fit_rows, grid, **LIMITS).point
            row[name] = None if point is None else {
                k: v for k, v in gated(scored[point.abstain_corpus][point.top_k], held_rows, point).items()
                if k in ("top1", "fired_right", "fired_wrong", "null_fpr")}
        row["rows"] = {"examples": len(every.rows), "misses": len(misses)}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str]) -> dict[str, Any]:
    return folds_trial(argv, __doc__, "misses_trial", run_set)


if __name__ == "__main__":
    main(sys.argv[1:])
