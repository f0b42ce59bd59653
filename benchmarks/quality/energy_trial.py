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

import argparse
import sys
from typing import Any

import numpy as np

from benchmarks.quality.run import FusedSet
from benchmarks.quality.statistic_trial import run
from capd import fused
from capd.evaluation import ScoreTable


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
    def variants(_: argparse.Namespace, on: FusedSet, table: ScoreTable) -> dict[str, np.ndarray]:
        assert on.service.router.head is not None
        return statistics(table, on.service.router.head, on.vectors.astype(np.float64), on.fit_rows)

    return run(__doc__, "energy_trial", argv, variants)


if __name__ == "__main__":
    main(sys.argv[1:])
