"""Research harness: the fit part's positives as extra examples of their capabilities, gates fitted out of fold.

Run: ``.venv/bin/python -m benchmarks.quality.examples_trial [--sets a,b] [--folds 5]`` (untuned
model, fused rule; 2 min on hwu64, healthcare and core together, 16 min on the two CLINC sets).

The tap's vetoes (:mod:`capd.calibrate`, ``fit_vetoes``) are the fit part's null rows kept for
routing; this is their positive counterpart: each fit positive becomes an example (a trigger) of
the capability it expects. The gates must then be fitted on rows that are not their own examples:
the fit part is cut into ``--folds`` folds, and fold k is scored by a copy of the tap whose
capabilities get the fit positives outside fold k as extra triggers (scored as ``capd calibrate``
scores: the fit part's nulls as vetoes, no row vetoed by its own copy). The gates are fitted on
those pooled out-of-fold rows; a copy with every fit positive as a trigger then scores the
held-out part at those gates. Printed per set, as one JSON line, held-out top1 / fired_right /
fired_wrong / null_fpr for the shipped calibration (``shipped``) and for this one (``examples``);
written to ``benchmarks/results/examples_trial.json``.
"""

from __future__ import annotations

import json
import shutil
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.quality.run import LIMITS, Bench, EvalSet, folds_trial
from capd.calibrate import Fitted, Variants, fit_gates, fitted_router, grid_for, score_variants
from capd.evaluation import ScoreTable, apply_gates, metrics
from capd.fixtures import Fixture


def tap_with(tap: Path, dest: Path, extra: dict[str, list[str]]) -> Path:
    """A copy of ``tap`` at ``dest`` whose capabilities have ``extra`` messages as more triggers."""
    shutil.copytree(tap, dest)
    for name, messages in extra.items():
        config = dest / "capabilities" / name / "config.toml"
        table = tomllib.loads(config.read_text(encoding="utf-8"))
        triggers = list(dict.fromkeys([*table.get("triggers", []), *messages]))
        lines = [f"description = {json.dumps(table['description'])}"] if "description" in table else []
        if "domains" in table:
            lines.append(f"domains = {json.dumps(table['domains'])}")
        lines.append("triggers = [" + ", ".join(json.dumps(t) for t in triggers) + "]")  # JSON strings are TOML's
        config.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dest


def positives_of(fixtures: Sequence[Fixture], rows: np.ndarray) -> dict[str, list[str]]:
    """capability -> the messages of ``rows`` that expect it alone."""
    extra: dict[str, list[str]] = {}
    for i in rows:
        fixture = fixtures[i]
        if fixture.positive and len(fixture.expect) == 1:
            extra.setdefault(fixture.expect[0], []).append(fixture.message)
    return extra


def pooled(tables: list[tuple[np.ndarray, ScoreTable]]) -> ScoreTable:
    """One table whose row i is taken from the fold table that held row i out."""
    base = tables[0][1]
    pick = np.zeros(len(base.fixtures), dtype=int)
    for k, (rows, _) in enumerate(tables):
        pick[rows] = k

    def take(attr: str) -> Any:
        arrays = [getattr(table, attr) for _, table in tables]
        if arrays[0] is None:
            return None
        out = arrays[0].copy()
        for k, array in enumerate(arrays):
            out[pick == k] = array[pick == k]
        return out

    return ScoreTable(base.fixtures, base.names, take("scores"), take("routable"), take("expected"),
                      take("levels"), take("vetoed"), take("coverage"))


def scored(bench: Bench, tap: Path, fixtures: Sequence[Fixture], vectors: np.ndarray,
           tokens: Any) -> Variants:
    """Every fixture scored by a fused service on ``tap``, as ``capd calibrate`` scores them."""
    service = bench.service(tap, "fused")
    try:
        router, _, _ = fitted_router(service.router, fixtures, vectors, tokens)
        return score_variants(router, fixtures, vectors, tokens, grid_for("fused"))
    finally:
        service.close()


def held_out(fitted: Fitted, variants: Variants, rows: np.ndarray) -> dict[str, Any] | None:
    point = fitted.point
    if point is None:
        return None
    table = variants[point.abstain_corpus][point.top_k].subset(rows)
    found = metrics(table, apply_gates(table, point.threshold, point.margin, point.coverage))
    return {**{key: found[key] for key in ("top1", "fired_right", "fired_wrong", "null_fpr")},
            "fit_fired_right": point.fired_right}


def run_set(bench: Bench, evalset: EvalSet, folds: int) -> dict[str, Any]:
    limits = (LIMITS["max_null_fpr"], LIMITS["max_wrong"])
    with bench.fused_set(evalset) as on:
        fixtures, fit_rows, held_rows, vectors, tokens = on.fixtures, on.fit_rows, on.held_rows, on.vectors, on.tokens
        router, _, _ = fitted_router(on.service.router, fixtures, vectors, tokens)
        shipped = score_variants(router, fixtures, vectors, tokens, grid_for("fused"))
    fold = np.arange(len(fit_rows)) % folds
    per_fold = [(fit_rows[fold == k],
                 scored(bench, tap_with(evalset.tap, bench.scratch / f"{evalset.name}-fold{k}",
                                        positives_of(fixtures, fit_rows[fold != k])), fixtures, vectors, tokens))
                for k in range(folds)]
    out_of_fold = {on: {k: pooled([(rows, variants[on][k]) for rows, variants in per_fold]) for k in shipped[on]}
                   for on in shipped}
    every_tap = tap_with(evalset.tap, bench.scratch / f"{evalset.name}-all", positives_of(fixtures, fit_rows))
    every = scored(bench, every_tap, fixtures, vectors, tokens)
    row = {"set": evalset.name,
           "shipped": held_out(fit_gates(shipped, fit_rows, grid_for("fused"), *limits), shipped, held_rows),
           "examples": held_out(fit_gates(out_of_fold, fit_rows, grid_for("fused"), *limits), every, held_rows)}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str]) -> dict[str, Any]:
    return folds_trial(argv, __doc__, "examples_trial", run_set)


if __name__ == "__main__":
    main(sys.argv[1:])
