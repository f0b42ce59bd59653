"""Research harness for the tuning recipe (``capd/tuning.py``): try other recipes on the eval sets.

Run: ``.venv/bin/python -m benchmarks.quality.tune_trial [--sets a,b] [--epochs N] [--lr X] ...``.

Per set: tune a copy of the bundled model on the tap's examples with the given recipe
(:func:`capd.tuning.train`), then measure the untuned and the tuned model with the code of
``make quality`` (``benchmarks.quality.run.measure``), with the tuned model passed in as the
encoder. Prints the held-out headline per rule and writes the JSON to
``benchmarks/results/tune_trial.json``. The shipped recipe is the defaults here.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.quality.run import CACHE, EVALSETS, RESULTS, SETS, find_sets, measure, write_report
from capd.encoder import Encoder, open_encoder
from capd.models import manifest_for, resolve
from capd.settings import Settings
from capd.taps import load_catalog
from capd.tuning import RECIPE, Batcher, Groups, Pair, Recipe, batches, groups_for, train


def headline(result: dict[str, Any], name: str) -> dict[str, Any]:
    rules = result["sets"][name]["rules"]
    return {rule: {"gates": r.get("calibrated", {}).get("gates"), "held_out": r.get("calibrated", {}).get("held_out"),
                   "all_rows": r.get("all_rows", {}).get("all")} for rule, r in rules.items()}


def hard_batches(items: list[Pair], size: int, rng: random.Random, neighbours: list[list[int]]) -> list[list[Pair]]:
    """Batches of confusable capabilities: a random pending capability, then its nearest
    neighbours (by the untuned model's centroids), one pair each, no capability twice."""
    pending: dict[int, list[Pair]] = {}
    shuffled = items[:]
    rng.shuffle(shuffled)
    for item in shuffled:
        pending.setdefault(item[0], []).append(item)
    out = []
    while pending:
        batch = []
        seed = rng.choice(sorted(pending))
        for label in [seed, *neighbours[seed]]:
            if label in pending:
                batch.append(pending[label].pop())
                if not pending[label]:
                    del pending[label]
                if len(batch) == size:
                    break
        out.append(batch)
    return out


def hard_batcher(encoder: Encoder, groups: Groups) -> Batcher:
    centroids = np.stack([encoder.embed(texts).mean(axis=0) for _, texts in groups])
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    similarity = centroids @ centroids.T
    neighbours = [[int(j) for j in np.argsort(-row) if j != i] for i, row in enumerate(similarity)]
    return partial(hard_batches, neighbours=neighbours)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--epochs", type=int, default=RECIPE.epochs)
    parser.add_argument("--lr", type=float, default=RECIPE.learning_rate)
    parser.add_argument("--batch", type=int, default=RECIPE.batch_size)
    parser.add_argument("--scale", type=float, default=RECIPE.scale)
    parser.add_argument("--pairs-per-example", type=int, default=RECIPE.pairs_per_example)
    parser.add_argument("--hard", action="store_true",
                        help="batches of confusable capabilities (nearest centroids) instead of random ones")
    parser.add_argument("--no-baseline", action="store_true", help="skip measuring the untuned model")
    parser.add_argument("--out", type=Path, default=RESULTS / "tune_trial.json")
    args = parser.parse_args(argv)
    found, skipped = find_sets([s for s in args.sets.split(",") if s], EVALSETS)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "skipped": skipped, "sets": {}}
    CACHE.mkdir(parents=True, exist_ok=True)
    base = open_encoder(Settings(data_dir=CACHE, taps=()))
    for evalset in found:
        groups = groups_for(load_catalog([evalset.tap]))
        entry: dict[str, Any] = {"capabilities": len(groups), "examples": sum(len(t) for _, t in groups)}
        if not args.no_baseline:
            before = measure([evalset.name], EVALSETS, [], encoder=base, timed=20, tune=False)
            entry["untuned"] = headline(before, evalset.name)
        with tempfile.TemporaryDirectory(prefix="capd-tune-") as scratch:
            model_dir = Path(scratch) / f"tuned-{evalset.name}"
            recipe = Recipe(args.epochs, args.lr, args.batch, args.scale, args.pairs_per_example)
            batcher = hard_batcher(base, groups) if args.hard else batches
            entry["tuning"] = train(resolve(manifest_for(Settings(taps=()))).directory, groups, model_dir, recipe,
                                    batcher)
            tuned = open_encoder(Settings(model=str(model_dir), data_dir=Path(scratch) / "data", taps=()))
            after = measure([evalset.name], EVALSETS, [], encoder=tuned, timed=20, tune=False)
        entry["tuned"] = headline(after, evalset.name)
        report["sets"][evalset.name] = entry
        for label in [k for k in ("untuned", "tuned") if k in entry]:
            for rule, r in entry[label].items():
                h = r["held_out"] or {}
                print(f"{evalset.name:20s} {label:8s} {rule:7s} " + " ".join(
                    f"{k}={h.get(k)}" for k in ("top1", "fired_right", "fired_wrong", "null_fpr")), flush=True)
        print(f"{evalset.name}: tuning {entry['tuning']}", flush=True)
        write_report(args.out, report)


if __name__ == "__main__":
    main(sys.argv[1:])
