"""Research harness: where the fused rule's top1 misses go, and what moves top1 with the bundled model.

Run: ``.venv/bin/python -m benchmarks.quality.top1_trial [--sets a,b] [--confusions 8] [--candidates 5]
[--no-examples]`` (20 minutes on 2 cores beside ``make quality``: each variant with other examples
embeds and fits its own; 3 minutes with ``--no-examples``).

Per set, top1 on the fit and held-out positives (the split ``capd calibrate`` uses) for:

- ``shipped``: the fused rule as shipped;
- ``offsets``: with the per-capability offsets ``capd calibrate --offsets`` fits on the fit part
  (:func:`capd.offsets.fit_offsets`; fit rows scored out of fold, as the gates see them);
- ``offsets + second stage``: the offsets fitted jointly with one more weight per tap for the
  second stage (late interaction over the ``--candidates`` best capabilities, shipped 5; 0 = every
  capability): ``F + β'·(M − max M) + d``, the same cross-entropy, penalty and folds as the offsets.
  Its fitted ``β'`` is printed (the shipped weight is ``RESCORE_WEIGHT``, already inside ``F``);
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
from capd import fused
from capd.calibrate import split
from capd.catalog import Capability
from capd.evaluation import ScoreTable, score_table
from capd.fixtures import Fixture, load_fixtures
from capd.offsets import OFFSET_FOLDS, OFFSET_MIN_ROWS, OFFSET_PENALTIES, fit_offsets

ExampleTexts = Callable[..., tuple[str, ...]]


def list_items(description: str) -> list[str]:
    """The parts of a description that lists things, or nothing when it does not (fewer than two)."""
    parts = [p.strip() for p in re.split(r"[,;:]", description) if p.strip()]
    return parts if len(parts) >= 2 else []


@contextmanager
def extra_examples(extra: Callable[[Capability], Sequence[str]]) -> Iterator[None]:
    """The fused rule's examples with ``extra(capability)`` appended, for services built inside."""
    shipped: ExampleTexts = capd.router.example_texts

    def texts(capability: Capability, rule: str, learned: Sequence[str] = (),
              tap_examples: Sequence[str] = ()) -> tuple[str, ...]:
        base = shipped(capability, rule, learned, tap_examples)
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


def second_stage_matches(head: fused.FusedHead, table: ScoreTable, tokens: Sequence[np.ndarray],
                         candidates: int) -> np.ndarray:
    """``[rows, capabilities]``: M − max M over each row's ``candidates`` best capabilities by the
    shipped F (0 = all), the second stage's late-interaction score; 0 elsewhere."""
    assert head.tokens is not None
    columns = table.scores.shape[1]
    top = columns if candidates <= 0 else min(candidates, columns)
    out = np.zeros(table.scores.shape)
    for row, message in enumerate(tokens):
        chosen = np.argpartition(-table.scores[row], top - 1)[:top]
        match, _ = head.tokens.late_interaction(np.asarray(message, dtype=np.float32), chosen.tolist())
        out[row, chosen] = match - match.max()
    return out


def _fit_weight(scores: np.ndarray, matches: np.ndarray, labels: np.ndarray, free: np.ndarray,
                penalty: float) -> tuple[float, np.ndarray]:
    """(β', d) minimising the mean cross-entropy of softmax(F + β'·M + d) plus penalty·‖d‖²."""
    from scipy.optimize import minimize

    n, columns = scores.shape
    rows = np.arange(n)

    def loss_and_gradient(theta: np.ndarray) -> tuple[float, np.ndarray]:
        offsets = np.zeros(columns)
        offsets[free] = theta[1:]
        shifted = scores + theta[0] * matches + offsets
        top = shifted.max(axis=1, keepdims=True)
        exp = np.exp(shifted - top)
        total = exp.sum(axis=1)
        loss = float(np.mean(top[:, 0] + np.log(total) - shifted[rows, labels]))
        loss += penalty * float(theta[1:] @ theta[1:])
        gradient = exp / total[:, None]
        gradient[rows, labels] -= 1
        gradient /= n
        return loss, np.concatenate([[float((gradient * matches).sum())],
                                     gradient.sum(axis=0)[free] + 2 * penalty * theta[1:]])

    found = minimize(loss_and_gradient, np.zeros(1 + int(free.sum())), jac=True, method="L-BFGS-B")
    offsets = np.zeros(columns)
    offsets[free] = found.x[1:]
    return float(found.x[0]), offsets


