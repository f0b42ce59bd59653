"""Research harness for the fused rule's auto gates (``capd/autogates.py``): how its two constants were chosen.

Run: ``.venv/bin/python -m benchmarks.quality.autogates_trial [--sets a,b] [--rates 0.02,0.03,0.05]
[--cuts=-0.05,0,0.05,0.1,9] [--wrongs 0.03] [--coverage off,on]`` (about 4 minutes on 2 cores with the
defaults; each extra value multiplies the candidates).

Per set and candidate (``AUTO_NULL_RATE`` = the abstain-corpus null rate allowed, ``CORPUS_LEVEL_CUT``
= corpus messages at or above this level at their winner are not nulls, 9 keeps them all;
``AUTO_MAX_WRONG`` = the out-of-fold wrong rate allowed; coverage ``on`` = the grid's coverage axis
swept, ``off`` = no coverage gate): the auto
gates fitted on the set's tap (no fixture seen), then measured on the fit part and on the held-out
part of the fixtures (the split ``capd calibrate`` uses). The candidate shipped is the one with the
best mean fit-part fired_right whose every set stays within null_fpr <= 0.05 and fired_wrong <= 0.03
on its fit part, leaving out a set that no candidate keeps within them (its nulls cannot rank the
candidates). Held-out rows play no part in the choice. Also timed per set, in one process: embedding
the corpus, fitting the auto gates (shipped constants: five fold heads and the scoring) and fitting the one
head the fused rule needs anyway.

Unseen tasks (``--unseen``, screened 2026-11-26, not kept): the corpus's nulls are chitchat,
feedback and logs, while the shared sets' nulls are requests for tasks the tap lacks. A stand-in
needing no fixture: the capabilities are split into five groups (a fixed shuffle), and per group a
head fitted without that group's capabilities scores their examples, each one a request for a task
the tap (so reduced) does not have. A value R < 1 adds the limit "at most R of those fire" to the
candidate's limits; 1 adds none (what ships).

Carrying over (``AUTO_REFIT_SHARE``): a daemon keeps its auto gates until more than that share
of the capabilities changed since the fit. Per set, share (``--shares``) and seed, the gates are
fitted without a random ``share`` of its capabilities (rounded down), as if those had been added
after the fit, and measured on the whole tap next to the gates refitted on all of it: the most a
carried-over point can differ at that share. A set too small for one capability to stay within
the share never carries over (any change refits).

Scoring fewer folds (``AUTO_MIN_SCORED``; ``--folds 1,2``): folds are scored in turn until
``AUTO_MIN_SCORED`` examples are. Per set and number of folds, ``AUTO_MIN_SCORED`` is set to what
that many folds hold, and the gates and what they give on the fixtures are shown next to every fold
scored (the shared sets have at most 1,050 examples, under the shipped 2,000). ``--generated 1000``
does the same on the generated 1,000-capability tap of ``benchmarks/bench_daemon.py`` (10,951
examples, no fixtures), where the shipped value scores one fold: each point is measured on the
out-of-fold rows of all five folds and the corpus, and ``choose`` is timed.

Writes ``benchmarks/results/autogates_trial.json``.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import gen_tap
from benchmarks.quality.run import (
    CACHE,
    EVALSETS,
    LIMITS,
    RESULTS,
    SETS,
    Bench,
    find_sets,
    gated,
    trial_bench,
    write_report,
)
from capd import autogates, fused
from capd.calibrate import FUSED_GRID, Grid, Point, best_point, split, sweep
from capd.evaluation import ScoreTable, apply_gates, metrics, score_table
from capd.fixtures import Fixture, load_fixtures
from capd.service import Service
from capd.settings import Settings
from capd.vetoes import abstain_corpus

# (null rate, level cut, max wrong, coverage axis "on"/"off", unseen-task fire rate allowed: 1 is no limit)
Candidate = tuple[float, float, float, str, float]
UNSEEN_GROUPS = 5


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


CARRY_SEEDS = 3


def without(examples: autogates.Examples, dropped: np.ndarray) -> autogates.Examples:
    """``examples`` as if the ``dropped`` capabilities had no examples yet (their columns never win)."""
    rows = np.flatnonzero(~np.isin(examples.labels, dropped))
    return autogates.Examples(examples.names, tuple(examples.texts[i] for i in rows), examples.vectors[rows],
                              examples.labels[rows], autogates._head(examples, rows), examples.embed_tokens)


def carry_over(examples: autogates.Examples, corpus: Sequence[str], embedded: Any, table: Any,
               rows: dict[str, np.ndarray], refitted: Any, share: float) -> list[dict[str, Any]]:
    """Per seed: the gates fitted before a random ``share`` of the capabilities were added, on the
    whole tap's fixtures, next to ``refitted`` (fitted on all of it)."""
    columns = len(examples.names)
    count = int(share * columns)
    out: list[dict[str, Any]] = []
    for seed in range(CARRY_SEEDS if count else 0):
        dropped = np.random.default_rng(seed).choice(columns, size=count, replace=False)
        point = autogates.choose(without(examples, dropped), corpus, embedded)
        out.append({"share": share, "seed": seed, "added_after_fit": count,
                    "gates": None if point is None else point.as_dict(),
                    **({} if point is None else {part: gated(table, r, point)
                                                 for part, r in rows.items()}),
                    "refitted": {part: gated(table, r, refitted)
                                 for part, r in rows.items()}})
    return out


