"""Research harness: what bounding the learned store (``learn_max``) costs routing.

Run: ``.venv/bin/python -m benchmarks.quality.learn_max_trial [--sets a,b] [--values 10,30,100]``
(about a minute per set and value).

Each capability keeps its latest ``learn_max`` learned triggers and learned abstains
(``capd/learned.py``; default 100). Per set and value, the feedback loop of ``make quality``
(``benchmarks.quality.run.feedback``'s first part): the fused rule at the gates calibrated on the fit
part, the fit part routed as traffic with its mistakes corrected (a miss enables the expected
capability, a null that fired is disabled), then the held-out part scored at the same gates. Also
how many corrections were kept, and the most any one capability kept of one kind. Writes
``benchmarks/results/learn_max_trial.json``.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.quality.run import (
    EVALSETS,
    LIMITS,
    RESULTS,
    correct,
    find_sets,
    gated,
    loop_service,
    trial_bench,
    write_report,
)
from capd.calibrate import fit_gates, grid_for, score_variants
from capd.evaluation import score_table


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="clinc150_domain,hwu64_scenario_oos")
    parser.add_argument("--values", default="10,30,100")
    parser.add_argument("--out", type=Path, default=RESULTS / "learn_max_trial.json")
    args = parser.parse_args(argv)
    found, skipped = find_sets([s for s in args.sets.split(",") if s], EVALSETS)
    values = [int(v) for v in args.values.split(",") if v.strip()]
    report: dict[str, Any] = {"skipped": skipped, "results": []}
    grid = grid_for("fused")
    with trial_bench("learn-max") as bench:
        for evalset in found:
            with bench.fused_set(evalset) as on:
                fixtures, fit_rows, held_rows = on.fixtures, on.fit_rows, on.held_rows
                vectors, tokens = on.vectors, on.tokens
                gates = fit_gates(score_variants(on.service.router, fixtures, vectors, tokens, grid), fit_rows,
                                  grid=grid, **LIMITS).point
            if gates is None:
                continue
            for value in values:
                bench.learn_max = value
                with loop_service(bench, evalset, gates, tuned=False) as service:
                    before = gated(score_table(service.router, fixtures, vectors=vectors, tokens=tokens),
                                   held_rows, gates)
                    traffic = correct(service, fixtures, fit_rows)
                    assert service.learned is not None
                    per_capability = Counter((e.capability, e.kind) for e in service.learned.entries())
                    after = gated(score_table(service.router, fixtures, vectors=vectors, tokens=tokens),
                                  held_rows, gates)
                row = {"set": evalset.name, "learn_max": value, "gates": gates.as_dict(), "before": before,
                       "after": after, "traffic": traffic, "kept": sum(per_capability.values()),
                       "most_kept_per_capability": max(per_capability.values(), default=0)}
                report["results"].append(row)
                print(f"{evalset.name:20s} learn_max {value:>4}: kept {row['kept']} (most for one capability "
                      f"{row['most_kept_per_capability']}, of one kind); held-out fired_right "
                      f"{before['fired_right']:.3f} -> {after['fired_right']:.3f}, fired_wrong "
                      f"{after['fired_wrong']:.3f}, null_fpr {after['null_fpr']}, "
                      f"top1 {before['top1']:.3f} -> {after['top1']:.3f}", flush=True)
            bench.learn_max = None
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
