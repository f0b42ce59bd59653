"""Routing metrics over fixtures (DESIGN.md "Fixture format").

The expensive part — embedding every message and scoring it against every capability —
is done once into a :class:`ScoreTable`; gates are then applied with numpy, so
``capd calibrate`` can sweep thousands of gate settings in seconds.

Metrics: ``top1`` (positives whose best capability is expected, gates ignored),
``fired_right`` / ``fired_wrong`` (positives where the router activated an expected /
another capability), ``null_fpr`` (nulls where it activated anything). A message
skipped by the short-input gate counts as an abstention.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from capd.encoder import TokenVectors
from capd.errors import CapdError
from capd.fixtures import Fixture
from capd.gates import passes_coverage
from capd.router import Router
from capd.text import clean_message, routed_key


@dataclass(frozen=True)
class ScoreTable:
    """Scores of every fixture message against every capability, for one rule and top_k.

    ``scores`` rank the capabilities. For the anchor and capd rules the gates read the same
    scores (threshold on top1, margin on top1 − top2); for ``fused`` they read ``levels``
    (threshold on the winner's level), the fused scores' gap and ``coverage`` (the winner's,
    for the coverage gate; NaN passes it).
    """

    fixtures: tuple[Fixture, ...]
    names: tuple[str, ...]
    scores: np.ndarray  # [rows, capabilities]
    routable: np.ndarray  # bool [rows]: passed the short-input gate
    expected: np.ndarray  # bool [rows, capabilities]
    levels: np.ndarray | None = None  # [rows, capabilities]: what the threshold reads, when not ``scores``
    vetoed: np.ndarray | None = None  # bool [rows]: a learned abstain vetoes the row's winner (capd.vetoes.Vetoes)
    coverage: np.ndarray | None = None  # [rows]: the winner's coverage (fused; None: no coverage gate)

    @functools.cached_property
    def positive(self) -> np.ndarray:
        """bool [rows]: the row expects a capability. From the fixtures, not from ``expected``: a row
        expecting a capability that has no triggers (so no column) is a positive nothing can fire right."""
        return np.array([f.positive for f in self.fixtures], dtype=bool)

    def gate_inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(winner index, what the threshold reads, what the margin reads) per row.

        Without ``levels``: top1 and top1 − top2 (top2 = 0 with one capability). With them:
        the winner's level and the gap between the two best scores (inf with one capability).
        """
        n = self.scores.shape[1]
        winner = self.scores.argmax(axis=1)
        rows = np.arange(len(winner))
        top1 = self.scores[rows, winner]
        if n < 2:
            top2 = np.zeros_like(top1) if self.levels is None else np.full_like(top1, -np.inf)
        else:
            top2 = np.partition(self.scores, n - 2, axis=1)[:, n - 2]
        level = top1 if self.levels is None else self.levels[rows, winner]
        return winner, level, top1 - top2

    def subset(self, rows: np.ndarray) -> ScoreTable:
        return ScoreTable(tuple(self.fixtures[i] for i in rows), self.names, self.scores[rows], self.routable[rows],
                          self.expected[rows], None if self.levels is None else self.levels[rows],
                          None if self.vetoed is None else self.vetoed[rows],
                          None if self.coverage is None else self.coverage[rows])

    def covered(self, gate: np.ndarray | float) -> np.ndarray:
        """bool [rows]: the coverage gate (per row, or one value) passes; 0 is no gate, NaN passes."""
        if self.coverage is None:
            return np.ones(len(self.routable), dtype=bool)
        return passes_coverage(self.coverage, gate)


def _texts(router: Router, fixtures: Sequence[Fixture]) -> list[str]:
    return [clean_message(f.message, router.min_chars)[0] for f in fixtures]


def embed_fixtures(router: Router, fixtures: Sequence[Fixture]) -> tuple[np.ndarray, TokenVectors | None]:
    """The vectors of the cleaned fixture messages (embedded once, then scored any number of
    ways) and, for the ``fused`` rule, their token vectors from the same model call."""
    texts = _texts(router, fixtures)
    if router.rule == "fused":
        return router.encoder.embed_tokens(texts)
    return router.encoder.embed(texts), None


def score_table(router: Router, fixtures: Sequence[Fixture], top_k: int | None = None,
                vectors: np.ndarray | None = None, tokens: TokenVectors | None = None,
                not_own_veto: bool = False, offsets: np.ndarray | None = None) -> ScoreTable:
    """Every fixture scored by the router's rule (``top_k`` applies to the cosine rules only).
    ``not_own_veto``: a row is not vetoed by a veto equal to its own message (:meth:`Router.refusals`).
    ``offsets`` (``fused``; ``[rows, capabilities]``, in the router's column order) are added to
    each row's scores before its winner is taken: ``capd calibrate`` scores each fit row with
    offsets fitted without it (:class:`capd.offsets.OffsetFit`).

    ``vectors`` and ``tokens`` come from :func:`embed_fixtures`; ``fused`` given vectors
    without tokens embeds the messages again for them. Raises CapdError when no capability can
    be routed to (none has triggers): every row would abstain, which measures nothing."""
    if router.index.capability_count == 0:
        raise CapdError("nothing to measure: no capability of the taps has triggers, so every message would "
                        "abstain (capd lint lists the capabilities without them)")
    if vectors is None:
        vectors, tokens = embed_fixtures(router, fixtures)
    levels = coverage = knn = None
    if router.rule == "fused":
        texts = _texts(router, fixtures)
        if tokens is None:
            tokens = router.encoder.embed_tokens(texts)[1]
        names, fused_scores = router.fused_scores(vectors, texts, tokens)
        scores, levels, coverage = fused_scores.fused, fused_scores.level, fused_scores.winner_coverage
        knn = fused_scores.knn
        if offsets is not None:
            scores = scores + offsets
            coverage = fused_scores.coverage[np.arange(len(fixtures)), scores.argmax(axis=1)]
    else:
        names, scores = router.index.named_scores(vectors, top_k or router.top_k)
    position = {n: i for i, n in enumerate(names)}
    routable = np.zeros(len(fixtures), dtype=bool)
    expected = np.zeros((len(fixtures), len(names)), dtype=bool)
    for row, fixture in enumerate(fixtures):
        routable[row] = clean_message(fixture.message, router.min_chars)[1]
        for name in fixture.expect:
            if name in position:
                expected[row, position[name]] = True
    scores = np.asarray(scores, dtype=np.float32)
    vetoed = None
    if len(router.vetoes) and len(names):
        winners = [names[i] for i in scores.argmax(axis=1).tolist()]
        own = [f.message for f in fixtures] if not_own_veto else None
        vetoed = np.array([r is not None for r in router.refusals(vectors, winners, own, knn)], dtype=bool)
    return ScoreTable(tuple(fixtures), names, scores, routable, expected, levels, vetoed, coverage)


def gate_arrays(router: Router, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-capability threshold, margin and coverage gate (the winner's tap gates apply)."""
    gates = [router._gates_for(n) for n in names]
    return (np.array([g.threshold for g in gates], dtype=np.float32),
            np.array([g.margin for g in gates], dtype=np.float32),
            np.array([g.coverage for g in gates], dtype=np.float32))


@dataclass(frozen=True)
class Outcome:
    """Per-row results of applying gates to a score table."""

    winner: np.ndarray
    fired: np.ndarray
    correct: np.ndarray  # the winner is an expected capability
    top1: np.ndarray
    margin: np.ndarray


def apply_gates(table: ScoreTable, threshold: np.ndarray | float, margin: np.ndarray | float,
                coverage: np.ndarray | float = 0.0) -> Outcome:
    """Per-capability arrays (indexed by each row's winner) or one value per gate; ``coverage`` 0: none.

    Compared in float64, as the router compares a message's statistics with its gates (and as
    ``capd calibrate``'s sweep does): a float32 statistic equal to a gate after rounding is not
    let through by one and stopped by the other."""
    winner, top1, gap = table.gate_inputs()
    top1, gap = top1.astype(np.float64), gap.astype(np.float64)
    thr = threshold[winner] if isinstance(threshold, np.ndarray) else threshold
    mar = margin[winner] if isinstance(margin, np.ndarray) else margin
    cov = coverage[winner] if isinstance(coverage, np.ndarray) else coverage
    fired = table.routable & (top1 >= thr) & (gap >= mar) & table.covered(cov)
    if table.vetoed is not None:
        fired &= ~table.vetoed
    correct = table.expected[np.arange(len(winner)), winner]
    return Outcome(winner, fired, correct, top1, gap)


class GatePoint(Protocol):
    """Anything that holds the three gate values (calibration's ``Point``, a tap's ``Gates``)."""

    @property
    def threshold(self) -> float: ...
    @property
    def margin(self) -> float: ...
    @property
    def coverage(self) -> float: ...


def gated_metrics(table: ScoreTable, gates: GatePoint) -> dict[str, Any]:
    """:func:`metrics` of ``table``'s rows at ``gates``."""
    return metrics(table, apply_gates(table, gates.threshold, gates.margin, gates.coverage))


def _share(numerator: np.ndarray, denominator: int) -> float | None:
    return round(float(numerator.sum()) / denominator, 4) if denominator else None


def metrics(table: ScoreTable, outcome: Outcome) -> dict[str, Any]:
    positive = table.positive
    p, n = int(positive.sum()), int((~positive).sum())
    right_rows = outcome.fired & outcome.correct
    wrong_rows = outcome.fired & ~outcome.correct & positive
    return {
        "n": len(table.fixtures),
        "positives": p,
        "nulls": n,
        "top1": _share(positive & outcome.correct, p),
        "fired_right": _share(right_rows, p),
        "fired_wrong": _share(wrong_rows, p),
        "null_fpr": _share(outcome.fired & ~positive, n),
        "skipped": int((~table.routable).sum()),
    }


def row_ok(table: ScoreTable, outcome: Outcome) -> np.ndarray:
    """True where the router did the right thing: fired an expected capability, or abstained on a null."""
    return np.where(table.positive, outcome.fired & outcome.correct, ~outcome.fired)


def breakdown(table: ScoreTable, outcome: Outcome, worst: int = 10) -> dict[str, Any]:
    """Per-kind results, per-capability recall and the most frequent confusions: rows whose
    capability ranked first (``got``) is not one expected, positives whether it fired or not (a
    near miss is a trigger to add), nulls when it fired; ``fired`` counts those it activated."""
    ok = row_ok(table, outcome)
    kinds: dict[str, Any] = {}
    for kind in sorted({f.kind for f in table.fixtures}):
        rows = np.array([f.kind == kind for f in table.fixtures])
        sub = table.subset(np.flatnonzero(rows))
        sub_out = Outcome(outcome.winner[rows], outcome.fired[rows], outcome.correct[rows], outcome.top1[rows],
                          outcome.margin[rows])
        kinds[kind] = {**metrics(sub, sub_out), "accuracy": _share(ok[rows], int(rows.sum()))}
    recall: dict[str, dict[str, Any]] = {}
    confusions: Counter[tuple[str, str]] = Counter()
    fired: Counter[tuple[str, str]] = Counter()
    for row, fixture in enumerate(table.fixtures):
        got = table.names[outcome.winner[row]]
        if fixture.positive and len(fixture.expect) == 1:
            entry = recall.setdefault(fixture.expect[0], {"n": 0, "fired_right": 0})
            entry["n"] += 1
            entry["fired_right"] += int(outcome.fired[row] and outcome.correct[row])
        if not outcome.correct[row] and (fixture.positive or outcome.fired[row]):
            expected = "/".join(fixture.expect) if fixture.expect else "(abstain)"
            confusions[(expected, got)] += 1
            fired[(expected, got)] += int(outcome.fired[row])
    for entry in recall.values():
        entry["recall"] = round(entry["fired_right"] / entry["n"], 4)
    return {
        "per_kind": kinds,
        "per_capability": dict(sorted(recall.items())),
        "confusions": [{"expected": e, "got": g, "count": c, "fired": fired[(e, g)]}
                       for (e, g), c in confusions.most_common(worst)],
    }


Gate = np.ndarray | float  # per capability (indexed by a row's winner) or one value, as apply_gates takes


def failing_rows(table: ScoreTable, outcome: Outcome, threshold: Gate, margin: Gate,
                 coverage: Gate = 0.0) -> list[dict[str, Any]]:
    """Every row decided wrong (:func:`row_ok`), with ``why``: what decided it at these gates (those
    :func:`apply_gates` applied), in the order the router checks them."""
    ok = row_ok(table, outcome)
    rows = []
    for row in np.flatnonzero(~ok):
        fixture = table.fixtures[row]
        winner = int(outcome.winner[row])
        rows.append({
            "source": fixture.source,
            "message": fixture.message,
            "kind": fixture.kind,
            "expect": list(fixture.expect) or None,
            "got": table.names[winner] if outcome.fired[row] else None,
            "best": table.names[winner],
            "score": round(float(outcome.top1[row]), 4),
            "margin": round(float(outcome.margin[row]), 4),
            "why": _why(table, outcome, int(row), *(float(g[winner]) if isinstance(g, np.ndarray) else float(g)
                                                   for g in (threshold, margin, coverage))),
        })
    return rows


def _why(table: ScoreTable, outcome: Outcome, row: int, threshold: float, margin: float, coverage: float) -> str:
    """The row's decision in a few words: activated, or the first gate that stopped its winner (the
    row's score and margin are beside it in :func:`failing_rows`)."""
    if outcome.fired[row]:
        return "activated"
    if not table.routable[row]:
        return "too short to route (the short-input gate)"
    if not float(outcome.top1[row]) >= threshold:
        return f"{'score' if table.levels is None else 'level'} below threshold {threshold:.3f}"
    if not float(outcome.margin[row]) >= margin:
        return f"margin below {margin:.3f}"
    if not table.covered(coverage)[row]:
        assert table.coverage is not None  # covered() passes every row without it
        return f"coverage {float(table.coverage[row]):.3f} below {coverage:.3f}"
    return ("vetoed: a veto (learned, the tap's or the abstain corpus) is nearer than its nearest example, or the "
            "abstain corpus outscores it as a class of the ranking (`capd route` says which)")


def evaluate(router: Router, fixtures: Sequence[Fixture], threshold: float | None = None,
             margin: float | None = None, coverage: float | None = None) -> tuple[dict[str, Any], ScoreTable, Outcome]:
    """Metrics of the router on fixtures, with every row decided wrong (``failing_rows``);
    threshold / margin / coverage override every tap's gates."""
    table = score_table(router, fixtures)
    thr, mar, cov = gate_arrays(router, table.names)
    gates: tuple[Gate, Gate, Gate] = (threshold if threshold is not None else thr,
                                      margin if margin is not None else mar, coverage if coverage is not None else cov)
    outcome = apply_gates(table, *gates)
    result = metrics(table, outcome)
    result.update({
        "rule": router.rule,
        "threshold": threshold if threshold is not None else _uniform(thr),
        "margin": margin if margin is not None else _uniform(mar),
        "coverage": coverage if coverage is not None else _uniform(cov),
        "top_k": router.top_k,
        "capabilities": len(table.names),
        "known": known_rows(router, fixtures),
    })
    result.update(breakdown(table, outcome))
    result["failing_rows"] = failing_rows(table, outcome, *gates)
    return result, table, outcome


KNOWN_NOTE = ("rows that are the taps' own examples (examples.jsonl) route to them, and rows that are their vetoes "
              "(vetoes.jsonl) are turned away, by construction: measure on rows the taps were not calibrated on")


def known_rows(router: Router, fixtures: Sequence[Fixture]) -> dict[str, int]:
    """How many fixture rows the taps already hold as lines: ``examples``, rows whose message
    (case, spacing and tags aside) is an example of a capability routed (``examples.jsonl``), and
    ``vetoes``, rows whose message is a veto (``vetoes.jsonl``); none under ``anchor``, which
    reads neither. Those rows pass by construction (:data:`KNOWN_NOTE`)."""
    if router.rule == "anchor":
        return {"examples": 0, "vetoes": 0}
    catalog = router.catalog
    examples = {routed_key(m) for c in catalog for m in catalog.examples_of(c)}
    vetoes = {routed_key(m) for config in catalog.tap_configs.values() for m in config.vetoes}
    keys = [routed_key(f.message) for f in fixtures]
    return {"examples": sum(k in examples for k in keys), "vetoes": sum(k in vetoes for k in keys)}


def _uniform(values: np.ndarray) -> float | str | None:
    if values.size == 0:
        return None
    unique = np.unique(values)
    return round(float(unique[0]), 4) if unique.size == 1 else "per-tap"