def carry_line(run: dict[str, Any], refitted: Any) -> str:
    head = f"carried over at {run['share']:g} (+{run['added_after_fit']} capabilities, seed {run['seed']}): "
    if run["gates"] is None:
        return head + "no feasible point"
    parts = [f"{part} fr {run[part]['fired_right']:.3f} vs {run['refitted'][part]['fired_right']:.3f}, "
             f"null {run[part]['null_fpr']} vs {run['refitted'][part]['null_fpr']}" for part in ("fit", "held_out")]
    return (head + f"gates {run['gates']['threshold']:+.2f} / {run['gates']['margin']:.2f} vs refitted "
            f"{refitted.threshold:+.2f} / {refitted.margin:.2f}; " + "; ".join(parts))  # coverage in the JSON


def unseen_tasks(examples: autogates.Examples) -> ScoreTable:
    """Every example as a null, scored by a head fitted without its capability's group (of
    :data:`UNSEEN_GROUPS`, by a fixed shuffle): a request for a task the tap does not have."""
    names, labels = examples.names, examples.labels
    group_of = np.empty(len(names), dtype=np.int64)
    group_of[np.random.default_rng(0).permutation(len(names))] = np.arange(len(names)) % UNSEEN_GROUPS
    head_tokens = examples.head.tokens.matrices() if examples.head.tokens is not None else {}
    scored: list[tuple[list[str], Any]] = []
    for group in range(UNSEEN_GROUPS):
        held = np.isin(labels, np.flatnonzero(group_of == group))
        kept, rows = np.flatnonzero(~held), np.flatnonzero(held)
        if not len(rows) or not len(kept):
            continue
        texts = [examples.texts[i] for i in rows]
        head = autogates._head(examples, kept)
        tokens = None if head.tokens is None else [head_tokens[t] for t in texts]
        scored.append((texts, autogates._score(head, examples, kept, examples.vectors[rows], texts, tokens)))
    fixtures = tuple(Fixture(t, (), "null", "unseen task") for texts, _ in scored for t in texts)
    count = len(fixtures)
    return ScoreTable(fixtures, names, np.vstack([s.fused for _, s in scored]), np.ones(count, dtype=bool),
                      np.zeros((count, len(names)), dtype=bool), np.vstack([s.level for _, s in scored]),
                      coverage=np.concatenate([s.winner_coverage for _, s in scored]))


