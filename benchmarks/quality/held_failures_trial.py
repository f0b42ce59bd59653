"""Research harness: which held-out rows break a limit on a split, and which of them are new.

Run: ``.venv/bin/python -m benchmarks.quality.held_failures_trial --sets core --splits 0,5,8
[--new taps/core/fixtures/requests.jsonl]`` (taps/core: about 10 s a split here).

``splits_trial`` says on which splits of a set plain ``capd calibrate`` misses the goal held out;
this says why: per split, the calibrated point (as ``splits_trial`` fits it, shipped choices) and
every held-out row that fires when it should not, a null that activates or a positive that
activates the wrong capability. Rows of the ``--new`` fixture files are marked ``NEW``, to tell a
miss among rows just added from one the added rows caused by moving the fit part. Printed, and
written to ``benchmarks/results/held_failures_trial.json``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.quality.run import chosen_sets, trial_bench, trial_parser, write_report
from benchmarks.quality.splits_trial import salted
from capd import calibrate as calibration
from capd.calibrate import Point
from capd.evaluation import ScoreTable, apply_gates
from capd.fixtures import load_fixtures


@contextmanager
def held_out_table() -> Iterator[list[tuple[ScoreTable, Point]]]:
    """While open, every table and point :func:`capd.calibrate.calibrate` measures is recorded in the
    list yielded (its last entry is the held-out part's)."""
    name = "gated_metrics"  # capd.calibrate's own reference to capd.evaluation.gated_metrics
    shipped: Callable[[ScoreTable, Point], dict[str, Any]] = getattr(calibration, name)
    seen: list[tuple[ScoreTable, Point]] = []

    def recording(table: ScoreTable, point: Point) -> dict[str, Any]:
        seen.append((table, point))
        return shipped(table, point)

    setattr(calibration, name, recording)
    try:
        yield seen
    finally:
        setattr(calibration, name, shipped)


def failures(table: ScoreTable, point: Point, new: set[str]) -> list[dict[str, Any]]:
    """The rows of ``table`` that fire at ``point`` and should not: nulls, and positives whose
    winner is not one they expect."""
    outcome = apply_gates(table, point.threshold, point.margin, point.coverage)
    rows = []
    for i, fixture in enumerate(table.fixtures):
        if outcome.fired[i] and not (fixture.positive and outcome.correct[i]):
            rows.append({"kind": "wrong" if fixture.positive else "null", "message": fixture.message,
                         "got": table.names[int(outcome.winner[i])], "new": fixture.message in new})
    return rows


def main(argv: list[str]) -> dict[str, Any]:
    parser = trial_parser(__doc__ or "", "held_failures_trial")
    parser.add_argument("--splits", default="0", help="comma-separated split numbers (splits_trial's)")
    parser.add_argument("--new", type=Path, action="append", default=[], help="fixture files whose rows are new")
    args = parser.parse_args(argv)
    new = {fixture.message for fixture in load_fixtures(args.new)}
    found, skipped = chosen_sets(args)
    report: dict[str, Any] = {"skipped": skipped, "results": []}
    with trial_bench("held_failures_trial") as bench:
        for evalset in found:
            with bench.fused_set(evalset) as on:
                for split in (int(s) for s in args.splits.split(",") if s.strip()):
                    with salted(split), held_out_table() as seen:
                        result = calibration.calibrate(on.service.router, on.fixtures,
                                                       rebuild=on.service.router_with_examples)
                    if result.get("held_out") is None:
                        print(f"{evalset.name} split {split}: nothing recommended", flush=True)
                        continue
                    table, point = seen[-1]
                    rows = failures(table, point, new)
                    held = result["held_out"]
                    print(f"{evalset.name} split {split}: gates {point.threshold} / {point.margin} / coverage "
                          f"{point.coverage}; held out {held['fired_right']} / {held['fired_wrong']} / "
                          f"{held['null_fpr']}", flush=True)
                    for row in rows:
                        print(f"   {'NEW' if row['new'] else '   '} {row['kind']:5s} -> {row['got']}: "
                              f"{row['message'][:80]!r}", flush=True)
                    report["results"].append({"set": evalset.name, "split": split, "gates": point.as_dict(),
                                              "held_out": held, "failures": rows})
    return write_report(args.out, report)


if __name__ == "__main__":
    main(sys.argv[1:])
