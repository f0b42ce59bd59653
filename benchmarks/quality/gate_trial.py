"""Research harness: a learned fire gate in place of the fused rule's three calibrated gates.

Run: ``.venv/bin/python -m benchmarks.quality.gate_trial [--sets a,b] [--features 0,1,2] [--c 0.1,1]``
(under a minute).

``capd calibrate`` fires when the winner's level, the log-odds gap to the runner-up and the
winner's coverage each clear a threshold: three axis-aligned cuts, swept on a grid. The
alternative screened here learns one direction through those statistics instead: a logistic
regression on the fit part's rows (standardised features; label 1 for a positive row whose winner
is expected, 0 for a null or a wrong winner), then one cut on its decision value, chosen on the
fit part as ``capd calibrate`` chooses (most fired_right with null_fpr <= 0.05 and
fired_wrong <= 0.03). Feature sets: ``0`` level, gap (capped at 30) and coverage (NaN counts
as 1, as the gate passes it); ``1`` adds the winner's fused score; ``2`` adds the runner-up's
level, level x coverage and log(1 + gap). Both are measured on the held-out part, on the score
table of the top_k calibration chose. Writes ``benchmarks/results/gate_trial.json``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

from benchmarks.quality.run import LIMITS, chosen_sets, fit_and_held_out, gated, trial_bench, trial_parser, write_report
from capd.calibrate import best_point, grid_for
from capd.evaluation import ScoreTable, apply_gates, metrics, score_table
from capd.gates import Gates

GAP_CAP = 30.0  # a lone capability's gap is inf


def features(table: ScoreTable, kind: int) -> np.ndarray:
    """[rows, features] of feature set ``kind`` (module docstring)."""
    assert table.levels is not None, "the fused rule's table"
    winner, level, gap = table.gate_inputs()
    rows = np.arange(len(winner))
    gap = np.minimum(gap, GAP_CAP)
    coverage = np.ones(len(rows)) if table.coverage is None else np.nan_to_num(table.coverage, nan=1.0)
    columns = [level, gap, coverage]
    if kind >= 1:
        columns.append(table.scores[rows, winner])
    if kind >= 2:
        others = np.where(np.arange(table.scores.shape[1])[None, :] == winner[:, None], -np.inf, table.scores)
        columns += [table.levels[rows, others.argmax(axis=1)], level * coverage, np.log1p(np.maximum(gap, 0.0))]
    return np.column_stack(columns).astype(np.float64)


def rates(table: ScoreTable, fired: np.ndarray) -> dict[str, Any]:
    """``capd eval``'s metrics (fired_right, fired_wrong, null_fpr …) of the rows ``fired`` marks."""
    return metrics(table, dataclasses.replace(apply_gates(table, -np.inf, -np.inf), fired=fired))


def learned_gate(fit: ScoreTable, held: ScoreTable, kind: int, c: float) -> dict[str, Any] | None:
    """The learned gate's fit and held-out rates; None when no cut keeps the fit part within the limits."""
    from sklearn.linear_model import LogisticRegression

    x_fit, x_held = features(fit, kind), features(held, kind)
    mean, spread = x_fit.mean(axis=0), x_fit.std(axis=0) + 1e-9
    winner = fit.scores.argmax(axis=1)
    label = fit.positive & fit.expected[np.arange(len(winner)), winner] & fit.routable
    if label.all() or not label.any():
        return None
    model = LogisticRegression(C=c, max_iter=2000).fit((x_fit - mean) / spread, label)
    value_fit = model.decision_function((x_fit - mean) / spread)
    value_held = model.decision_function((x_held - mean) / spread)
    best: tuple[float, dict[str, Any]] | None = None
    for cut in np.unique(value_fit):
        got = rates(fit, fit.routable & (value_fit >= cut))
        within = (got["fired_wrong"] or 0.0) <= LIMITS["max_wrong"] + 1e-9 \
            and (got["null_fpr"] or 0.0) <= LIMITS["max_null_fpr"] + 1e-9
        if within and (best is None or (got["fired_right"] or 0.0) > (best[1]["fired_right"] or 0.0)):
            best = (float(cut), got)
    if best is None:
        return None
    return {"fit": best[1], "held_out": rates(held, held.routable & (value_held >= best[0]))}


def main(argv: list[str]) -> dict[str, Any]:
    parser = trial_parser(__doc__, "gate_trial")
    parser.add_argument("--features", default="0,1,2")
    parser.add_argument("--c", default="0.1,1", help="the logistic regression's inverse L2 strengths")
    args = parser.parse_args(argv)
    kinds = [int(k) for k in args.features.split(",")]
    strengths = [float(c) for c in args.c.split(",")]
    found, skipped = chosen_sets(args)
    report: dict[str, Any] = {"limits": LIMITS, "skipped": skipped, "results": []}
    with trial_bench("gate") as bench:
        for evalset in found:
            with bench.fused_set(evalset) as on:
                fit_rows, held_rows, grid = on.fit_rows, on.held_rows, grid_for("fused")
                tables = {k: score_table(on.service.router, on.fixtures, top_k=k, vectors=on.vectors,
                                         tokens=on.tokens) for k in grid.top_ks}
                point, _ = best_point({k: t.subset(fit_rows) for k, t in tables.items()}, LIMITS["max_null_fpr"],
                                      LIMITS["max_wrong"], grid)
                if point is None:
                    continue
                table = tables[point.top_k]
                shipped = gated(table, held_rows, Gates(point.threshold, point.margin, coverage=point.coverage))
                report["results"].append({"set": evalset.name, "gate": "calibrated grid", "fit_fired_right":
                                          point.fired_right, "held_out": shipped})
                line = fit_and_held_out(point.fired_right, shipped)
                print(f"{evalset.name:20s} calibrated grid   {line}", flush=True)
                for kind in kinds:
                    for c in strengths:
                        got = learned_gate(table.subset(fit_rows), table.subset(held_rows), kind, c)
                        name = f"learned f{kind} C={c:g}"
                        report["results"].append({"set": evalset.name, "gate": name, "outcome": got})
                        line = ("no feasible cut" if got is None
                                else fit_and_held_out(got["fit"]["fired_right"], got["held_out"]))
                        print(f"{evalset.name:20s} {name:17s} {line}", flush=True)
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