def choose_within(examples: autogates.Examples, corpus: Sequence[str], embedded: Any, grid: Grid,
                  unseen: ScoreTable | None, rate: float) -> Point | None:
    """``autogates.choose``, with at most ``rate`` of the ``unseen`` tasks firing (``rate`` 1: the same)."""
    if unseen is None or rate >= 1:
        return autogates.choose(examples, corpus, embedded, grid)
    evidence = autogates.evidence(examples, corpus, embedded)
    if evidence is None:
        return None
    fires = sweep(unseen, grid)[2]

    def accept(_: ScoreTable, right: np.ndarray, wrong: np.ndarray, null: np.ndarray) -> np.ndarray:
        return ((null <= autogates.AUTO_NULL_RATE + 1e-9) & (wrong <= autogates.AUTO_MAX_WRONG + 1e-9)
                & (fires <= rate + 1e-9))

    return best_point({fused.TOP_K: evidence}, 0.0, 0.0, grid=grid, accept=accept)[0]


def fold_sizes(examples: autogates.Examples) -> np.ndarray:
    """Examples each fold scores (a capability's only example is never held out)."""
    alone = np.bincount(examples.labels)[examples.labels] < 2
    return np.bincount(autogates.folds(examples.labels)[~alone], minlength=autogates.AUTO_FOLDS)


def fewer_folds(examples: autogates.Examples, corpus: Sequence[str], embedded: Any, table: Any,
                rows: dict[str, np.ndarray], counts: list[int]) -> list[dict[str, Any]]:
    """Per number of folds: the auto gates from that many and what they give on the fixtures' ``rows``."""
    shipped, out = autogates.AUTO_MIN_SCORED, []
    sizes = np.cumsum(fold_sizes(examples))
    try:
        for count in sorted({*counts, autogates.AUTO_FOLDS}):
            autogates.AUTO_MIN_SCORED = int(sizes[count - 1])
            point = autogates.choose(examples, corpus, embedded)
            out.append({"folds": count, "scored": int(sizes[count - 1]), "of": int(sizes[-1]),
                        "gates": None if point is None else point.as_dict(),
                        **({} if point is None else {part: gated(table, r, point) for part, r in rows.items()})})
    finally:
        autogates.AUTO_MIN_SCORED = shipped
    return out


def fewer_folds_line(run: dict[str, Any]) -> str:
    head = f"{run['folds']} fold(s), {run['scored']} of {run['of']} examples scored: "
    if run["gates"] is None:
        return head + "no feasible point"
    return head + f"gates {run['gates']['threshold']:+.2f} / {run['gates']['margin']:.2f}  " + "  ".join(
        f"{part} fr {run[part]['fired_right']:.3f} fw {run[part]['fired_wrong']:.3f} null {run[part]['null_fpr']}"
        for part in ("fit", "held_out"))


