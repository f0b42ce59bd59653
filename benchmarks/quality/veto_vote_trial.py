"""Research harness: does the fit part flatter the tap's vetoes?

Run: ``.venv/bin/python -m benchmarks.quality.veto_vote_trial [--sets core-cal,hwu64_scenario_oos]``
(seconds a set; untuned model).

``capd calibrate`` fits the gates with the fit part's null rows as the tap's vetoes, each row scored
without its own copy (:class:`capd.vetoes.Vetoes`): a winner is turned away when a *second* veto is
nearer the message than the winner's nearest example (``TAP_VETO_VOTES``). If the fit nulls were
nearer one another than new nulls are to them (a batch of look-alikes written together), the fit
part would see more of its nulls vetoed than new traffic would, and calibration would spend that on
a lower margin. The check: per null, the cosine of its second-nearest fit null (other than itself),
for the fit part's nulls and for the held-out part's, compared. Any set of the quality report, with
its split (``core-cal``: calibrated on taps/core/calibration, held out on taps/core/fixtures).
Written to ``benchmarks/results/veto_vote_trial.json``.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import numpy as np

from benchmarks.quality.run import CORE_CAL, EVALSETS, find_sets, trial_bench, trial_parser, write_report
from capd.calibrate import split
from capd.vetoes import TAP_VETO_VOTES


def second_nearest(queries: np.ndarray, vetoes: np.ndarray, same: bool) -> np.ndarray:
    """Per query row, its ``TAP_VETO_VOTES``-th nearest veto's cosine (``same``: the queries are the
    vetoes, each left out of its own)."""
    sims = queries @ vetoes.T
    if same:
        np.fill_diagonal(sims, -np.inf)
    return np.sort(sims, axis=1)[:, -TAP_VETO_VOTES]


def summary(values: np.ndarray) -> dict[str, Any]:
    return {"n": len(values), "median": round(float(statistics.median(values)), 3),
            "mean": round(float(values.mean()), 3), "share_at_least_0.5": round(float((values >= 0.5).mean()), 3)}


def main(argv: list[str]) -> dict[str, Any]:
    args = trial_parser(__doc__ or "", "veto_vote_trial", sets=(CORE_CAL, "hwu64_scenario_oos")).parse_args(argv)
    found, skipped = find_sets([s for s in args.sets.split(",") if s], EVALSETS, report=True)
    report: dict[str, Any] = {"skipped": skipped, "results": []}
    with trial_bench("veto-vote") as bench:
        for evalset in found:
            with evalset.file_split() as fixtures, bench.fused_set(evalset, fixtures) as fused:
                fit, held = split(fixtures)
                fit_nulls = [i for i in fit if not fixtures[i].positive]
                held_nulls = [i for i in held if not fixtures[i].positive]
                if len(fit_nulls) <= TAP_VETO_VOTES or not held_nulls:
                    report["skipped"].append(f"{evalset.name}: too few null rows")
                    continue
                vetoes = fused.vectors[fit_nulls]
                row = {"set": evalset.name,
                       "fit": summary(second_nearest(vetoes, vetoes, same=True)),
                       "held_out": summary(second_nearest(fused.vectors[held_nulls], vetoes, same=False))}
            report["results"].append(row)
            print(f"{evalset.name:20s} second-nearest fit null: fit nulls {row['fit']}, held-out nulls "
                  f"{row['held_out']}", flush=True)
    return write_report(args.out, report)


if __name__ == "__main__":
    main(sys.argv[1:])
