"""Choose a rule's *default* gates (the model manifest's) from the fit parts of every eval set.

A tap that was never calibrated routes with the manifest's gates, so they must be safe on
taps they were not fitted on. This sweeps the rule's gate grid and keeps the point with the
highest mean fired_right over the sets whose worst null_fpr and fired_wrong stay within the
limits — on the fit parts only (``capd.calibrate.split``), so every held-out row stays unseen.

    .venv/bin/python -m benchmarks.quality.default_gates --rule fused [--tune]

``--tune`` chooses them for the tuned model (``tune = true``), reusing the tuned models that
``make quality`` cached in ``benchmarks/.cache/quality/tuned`` (tuning any that are missing).

Prints the chosen point and, for reference, what it gives on each set's fit part.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.quality.run import CACHE, EVALSETS, SETS, find_sets
from capd.calibrate import grid_for, split, sweep
from capd.evaluation import score_table
from capd.fixtures import load_fixtures
from capd.service import Service
from capd.settings import load_settings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rule", default="fused")
    parser.add_argument("--max-null-fpr", type=float, default=0.05)
    parser.add_argument("--max-wrong", type=float, default=0.03)
    parser.add_argument("--tune", action="store_true", help="for the tuned model (tune = true)")
    args = parser.parse_args()
    grid = grid_for(args.rule)
    k = 3 if 3 in grid.top_ks else grid.top_ks[0]
    rights, wrongs, nulls = {}, {}, {}
    with tempfile.TemporaryDirectory() as data_dir:
        for evalset in find_sets(SETS, EVALSETS)[0]:
            name = evalset.name
            folder = CACHE / "tuned" / name if args.tune else Path(data_dir)
            settings = load_settings(flags={"taps": [str(evalset.tap)], "rule": args.rule, "data_dir": str(folder),
                                            "tune": args.tune})
            service = Service(settings).start()
            fixtures = load_fixtures(evalset.fixture_files)
            fit_rows, _ = split(fixtures)
            table = score_table(service.router, fixtures, top_k=k).subset(fit_rows)
            rights[name], wrongs[name], nulls[name] = sweep(table, grid)  # no nulls: null_fpr 0
            service.close()
    worst_null = np.max(np.stack(list(nulls.values())), axis=0)
    worst_wrong = np.max(np.stack(list(wrongs.values())), axis=0)
    mean_right = np.mean(np.stack(list(rights.values())), axis=0)
    ok = (worst_null <= args.max_null_fpr + 1e-9) & (worst_wrong <= args.max_wrong + 1e-9)
    score = np.where(ok, mean_right, -1.0)
    at = np.unravel_index(int(np.argmax(score)), score.shape)  # (threshold, margin, coverage)
    if score[at] < 0:
        raise SystemExit("no gate point keeps every set within the limits")
    print(json.dumps({
        "rule": args.rule, "tuned": args.tune, "threshold": float(grid.thresholds[at[0]]),
        "margin": float(grid.margins[at[1]]), "coverage": float(grid.coverages[at[2]]),
        "mean_fit_fired_right": round(float(mean_right[at]), 4),
        "per_set_fit": {n: {"fired_right": round(float(rights[n][at]), 4),
                            "fired_wrong": round(float(wrongs[n][at]), 4),
                            "null_fpr": round(float(nulls[n][at]), 4)} for n in rights},
    }, indent=2))


if __name__ == "__main__":
    main()