def _loss(scores: np.ndarray, matches: np.ndarray, labels: np.ndarray, fit: tuple[float, np.ndarray]) -> float:
    shifted = scores + fit[0] * matches + fit[1]
    top = shifted.max(axis=1)
    return float(np.sum(top + np.log(np.exp(shifted - top[:, None]).sum(axis=1)) - shifted[np.arange(len(labels)),
                                                                                             labels]))


def second_stage_fit(table: ScoreTable, matches: np.ndarray, fit_rows: np.ndarray) -> tuple[float, np.ndarray]:
    """β' and what each row is scored with (``[rows, capabilities]`` added to F): fit rows out of
    fold, as :func:`capd.offsets.fit_offsets` scores them, the others with the full fit."""
    single = table.expected.sum(axis=1) == 1
    chosen = np.asarray([r for r in fit_rows if table.positive[r] and single[r] and table.routable[r]], dtype=np.int64)
    scores, labels = table.scores.astype(np.float64), table.expected.argmax(axis=1)
    free = np.bincount(labels[chosen], minlength=scores.shape[1]) >= OFFSET_MIN_ROWS
    folds = np.arange(len(chosen)) % OFFSET_FOLDS
    best: tuple[float, float, list[tuple[float, np.ndarray]]] | None = None
    for penalty in OFFSET_PENALTIES:
        fitted = [_fit_weight(scores[chosen[folds != k]], matches[chosen[folds != k]], labels[chosen[folds != k]],
                              free, penalty) for k in range(OFFSET_FOLDS)]
        loss = sum(_loss(scores[chosen[folds == k]], matches[chosen[folds == k]], labels[chosen[folds == k]],
                         fitted[k]) for k in range(OFFSET_FOLDS))
        if best is None or loss < best[0]:
            best = (loss, penalty, fitted)
    assert best is not None
    weight, offsets = _fit_weight(scores[chosen], matches[chosen], labels[chosen], free, best[1])
    by_row = weight * matches + offsets
    for k, (fold_weight, fold_offsets) in enumerate(best[2]):
        rows = chosen[folds == k]
        by_row[rows] = fold_weight * matches[rows] + fold_offsets
    return weight, by_row


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
    parser.add_argument("--candidates", type=int, default=fused.RESCORE_CANDIDATES,
                        help="capabilities the fitted second-stage weight re-scores (0: all)")
    parser.add_argument("--no-examples", action="store_true",
                        help="skip the variants with other examples (each embeds and fits its own; most of the time)")
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
            assert service.router.head is not None
            weight, by_row = second_stage_fit(table, second_stage_matches(service.router.head, table, tokens,
                                                                          args.candidates), fit_rows)
            report["results"].append(measure(evalset.name, "offsets + second stage", table, parts, by_row)
                                     | {"weight": round(weight, 2), "candidates": args.candidates})
            print(f"{'':20s} fitted second-stage weight {weight:.2f} over {args.candidates or 'all'} candidates")
            variants: list[tuple[str, Callable[[Capability], Sequence[str]]]] = [
                ("list items", lambda c: list_items(c.description or "")),
                ("fit positives", partial(examples_of, fit_positives)),
            ]
            for label, extra in [] if args.no_examples else variants:
                with extra_examples(extra):
                    variant = bench.service(evalset.tap, "fused")
                    report["results"].append(measure(evalset.name, label, score_table(
                        variant.router, fixtures, vectors=vectors, tokens=tokens), parts))
            for pair in shipped["confusions"]:
                print(f"    {pair['count']:3d}  {pair['expected']} -> {pair['got']}")
    write_report(args.out, report)


if __name__ == "__main__":
    main(sys.argv[1:])
