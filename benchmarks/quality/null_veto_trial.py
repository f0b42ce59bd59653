"""Research harness: the tap's own null fixtures as vetoes, calibrated with the gates.

Run: ``.venv/bin/python -m benchmarks.quality.null_veto_trial [--sets a,b] [--deltas 0,0.05]``
(a few minutes; untuned model).

A tap's fixture rows that expect nothing are its author's examples of what must not activate
anything. For the shared sets those are requests for tasks the tap lacks (hwu64's held-out
scenarios, CLINC's out-of-scope queries), which the generic abstain corpus does not resemble. The
variant: a winner that cleared the gates is vetoed when the message is nearer one of the *fit
part's* null messages than to the winner's nearest example by more than ``delta`` (the learned
abstains' rule, with the tap's nulls for every capability). Each fit-part null is left out of its
own veto set, so calibration on the fit part does not see a null vetoed by itself; held-out rows
see every fit-part null. Gates are calibrated on the fit part with the vetoes in force (as
``capd calibrate`` does for the abstain corpus), and held-out metrics printed per variant and
written to ``benchmarks/results/null_veto_trial.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import numpy as np

from benchmarks.quality.run import LIMITS, ROOT, chosen_sets, trial_bench, trial_parser, write_report
from benchmarks.quality.statistic_trial import calibrated, report_variants
from capd.autogates import examples_of
from capd.calibrate import split
from capd.evaluation import ScoreTable, score_table
from capd.fixtures import Fixture, load_fixtures, tap_fixture_files
from capd.service import Service


def null_vetoes(table: ScoreTable, vectors: np.ndarray, example_vectors: np.ndarray, example_labels: np.ndarray,
                fit_rows: np.ndarray, delta: float, k: int = 1) -> np.ndarray:
    """bool [rows]: the row's winner is vetoed: ``k`` fit-part nulls other than the row itself are
    nearer it than the winner's nearest example by more than ``delta``."""
    winner = table.scores.argmax(axis=1)
    nearest = np.full(len(winner), -np.inf, dtype=np.float32)
    for column in np.unique(winner):
        rows = winner == column
        own = example_vectors[example_labels == column]
        if len(own):
            nearest[rows] = (vectors[rows] @ own.T).max(axis=1)
    nulls = fit_rows[~table.positive[fit_rows]]
    similarity = vectors @ vectors[nulls].T  # [rows, fit nulls]
    similarity[nulls, np.arange(len(nulls))] = -np.inf  # a null never vetoes itself
    if similarity.shape[1] < k:
        return np.zeros(len(winner), dtype=bool)
    kth = -np.partition(-similarity, k - 1, axis=1)[:, k - 1]
    return np.asarray(kth > nearest + delta, dtype=bool)


def main(argv: list[str]) -> dict[str, Any]:
    parser = trial_parser(__doc__, "null_veto_trial")
    parser.add_argument("--deltas", default="0,0.05,-0.05", help="margins the null must be nearer by")
    parser.add_argument("--ks", default="1", help="how many fit nulls must be nearer than the nearest example")
    parser.add_argument("--core-cal", action="store_true", help="also taps/core calibrated on taps/core/calibration "
                        "(its 70%% fit part, as `capd calibrate` does) and measured on all of its fixtures")
    parser.add_argument("--max-null-fpr", type=float, default=LIMITS["max_null_fpr"])
    parser.add_argument("--max-wrong", type=float, default=LIMITS["max_wrong"])
    args = parser.parse_args(argv)
    LIMITS["max_null_fpr"], LIMITS["max_wrong"] = args.max_null_fpr, args.max_wrong  # the dict every harness reads
    found, skipped = chosen_sets(args)
    report: dict[str, Any] = {"limits": LIMITS, "skipped": skipped, "results": []}
    with trial_bench("null_veto_trial") as bench:
        for evalset in found:
            with bench.fused_set(evalset) as on:
                variants = veto_variants(args, on.service, on.fixtures, on.vectors, on.tokens, on.fit_rows,
                                         on.held_rows)
            report_variants(report, evalset.name, variants)
        if args.core_cal:
            tap = ROOT / "taps" / "core"
            calibration = load_fixtures(sorted((tap / "calibration").glob("*.jsonl")))
            fixtures = calibration + load_fixtures(tap_fixture_files(tap))
            service = bench.service(tap, "fused")
            try:
                vectors, tokens = bench.vectors(service, fixtures), bench.tokens(service, fixtures)
                variants = veto_variants(args, service, fixtures, vectors, tokens, split(calibration)[0],
                                         np.arange(len(calibration), len(fixtures)))
            finally:
                service.close()
            report_variants(report, "core-cal", variants)
    return write_report(args.out, report)


def veto_variants(args: argparse.Namespace, service: Service, fixtures: list[Fixture], vectors: np.ndarray,
                  tokens: list[np.ndarray], fit_rows: np.ndarray, held_rows: np.ndarray) -> dict[str, Any]:
    """The shipped calibration and each (k, delta) variant of the vetoes, fit → held-out."""
    table = score_table(service.router, fixtures, vectors=vectors, tokens=tokens)
    router = service.router
    assert router.head is not None
    examples = examples_of(router.index, router.head, router.encoder.embed_tokens)
    assert examples is not None
    variants = {"shipped": calibrated(table, fit_rows, held_rows, percentiles=False)}
    for k in (int(v) for v in args.ks.split(",") if v):
        for delta in (float(d) for d in args.deltas.split(",") if d):
            vetoed = null_vetoes(table, np.asarray(vectors, dtype=np.float32),
                                 np.asarray(examples.vectors, dtype=np.float32), examples.labels, fit_rows, delta, k)
            got = calibrated(dataclasses.replace(table, vetoed=vetoed), fit_rows, held_rows, percentiles=False)
            got["vetoed_positives_held_out"] = int((vetoed & table.positive)[held_rows].sum())
            variants[f"k{k} {delta:+g}"] = got
    return variants


if __name__ == "__main__":
    main(sys.argv[1:])
