"""Research harness for the fused rule's second stage (late interaction, ``capd/fused.py``).

Run: ``.venv/bin/python -m benchmarks.quality.rescore_trial [--sets a,b] [--weights 0,5,10,20]
[--candidates 3,5,10] [--tuned]`` (about 2 minutes untuned; ``--tuned`` reuses the tuned models
``make quality`` cached in ``benchmarks/.cache/quality/tuned``).

Per set: the fused rule's score table with the second stage's weight β
(``FusedHead.rescore_weight``; 0 = no second stage) and number of re-scored candidates varied,
gates calibrated on the fit part exactly as ``make quality`` does (``best_point``), and the
held-out metrics, plus top1 on all rows. Prints one line per variant and writes
``benchmarks/results/rescore_trial.json``. The shipped values are β = 10, 5 candidates.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
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
from capd import fused
from capd.calibrate import best_point, grid_for, split
from capd.evaluation import score_table
from capd.fixtures import load_fixtures


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--weights", default="0,5,10,20")
    parser.add_argument("--candidates", default=str(fused.RESCORE_CANDIDATES))
    parser.add_argument("--tuned", action="store_true", help="with each set's tuned model (tune = true)")
    parser.add_argument("--out", type=Path, default=RESULTS / "rescore_trial.json")
    args = parser.parse_args(argv)
    found, skipped = find_sets([s for s in args.sets.split(",") if s], EVALSETS)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "skipped": skipped, "results": []}
    shipped = fused.RESCORE_CANDIDATES
    with trial_bench("rescore", tuned=True) as bench:
        for evalset in found:
            fixtures = load_fixtures(evalset.fixture_files)
            fit_rows, held_rows = split(fixtures)
            service = bench.service(evalset.tap, "fused", tuned_as=evalset.name if args.tuned else None)
            try:
                router, head = service.router, service.router.head
                assert head is not None
                vectors, tokens = bench.vectors(service, fixtures), bench.tokens(service, fixtures)
                for candidates in [int(c) for c in args.candidates.split(",")]:
                    fused.RESCORE_CANDIDATES = candidates
                    for weight in [float(w) for w in args.weights.split(",")]:
                        router.head = dataclasses.replace(head, rescore_weight=weight)
                        table = score_table(router, fixtures, vectors=vectors, tokens=tokens)
                        winner, _, _ = table.gate_inputs()
                        right = table.expected[np.arange(len(winner)), winner] & table.positive
                        point, _ = best_point({fused.TOP_K: table.subset(fit_rows)}, grid=grid_for("fused"), **LIMITS)
                        held = None if point is None else gated(table, held_rows, point)
                        fit = None if point is None else gated(table, fit_rows, point)
                        entry = {"set": evalset.name, "tuned": args.tuned, "weight": weight, "candidates": candidates,
                                 "top1_all": round(float(right.sum() / table.positive.sum()), 4),
                                 "held_out": held, "fit": fit}
                        report["results"].append(entry)
                        print(f"{evalset.name:20s} β={weight:<5g} candidates={candidates:<3d} "
                              f"top1(all)={entry['top1_all']:.3f} " + ("no feasible point" if held is None else
                              " ".join(f"{k}={held[k] if held[k] is None else round(held[k], 3)}"
                                       for k in ("fired_right", "fired_wrong", "null_fpr"))
                              + f" fit fired_right={fit['fired_right'] if fit else None}"), flush=True)
            finally:
                fused.RESCORE_CANDIDATES = shipped
                service.close()
    write_report(args.out, report)


if __name__ == "__main__":
    main(sys.argv[1:])
