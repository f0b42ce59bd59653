"""What the threshold-statistic trials share (``mahalanobis_trial``, ``intruder_trial``,
``energy_trial``): each replaces the fused rule's level ``K - mu_in`` with other statistics, keeps
the ranking (and so the winner), calibrates the gates on the fit part as ``make quality`` does
(the threshold swept over the fit part's percentiles of the statistic) and reports the held-out
metrics per variant, printed and as JSON."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.quality.run import (
    LIMITS,
    FusedSet,
    chosen_sets,
    fit_and_held_out,
    gated,
    trial_bench,
    trial_parser,
    write_report,
)
from capd import fused
from capd.autogates import Examples, examples_of
from capd.calibrate import best_point, grid_for
from capd.evaluation import ScoreTable, score_table

# (the parsed arguments, one eval set under the fused rule, its score table) -> {variant: [rows, C]}
Statistics = Callable[[argparse.Namespace, FusedSet, ScoreTable], dict[str, np.ndarray]]


def head_and_examples(on: FusedSet) -> tuple[fused.FusedHead, Examples]:
    """The set's fused head and the examples it was fitted on (vectors, labels)."""
    router = on.service.router
    assert router.head is not None, "the fused rule's head"
    examples = examples_of(router.index, router.head, router.encoder.embed_tokens)
    assert examples is not None, "the index the head was fitted on"
    return router.head, examples


def per_value(values: str, variants: Callable[[str], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The variants of each comma-separated value of a trial's option (``--shrinkage lw,0.5``), in one dict."""
    found: dict[str, np.ndarray] = {}
    for value in (v for v in values.split(",") if v):
        found |= variants(value)
    return found


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


def run(doc: str, name: str, argv: list[str], statistics: Statistics,
        arguments: Callable[[argparse.ArgumentParser], object] | None = None) -> dict[str, Any]:
    """A trial's command line (``--sets``, ``--out``, and what ``arguments`` adds): every chosen set
    under the fused rule, its variants from ``statistics``; written to ``--out`` and returned."""
    parser = trial_parser(doc, name)
    if arguments is not None:
        arguments(parser)
    args = parser.parse_args(argv)
    found, skipped = chosen_sets(args)
    report: dict[str, Any] = {"limits": LIMITS, "skipped": skipped, "results": []}
    with trial_bench(name) as bench:
        for evalset in found:
            with bench.fused_set(evalset) as on:
                assert on.service.router.head is not None, "the fused rule's head"
                table = score_table(on.service.router, on.fixtures, vectors=on.vectors, tokens=on.tokens)
                variants = calibrated_variants(table, statistics(args, on, table), on.fit_rows, on.held_rows)
            report_variants(report, evalset.name, variants)
    return write_report(args.out, report)
