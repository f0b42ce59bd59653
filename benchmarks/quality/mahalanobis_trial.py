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

import dataclasses
import sys
from typing import Any

import numpy as np

from benchmarks.quality.run import LIMITS, chosen_sets, fit_and_held_out, gated, trial_bench, trial_parser, write_report
from capd import fused
from capd.autogates import examples_of
from capd.calibrate import best_point, grid_for
from capd.evaluation import ScoreTable, score_table


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


def calibrated(table: ScoreTable, fit_rows: np.ndarray, held_rows: np.ndarray, percentiles: bool) -> dict[str, Any]:
    """Fit-part fired_right and the held-out metrics at the gates calibrated on the fit part."""
    grid = grid_for("fused")
    if percentiles:
        assert table.levels is not None
        winner = table.scores.argmax(axis=1)
        level = table.levels[np.arange(len(winner)), winner][fit_rows]
        grid = dataclasses.replace(grid, thresholds=np.unique(np.quantile(level, np.linspace(0, 1, 101))))
    point, _ = best_point({fused.TOP_K: table.subset(fit_rows)}, grid=grid, **LIMITS)
    if point is None:
        return {"fit_fired_right": None, "held_out": None}
    return {"fit_fired_right": point.fired_right, "coverage": point.coverage,
            "held_out": gated(table, held_rows, point)}


def calibrated_variants(table: ScoreTable, statistics: dict[str, np.ndarray], fit_rows: np.ndarray,
                        held_rows: np.ndarray) -> dict[str, dict[str, Any]]:
    """:func:`calibrated` for the shipped level and for each named threshold statistic ``[rows, C]``
    in its place, the threshold swept over the fit part's percentiles of that statistic."""
    variants = {"shipped": calibrated(table, fit_rows, held_rows, percentiles=False)}
    for name, levels in statistics.items():
        variants[name] = calibrated(dataclasses.replace(table, levels=levels), fit_rows, held_rows, percentiles=True)
    return variants


def report_variants(report: dict[str, Any], set_name: str, variants: dict[str, dict[str, Any]]) -> None:
    """Add one set's :func:`calibrated` results to ``report`` and print them, a line per variant."""
    for name, got in variants.items():
        report["results"].append({"set": set_name, "variant": name, **got})
        print(f"{set_name:20s} {name:13s} {fit_and_held_out(got['fit_fired_right'], got['held_out'])}", flush=True)


def main(argv: list[str]) -> dict[str, Any]:
    parser = trial_parser(__doc__, "mahalanobis_trial")
    parser.add_argument("--shrinkage", default="lw,0.5,0.8", help="lw (Ledoit-Wolf) or fixed shares")
    args = parser.parse_args(argv)
    found, skipped = chosen_sets(args)
    report: dict[str, Any] = {"limits": LIMITS, "skipped": skipped, "results": []}
    with trial_bench("mahalanobis") as bench:
        for evalset in found:
            with bench.fused_set(evalset) as on:
                router, fit_rows, held_rows, vectors = on.service.router, on.fit_rows, on.held_rows, on.vectors
                assert router.head is not None
                examples = examples_of(router.index, router.head, router.encoder.embed_tokens)
                assert examples is not None
                table = score_table(router, on.fixtures, vectors=vectors, tokens=on.tokens)
                found_stats: dict[str, np.ndarray] = {}
                for shrinkage in [s for s in args.shrinkage.split(",") if s]:
                    found_stats |= statistics(table, examples.vectors.astype(np.float64), examples.labels,
                                              vectors.astype(np.float64), fit_rows, shrinkage)
                variants = calibrated_variants(table, found_stats, fit_rows, held_rows)
            report_variants(report, evalset.name, variants)
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
