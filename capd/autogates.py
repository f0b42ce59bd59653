"""Auto gates: fixture-free gates for the ``fused`` rule, fitted on the taps' own examples.

Without ``capd calibrate``, a tap used to get the model manifest's fused gates: one point for
every tap. The fused statistics' scale moves with the taps (how many capabilities, how alike
their examples are) and with the model (a tuned model's levels run lower), so one point
transfers badly. Auto gates calibrate on what every tap already has:

- **positives**: every example (trigger, description, name), scored *out of fold*. The j-th
  example of each capability goes to fold ``j mod AUTO_FOLDS``; the head, ``μ_in``, BM25 and
  the token table fitted on the other folds score the held fold, so an example never meets
  itself. A capability's only example stays in (there is nothing to score it against). Folds
  are scored in turn until ``AUTO_MIN_SCORED`` examples are: every fold holds a share of each
  capability's examples and every fold head is fitted on the same share of the tap, so a large
  tap's first fold samples what all five would score, at a fifth of the fits. A tap under
  ``AUTO_MIN_SCORED`` examples scores them all: samples of about a hundred examples moved the
  gates of the small shared sets, while 2,553 of the generated 1,000-capability tap's examples
  gave gates a little more cautious than all 10,951 (``benchmarks/quality/README.md``).
- **nulls**: the shipped abstain corpus (:func:`capd.vetoes.abstain_corpus`), scored by the head
  the rule routes with, minus the messages whose level at their winner reaches ``CORPUS_LEVEL_CUT``: they
  are as close to a capability as its own examples are to each other ("see you tomorrow" for a
  tap with a goodbye capability is no null there).

The chosen point is :func:`capd.calibrate.best_point` over those rows with the corpus null rate at
most ``AUTO_NULL_RATE`` and the wrong rate at most ``AUTO_MAX_WRONG``, on :data:`AUTO_GRID`:
threshold and margin, no coverage gate. A coverage gate fitted against the generic corpus is tuned
on chitchat-like nulls and lets task-like ones through (it broke hwu64's null limit on its fit part
for every candidate that gained); it takes a tap's own nulls, i.e. ``capd calibrate``. The constants
were chosen on the fit parts of the shared eval sets and taps/core
(``benchmarks/quality/README.md``, "Auto gates" and "Coverage gate"); the held-out parts were not
used. Precedence: manifest < auto gates < a tap's ``capd.toml`` < settings. The result is cached in
the data directory by the content hash of the examples, the corpus and these constants.

**Refits.** Fitting costs up to five head fits (on a 1,000-capability tap an edit was live after
66 s with five and 13 s without, ``benchmarks/bench_daemon.py``), and every tap edit or applied
learned correction changes the examples. The point is a statistic over all of them, so a few
changed capabilities barely move it: the gates carry over until more than ``AUTO_REFIT_SHARE`` of the capabilities they
were fitted on have changed (added, removed, or other examples), counted from the last fit,
not from the last edit, and with the same model. A carried-over point is cached for the new
examples with the fit it came from, so a restart keeps it (``benchmarks/quality/README.md``,
"Auto gates carried over", measures what carrying over costs against refitting).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from capd import atomic, fused
from capd.calibrate import FUSED_GRID, Grid, Point, best_point
from capd.encoder import Embedded, TokenVectors
from capd.evaluation import ScoreTable
from capd.fixtures import Fixture
from capd.index import Ints, TriggerIndex, segment_topk_mean

log = logging.getLogger(__name__)

AUTO_FOLDS = 5
AUTO_MIN_SCORED = 2_000  # examples scored out of fold, after which no further fold is fitted
AUTO_NULL_RATE = 0.02  # of the corpus messages kept as nulls
AUTO_MAX_WRONG = 0.03
CORPUS_LEVEL_CUT = 0.0
AUTO_REFIT_SHARE = 0.02  # of the capabilities fitted on that may change before the gates are refitted
AUTO_GRID = replace(FUSED_GRID, coverages=np.zeros(1))  # threshold and margin only (see above)
VERSION = "auto-2"  # bump when anything above changes the chosen gates or the cache file


@dataclass(frozen=True)
class Fit:
    """Auto gates (None: no feasible point) and what they were fitted on: the model and each
    capability's examples fingerprint (:meth:`capd.index.TriggerIndex.fingerprint_of`)."""

    point: Point | None
    model: str
    basis: Mapping[str, str]

    def as_dict(self) -> dict[str, object]:
        return {"point": None if self.point is None else self.point.as_dict(), "model": self.model,
                "basis": dict(self.basis)}

    @classmethod
    def from_dict(cls, stored: dict[str, object]) -> Fit:
        point, basis = stored["point"], stored["basis"]
        if not isinstance(basis, dict) or not (point is None or isinstance(point, dict)):
            raise ValueError("not an auto gates record")
        return cls(None if point is None else Point(**point), str(stored["model"]),
                   {str(k): str(v) for k, v in basis.items()})


