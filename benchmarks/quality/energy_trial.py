"""Research harness: the head's logits (max logit, energy) as the fused rule's threshold statistic.

Run: ``.venv/bin/python -m benchmarks.quality.energy_trial [--sets a,b]`` (under a minute with the
caches `make quality` leaves).

The fused rule's threshold reads the winner's level, ``K - mu_in``: nearest-example cosines, a
density-like signal. Out-of-distribution detection for classifiers often reads the classifier
itself instead: its largest logit, or its energy ``logsumexp(logits)`` (Liu et al., 2020),
which unlike the softmax probability does not saturate for inputs far from every class. The
fused head is a multinomial logistic regression on the sentence vector, so both come free with
``x @ W + b``. Screened as the threshold's statistic, the ranking (and so the winner) unchanged:

- ``logit``: the capability's own logit (the winner's, as the gate reads it);
- ``energy``: ``logsumexp`` over every capability's logit (one value per message);
- ``knn-energy``: the same over the nearest-example scores, ``tau * logsumexp(K / tau)``;
- ``combo-logit`` / ``combo-energy``: the shipped level and that statistic, each standardised over
  the fit part's winners, averaged.

Gates are calibrated on the fit part as ``make quality`` does, with the threshold swept over the
fit part's percentiles of the new statistic; the held-out metrics are printed per variant and
written to ``benchmarks/results/energy_trial.json``.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from benchmarks.quality.mahalanobis_trial import calibrated_variants, report_variants
from benchmarks.quality.run import LIMITS, chosen_sets, trial_bench, trial_parser, write_report
from capd import fused
from capd.evaluation import ScoreTable, score_table


def logsumexp(values: np.ndarray) -> np.ndarray:
    """``[n]``: the log of the summed exponentials of each row, computed stably."""
    top = values.max(axis=1, keepdims=True)
    return np.asarray(top[:, 0] + np.log(np.exp(values - top).sum(axis=1)))


def statistics(table: ScoreTable, head: fused.FusedHead, messages: np.ndarray,
               fit_rows: np.ndarray) -> dict[str, np.ndarray]:
    """The variants' threshold statistics ``[rows, C]`` (module docstring)."""
    assert table.levels is not None and head.weight is not None and head.bias is not None
    logits = messages @ head.weight.astype(np.float64) + head.bias.astype(np.float64)
    near = table.levels + head.in_class[None, :]  # K
    columns = logits.shape[1]
    energy = np.repeat(logsumexp(logits)[:, None], columns, axis=1)
    knn_energy = np.repeat(fused.TEMPERATURE * logsumexp(near / fused.TEMPERATURE)[:, None], columns, axis=1)
    winner = table.scores.argmax(axis=1)
    rows = np.arange(len(winner))

    def standardised(values: np.ndarray) -> np.ndarray:
        on_fit = values[rows, winner][fit_rows]
        return np.asarray((values - on_fit.mean()) / on_fit.std())

    return {"logit": logits, "energy": energy, "knn-energy": knn_energy,
            "combo-logit": (standardised(table.levels) + standardised(logits)) / 2,
            "combo-energy": (standardised(table.levels) + standardised(energy)) / 2}


def main(argv: list[str]) -> dict[str, Any]:
    parser = trial_parser(__doc__, "energy_trial")
    args = parser.parse_args(argv)
    found, skipped = chosen_sets(args)
    report: dict[str, Any] = {"limits": LIMITS, "skipped": skipped, "results": []}
    with trial_bench("energy") as bench:
        for evalset in found:
            with bench.fused_set(evalset) as on:
                router = on.service.router
                assert router.head is not None
                table = score_table(router, on.fixtures, vectors=on.vectors, tokens=on.tokens)
                stats = statistics(table, router.head, on.vectors.astype(np.float64), on.fit_rows)
                variants = calibrated_variants(table, stats, on.fit_rows, on.held_rows)
            report_variants(report, evalset.name, variants)
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
