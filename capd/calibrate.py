"""``capd calibrate``: choose gates from fixtures, and say how they hold up on unseen rows.

Every gate parameter the router has is swept: ``top_k`` (1–5), ``threshold`` and
``margin``, and for ``fused`` ``coverage`` (grids below; coverage 0 is no coverage gate).
Fixtures are split deterministically by a hash of the message — ``HELD_OUT_SHARE`` of them
are never used for fitting — and the recommended point is the one with the most
``fired_right`` on the fitting part whose ``null_fpr`` and ``fired_wrong`` stay within the
limits (ties go to the higher threshold; at one threshold, to the lowest margin and then the
lowest coverage that reach the same ``fired_right`` for one ``top_k``, and between ``top_k``
values to the higher margin, the more cautious point). The same point is then reported on the
held-out part.

The sweep counts, for every grid point at once, the rows each gate lets through: a row passes
every threshold up to its level, every margin up to its gap and every coverage gate up to its
coverage, so the rows are binned by those three grid positions and summed from the top of each
axis (exactly what comparing every row with every grid point gives, in O(rows + grid) instead of
O(rows × grid)).

For the ``capd`` and ``fused`` rules the sweep runs twice: without and with the shipped abstain
corpus (:func:`capd.router.abstain_corpus`: a winner is vetoed when the message is nearer one
of those generic messages than to the winner's nearest example). The corpus is kept only when
it adds at least ``CORPUS_MIN_GAIN`` to ``fired_right`` on the fitting part within the limits
(on taps/core's ``capd`` rule it added one fit row of 157, 0.007, and cost 0.015 held out; a gain
that small is noise). It pays on taps whose traffic holds chitchat, feedback and pasted logs (an
agent's tools), and costs taps whose capabilities are themselves everyday requests (weather,
music), so it is the tap's fixtures that decide.

The fit part's null rows are the tap's vetoes while the gates are fitted (:func:`fit_vetoes`;
:class:`capd.router.Vetoes`: a winner is turned away when two of them are nearer the message than
the winner's nearest example), each row scored without its own copy among them, and ``--write``
appends them to ``<tap>/vetoes.jsonl`` so that the daemon routes as calibration measured
(``--no-vetoes``: neither). Held out, this lifted hwu64's fired_right from 0.60 to 0.78 at the same
null_fpr (its nulls are four whole scenarios the tap lacks, and the fit part has 120 of them) and
changed nothing where the nulls share little (CLINC's out-of-scope queries).

With ``--offsets`` (``fused``) a number per capability is fitted first and added to its score
(:func:`fit_offsets`; ``[gates.fused.offsets]``), and the gates are fitted on out-of-fold scores.
Opt-in: held out it lifted top1 on four of six sets (clinc150_intent 0.888 → 0.911) but left a limit
a row or two over on others (``benchmarks/quality/README.md``).

``--write`` stores the point in ``<tap>/capd.toml`` (``[gates]`` plus the model it was fitted
for), updating the file in place so that what the tap's author wrote there stays
(:func:`write_gates`); capability files are never touched.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from capd import atomic, fused, toml_edit
from capd.encoder import TokenVectors
from capd.errors import TapFileError
from capd.evaluation import ScoreTable, apply_gates, embed_fixtures, metrics, score_table
from capd.fixtures import Fixture, read_fixture_file
from capd.router import Router, distinct_vetoes, veto_text
from capd.taps import GATE_KEYS, MAX_OFFSET, SWITCH, TAP_VETOES, read_tap_file, tap_config
from capd.text import recall_key, strip_tags
from capd.toml_edit import KeyPath, render_key

HELD_OUT_SHARE = 0.3
CORPUS_MIN_GAIN = 0.02  # fit fired_right the abstain corpus must add to be kept
OFFSET_PENALTIES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)  # λ tried for the offsets; each tap's is chosen by CV
OFFSET_FOLDS = 5
OFFSET_MIN_ROWS = 3  # fit rows a capability needs to get an offset (the others keep 0)


@dataclass(frozen=True)
class Grid:
    """The gate values swept for one rule (each rule has its own scale); ``coverages`` start with
    0, no coverage gate (the only value for the rules that have none)."""

    thresholds: np.ndarray
    margins: np.ndarray
    top_ks: tuple[int, ...]
    coverages: np.ndarray = field(default_factory=lambda: np.zeros(1))


COSINE_GRID = Grid(np.round(np.arange(0.0, 1.0001, 0.01), 2), np.round(np.arange(0.0, 0.3001, 0.005), 3),
                   (1, 2, 3, 4, 5))
# fused: threshold on level = K - mu_in (about -0.6..0.4 in practice), margin on a log-odds gap, coverage
# (a mean of token cosines: 0.2-0.6 for what the gate turns away here, 1.0 for a message made of an example's words)
FUSED_GRID = Grid(np.round(np.arange(-0.6, 0.4001, 0.01), 2), np.round(np.arange(0.0, 6.0001, 0.05), 2),
                  (fused.TOP_K,), np.concatenate([[0.0], np.round(np.arange(0.2, 0.9001, 0.01), 2)]))


def grid_for(rule: str) -> Grid:
    return FUSED_GRID if rule == "fused" else COSINE_GRID


def split(fixtures: Sequence[Fixture]) -> tuple[np.ndarray, np.ndarray]:
    """(fit rows, held-out rows): stable across runs and machines, independent of file order.

    A row's side is a hash of its message, so copies of a message fall on one side. So do messages
    that route as one text once their tags are removed (``<context>…</context> open the file`` and
    ``open the file``), or that differ in case and spacing only (the model does not see those,
    and a corrected message is recalled across them: :func:`~capd.text.recall_key`): those take the
    side of that text, or one of them would be scored held out on the very text the gates were
    fitted on."""
    cleaned = [recall_key(strip_tags(f.message)) for f in fixtures]
    spellings: dict[str, set[str]] = {}
    for fixture, text in zip(fixtures, cleaned, strict=True):
        spellings.setdefault(text, set()).add(fixture.message)
    keys = [text if text and len(spellings[text]) > 1 else f.message  # (all tags: nothing routes, nothing leaks)
            for f, text in zip(fixtures, cleaned, strict=True)]
    held = np.array([int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 1000 < HELD_OUT_SHARE * 1000
                     for key in keys], dtype=bool)
    return np.flatnonzero(~held), np.flatnonzero(held)


@dataclass(frozen=True)
class Point:
    top_k: int
    threshold: float
    margin: float
    fired_right: float
    fired_wrong: float
    null_fpr: float
    abstain_corpus: bool = False
    coverage: float = 0.0

    def as_dict(self) -> dict[str, float | int | bool]:
        return {"top_k": self.top_k, "threshold": self.threshold, "margin": self.margin, "coverage": self.coverage,
                "fired_right": self.fired_right, "fired_wrong": self.fired_wrong, "null_fpr": self.null_fpr,
                "abstain_corpus": self.abstain_corpus}


def _measured(point: Point, nulls: int) -> dict[str, float | int | bool | None]:
    """A point as the report shows it: with no null row in the fit part its null_fpr was never
    measured, so it is ``null``, as in the report's ``fit`` figures (the sweep counted it as 0)."""
    shown: dict[str, float | int | bool | None] = {**point.as_dict()}
    if not nulls:
        shown["null_fpr"] = None
    return shown


