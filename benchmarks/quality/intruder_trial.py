"""Research harness: the level gate measured against each capability's intruders.

Run: ``.venv/bin/python -m benchmarks.quality.intruder_trial [--sets a,b] [--quantiles 0.9,0.99,1]``
(under a minute with the caches `make quality` leaves).

The fused rule's threshold reads the winner's level, ``K - mu_in``: the mean of its top-3
example cosines less what its own examples score among themselves. hwu64's nulls are requests
for whole scenarios the tap lacks, which land on a neighbouring capability about as close as
its own messages do. The tap's other capabilities' examples are such requests, for each
capability: its *intruders*. ``intr[c]`` is a quantile of ``K_c`` over every example of the
other capabilities (how close a request for something else gets to ``c``). Screened as the
threshold's statistic, the ranking (and so the winner) unchanged:

- ``K-intr``: ``K - intr[c]`` (how far above its intruders the message is);
- ``ratio``: ``(K - intr[c]) / (mu_in[c] - intr[c])`` (where between its intruders and its own
  examples the message sits; the denominator kept at 0.02 or more);
- ``K-mid``: ``K - (mu_in[c] + intr[c]) / 2`` (the midpoint of the two as the reference).

Gates are calibrated on the fit part as ``make quality`` does, with the threshold swept over the
fit part's percentiles of the new statistic; the held-out metrics are printed per variant and
written to ``benchmarks/results/intruder_trial.json``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from benchmarks.quality.run import FusedSet
from benchmarks.quality.statistic_trial import head_and_examples, per_value, run
from capd.autogates import nearest_mean
from capd.evaluation import ScoreTable


def intruders(vectors: np.ndarray, labels: np.ndarray, columns: int, quantile: float) -> np.ndarray:
    """``intr [C]``: per capability, this quantile of its ``K`` over the other capabilities' examples."""
    near = nearest_mean(vectors, vectors, labels, columns)
    return np.array([np.quantile(near[labels != c, c], quantile) for c in range(columns)], dtype=np.float32)


def statistics(table: ScoreTable, in_class: np.ndarray, intr: np.ndarray, quantile: float) -> dict[str, np.ndarray]:
    """The variants' threshold statistics ``[rows, C]`` (module docstring)."""
    assert table.levels is not None, "the fused rule's table"
    near = table.levels + in_class[None, :]  # K
    return {f"K-intr {quantile:g}": near - intr[None, :],
            f"ratio {quantile:g}": (near - intr[None, :]) / np.maximum(in_class - intr, 0.02)[None, :],
            f"K-mid {quantile:g}": near - (in_class + intr)[None, :] / 2}


def all_statistics(args: argparse.Namespace, on: FusedSet, table: ScoreTable) -> dict[str, np.ndarray]:
    """Every ``--quantiles``'s variants."""
    head, examples = head_and_examples(on)

    def at(quantile: str) -> dict[str, np.ndarray]:
        intr = intruders(examples.vectors, examples.labels, len(table.names), float(quantile))
        return statistics(table, head.in_class, intr, float(quantile))

    return per_value(args.quantiles, at)


def main(argv: list[str]) -> dict[str, Any]:
    return run(__doc__, "intruder_trial", argv, all_statistics, lambda parser: parser.add_argument(
        "--quantiles", default="0.9,0.99,1", help="quantiles of the intruders' K"))


if __name__ == "__main__":
    main(sys.argv[1:])