def generated(size: int, counts: list[int], bench: Bench, corpus: Sequence[str]) -> dict[str, Any]:
    """``choose`` on the generated tap of ``size`` per number of folds (timed; with the shipped
    ``AUTO_MIN_SCORED`` too), each point measured on every fold's out-of-fold rows and the corpus
    nulls (no fixtures exist)."""
    tap = gen_tap.cached_tap(size, CACHE.parent)
    data_dir = bench.scratch / f"generated-{size}"
    primed = CACHE.parent / f"data-{size}-v{gen_tap.VERSION}" / "vectors.sqlite3"  # bench_daemon's, if it ran
    if primed.is_file():
        data_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(primed, data_dir / primed.name)
    # not bench.service(): the bench's services share one data dir, and this one needs no auto gates
    settings = Settings(taps=(tap,), rule="fused", data_dir=data_dir, auto_gates=False)
    service = Service(settings, encoder=bench.encoder).start()
    try:
        router = service.router
        assert router.head is not None and service.index is not None
        examples = autogates.examples_of(service.index, router.head, router.encoder.embed_tokens)
        assert examples is not None
        embedded = router.encoder.embed_tokens(list(corpus))
        shipped, runs = autogates.AUTO_MIN_SCORED, []
        try:
            autogates.AUTO_MIN_SCORED = len(examples.labels)  # every fold: the reference rows
            reference = autogates.evidence(examples, corpus, embedded)
            assert reference is not None
            sizes = np.cumsum(fold_sizes(examples))
            for value in sorted({*(int(sizes[c - 1]) for c in {*counts, autogates.AUTO_FOLDS}), shipped}):
                autogates.AUTO_MIN_SCORED = value
                started = time.perf_counter()
                point = autogates.choose(examples, corpus, embedded)
                seconds = time.perf_counter() - started
                run: dict[str, Any] = {"min_scored": value, "folds": int(np.searchsorted(sizes, value) + 1),
                                       "choose_s": round(seconds, 2),
                                       "gates": None if point is None else point.as_dict()}
                if point is not None:
                    run["all_folds"] = metrics(reference, apply_gates(reference, point.threshold, point.margin))
                runs.append(run)
                print(f"generated-{size}: min_scored {value:>6} ({run['folds']} fold(s)) choose {seconds:.1f} s "
                      + ("no feasible point" if point is None else
                         f"gates {point.threshold:+.2f} / {point.margin:.2f}; on every fold's rows: fr "
                         f"{run['all_folds']['fired_right']:.3f} fw {run['all_folds']['fired_wrong']:.3f} "
                         f"corpus null {run['all_folds']['null_fpr']:.3f}"), flush=True)
        finally:
            autogates.AUTO_MIN_SCORED = shipped
        return {"capabilities": len(examples.names), "examples": len(examples.labels), "runs": runs}
    finally:
        service.close()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--rates", default="0.02,0.03,0.05")
    parser.add_argument("--cuts", default="-0.05,0,0.05,0.1,9")
    parser.add_argument("--wrongs", default=str(autogates.AUTO_MAX_WRONG), help="AUTO_MAX_WRONG values")
    parser.add_argument("--coverage", default="off", help="on: sweep the coverage gate too; off: not (shipped)")
    parser.add_argument("--unseen", default="1", help="unseen-task fire rates allowed (1: no limit, shipped)")
    parser.add_argument("--shares", default="0.02,0.05", help="carry-over shares to measure")
    parser.add_argument("--folds", default="", help="numbers of folds to compare with all five (e.g. 1,2)")
    parser.add_argument("--generated", type=int, default=0, help="also compare them on the generated tap of this size")
    parser.add_argument("--out", type=Path, default=RESULTS / "autogates_trial.json")
    args = parser.parse_args(argv)
    fold_counts = [int(v) for v in args.folds.split(",") if v.strip()]
    found, skipped = find_sets([s for s in args.sets.split(",") if s], EVALSETS)
    rates = [float(r) for r in args.rates.split(",")]
    cuts = [float(c) for c in args.cuts.split(",")]
    shares = [float(c) for c in args.shares.split(",") if c.strip()]
    wrongs = [float(w) for w in args.wrongs.split(",")]
    axes = {"on": FUSED_GRID, "off": autogates.AUTO_GRID}  # off: what ships
    coverage_modes = [c for c in args.coverage.split(",") if c in axes]
    unseen_rates = [float(r) for r in args.unseen.split(",")]
    shipped = autogates.AUTO_NULL_RATE, autogates.CORPUS_LEVEL_CUT, autogates.AUTO_MAX_WRONG
    results: dict[str, dict[Candidate, dict[str, Any]]] = {}
    costs: dict[str, dict[str, float]] = {}
    carried: dict[str, list[dict[str, Any]]] = {}
    folds: dict[str, Any] = {}
    corpus = abstain_corpus()
    with trial_bench("autogates") as bench:
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
                refitted = autogates.choose(examples, corpus, embedded)  # the shipped constants
                cost["auto_gates_s"] = time.perf_counter() - started
                started = time.perf_counter()
                fused.fit_head(examples.vectors, examples.labels, len(examples.names))
                cost["head_fit_s"] = time.perf_counter() - started
                costs[evalset.name] = {k: round(v, 3) for k, v in cost.items()}
                print(f"{evalset.name:20s} cost: " + ", ".join(f"{k} {v:.2f}" for k, v in cost.items()), flush=True)
                if refitted is not None:
                    carried[evalset.name] = [run for share in shares for run in carry_over(
                        examples, corpus, embedded, table, {"fit": fit_rows, "held_out": held_rows}, refitted, share)]
                    for run in carried[evalset.name]:
                        print(f"{evalset.name:20s} {carry_line(run, refitted)}", flush=True)
                if fold_counts:
                    folds[evalset.name] = fewer_folds(examples, corpus, embedded, table,
                                                      {"fit": fit_rows, "held_out": held_rows}, fold_counts)
                    for run in folds[evalset.name]:
                        print(f"{evalset.name:20s} {fewer_folds_line(run)}", flush=True)
                per: dict[Candidate, dict[str, Any]] = {}
                unseen = unseen_tasks(examples) if any(r < 1 for r in unseen_rates) else None
                for candidate in itertools.product(rates, cuts, wrongs, coverage_modes, unseen_rates):
                    rate, cut, wrong, axis, unseen_rate = candidate
                    autogates.AUTO_NULL_RATE, autogates.CORPUS_LEVEL_CUT, autogates.AUTO_MAX_WRONG = rate, cut, wrong
                    point = choose_within(examples, corpus, embedded, axes[axis], unseen, unseen_rate)
                    per[candidate] = {} if point is None else {
                        "gates": point.as_dict(),
                        "fit": gated(table, fit_rows, point),
                        "held_out": gated(table, held_rows, point)}
                    line = "no feasible point" if point is None else (
                        f"gates {point.threshold:+.2f} / {point.margin:.2f} / {point.coverage:.2f}  " + "  ".join(
                            f"{part} fr {per[candidate][part]['fired_right']:.3f} fw "
                            f"{per[candidate][part]['fired_wrong']:.3f} null {per[candidate][part]['null_fpr']}"
                            for part in ("fit", "held_out")))
                    print(f"{evalset.name:20s} rate={rate:<5g} cut={cut:<5g} wrong={wrong:<5g} coverage={axis:<3} "
                          f"unseen={unseen_rate:<5g} {line}", flush=True)
                results[evalset.name] = per
            finally:
                autogates.AUTO_NULL_RATE, autogates.CORPUS_LEVEL_CUT, autogates.AUTO_MAX_WRONG = shipped
                service.close()
        if args.generated:
            folds[f"generated-{args.generated}"] = generated(args.generated, fold_counts, bench, corpus)
    best, rankable = choose(results) if results else (None, [])
    print(f"chosen on the fit parts (rankable sets: {', '.join(rankable)}): "
          + ("none" if best is None else f"rate {best[0]:g}, cut {best[1]:g}, wrong {best[2]:g}, coverage {best[3]}, "
             f"unseen {best[4]:g}")
          + f"; shipped: rate {shipped[0]:g}, cut {shipped[1]:g}, wrong {shipped[2]:g}, coverage off, unseen 1")
    names = ("rate", "cut", "wrong", "coverage", "unseen")
    report = {"args": vars(args) | {"out": str(args.out)}, "skipped": skipped, "rankable": rankable,
              "chosen": None if best is None else dict(zip(names, best, strict=True)),
              "shipped": dict(zip(names[:3], shipped, strict=True)), "cost_seconds": costs, "carry_over": carried,
              "fewer_folds": folds,
              "results": {s: [{**dict(zip(names, c, strict=True)), **r} for c, r in per.items()]
                          for s, per in results.items()}}
    write_report(args.out, report)


if __name__ == "__main__":
    main(sys.argv[1:])
