"""Research harness: where the fused rule's top1 misses go, and what moves top1 with the bundled model.

Run: ``.venv/bin/python -m benchmarks.quality.top1_trial [--sets a,b] [--confusions 8]`` (20 minutes
on 2 cores beside ``make quality``: each variant embeds and fits its own examples).

Per set, top1 on the fit and held-out positives (the split ``capd calibrate`` uses) for:

- ``shipped``: the fused rule as shipped;
- ``offsets``: with the per-capability offsets ``capd calibrate --offsets`` fits on the fit part
  (:func:`capd.calibrate.fit_offsets`; fit rows scored out of fold, as the gates see them);
- ``list items``: each capability's description split at commas, semicolons and colons, the parts
  added as examples when there are two or more (descriptions that list what a capability covers,
  as the shared sets' do: "iot: iot cleaning, iot coffee, …");
- ``fit positives``: every fit-part positive added as an example of its capability (not a rule:
  a bound on what more examples of the tap's own traffic could give the ranking).

Also the most frequent held-out confusions (expected → ranked first) of the shipped rule. Writes
``benchmarks/results/top1_trial.json``.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np

import capd.router
from benchmarks.quality.run import SETS, chosen_sets, trial_bench, trial_parser, write_report
from capd.calibrate import fit_offsets, split
from capd.catalog import Capability
from capd.evaluation import ScoreTable, score_table
from capd.fixtures import Fixture, load_fixtures

ExampleTexts = Callable[..., tuple[str, ...]]


def list_items(description: str) -> list[str]:
    """The parts of a description that lists things, or nothing when it does not (fewer than two)."""
    parts = [p.strip() for p in re.split(r"[,;:]", description) if p.strip()]
    return parts if len(parts) >= 2 else []


@contextmanager
def extra_examples(extra: Callable[[Capability], Sequence[str]]) -> Iterator[None]:
    """The fused rule's examples with ``extra(capability)`` appended, for services built inside."""
    shipped: ExampleTexts = capd.router.example_texts

    def texts(capability: Capability, rule: str, learned: Sequence[str] = ()) -> tuple[str, ...]:
        base = shipped(capability, rule, learned)
        return tuple(dict.fromkeys([*base, *extra(capability)])) if base and rule == "fused" else base

    capd.router.example_texts = texts
    try:
        yield
    finally:
        capd.router.example_texts = shipped


def examples_of(messages: dict[str, list[str]], capability: Capability) -> list[str]:
    return messages.get(capability.name, [])


def top1(table: ScoreTable, rows: np.ndarray, offsets: np.ndarray | None = None) -> float:
    scores = table.scores if offsets is None else table.scores + offsets
    winners = scores[rows].argmax(axis=1)
    return round(float(table.expected[rows, winners].mean()), 4)


def confusions(table: ScoreTable, rows: np.ndarray, count: int) -> list[dict[str, Any]]:
    winners = table.scores.argmax(axis=1)
    pairs: Counter[tuple[str, str]] = Counter()
    for row in rows:
        if not table.expected[row, winners[row]]:
            expected = "/".join(table.names[c] for c in np.flatnonzero(table.expected[row]))
            pairs[(expected, table.names[winners[row]])] += 1
    return [{"expected": e, "got": g, "count": n} for (e, g), n in pairs.most_common(count)]


def measure(name: str, label: str, table: ScoreTable, split_rows: tuple[np.ndarray, np.ndarray],
            offsets: np.ndarray | None = None) -> dict[str, Any]:
    """Top1 on the fit and held-out positives of ``table`` (with ``offsets`` added), printed."""
    fit_rows, held_rows = split_rows
    positive = table.positive
    entry = {"set": name, "variant": label, "top1_fit": top1(table, fit_rows[positive[fit_rows]], offsets),
             "top1_held": top1(table, held_rows[positive[held_rows]], offsets)}
    print(f"{name:20s} {label:14s} top1 fit {entry['top1_fit']:.3f} held {entry['top1_held']:.3f}", flush=True)
    return entry


def main(argv: list[str]) -> None:
    parser = trial_parser(__doc__ or "", "top1_trial", SETS)
    parser.add_argument("--confusions", type=int, default=8, help="how many held-out confusions to list")
    args = parser.parse_args(argv)
    found, skipped = chosen_sets(args)
    report: dict[str, Any] = {"skipped": skipped, "results": []}
    with trial_bench("top1") as bench:
        for evalset in found:
            fixtures: list[Fixture] = load_fixtures(evalset.fixture_files)
            parts = fit_rows, held_rows = split(fixtures)
            fit_positives: dict[str, list[str]] = {}
            for row in fit_rows:
                if len(fixtures[row].expect) == 1:
                    fit_positives.setdefault(fixtures[row].expect[0], []).append(fixtures[row].message)
            service = bench.service(evalset.tap, "fused")
            vectors, tokens = bench.vectors(service, fixtures), bench.tokens(service, fixtures)
            table = score_table(service.router.with_offsets({}), fixtures, vectors=vectors, tokens=tokens)
            shipped = measure(evalset.name, "shipped", table, parts)
            shipped["confusions"] = confusions(table, held_rows[table.positive[held_rows]], args.confusions)
            report["results"] += [shipped, measure(evalset.name, "offsets", table, parts,
                                                   fit_offsets(table, fit_rows).by_row)]
            variants: list[tuple[str, Callable[[Capability], Sequence[str]]]] = [
                ("list items", lambda c: list_items(c.description or "")),
                ("fit positives", partial(examples_of, fit_positives)),
            ]
            for label, extra in variants:
                with extra_examples(extra):
                    variant = bench.service(evalset.tap, "fused")
                    report["results"].append(measure(evalset.name, label, score_table(
                        variant.router, fixtures, vectors=vectors, tokens=tokens), parts))
            for pair in shipped["confusions"]:
                print(f"    {pair['count']:3d}  {pair['expected']} -> {pair['got']}")
    write_report(args.out, report)


if __name__ == "__main__":
    main(sys.argv[1:])
