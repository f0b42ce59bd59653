"""Research harness for the fused rule's auto gates (``capd/autogates.py``): how its two constants were chosen.

Run: ``.venv/bin/python -m benchmarks.quality.autogates_trial [--sets a,b] [--rates 0.02,0.03,0.05]
[--cuts -0.05,0,0.05,0.1,9]`` (about 4 minutes on 2 cores).

Per set and candidate (``AUTO_NULL_RATE`` = the abstain-corpus null rate allowed, ``CORPUS_LEVEL_CUT``
= corpus messages at or above this level at their winner are not nulls; 9 keeps them all): the auto
gates fitted on the set's tap (no fixture seen), then measured on the fit part and on the held-out
part of the fixtures (the split ``capd calibrate`` uses). The candidate shipped is the one with the
best mean fit-part fired_right whose every set stays within null_fpr <= 0.05 and fired_wrong <= 0.03
on its fit part, leaving out a set that no candidate keeps within them (its nulls cannot rank the
candidates). Held-out rows play no part in the choice. Also timed per set, in one process: embedding
the corpus, fitting the auto gates (shipped constants: five fold heads and the scoring) and fitting the one
head the fused rule needs anyway. Writes ``benchmarks/results/autogates_trial.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.quality.run import CACHE, EVALSETS, LIMITS, RESULTS, SETS, Bench, find_sets, gated, manifest_info
from capd import autogates, fused
from capd.calibrate import split
from capd.encoder import open_encoder
from capd.evaluation import score_table
from capd.fixtures import load_fixtures
from capd.router import abstain_corpus
from capd.settings import Settings

Candidate = tuple[float, float]  # (null rate, level cut)


def within(values: dict[str, Any]) -> bool:
    null = values["null_fpr"] or 0.0
    return null <= LIMITS["max_null_fpr"] + 1e-9 and values["fired_wrong"] <= LIMITS["max_wrong"] + 1e-9


def choose(results: dict[str, dict[Candidate, dict[str, Any]]]) -> tuple[Candidate | None, list[str]]:
    """The shipped rule: best mean fit fired_right, every rankable set within the limits on its fit part."""
    candidates = list(next(iter(results.values())))
    rankable = [s for s, per in results.items() if any(r and within(r["fit"]) for r in per.values())]
    feasible = [c for c in candidates if all(results[s][c] and within(results[s][c]["fit"]) for s in rankable)]
    if not feasible:
        return None, rankable
    best = max(feasible, key=lambda c: np.mean([results[s][c]["fit"]["fired_right"] if results[s][c] else 0.0
                                                for s in results]))
    return best, rankable


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--rates", default="0.02,0.03,0.05")
    parser.add_argument("--cuts", default="-0.05,0,0.05,0.1,9")
    parser.add_argument("--out", type=Path, default=RESULTS / "autogates_trial.json")
    args = parser.parse_args(argv)
    found, skipped = find_sets([s for s in args.sets.split(",") if s], EVALSETS)
    rates = [float(r) for r in args.rates.split(",")]
    cuts = [float(c) for c in args.cuts.split(",")]
    shipped = autogates.AUTO_NULL_RATE, autogates.CORPUS_LEVEL_CUT
    results: dict[str, dict[Candidate, dict[str, Any]]] = {}
    costs: dict[str, dict[str, float]] = {}
    CACHE.mkdir(parents=True, exist_ok=True)
    encoder = open_encoder(Settings(data_dir=CACHE, taps=()))
    corpus = abstain_corpus()
    with tempfile.TemporaryDirectory(prefix="capd-autogates-") as scratch:
        bench = Bench(encoder, Path(scratch), manifest_info()["gates"])
        for evalset in found:
            fixtures = load_fixtures(evalset.fixture_files)
            fit_rows, held_rows = split(fixtures)
            service = bench.service(evalset.tap, "fused")
            try:
                router = service.router
                assert router.head is not None and service.index is not None
                examples = autogates.examples_of(service.index, router.head, router.encoder.embed_tokens)
                assert examples is not None
                table = score_table(router, fixtures, vectors=bench.vectors(service, fixtures),
                                    tokens=bench.tokens(service, fixtures))
                started = time.perf_counter()
                embedded = router.encoder.embed_tokens(list(corpus))
                cost = {"corpus_embed_s": time.perf_counter() - started}
                started = time.perf_counter()
                autogates.choose(examples, corpus, embedded)  # the shipped constants
                cost["auto_gates_s"] = time.perf_counter() - started
                started = time.perf_counter()
                fused.fit_head(examples.vectors, examples.labels, len(examples.names))
                cost["head_fit_s"] = time.perf_counter() - started
                costs[evalset.name] = {k: round(v, 3) for k, v in cost.items()}
                print(f"{evalset.name:20s} cost: " + ", ".join(f"{k} {v:.2f}" for k, v in cost.items()), flush=True)
                per: dict[Candidate, dict[str, Any]] = {}
                for cut in cuts:
                    for rate in rates:
                        autogates.AUTO_NULL_RATE, autogates.CORPUS_LEVEL_CUT = rate, cut
                        point = autogates.choose(examples, corpus, embedded)
                        per[rate, cut] = {} if point is None else {
                            "gates": point.as_dict(),
                            "fit": gated(table, fit_rows, point.threshold, point.margin),
                            "held_out": gated(table, held_rows, point.threshold, point.margin)}
                        line = "no feasible point" if point is None else (
                            f"gates {point.threshold:+.2f} / {point.margin:.2f}  " + "  ".join(
                                f"{part} fr {per[rate, cut][part]['fired_right']:.3f} fw "
                                f"{per[rate, cut][part]['fired_wrong']:.3f} null {per[rate, cut][part]['null_fpr']}"
                                for part in ("fit", "held_out")))
                        print(f"{evalset.name:20s} rate={rate:<5g} cut={cut:<5g} {line}", flush=True)
                results[evalset.name] = per
            finally:
                autogates.AUTO_NULL_RATE, autogates.CORPUS_LEVEL_CUT = shipped
                service.close()
    best, rankable = choose(results) if results else (None, [])
    print(f"chosen on the fit parts (rankable sets: {', '.join(rankable)}): "
          + ("none" if best is None else f"rate {best[0]:g}, cut {best[1]:g}")
          + f"; shipped: rate {shipped[0]:g}, cut {shipped[1]:g}")
    report = {"args": vars(args) | {"out": str(args.out)}, "skipped": skipped, "rankable": rankable,
              "chosen": None if best is None else {"rate": best[0], "cut": best[1]},
              "shipped": {"rate": shipped[0], "cut": shipped[1]}, "cost_seconds": costs,
              "results": {s: [{"rate": c[0], "cut": c[1], **r} for c, r in per.items()] for s, per in results.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