def _passed(values: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Per row: the index of the last grid step at or below its value (-1: below every step)."""
    return np.searchsorted(steps, values, side="right") - 1


def sweep(table: ScoreTable, grid: Grid) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fired_right, fired_wrong, null_fpr for every (threshold, margin, coverage): arrays [T, M, V]."""
    winner, top1, gap = table.gate_inputs()
    correct = table.expected[np.arange(len(winner)), winner]
    positive = table.positive
    p, n = max(int(positive.sum()), 1), int((~positive).sum())
    routable = table.routable if table.vetoed is None else table.routable & ~table.vetoed
    shape = (len(grid.thresholds), len(grid.margins), len(grid.coverages))
    t, m = _passed(top1, grid.thresholds), _passed(gap, grid.margins)
    v = np.full(len(winner), shape[2] - 1)  # no coverage (or NaN): every coverage gate passes
    if table.coverage is not None:
        known = ~np.isnan(table.coverage)
        v[known] = _passed(table.coverage[known], grid.coverages)
    v = np.maximum(v, np.flatnonzero(grid.coverages <= 0).max(initial=-1))  # coverage 0 is no gate
    fires = routable & (t >= 0) & (m >= 0) & (v >= 0)
    cell = np.ravel_multi_index((t[fires], m[fires], v[fires]), shape)

    def rate(rows: np.ndarray, total: int) -> np.ndarray:
        counts = np.bincount(cell, weights=rows[fires].astype(np.float64), minlength=int(np.prod(shape)))
        counts = counts.reshape(shape)
        for axis in range(3):  # a row passes every step up to its own on each axis
            counts = np.flip(np.cumsum(np.flip(counts, axis), axis=axis), axis)
        return counts / total

    right = rate(positive & correct, p)
    wrong = rate(positive & ~correct, p)
    null = rate(~positive, n) if n else np.zeros(shape)
    return right, wrong, null


Accept = Callable[[ScoreTable, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def best_point(tables: dict[int, ScoreTable], max_null_fpr: float, max_wrong: float,
               grid: Grid = COSINE_GRID, accept: Accept | None = None) -> tuple[Point | None, list[Point]]:
    """The recommended point and the operating curve (best point per threshold) over all top_k.

    ``accept(table, fired_right, fired_wrong, null_fpr)`` replaces the limits test with another
    mask over the grid, ``[T, M, V]`` (the research harness ``benchmarks/quality/calibration_trial.py``)."""
    best: Point | None = None
    curve: dict[float, Point] = {}
    for top_k, table in tables.items():
        right, wrong, null = sweep(table, grid)
        if accept is None:
            ok = (null <= max_null_fpr + 1e-9) & (wrong <= max_wrong + 1e-9)
        else:
            ok = accept(table, right, wrong, null)
        score = np.where(ok, right, -1.0)
        for t_index, threshold in enumerate(grid.thresholds):
            m_index, v_index = np.unravel_index(int(np.argmax(score[t_index])), score.shape[1:])
            at = (t_index, m_index, v_index)
            if score[at] < 0:
                continue
            point = Point(top_k, float(threshold), float(grid.margins[m_index]), round(float(right[at]), 4),
                          round(float(wrong[at]), 4), round(float(null[at]), 4),
                          coverage=float(grid.coverages[v_index]))
            current = curve.get(point.threshold)
            if current is None or point.fired_right > current.fired_right:
                curve[point.threshold] = point
            if best is None or (point.fired_right, point.threshold, point.margin) > (best.fired_right,
                                                                                     best.threshold, best.margin):
                best = point
    return best, [curve[t] for t in sorted(curve)]


@dataclass(frozen=True)
class Fitted:
    """What :func:`fit_gates` chose: the point (None: nothing meets the limits), its operating
    curve, the chosen variant's score tables for every top_k, and the best fit ``fired_right``
    without and with the abstain corpus (None: not tried, or nothing met the limits)."""

    point: Point | None
    curve: list[Point]
    tables: dict[int, ScoreTable]
    corpus: dict[str, float | None]


Variants = dict[bool, dict[int, ScoreTable]]  # abstain corpus off/on -> top_k -> every fixture scored


def score_variants(router: Router, fixtures: Sequence[Fixture], vectors: np.ndarray, tokens: TokenVectors | None,
                   grid: Grid | None = None, offsets: OffsetFit | None = None) -> Variants:
    """Every fixture (embedded as ``vectors``/``tokens`` by :func:`embed_fixtures`) scored for
    every top_k of the grid, without and (``capd``, ``fused``) with the abstain corpus. No row is
    vetoed by its own copy among the vetoes (:func:`fit_vetoes` puts the fit part's nulls there);
    ``offsets`` are added row by row (:class:`OffsetFit`)."""
    grid = grid or grid_for(router.rule)
    by_row = None if offsets is None else offsets.by_row
    out: Variants = {}
    for on in (False, True) if router.rule != "anchor" else (False,):
        variant = router.with_abstain_corpus(on)
        out[on] = {k: score_table(variant, fixtures, top_k=k, vectors=vectors, tokens=tokens, not_own_veto=True,
                                  offsets=by_row)
                   for k in grid.top_ks}
    return out


def fit_vetoes(fixtures: Sequence[Fixture], rule: str) -> list[Fixture]:
    """The rows that become the tap's vetoes: the fit part's null rows, once per routed text
    (:func:`~capd.router.distinct_vetoes`; none for ``anchor``, which has no vetoes). Calibration
    fits the gates with them in force, each row scored without its own copy, and ``--write``
    stores them in ``<tap>/vetoes.jsonl``; the held-out part never joins them, so its figures stay
    those of unseen messages."""
    if rule == "anchor":
        return []
    fit_rows, _ = split(fixtures)
    rows: dict[str, Fixture] = {}
    for i in fit_rows:
        if not fixtures[i].positive:
            rows.setdefault(fixtures[i].message, fixtures[i])
    return [rows[message] for message in distinct_vetoes(list(rows))]


@dataclass(frozen=True)
class OffsetFit:
    """What :func:`fit_offsets` fitted: ``offsets`` (capability name -> value; what ``--write``
    stores and the daemon adds), and ``by_row`` ``[rows, capabilities]``: what each fixture row is
    scored with while the gates are fitted. A row the offsets were fitted on gets those fitted
    without its fold (else the gates would be fitted on rows the offsets had already learned, and
    the limits would hold on them only); every other row (nulls, the held-out part) gets ``offsets``."""

    offsets: dict[str, float]
    by_row: np.ndarray


def fit_offsets(table: ScoreTable, rows: np.ndarray) -> OffsetFit:
    """Per-capability offsets added to the fused score ``F``, fitted on the positive ``rows`` of
    ``table`` (scored without offsets) that expect one capability: the ``d`` that minimises the
    rows' mean cross-entropy of ``softmax(F + d)`` plus ``λ·‖d‖²``. A capability whose examples
    pull too few of its own messages (or too many of its neighbours') is moved up (or down), which
    the head and the nearest examples, fitted on a few triggers each, cannot see. Only capabilities
    with ``OFFSET_MIN_ROWS`` fit rows or more get one (a tap's fixtures need not cover every
    capability, and one without rows would only be pushed down). ``λ`` is the one of
    ``OFFSET_PENALTIES`` with the lowest cross-entropy over ``OFFSET_FOLDS`` folds of those rows.
    Rounded to 3 decimals: what ``--write`` stores is what was measured."""
    columns = len(table.names)
    none = OffsetFit({}, np.zeros((len(table.fixtures), columns), dtype=np.float32))
    single = table.expected.sum(axis=1) == 1
    chosen = np.asarray([r for r in rows if table.positive[r] and single[r] and table.routable[r]], dtype=np.int64)
    if not len(chosen):
        return none
    scores = table.scores[chosen].astype(np.float64)
    labels = table.expected[chosen].argmax(axis=1)
    free = np.bincount(labels, minlength=columns) >= OFFSET_MIN_ROWS
    if not free.any():
        return none
    folds = np.arange(len(chosen)) % OFFSET_FOLDS
    best: tuple[float, list[np.ndarray]] | None = None
    for penalty in OFFSET_PENALTIES:
        fitted = [_offsets(scores[folds != k], labels[folds != k], free, penalty) for k in range(OFFSET_FOLDS)]
        loss = sum(_cross_entropy(scores[folds == k], labels[folds == k], fitted[k]) for k in range(OFFSET_FOLDS))
        if best is None or loss < best[0]:
            best, chosen_penalty = (loss, fitted), penalty
    assert best is not None
    offsets = np.round(_offsets(scores, labels, free, chosen_penalty), 3)
    by_row = np.tile(offsets.astype(np.float32), (len(table.fixtures), 1))
    for k, fold_offsets in enumerate(best[1]):
        by_row[chosen[folds == k]] = np.round(fold_offsets, 3)
    return OffsetFit({table.names[c]: float(offsets[c]) for c in np.flatnonzero(free) if offsets[c]}, by_row)


def _cross_entropy(scores: np.ndarray, labels: np.ndarray, offsets: np.ndarray) -> float:
    shifted = scores + offsets
    top = shifted.max(axis=1)
    rows = np.arange(len(labels))
    return float(np.sum(top + np.log(np.exp(shifted - top[:, None]).sum(axis=1)) - shifted[rows, labels]))


def _offsets(scores: np.ndarray, labels: np.ndarray, free: np.ndarray, penalty: float) -> np.ndarray:
    """The offsets (0 where not ``free``) minimising the mean cross-entropy plus ``penalty·‖d‖²``."""
    from scipy.optimize import minimize  # as capd.fused: only when fitting

    n = len(labels)
    if n == 0:
        return np.zeros(scores.shape[1])
    counts = np.bincount(labels, minlength=scores.shape[1])

    def loss_and_gradient(values: np.ndarray) -> tuple[float, np.ndarray]:
        offsets = np.zeros(scores.shape[1])
        offsets[free] = values
        shifted = scores + offsets
        top = shifted.max(axis=1, keepdims=True)
        exp = np.exp(shifted - top)
        total = exp.sum(axis=1)
        loss = float(np.mean(top[:, 0] + np.log(total) - shifted[np.arange(n), labels]))
        loss += penalty * float(values @ values)
        gradient = ((exp / total[:, None]).sum(axis=0) - counts) / n
        return loss, gradient[free] + 2 * penalty * values

    found = minimize(loss_and_gradient, np.zeros(int(free.sum())), jac=True, method="L-BFGS-B")
    offsets = np.zeros(scores.shape[1])
    offsets[free] = np.clip(found.x, -MAX_OFFSET, MAX_OFFSET)
    return offsets


def fit_gates(variants: Variants, rows: np.ndarray, grid: Grid, max_null_fpr: float = 0.05,
              max_wrong: float = 0.03) -> Fitted:
    """Sweep ``grid`` on ``rows`` of each variant; the corpus variant wins only by ``CORPUS_MIN_GAIN``."""
    fitted = {}
    for on, full in variants.items():
        point, curve = best_point({k: t.subset(rows) for k, t in full.items()}, max_null_fpr, max_wrong, grid)
        curve = [replace(c, abstain_corpus=on) for c in curve]  # each point says which variant it was measured on
        fitted[on] = (replace(point, abstain_corpus=on) if point is not None else None, curve, full)
    right = {on: p.fired_right if p is not None else None for on, (p, _, _) in fitted.items()}
    corpus = {"without": right[False], "with": right.get(True)}
    with_corpus = corpus["with"] is not None and (corpus["without"] is None
                                                   or corpus["with"] >= corpus["without"] + CORPUS_MIN_GAIN - 1e-9)
    return Fitted(*fitted[with_corpus], corpus)


def fitted_router(router: Router, fixtures: Sequence[Fixture], vectors: np.ndarray, tokens: TokenVectors | None,
                  vetoes: bool = True, offsets: bool = False) -> tuple[Router, list[Fixture], OffsetFit | None]:
    """The router ``capd calibrate`` fits the gates with, the veto rows and the offsets: with
    ``vetoes`` the fit part's null rows join every tap's vetoes (:func:`fit_vetoes`); under
    ``fused`` the taps' own offsets are dropped and, with ``offsets``, new ones fitted on the fit
    part (:func:`fit_offsets`), which the score tables add row by row (``OffsetFit.by_row``)."""
    veto_rows = fit_vetoes(fixtures, router.rule) if vetoes else []
    router = router.with_tap_vetoes([f.message for f in veto_rows])
    fitted = None
    if router.rule == "fused":
        router = router.with_offsets({})
        if offsets:
            fit_rows, _ = split(fixtures)
            fitted = fit_offsets(score_table(router, fixtures, vectors=vectors, tokens=tokens, not_own_veto=True),
                                 fit_rows)
    return router, veto_rows, fitted


def calibrate(router: Router, fixtures: Sequence[Fixture], max_null_fpr: float = 0.05,
              max_wrong: float = 0.03, auto: Point | None = None, grid: Grid | None = None,
              vetoes: bool = True, offsets: bool = False) -> dict[str, Any]:
    """The recommended gates, their curve and their fit / held-out metrics; with ``auto`` (the
    fused rule's auto gates, :mod:`capd.autogates`), also what those give on the held-out rows.
    ``grid`` replaces the rule's grid (ablations: e.g. no coverage axis). With ``vetoes`` the fit
    part's null rows veto every capability while the gates are fitted (:func:`fit_vetoes`); with
    ``offsets`` (``fused`` only) the per-capability offsets are fitted first (:func:`fit_offsets`).
    Without a positive row in the fit part nothing is recommended (``error`` says why): a sweep
    there would choose gates that never fire."""
    fit_rows, held_rows = split(fixtures)
    positives = sum(fixtures[i].positive for i in fit_rows)
    nulls = len(fit_rows) - positives
    counts = {"fit": len(fit_rows), "held_out": len(held_rows), "fit_nulls": nulls}
    if not positives:  # every point would tie at fired_right 0, and the tie goes to the gates that fire least
        return {"rule": router.rule, "limits": {"max_null_fpr": max_null_fpr, "max_wrong": max_wrong},
                "rows": counts, "recommended": None,
                "error": f"no positive row to fit on ({sum(f.positive for f in fixtures)} positive rows in all, "
                         f"and calibration fits on about {1 - HELD_OUT_SHARE:.0%} of the rows, chosen by a hash of "
                         "each message): add rows that expect a capability",
                "abstain_corpus": {"without": None, "with": None}, "vetoes": 0, "offsets": {}, "curve": [],
                "warnings": [NO_NULLS] if nulls == 0 else []}
    vectors, tokens = embed_fixtures(router, fixtures)
    grid = grid or grid_for(router.rule)
    untouched = router
    router, veto_rows, fitted_offsets = fitted_router(router, fixtures, vectors, tokens, vetoes, offsets)
    variants = score_variants(router, fixtures, vectors, tokens, grid, fitted_offsets)
    fitted = fit_gates(variants, fit_rows, grid, max_null_fpr, max_wrong)
    point = fitted.point
    error = None
    if point is not None and point.fired_right <= 0:  # the same tie: gates that fire nothing would be written
        point, error = None, (f"no gates within the limits fire any of the {positives} fit positive rows right "
                              "(too short to route, expecting capabilities without triggers, or beaten by the "
                              "nulls the limits must keep out): nothing to recommend")
    report: dict[str, Any] = {
        "rule": router.rule,
        "limits": {"max_null_fpr": max_null_fpr, "max_wrong": max_wrong},
        "rows": counts,
        "recommended": _measured(point, nulls) if point else None,
        "abstain_corpus": fitted.corpus,
        "vetoes": len(veto_rows),
        "offsets": {} if fitted_offsets is None else fitted_offsets.offsets,
        "curve": [_measured(c, nulls) for c in fitted.curve],
    }
    if error is not None:
        report["error"] = error
    if point is not None:
        table = fitted.tables[point.top_k]
        for label, rows in (("fit", fit_rows), ("held_out", held_rows)):
            sub = table.subset(rows)
            report[label] = metrics(sub, apply_gates(sub, point.threshold, point.margin, point.coverage))
    report["warnings"] = _warnings(report, positives, nulls, max_null_fpr, max_wrong)
    if auto is not None and auto.top_k in variants[False]:  # as the tap routes before --write: no new vetoes
        held = score_table(untouched, fixtures, top_k=auto.top_k, vectors=vectors, tokens=tokens).subset(held_rows)
        report["auto_gates"] = {"gates": auto.as_dict(), "held_out": metrics(
            held, apply_gates(held, auto.threshold, auto.margin, auto.coverage))}
    return report


NO_NULLS = ("no null row in the fit part: the null_fpr limit was never checked, so the gates may fire on "
            "messages that should activate nothing; add rows that expect nothing (\"expect\": null)")


def _warnings(report: dict[str, Any], positives: int, nulls: int, max_null_fpr: float,
              max_wrong: float) -> list[str]:
    """What a tap author should know before trusting the recommended gates: the null limit untested,
    a limit the fit part has too few rows to allow anything under (:func:`small_part_warnings`), or one the
    held-out rows break (the fit rows met it: too few rows to be sure)."""
    warnings = [NO_NULLS] if nulls == 0 else []
    warnings += small_part_warnings(positives, nulls, max_null_fpr, max_wrong)
    held = report.get("held_out")
    if held is not None:
        for key, limit in (("fired_wrong", max_wrong), ("null_fpr", max_null_fpr)):
            value = held.get(key)
            if value is not None and value > limit + 1e-9:
                warnings.append(f"held-out {key} {value:.3f} is over the limit {limit} that the fit rows met: "
                                "more fixture rows would make the gates surer")
    return warnings


def small_part_warnings(positives: int, nulls: int, max_null_fpr: float, max_wrong: float) -> list[str]:
    """A warning per limit that the fit part's ``positives`` or ``nulls`` are too few to allow
    anything under (:func:`_too_few`)."""
    return (_too_few(nulls, "null", "null_fpr", max_null_fpr, "let none of them through")
            + _too_few(positives, "positive", "fired_wrong", max_wrong, "fire none of them wrong"))


def _too_few(rows: int, kind: str, metric: str, limit: float, none: str) -> list[str]:
    """A warning when one of the fit part's ``rows`` is more than ``limit`` of ``metric``: the
    limit then allows none, and the gates are fitted to the few rows that happen to be there
    (healthcare: gates that keep out all 11 of its fit nulls fire right on 14 of 19 held-out
    positives and let 2 of 5 held-out nulls through; its auto gates, 18 and 1)."""
    if rows == 0 or not 0 < limit < 1 or 1 / rows <= limit + 1e-9:
        return []
    needed = math.ceil(1 / limit - 1e-9)
    return [f"the fit part has {rows} {kind} rows: one is {1 / rows:.3f} of {metric}, over the limit {limit}, so "
            f"the gates must {none} and are fitted to the few that happen to be there; with {needed} {kind} rows "
            f"in the fit part (about {math.ceil(needed / (1 - HELD_OUT_SHARE))} in all) the limit allows one"]


@dataclass(frozen=True)
class GatesEdit:
    """A ``capd.toml`` edit checked and ready (:func:`gates_edit`); :meth:`write` stores it."""

    tap: Path
    path: Path
    text: str

    def write(self) -> Path:
        try:
            atomic.write_text(self.path, self.text)
        except OSError as exc:
            raise TapFileError(self.path, f"cannot write it: {exc.strerror or exc}; nothing was changed") from None
        return self.tap / "capd.toml"


VETOES_HEADER = """\
# Vetoes of this tap: messages none of its capabilities may take. A winner is turned away when
# two of these are nearer the message than the winner's nearest example, or the message is one of
# them. One fixture row per line ("expect": null). `capd calibrate --write` appends the null rows
# it fitted the gates with (the gates assume them: remove a line and more messages like it may
# fire); add your own freely.
"""


def vetoes_edit(tap: Path, rows: Sequence[Fixture]) -> tuple[Path, str] | None:
    """``<tap>/vetoes.jsonl`` with the ``rows`` it lacks appended (None: it has them all). What is
    there stays byte for byte: lines are only added, never changed or reordered."""
    path = _writable(tap, TAP_VETOES)
    old, have = "", set()
    if os.path.lexists(path):
        try:
            data = read_tap_file(path, tap)
            old = data.decode("utf-8")  # a BOM stays (read_fixture_file skips it)
        except TapFileError as exc:
            raise TapFileError(path, f"{exc.reason}; no veto was added") from None
        except UnicodeDecodeError as exc:
            raise TapFileError(path, f"not UTF-8 text ({exc.reason}); no veto was added") from None
        have = {recall_key(veto_text(f.message)) for f in read_fixture_file(path, data)[0]}
    new = [row for row in rows if recall_key(veto_text(row.message)) not in have]
    if not new:
        return None
    lines = [json.dumps({"message": row.message, "expect": None, "kind": row.kind}, ensure_ascii=False) for row in new]
    text = (old if old.endswith("\n") or not old else old + "\n") if old else VETOES_HEADER
    return path, text + "\n".join(lines) + "\n"


def write_vetoes(edit: tuple[Path, str]) -> Path:
    """Store a :func:`vetoes_edit`."""
    path, text = edit
    try:
        atomic.write_text(path, text)
    except OSError as exc:
        raise TapFileError(path, f"cannot write it: {exc.strerror or exc}; nothing was changed") from None
    return path


def write_gates(tap: Path, point: dict[str, Any], model: str, rule: str = "capd",
                offsets: dict[str, float] | None = None) -> Path:
    """:func:`gates_edit`, written."""
    return gates_edit(tap, point, model, rule, offsets).write()


def gates_edit(tap: Path, point: dict[str, Any], model: str, rule: str = "capd",
               offsets: dict[str, float] | None = None) -> GatesEdit:
    """The edit that stores gates for ``rule`` in ``<tap>/capd.toml``, keeping the other rule's
    gates: made and checked here, written by :meth:`GatesEdit.write` (so that a calibration of
    several taps writes none when one of them cannot be edited).

    An existing file is updated in place, line by line: the values of ``threshold``, ``margin``
    and ``top_k`` (``[gates]``: rules capd, anchor) or ``coverage`` (``[gates.fused]``) are
    replaced where they stand, a trailing comment kept; a missing key goes after the last key
    line of its table, a missing table at the end, a missing ``model`` before the first table.
    Every comment, blank line and other key stays. ``abstain_corpus = true`` is written when the
    point chose the corpus, and an ``abstain_corpus`` already there is set to ``false`` when it
    did not. With ``offsets`` (``fused``: this tap's capabilities' :func:`fit_offsets`)
    ``[gates.fused.offsets]`` is made to hold exactly those, value lines updated in place, new ones
    added, lines of capabilities without an offset now deleted; None leaves it alone. Gates
    recorded for another model are stale (each model has its own scale): the other
    table's gate lines are deleted, its comments kept. A new file starts with a comment that says
    what it is. The result is read back before it replaces the file, which is left alone (error)
    when it does not parse, when the gates are written in a shape capd does not edit (an inline
    table, an array of tables, a value over several lines) or when the read-back is not exactly
    the intended gates with every other key unchanged.
    """
    path = _writable(tap)
    text, old = _NEW_FILE, {}
    if path.exists():
        try:
            text = path.read_bytes().decode("utf-8")  # not read_text: its newline translation would drop \r\n
            old = tomllib.loads(text.removeprefix("\ufeff"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise TapFileError(path, f"cannot update it ({exc}); fix or remove it, then calibrate again") from None
    own: KeyPath
    other: KeyPath
    if rule == "fused":
        own, other = ("gates", "fused"), ("gates",)
        values: dict[str, float | int | bool] = {"threshold": float(point["threshold"]),
                                                 "margin": float(point["margin"]),
                                                 "coverage": float(point.get("coverage", 0.0))}
    else:
        own, other = ("gates",), ("gates", "fused")
        values = {"threshold": float(point["threshold"]), "margin": float(point["margin"]),
                  "top_k": int(point["top_k"])}
    stale = other if old.get("model") not in (None, model) else None
    new, expected = _edit_gates(path, text, old, model, own, values, bool(point.get(SWITCH)), stale,
                                None if rule != "fused" else offsets)
    try:
        reread: dict[str, Any] | None = tomllib.loads(new.removeprefix("\ufeff"))
    except tomllib.TOMLDecodeError:
        reread = None
    if reread is not None:  # a table whose last lines went is gone unless it has a header of its own
        for emptied in ((stale,) if stale is not None else ()) + ((OFFSETS,) if rule == "fused" else ()):
            _drop_emptied(expected, reread, emptied)
    if reread is None or not toml_edit.same(reread, expected):
        raise TapFileError(path, "capd cannot update it in place without changing what else it says; write the "
                                 "gates as [gates] and [gates.fused] tables with one `key = value` line per gate, "
                                 "then calibrate again")
    try:
        tap_config(path, reread, new)
    except TapFileError as exc:  # a mistake elsewhere in the file: written, it would still not load
        raise TapFileError(path, f"with the new gates it would still not load: {exc.reason}; fix that, then calibrate "
                                 "again (nothing was changed)", _line_now(path, old, text, exc.reason)) from None
    return GatesEdit(tap, path, new)


def _line_now(path: Path, table: dict[str, Any], text: str, reason: str) -> int | None:
    """The line of the file as it stands that fails with ``reason`` (the edited text's lines have
    moved), or None when the file as it stands does not fail that way."""
    try:
        tap_config(path, table, text)
    except TapFileError as exc:
        return exc.line if exc.reason == reason else None
    return None


def _writable(tap: Path, name: str = "capd.toml") -> Path:
    """The file ``--write`` edits: ``<tap>/<name>``, or the file it links to inside the tap (a
    rename over the link would replace the link with a plain file and leave its target stale). A link
    out of the tap is refused, as the tap loader refuses to read through one."""
    path = tap / name
    if not path.is_symlink():
        return path
    try:
        target, root = path.resolve(strict=False), tap.resolve()
    except (OSError, RuntimeError) as exc:
        raise TapFileError(path, f"cannot follow the link: {exc}") from None
    if not target.is_relative_to(root):
        raise TapFileError(path, f"links to {target}, outside the tap; capd edits only files in the tap: "
                                 "replace the link with the file, then calibrate again")
    return target


_NEW_FILE = ("# Written by `capd calibrate --write`. Gates for this tap's capabilities: [gates] for the\n"
             "# anchor and capd rules, [gates.fused] for the fused rule. CAPD_THRESHOLD / CAPD_MARGIN /\n"
             "# CAPD_TOP_K and flags still override them.\n")
_GATE_KEYS = (*GATE_KEYS, "coverage", SWITCH)  # what a stale table loses


def _edit_gates(path: Path, text: str, old: dict[str, Any], model: str, own: KeyPath,
                values: dict[str, float | int | bool], switch: bool,
                stale: KeyPath | None, offsets: dict[str, float] | None = None) -> tuple[str, dict[str, Any]]:
    """The edited text, and what it must parse to."""
    bom = "\ufeff" if text.startswith("\ufeff") else ""
    tables = (own, *([OFFSETS] if offsets is not None else []), *([stale] if stale else []))
    edit = _editor(path, text.removeprefix(bom), tables)
    if switch or edit.find((*own, SWITCH)) is not None:  # an abstain_corpus line is never removed
        values = {**values, SWITCH: switch}
    found = edit.find(("model",))
    if found is not None:
        edit.set_value(found, model)
    else:
        edit.add_top_level("model", model)
    _set_keys(path, edit, own, values)
    expected = copy.deepcopy(old)
    expected["model"] = model
    _table(expected, own).update(values)
    if offsets is not None:
        _edit_offsets(path, edit, expected, offsets)
    if stale is not None:  # the other table's gates were fitted for another model: only its gate lines go
        for s in edit.statements:
            if s.value is not None and s.path[:-1] == stale and s.path[-1] in _GATE_KEYS:
                edit.delete(s)
                del _table(expected, stale)[s.path[-1]]
    return bom + edit.result(), expected


def _set_keys(path: Path, edit: toml_edit.Editor, table: KeyPath, values: dict[str, float | int | bool]) -> None:
    """Each of ``values`` set where its line stands in ``table`` (a trailing comment kept), the
    missing ones added after the table's last key line; a value over several lines is refused."""
    missing: dict[str, float | int | bool] = {}
    for key, value in values.items():
        found = edit.find((*table, key))
        if found is None or found.value is None:
            missing[key] = value
        elif "\n" in edit.text[found.value[0]:found.value[1]]:
            raise TapFileError(path, f"{render_key(found.path)} runs over several lines; write its value on one "
                                     f"line ({render_key((key,))} = …), then calibrate again",
                               toml_edit.line_of(edit.text, found.start))
        else:
            edit.set_value(found, value)
    if missing:
        edit.add_keys(table, missing)


OFFSETS: KeyPath = ("gates", "fused", "offsets")


def _edit_offsets(path: Path, edit: toml_edit.Editor, expected: dict[str, Any], offsets: dict[str, float]) -> None:
    """``[gates.fused.offsets]`` made to hold exactly ``offsets`` (see :func:`gates_edit`)."""
    for s in edit.statements:
        if s.value is not None and s.path[:-1] == OFFSETS and s.path[-1] not in offsets:
            edit.delete(s)
    _set_keys(path, edit, OFFSETS, dict(offsets))
    table = _table(expected, OFFSETS)
    table.clear()
    table.update(offsets)


def _editor(path: Path, text: str, tables: tuple[KeyPath, ...]) -> toml_edit.Editor:
    """An editor for ``text``, or why ``tables`` cannot be edited in it line by line."""
    try:
        edit = toml_edit.Editor(text)
    except toml_edit.ScanError as exc:
        raise TapFileError(path, f"capd cannot follow this file to update it in place ({exc}); write the gates as "
                                 "[gates] and [gates.fused] tables, then calibrate again",
                           toml_edit.line_of(text, exc.offset)) from None
    blocking = edit.blocking(tables)
    if blocking is not None:
        reason = (f"[[{render_key(blocking.table)}]] is an array of tables" if blocking.array else
                  f"`{render_key(blocking.path)} = …` holds the gates in one value")
        raise TapFileError(path, f"{reason}, which capd cannot update in place; write the gates as [gates] and "
                                 "[gates.fused] tables with one `key = value` line per gate, then calibrate again",
                           toml_edit.line_of(edit.text, blocking.start))
    return edit


def _drop_emptied(expected: dict[str, Any], reread: dict[str, Any], path: KeyPath) -> None:
    """A stale table written only as dotted keys (``fused.threshold = …`` under ``[gates]``) is gone
    once its gate lines are: expect it gone, not as an empty table (one with a header of its own stays)."""
    parent, found = expected, reread
    for part in path[:-1]:
        parent, found = parent.get(part, {}), found.get(part, {})
    if parent.get(path[-1]) == {} and path[-1] not in found:
        del parent[path[-1]]


def _table(data: dict[str, Any], path: KeyPath) -> dict[str, Any]:
    for part in path:
        data = data.setdefault(part, {})
    return data
