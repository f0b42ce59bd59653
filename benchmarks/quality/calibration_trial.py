"""Research harness: does a more cautious calibration keep the limits on held-out rows?

Run: ``.venv/bin/python -m benchmarks.quality.calibration_trial [--sets a,b] [--rules fused,anchor+tuned]``.

``capd calibrate`` picks the point with the most fired_right on the fit part whose null_fpr and
fired_wrong are within the limits. Chosen on the edge of the feasible region, that point can
exceed a limit on unseen rows. This compares, on the held-out part, the shipped choice
(``plain``) with three cautious ones:

- ``spare``: the limits must still hold with one more null (and one more wrong) fired;
- ``wilson``: the one-sided Wilson upper bound (z = 1) of each rate must be within its limit;
- ``erode``: the point's neighbours with a one-step lower threshold and a one-step lower
  margin (which fire more) must be within the limits too.

Rules with ``+tuned`` use the set's tuned model from the ``make quality`` cache (tuned on first
use).

``--corpus-gains 0,0.01,0.02,0.03`` instead sweeps ``CORPUS_MIN_GAIN`` (the fit fired_right the
abstain corpus must add for ``capd calibrate`` to keep it, ``capd.calibrate.fit_gates``): per set,
rule and value, whether the corpus is kept and what the chosen gates give on the held-out part.

Writes ``benchmarks/results/calibration_trial.json``.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.quality.run import (
    EVALSETS,
    LIMITS,
    RESULTS,
    SETS,
    find_sets,
    gated,
    trial_bench,
    write_report,
)
from capd import calibrate
from capd.calibrate import Grid, best_point, fit_gates, grid_for, score_variants, split, sweep
from capd.evaluation import ScoreTable, score_table
from capd.fixtures import load_fixtures
from capd.gates import Gates

MODES = ("plain", "spare", "wilson", "erode")


def wilson_upper(rate: np.ndarray, n: int, z: float = 1.0) -> np.ndarray:
    if n == 0:
        return rate
    centre = rate + z * z / (2 * n)
    spread = z * np.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n))
    return np.asarray((centre + spread) / (1 + z * z / n))


def accept(mode: str, table: ScoreTable, right: np.ndarray, wrong: np.ndarray, null: np.ndarray) -> np.ndarray:
    """The points ``mode`` accepts, [thresholds, margins, coverages] (``capd.calibrate.best_point``'s ``accept``);
    ``erode`` erodes along thresholds and margins."""
    nulls, positives = int((~table.positive).sum()), max(int(table.positive.sum()), 1)
    max_null, max_wrong = LIMITS["max_null_fpr"] + 1e-9, LIMITS["max_wrong"] + 1e-9
    if mode == "spare":
        ok = (null + (1 / nulls if nulls else 0.0) <= max_null) & (wrong + 1 / positives <= max_wrong)
    elif mode == "wilson":
        ok = (wilson_upper(null, nulls) <= max_null) & (wilson_upper(wrong, positives) <= max_wrong)
    else:
        ok = (null <= max_null) & (wrong <= max_wrong)
    if mode == "erode":
        inner = ok.copy()
        inner[0, :] = False
        inner[1:, :] &= ok[:-1, :]
        inner[:, 1:] &= ok[:, :-1]
        ok = inner
    return np.asarray(ok)


def feasible(table: ScoreTable, grid: Grid, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(fired_right, mask of the points the mode accepts), both [thresholds, margins, coverages]."""
    right, wrong, null = sweep(table, grid)
    return right, accept(mode, table, right, wrong, null)


def choose(tables: dict[int, ScoreTable], grid: Grid, mode: str) -> tuple[int, float, float, float, float] | None:
    """(top_k, threshold, margin, fit fired_right, coverage): ``capd calibrate``'s choice among the
    points the mode accepts."""
    point, _ = best_point(tables, LIMITS["max_null_fpr"], LIMITS["max_wrong"], grid, partial(accept, mode))
    return None if point is None else (point.top_k, point.threshold, point.margin, point.fired_right, point.coverage)


def corpus_gains(router: Any, fixtures: Any, vectors: np.ndarray, tokens: Any, rows: dict[str, np.ndarray],
                 gains: list[float]) -> list[dict[str, Any]]:
    """Per ``CORPUS_MIN_GAIN`` value: ``capd calibrate``'s choice on the fit rows and its held-out metrics."""
    grid = grid_for(router.rule)
    variants = score_variants(router, fixtures, vectors, tokens, grid)
    shipped, out = calibrate.CORPUS_MIN_GAIN, []
    try:
        for gain in gains:
            calibrate.CORPUS_MIN_GAIN = gain
            fitted = fit_gates(variants, rows["fit"], grid, LIMITS["max_null_fpr"], LIMITS["max_wrong"])
            point = fitted.point
            out.append({"gain": gain, "fit_without_with": fitted.corpus,
                        "point": None if point is None else point.as_dict(),
                        "held_out": None if point is None else gated(fitted.tables[point.top_k], rows["held_out"],
                                                                     point)})
    finally:
        calibrate.CORPUS_MIN_GAIN = shipped
    return out


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--rules", default="fused,anchor,fused+tuned,anchor+tuned")
    parser.add_argument("--corpus-gains", default="", help="CORPUS_MIN_GAIN values to sweep instead of the modes")
    parser.add_argument("--out", type=Path, default=RESULTS / "calibration_trial.json")
    args = parser.parse_args(argv)
    gains = [float(g) for g in args.corpus_gains.split(",") if g.strip()]
    found, skipped = find_sets([s for s in args.sets.split(",") if s], EVALSETS)
    report: dict[str, Any] = {"limits": LIMITS, "skipped": skipped, "results": []}
    with trial_bench("calibration", tuned=True) as bench:
        for evalset in found:
            fixtures = load_fixtures(evalset.fixture_files)
            fit_rows, held_rows = split(fixtures)
            for rule in args.rules.split(","):
                base = rule.removesuffix("+tuned")
                service = bench.service(evalset.tap, base, tuned_as=evalset.name if rule != base else None)
                try:
                    vectors = bench.vectors(service, fixtures)
                    tokens = bench.tokens(service, fixtures) if base == "fused" else None
                    if gains:
                        if base == "anchor":  # the anchor rule never uses the corpus
                            continue
                        for run in corpus_gains(service.router, fixtures, vectors, tokens,
                                                {"fit": fit_rows, "held_out": held_rows}, gains):
                            report["results"].append({"set": evalset.name, "rule": rule, **run})
                            held, tried = run["held_out"], run["fit_without_with"]
                            kept = run["point"] is not None and run["point"]["abstain_corpus"]
                            print(f"{evalset.name:20s} {rule:13s} gain {run['gain']:<5g} fit without/with "
                                  f"{tried['without']} / {tried['with']} corpus {'kept' if kept else 'not kept'}: "
                                  + ("no feasible point" if held is None else
                                     f"held-out fired_right={held['fired_right']:.3f} "
                                     f"fired_wrong={held['fired_wrong']:.3f} null_fpr={held.get('null_fpr')}"),
                                  flush=True)
                        continue
                    grid = grid_for(base)
                    tables = {k: score_table(service.router, fixtures, top_k=k, vectors=vectors, tokens=tokens)
                              for k in grid.top_ks}
                    for mode in MODES:
                        point = choose({k: t.subset(fit_rows) for k, t in tables.items()}, grid, mode)
                        held = None if point is None else gated(tables[point[0]], held_rows,
                                                                    Gates(point[1], point[2], coverage=point[4]))
                        within = held is not None and (held.get("null_fpr") or 0) <= LIMITS["max_null_fpr"] + 1e-9 \
                            and held["fired_wrong"] <= LIMITS["max_wrong"] + 1e-9
                        report["results"].append({"set": evalset.name, "rule": rule, "mode": mode, "point": point,
                                                  "held_out": held, "within_limits": within})
                        print(f"{evalset.name:20s} {rule:13s} {mode:7s} " + ("no feasible point" if held is None else
                              f"fired_right={held['fired_right']:.3f} fired_wrong={held['fired_wrong']:.3f} "
                              f"null_fpr={held.get('null_fpr')} {'within' if within else 'OVER'}"), flush=True)
                finally:
                    service.close()
    for mode in MODES if not gains else ():
        rows = [r for r in report["results"] if r["mode"] == mode]
        mean = np.mean([r["held_out"]["fired_right"] if r["held_out"] else 0.0 for r in rows])
        print(f"{mode:7s}: held-out within the limits on {sum(r['within_limits'] for r in rows)} of {len(rows)}; "
              f"mean fired_right {mean:.3f} (no feasible point counts as 0)")
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
