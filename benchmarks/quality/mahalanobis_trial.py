"""Research harness: Mahalanobis distances as the fused rule's threshold statistic.

Run: ``.venv/bin/python -m benchmarks.quality.mahalanobis_trial [--sets a,b] [--shrinkage lw,0.5,0.8]``
(about 2 minutes).

The fused rule's threshold reads the winner's level, ``K - mu_in`` (mean of its top-3 example
cosines less what its own examples score among themselves). Out-of-scope detection in intent
classification often does better with a Mahalanobis distance to each class's mean under one
covariance shared by all classes, since it weighs each direction of the embedding by how much
the tap's examples vary along it. Screened here, with the ranking (and so the winner) unchanged:

- ``maha``: minus the winner's squared distance to its capability's example mean (per dimension);
- ``relmaha``: the same less the squared distance to a single Gaussian fitted on every example
  (the "relative" distance, which cancels what makes a message far from everything);
- ``combo``: the shipped level and ``maha``, each standardised over the fit part's winners, averaged.

The covariance is the examples' within-capability scatter shrunk towards a multiple of the
identity, by Ledoit-Wolf (``lw``) or by a fixed share. Gates are calibrated on the fit part as
``make quality`` does, with the threshold swept over the fit part's percentiles of the new
statistic; the held-out metrics are printed per variant and written to
``benchmarks/results/mahalanobis_trial.json``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from benchmarks.quality.run import FusedSet
from benchmarks.quality.statistic_trial import head_and_examples, per_value, run
from capd.evaluation import ScoreTable


def precision(residuals: np.ndarray, shrinkage: str) -> tuple[np.ndarray, float]:
    """The inverse of the residuals' covariance shrunk towards the identity, and the share used."""
    if shrinkage == "lw":
        from sklearn.covariance import LedoitWolf

        fitted = LedoitWolf(assume_centered=True).fit(residuals)
        return np.asarray(fitted.precision_), float(fitted.shrinkage_)
    share, dim = float(shrinkage), residuals.shape[1]
    scatter = residuals.T @ residuals / len(residuals)
    return np.linalg.inv((1 - share) * scatter + share * np.trace(scatter) / dim * np.eye(dim)), share


def squared_distances(vectors: np.ndarray, means: np.ndarray, inverse: np.ndarray) -> np.ndarray:
    """``[n, C]``: each vector's squared Mahalanobis distance to each mean."""
    projected = vectors @ inverse
    return np.asarray((projected * vectors).sum(axis=1)[:, None] - 2 * projected @ means.T
                      + ((means @ inverse) * means).sum(axis=1)[None, :])


def statistics(table: ScoreTable, examples: np.ndarray, labels: np.ndarray, messages: np.ndarray,
               fit_rows: np.ndarray, shrinkage: str) -> dict[str, np.ndarray]:
    """The variants' threshold statistics ``[rows, C]`` (module docstring)."""
    assert table.levels is not None, "the fused rule's table"
    dim = examples.shape[1]
    means = np.stack([examples[labels == c].mean(axis=0) for c in range(len(table.names))])
    inverse, share = precision(examples - means[labels], shrinkage)
    near = -squared_distances(messages, means, inverse) / dim
    centre = examples.mean(axis=0, keepdims=True)
    background, _ = precision(examples - centre, shrinkage)
    relative = near + squared_distances(messages, centre, background) / dim
    winner = table.scores.argmax(axis=1)
    rows = np.arange(len(winner))

    def standardised(values: np.ndarray) -> np.ndarray:
        on_fit = values[rows, winner][fit_rows]
        return np.asarray((values - on_fit.mean()) / on_fit.std())

    tag = f"{share:.2f}"
    return {f"maha {tag}": near, f"relmaha {tag}": relative,
            f"combo {tag}": (standardised(table.levels) + standardised(near)) / 2}


def all_statistics(args: argparse.Namespace, on: FusedSet, table: ScoreTable) -> dict[str, np.ndarray]:
    """Every ``--shrinkage``'s variants."""
    _, examples = head_and_examples(on)
    return per_value(args.shrinkage, lambda shrinkage: statistics(
        table, examples.vectors.astype(np.float64), examples.labels, on.vectors.astype(np.float64), on.fit_rows,
        shrinkage))


def main(argv: list[str]) -> dict[str, Any]:
    return run(__doc__, "mahalanobis_trial", argv, all_statistics, lambda parser: parser.add_argument(
        "--shrinkage", default="lw,0.5,0.8", help="lw (Ledoit-Wolf) or fixed shares"))


if __name__ == "__main__":
    main(sys.argv[1:])
