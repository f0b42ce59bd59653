"""Research harness: does the headline hold on other fit / held-out splits of the same rows?

Run: ``.venv/bin/python -m benchmarks.quality.splits_trial [--sets a,b] [--splits 5]`` (5 splits
of all six sets took about 50 min here beside other runs, healthcare, taps/core and snips7 6 min;
fused rule, untuned model).

``make quality``'s headline is plain ``capd calibrate`` held out on one split: 30% of the rows
held out by a hash of each message (:func:`capd.calibrate.split`). On a small set one row moves a
held-out figure a lot (healthcare holds out 5 nulls, so one null is 0.2 of null_fpr), so a goal met
or missed there may be the split's doing. This harness repeats plain ``capd calibrate`` (the
gates, the vetoes, the abstain corpus and the fit positives as examples each chosen on the fit
part, as the command does) on ``--splits`` splits. Split 0 is the shipped one; split ``s`` > 0
hashes ``"<s>:" + message`` instead of the message, which moves every row to a side and a fold
of its own while keeping copies of a message together, as the shipped split does. Per set and
split: the held-out figures, whether the examples were kept, the fixture-free auto gates' held-out
figures for comparison, and whether the goal (:data:`~benchmarks.quality.run.GOAL`) is met.
Written to ``benchmarks/results/splits_trial.json``.

Variants of how calibration chooses its point, each measured this way (the goal checked stays the
same): ``--ties strict|middle|near`` (another point among those reaching the best fit fired_right,
or for ``near`` within :data:`NEAR` of it),
``--mode spare|wilson|erode`` (``calibration_trial``'s cautious limits), ``--max-null-fpr`` /
``--max-wrong`` (the limits calibration is given), and ``--corpus on|off`` (the shipped abstain
corpus always or never, instead of when it adds ``CORPUS_MIN_GAIN`` to the fit fired_right; each
split records the fit gain either way). Results: ``benchmarks/quality/README.md``, "The headline on
other splits".
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from benchmarks.quality.calibration_trial import MODES
from benchmarks.quality.calibration_trial import accept as cautious
from benchmarks.quality.oof_gates_trial import figures as rates
from benchmarks.quality.report import meets
from benchmarks.quality.run import (
    GOAL,
    LIMITS,
    Bench,
    EvalSet,
    chosen_sets,
    split_hashed,
    trial_bench,
    trial_parser,
    write_report,
)
from capd import calibrate as calibration
from capd.calibrate import Grid, Point
from capd.evaluation import ScoreTable


@contextmanager
def salted(split: int) -> Iterator[None]:
    """Split ``split`` of the rows: every hash :func:`capd.calibrate.split` and
    :func:`capd.calibrate.folds_of` take is of ``"<split>:" + key`` (split 0: of the key itself)."""
    with split_hashed(lambda shipped, key, part: shipped(f"{split}:{key}" if split else key, part)):
        yield


TIES = ("shipped", "strict", "middle", "near")
NEAR = 0.01  # ``--ties near``: how much fit fired_right a safer point may cost
CORPUS_GAINS = {"on": -1.0, "off": 2.0}  # fit fired_right is within [0, 1]: any gain wins, none does


def chooser(ties: str, mode: str) -> Any:
    """:func:`capd.calibrate.best_point` with a cautious feasibility ``mode`` (``calibration_trial``'s
    ``accept``: ``spare``, ``wilson``, ``erode``; ``plain`` is the limits as shipped) and another
    choice among the points that reach the best fit fired_right (``ties``). ``strict``: the highest
    threshold, then margin, then coverage among them; ``middle``: the highest threshold (as
    shipped), then the middle of the run of margins that reach it from the shipped (lowest) one,
    then likewise for coverage; ``near``: among the points within :data:`NEAR` of the best fit
    fired_right, the one with the lowest fit null_fpr, then fired_wrong, then the most fired_right
    (then as shipped: the highest threshold, the lowest margin and coverage)."""
    shipped = calibration.best_point

    def best_point(tables: dict[int, ScoreTable], max_null_fpr: float, max_wrong: float,
                   grid: Grid = calibration.COSINE_GRID, accept: Any = None) -> tuple[Point | None, list[Point]]:
        if accept is None and mode != "plain":
            accept = partial(cautious, mode)
        point, curve = shipped(tables, max_null_fpr, max_wrong, grid, accept)
        if point is None or ties == "shipped":
            return point, curve
        table = tables[point.top_k]
        right, wrong, null = calibration.sweep(table, grid)
        ok = (accept(table, right, wrong, null) if accept is not None
              else (null <= max_null_fpr + 1e-9) & (wrong <= max_wrong + 1e-9))
        best = ok & (np.round(right, 4) >= point.fired_right - 1e-9)
        t = int(np.flatnonzero(np.isclose(grid.thresholds, point.threshold))[0])
        m = int(np.flatnonzero(np.isclose(grid.margins, point.margin))[0])
        v = int(np.flatnonzero(np.isclose(grid.coverages, point.coverage))[0])
        if ties == "strict":
            t, m, v = (int(i) for i in np.argwhere(best)[-1])
        elif ties == "near":
            near = np.argwhere(ok & (np.round(right, 4) >= point.fired_right - NEAR - 1e-9))
            t, m, v = (int(i) for i in min(near, key=lambda i: (null[tuple(i)], wrong[tuple(i)], -right[tuple(i)],
                                                                   -i[0], i[1], i[2])))
        else:
            m = (m + _run_end(best[t, :, v], m)) // 2
            v = (v + _run_end(best[t, m, :], v)) // 2
        return Point(point.top_k, float(grid.thresholds[t]), float(grid.margins[m]), round(float(right[t, m, v]), 4),
                     round(float(wrong[t, m, v]), 4), round(float(null[t, m, v]), 4),
                     coverage=float(grid.coverages[v])), curve

    return best_point


def _run_end(mask: np.ndarray, start: int) -> int:
    """The last index of the run of True in ``mask`` that begins at ``start``."""
    end = start
    while end + 1 < len(mask) and mask[end + 1]:
        end += 1
    return end


@contextmanager
def choosing(ties: str, mode: str, corpus: str = "shipped") -> Iterator[None]:
    """Calibration chooses its point by ``ties`` and ``mode`` (:func:`chooser`) and keeps the abstain
    corpus always (``corpus`` ``on``: any feasible point with it wins), never (``off``) or as shipped,
    meanwhile; the auto gates keep the shipped choice (:mod:`capd.autogates` holds its own reference)."""
    shipped, gain = calibration.best_point, calibration.CORPUS_MIN_GAIN
    if (ties, mode) != ("shipped", "plain"):
        calibration.best_point = chooser(ties, mode)
    calibration.CORPUS_MIN_GAIN = CORPUS_GAINS.get(corpus, gain)
    try:
        yield
    finally:
        calibration.best_point, calibration.CORPUS_MIN_GAIN = shipped, gain


def _corpus(report: dict[str, Any]) -> str:
    """Whether the abstain corpus was kept, and the fit fired_right without → with it."""
    kept = bool(report["recommended"] and report["recommended"]["abstain_corpus"])
    tried = report["abstain_corpus"]
    return f"{'on' if kept else 'off'} (fit {tried['without']} -> {tried['with']})"


def meets_goal(held: dict[str, Any]) -> bool:
    """The issue's goal on one held-out part, as the quality report checks it (a set without nulls
    has no null_fpr to break)."""
    return all(meets(name, held.get(name)) is not False for name in GOAL)


def figures(held: dict[str, Any] | None) -> str:
    return "nothing recommended" if held is None else f"{rates(held)}, top1 {held['top1']:.3f}"


@dataclass(frozen=True)
class Variant:
    """How calibration chooses its point (:func:`chooser`), and the limits it is given (the goal
    checked is :data:`~benchmarks.quality.run.GOAL`'s either way)."""

    ties: str = "shipped"
    mode: str = "plain"
    max_null_fpr: float = LIMITS["max_null_fpr"]
    max_wrong: float = LIMITS["max_wrong"]
    corpus: str = "shipped"


def run_set(bench: Bench, evalset: EvalSet, splits: int, variant: Variant = Variant()) -> dict[str, Any]:
    rows = []
    with bench.fused_set(evalset) as on:
        auto = on.service.fit_auto_gates()
        for split in range(splits):
            with salted(split), choosing(variant.ties, variant.mode, variant.corpus):
                report = calibration.calibrate(on.service.router, on.fixtures, variant.max_null_fpr,
                                               variant.max_wrong, auto=auto,
                                               rebuild=on.service.router_with_examples)
            held = report.get("held_out")
            auto_held = (report.get("auto_gates") or {}).get("held_out")
            row = {"split": split, "rows": report["rows"], "recommended": report["recommended"],
                   "examples_added": bool(report["examples"] and report["examples"]["added"]),
                   "add_examples": report["add_examples"], "abstain_corpus": report["abstain_corpus"],
                   "held_out": held, "auto_held_out": auto_held, "met": held is not None and meets_goal(held)}
            rows.append(row)
            print(f"{evalset.name:20s} split {split}: held out {figures(held)}"
                  f" ({report['rows']['held_out']} rows), examples {'kept' if row['examples_added'] else 'not kept'},"
                  f" corpus {_corpus(report)},"
                  f" goal {'met' if row['met'] else 'not met'}; auto gates {figures(auto_held)}", flush=True)
    right = [r["held_out"]["fired_right"] for r in rows if r["held_out"] is not None]
    summary = {"met": sum(r["met"] for r in rows), "splits": len(rows),
               "fired_right_median": round(statistics.median(right), 3) if right else None,
               "fired_right_min": round(min(right), 3) if right else None}
    print(f"{evalset.name:20s} goal met on {summary['met']} of {summary['splits']} splits; held-out fired_right "
          f"median {summary['fired_right_median']}, min {summary['fired_right_min']}", flush=True)
    return {"set": evalset.name, "summary": summary, "splits": rows}


def main(argv: list[str]) -> dict[str, Any]:
    parser = trial_parser(__doc__ or "", "splits_trial")
    parser.add_argument("--splits", type=int, default=5)
    parser.add_argument("--ties", choices=TIES, default="shipped")
    parser.add_argument("--mode", choices=MODES, default="plain")
    parser.add_argument("--max-null-fpr", type=float, default=LIMITS["max_null_fpr"],
                        help="the null limit calibration is given (the goal checked stays 0.05)")
    parser.add_argument("--max-wrong", type=float, default=LIMITS["max_wrong"],
                        help="the wrong limit calibration is given (the goal checked stays 0.03)")
    parser.add_argument("--corpus", choices=("shipped", *CORPUS_GAINS), default="shipped",
                        help="keep the abstain corpus always (on), never (off) or as calibrate decides")
    args = parser.parse_args(argv)
    found, skipped = chosen_sets(args)
    variant = Variant(args.ties, args.mode, args.max_null_fpr, args.max_wrong, args.corpus)
    report: dict[str, Any] = {"goal": GOAL, "splits": args.splits, "variant": dataclasses.asdict(variant),
                              "skipped": skipped, "results": []}
    with trial_bench("splits_trial") as bench:
        for evalset in found:
            report["results"].append(run_set(bench, evalset, args.splits, variant))
    return write_report(args.out, report)


def patched_main(argv: list[str], doc: str, trial: str, variants: Sequence[str],
                 patched: Callable[[str], AbstractContextManager[object]]) -> dict[str, Any]:
    """A trial that is this one with ``patched(variant)`` in force: it takes ``--variant`` (one of
    ``variants``) and passes the rest on, with taps/core, healthcare and snips7 as its sets and
    ``benchmarks/results/<trial>_<variant>.json`` as its output unless they are given."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--variant", choices=variants, required=True)
    args, rest = parser.parse_known_args(argv)  # the rest are this trial's options
    if "--sets" not in rest:
        rest += ["--sets", "core,healthcare,snips7"]
    if "--out" not in rest:
        rest += ["--out", f"benchmarks/results/{trial}_{args.variant}.json"]
    with patched(args.variant):
        return main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