def changed_share(basis: Mapping[str, str], current: Mapping[str, str]) -> float:
    """The share of ``basis``'s capabilities that were added, removed or changed in ``current``."""
    changed = sum(basis.get(name) != current.get(name) for name in basis.keys() | current.keys())
    return changed / max(len(basis), 1)


@dataclass(frozen=True)
class Examples:
    """The fused rule's examples, as :meth:`capd.index.TriggerIndex.examples` gives them, and the
    head fitted on all of them (which scores the corpus)."""

    names: tuple[str, ...]
    texts: tuple[str, ...]  # per vector row
    vectors: fused.Floats  # unit rows, grouped by capability
    labels: Ints  # each row's position in names
    head: fused.FusedHead
    embed_tokens: fused.EmbedTokens | None = None  # None: no second stage (the head has none)
    stop: fused.Stop | None = None  # the fold heads' fits end (Stopping) once it says so


def examples_of(index: TriggerIndex, head: fused.FusedHead, embed_tokens: fused.EmbedTokens,
                stop: fused.Stop | None = None) -> Examples | None:
    """The examples ``head`` was fitted on, from the index (None if the index has moved on). The
    fold heads reuse ``head``'s token vectors: ``embed_tokens`` only serves a text it lacks (none,
    normally), and is dropped when ``head`` has no second stage."""
    names, vectors, labels = index.examples()
    if names != head.names:
        return None
    texts = tuple(t for name in names for t in index.triggers(name))
    return Examples(names, texts, vectors, labels, head, embed_tokens if head.tokens is not None else None, stop)


def nearest_mean(vectors: fused.Floats, examples: fused.Floats, labels: Ints, columns: int) -> fused.Floats:
    """``K`` ``[n, C]``: the index's mean of the top-k example cosines per capability (-1 without
    examples); ``labels`` are grouped by capability, as the index keeps them."""
    out = np.full((len(vectors), columns), -1.0, dtype=np.float32)
    present, starts, counts = np.unique(labels, return_index=True, return_counts=True)
    if len(present):
        out[:, present] = segment_topk_mean(np.asarray(vectors @ examples.T, dtype=np.float32), starts, counts,
                                            fused.TOP_K)
    return out


def _head(examples: Examples, rows: np.ndarray) -> fused.FusedHead:
    """The fused head fitted on ``rows`` of the examples only (token vectors reused, not re-embedded)."""
    labels = examples.labels[rows]
    documents = [[examples.texts[i] for i in rows[labels == c]] for c in range(len(examples.names))]
    return fused.build_head(examples.names, documents, examples.vectors[rows], labels, key="", cache_dir=None,
                            embed_tokens=examples.embed_tokens, previous=examples.head.tokens, stop=examples.stop)


def _score(head: fused.FusedHead, examples: Examples, rows: np.ndarray, vectors: fused.Floats,
           texts: Sequence[str], tokens: TokenVectors | None) -> fused.Scores:
    knn = nearest_mean(vectors, examples.vectors[rows], examples.labels[rows], len(examples.names))
    return head.score(knn, vectors, texts, tokens)


def folds(labels: Ints) -> Ints:
    """Each example's fold: its position among its capability's examples, modulo :data:`AUTO_FOLDS`."""
    position = np.zeros(len(labels), dtype=np.int64)
    for column in np.unique(labels):
        members = np.flatnonzero(labels == column)
        position[members] = np.arange(len(members))
    return position % AUTO_FOLDS


def out_of_fold(examples: Examples) -> tuple[np.ndarray, fused.Floats, fused.Floats, fused.Floats]:
    """(rows scored, their fused scores ``[n, C]``, their levels ``[n, C]``, their winners'
    coverage ``[n]``), each example scored by a head that never saw it; fold after fold until
    :data:`AUTO_MIN_SCORED` rows are scored."""
    labels = examples.labels
    fold_of = folds(labels)
    held_rows, fused_rows, level_rows, coverage_rows = [], [], [], []
    head_tokens = examples.head.tokens.matrices() if examples.head.tokens is not None else {}
    for fold in range(AUTO_FOLDS):
        held = fold_of == fold
        kept = np.bincount(labels[~held], minlength=len(examples.names))
        held &= kept[labels] > 0  # a capability keeps at least one example
        if not held.any():
            continue
        train, rows = np.flatnonzero(~held), np.flatnonzero(held)
        texts = [examples.texts[i] for i in rows]
        head = _head(examples, train)
        tokens = None if head.tokens is None else [head_tokens[t] for t in texts]
        scores = _score(head, examples, train, examples.vectors[rows], texts, tokens)
        held_rows.append(rows)
        fused_rows.append(scores.fused)
        level_rows.append(scores.level)
        coverage_rows.append(scores.winner_coverage)
        if sum(map(len, held_rows)) >= AUTO_MIN_SCORED:
            break
    if not held_rows:
        dim = len(examples.names)
        return (np.zeros(0, np.int64), np.zeros((0, dim), np.float32), np.zeros((0, dim), np.float32),
                np.zeros(0, np.float32))
    return (np.concatenate(held_rows), np.concatenate(fused_rows), np.concatenate(level_rows),
            np.concatenate(coverage_rows))


def choose(examples: Examples, corpus: Sequence[str], corpus_embedded: Embedded,
           grid: Grid = AUTO_GRID) -> Point | None:
    """The auto gates for these examples (None when no point is feasible, nothing can be held out,
    or the examples are over the head's budget: the fused rule then has no head to refit).
    ``grid``: the gates swept (research harnesses pass others)."""
    if len(examples.labels) * len(examples.names) > fused.HEAD_BUDGET:
        return None
    table = evidence(examples, corpus, corpus_embedded)
    if table is None:
        return None
    point, _ = best_point({fused.TOP_K: table}, max_null_fpr=AUTO_NULL_RATE, max_wrong=AUTO_MAX_WRONG, grid=grid)
    return point


def evidence(examples: Examples, corpus: Sequence[str], corpus_embedded: Embedded) -> ScoreTable | None:
    """What the auto gates are chosen on: the examples scored out of fold (positives) and the
    corpus messages that stay nulls, scored by the rule's head (None: nothing can be held out)."""
    rows, fused_rows, level_rows, coverage_rows = out_of_fold(examples)
    if not len(rows):
        return None
    everything = np.arange(len(examples.labels))
    corpus_vectors, corpus_tokens = corpus_embedded
    null_scores = _score(examples.head, examples, everything, np.asarray(corpus_vectors, np.float32), corpus,
                         corpus_tokens)
    nulls = null_scores.winner_level < CORPUS_LEVEL_CUT
    names = examples.names
    fixtures = ([Fixture(examples.texts[i], (names[examples.labels[i]],), "positive", "example")
                 for i in rows]
                + [Fixture(m, (), "null", "abstain corpus") for m, keep in zip(corpus, nulls, strict=True) if keep])
    expected = np.zeros((len(fixtures), len(names)), dtype=bool)
    expected[np.arange(len(rows)), examples.labels[rows]] = True
    return ScoreTable(tuple(fixtures), names, np.vstack([fused_rows, null_scores.fused[nulls]]),
                      np.ones(len(fixtures), dtype=bool), expected, np.vstack([level_rows, null_scores.level[nulls]]),
                      coverage=np.concatenate([coverage_rows, null_scores.winner_coverage[nulls]]))


def auto_gates(examples: Examples, corpus: Sequence[str], embed_corpus: Callable[[Sequence[str]], Embedded],
               head_key: str, cache_dir: Path | None, model: str = "", fingerprints: Mapping[str, str] | None = None,
               previous: Fit | None = None) -> Fit:
    """:func:`choose`, cached in ``cache_dir`` by the head's key, the fused scoring constants
    (:func:`capd.fused.scoring_key`), the corpus and :data:`VERSION`;
    ``previous`` (the last fit, for ``model``) carries over while the examples' ``fingerprints``
    differ from its basis in at most :data:`AUTO_REFIT_SHARE` of the capabilities."""
    fingerprints = dict(fingerprints or {})
    digest = hashlib.sha256(f"{VERSION}\n{head_key}\n{fused.scoring_key()}\n{AUTO_FOLDS} {AUTO_NULL_RATE} "
                            f"{AUTO_MAX_WRONG} {CORPUS_LEVEL_CUT} {AUTO_REFIT_SHARE} {AUTO_MIN_SCORED}\n".encode())
    for message in corpus:
        digest.update(message.encode() + b"\n")
    path = cache_dir / f"{digest.hexdigest()}.auto.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            return Fit.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring unreadable auto gates %s: %s", path, exc)
    share = 1.0 if previous is None or previous.model != model else changed_share(previous.basis, fingerprints)
    if previous is not None and share <= AUTO_REFIT_SHARE:
        fit = previous
        log.info("fused auto gates carried over: %.1f%% of the capabilities changed since they were fitted "
                 "(refitted above %g%%)", 100 * share, 100 * AUTO_REFIT_SHARE)
    else:
        fit = Fit(choose(examples, corpus, embed_corpus(corpus)), model, fingerprints)
        if fit.point is None:
            log.warning("auto gates: none (no feasible point on the examples, or over the head budget); "
                        "using the model manifest's fused gates")
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_text(path, json.dumps(fit.as_dict()))
        except OSError as exc:  # a read-only data directory only costs a refit next start
            log.warning("cannot cache the auto gates in %s: %s", path.parent, exc)
    return fit
