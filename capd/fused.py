"""The ``fused`` rule: a light head, soft nearest neighbours and lexical evidence, fused.

The anchor's rule ranks capabilities by the mean of their top-3 trigger cosines and fires
on a raw cosine threshold. Its ranking is mostly right; its *decision* is weak, because
some capabilities' triggers sit close to everything and others' far from everything, so
one cosine threshold suits none of them. ``fused`` keeps the same embeddings and changes
three things (measured one by one in ``benchmarks/quality/README.md``):

1. **Examples**: each capability's triggers plus its description and its name (``-`` as a
   space) — and any learned corrections (:mod:`capd.learned`) — are its examples.
2. **Ranking**: ``F = A·log_softmax(head) + (1−A)·log_softmax(K/τ) + W_BM·BM25/τ`` where
   ``head`` is a multinomial logistic regression fitted on the example embeddings (the
   tap's own triggers are its training data), ``K`` is the anchor's mean-of-top-3 over the
   examples, and BM25 scores the message's words against one document per capability
   (names and products that embeddings blur).
3. **Second stage** (near ties): the :data:`RESCORE_CANDIDATES` best capabilities by ``F``
   are re-scored by late interaction: for each of their examples, the mean over the
   message's token vectors of the best cosine to one of the example's token vectors
   ("MaxSim"), then the mean of the top-k examples per capability, ``R``. Each candidate's
   ``F`` moves by ``RESCORE_WEIGHT·(R − max R)`` (the best-matching candidate keeps its
   score, the others drop by how much worse they match word by word). Pooled sentence
   vectors blur which words carry the request; token vectors keep them. The examples' token
   vectors are computed once and cached with the head (``float16`` on disk; over
   :data:`TOKEN_BUDGET` rows there is no second stage, logged).
4. **Gates**: ``level = K_w − μ_in[w]`` (how close the message is to the winner compared
   with how close the winner's own examples are to each other) must reach ``threshold``,
   ``gap = F_w − F_second`` (a log-odds margin) must reach ``margin``, and the winner's
   ``coverage`` must reach ``coverage`` (0: no coverage gate). Coverage is the mean, over the
   message's token vectors, of each one's best cosine to any token of the capability's
   examples: how much of what the message says the capability's examples speak of. A message
   that matches a capability except for one word it never mentions ("what *takeout* places
   are near me" against "what pubs are close") keeps a high pooled similarity, and a mean
   late-interaction score dilutes the word, but its coverage drops. It comes from the
   similarities the second stage computes anyway (no cost), for the re-scored candidates
   only; without token vectors it is NaN and the gate passes.

The head costs examples × capabilities logits to fit; above :data:`HEAD_BUDGET` it is not
fitted and the rule runs on ``K`` and BM25 alone (logged). A fitted head is cached in the
data directory by the content hash of everything it was fitted on, so restarts do not refit.
"""

from __future__ import annotations

import hashlib
import logging
import zipfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from threadpoolctl import threadpool_limits

from capd.atomic import write_with
from capd.encoder import Embedded, TokenVectors
from capd.errors import Stopping
from capd.index import Ints
from capd.lexicon import Lexicon

log = logging.getLogger(__name__)

Floats = npt.NDArray[np.float32]
EmbedTokens = Callable[[Sequence[str]], Embedded]  # Encoder.embed_tokens
Stop = Callable[[], bool]  # true once the fit's result is no longer wanted (capd is stopping)

MIX = 0.85  # A: weight of the head against soft nearest neighbours
TEMPERATURE = 0.05  # τ
LEXICAL_WEIGHT = 0.02  # W_BM
TOP_K = 3
HEAD_C = 10.0  # inverse L2 strength of the head (scikit-learn's C)
HEAD_TOL, HEAD_MAX_ITER = 1e-4, 3000  # the head's fit stops at this largest gradient component
ONE_THREAD_WORK = 1 << 28  # examples × capabilities × dim below which the head's fit keeps to one BLAS thread
HEAD_BUDGET = 20_000_000  # examples × capabilities above which no head is fitted
RESCORE_WEIGHT = 10.0  # β of the second stage, in F's log-odds units per unit of MaxSim
RESCORE_CANDIDATES = 5
# A candidate's examples the second stage reads: with more than this, its nearest ones by sentence
# cosine. It bounds the stage's cost on a capability with hundreds of examples (clinc150_domain with
# `capd calibrate --examples`, ~240 each: reading them all took 4.1 ms a message, a route 1.84x a bare
# encode). 32 -> 16 (2026-12-07): a route with the examples 1.43x -> 1.35x on clinc150_domain, 1.36x ->
# 1.25x on snips7, and over 8 splits of the four public intent sets (`python -m
# benchmarks.quality.rescore_examples_trial`) the goal is met as often or more on each. taps/core and
# healthcare have at most 13 examples a capability, so their scores are unchanged.
RESCORE_EXAMPLES = 16
TOKEN_BUDGET = 100_000  # example token rows kept for the second stage (~150 MB of float32 at dim 384)
VERSION = "fused-4"  # bump when anything above changes the cached heads


def scoring_key() -> str:
    """The constants a fused score reads besides its head, as they are when called (a harness that
    sets one is keyed by it). What is fitted on fused scores and cached, the auto gates, is cached by
    it too: the head's key alone misses a change that leaves the heads as they were
    (``RESCORE_EXAMPLES`` 32 -> 16 did, and auto gates fitted at 32 were read back at 16)."""
    return (f"{MIX} {TEMPERATURE} {LEXICAL_WEIGHT} {TOP_K} {RESCORE_WEIGHT} {RESCORE_CANDIDATES} "
            f"{RESCORE_EXAMPLES} {TOKEN_BUDGET}")


def log_softmax(x: Floats) -> Floats:
    shifted = x - x.max(axis=1, keepdims=True)
    return np.asarray(shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)), dtype=np.float32)


@dataclass(frozen=True)
class Scores:
    """Per message: the fused ranking ``F``, the gate statistics and the winner."""

    fused: Floats  # [n, C]
    level: Floats  # [n, C]: K - mu_in, the threshold statistic of each capability
    winner: npt.NDArray[np.int64]  # [n]
    gap: Floats  # [n]: F_winner - F_second (inf with one capability)
    coverage: Floats  # [n, C]: the coverage gate's statistic; NaN where not computed (not re-scored)
    knn: Floats  # [n, C]: K, the mean-top-k example cosines the level was taken from

    @property
    def winner_level(self) -> Floats:
        return np.asarray(self.level[np.arange(len(self.winner)), self.winner], dtype=np.float32)

    @property
    def winner_coverage(self) -> Floats:
        return np.asarray(self.coverage[np.arange(len(self.winner)), self.winner], dtype=np.float32)


@dataclass(frozen=True)
class ExampleTokens:
    """Every example's token vectors, examples grouped by capability (in the head's column order)."""

    texts: tuple[str, ...]  # [E]
    rows: Floats  # [T, dim] (float16 in the cache file)
    starts: Ints  # [E + 1]: example e's tokens are rows[starts[e]:starts[e + 1]]
    first: Ints  # [C + 1]: capability c's examples are first[c]:first[c + 1]
    # [E, dim]: the examples' sentence vectors (not cached: the index has them), to pick a
    # candidate's nearest RESCORE_EXAMPLES; None reads every example
    sentences: Floats | None = None

    @classmethod
    def build(cls, texts: Sequence[str], labels: Ints, matrices: TokenVectors, columns: int) -> ExampleTokens:
        """``texts``/``matrices`` per example with its column in ``labels`` (grouped by column)."""
        lengths = np.array([len(m) for m in matrices], dtype=np.int64)
        if np.any(lengths == 0):
            raise ValueError("every example needs at least one token vector")
        dim = matrices[0].shape[1] if matrices else 0
        # rounded to float16 as the cache file stores them: a restart scores exactly like the first start
        rows = (np.concatenate(matrices).astype(np.float16).astype(np.float32) if matrices
                else np.zeros((0, dim), np.float32))
        return cls.from_rows(texts, labels, rows, np.concatenate([[0], np.cumsum(lengths)]), columns)

    @classmethod
    def from_rows(cls, texts: Sequence[str], labels: Ints, rows: npt.NDArray[np.floating[Any]],
                  starts: npt.NDArray[np.integer[Any]], columns: int) -> ExampleTokens:
        """From the stacked rows and each example's first row (as :func:`_store` keeps them)."""
        if len(labels) and np.any(np.diff(labels) < 0):
            raise ValueError("examples must be grouped by capability")
        first = np.searchsorted(labels, np.arange(columns + 1)).astype(np.int64)
        return cls(tuple(texts), rows.astype(np.float32), starts.astype(np.int64), first)

    def matrices(self) -> dict[str, Floats]:
        """Example text → its token vectors (to reuse when the examples change a little)."""
        return {t: self.rows[self.starts[i]:self.starts[i + 1]] for i, t in enumerate(self.texts)}

    def late_interaction(self, message: Floats, columns: Sequence[int], k: int = TOP_K,
                         sentence: Floats | None = None) -> tuple[Floats, Floats]:
        """Per column: ``R``, the mean of its top-k examples' MaxSim with the message's tokens, and
        its coverage, the mean over the message's tokens of the best cosine to any of its
        examples' tokens (NaN without message tokens or examples). Given the message's
        ``sentence`` vector, a column with more than :data:`RESCORE_EXAMPLES` examples is read
        through its nearest ones by sentence cosine only."""
        match = np.full(len(columns), -1.0, dtype=np.float32)
        coverage = np.full(len(columns), np.nan, dtype=np.float32)
        if not len(message):
            return match, coverage
        for i, column in enumerate(columns):
            a, b = int(self.first[column]), int(self.first[column + 1])
            if a == b:
                continue
            rows, offsets = self._tokens_of(a, b, sentence)
            sims = message @ rows.T  # [message tokens, the example tokens read]
            best = np.maximum.reduceat(sims, offsets, axis=1)  # [message tokens, examples]
            per_example = best.mean(axis=0)
            kk = min(k, len(offsets))
            match[i] = float(np.partition(per_example, len(offsets) - kk)[len(offsets) - kk:].mean())
            coverage[i] = float(best.max(axis=1).mean())
        return match, coverage

    def _tokens_of(self, a: int, b: int, sentence: Floats | None) -> tuple[Floats, Ints]:
        """The token rows of examples ``a:b`` (or of the :data:`RESCORE_EXAMPLES` nearest ``sentence``
        among them, gathered) and where each example's rows start within them."""
        if sentence is None or self.sentences is None or b - a <= RESCORE_EXAMPLES:
            low = self.starts[a]
            return self.rows[low:self.starts[b]], self.starts[a:b] - low
        near = a + np.argpartition(self.sentences[a:b] @ sentence, b - a - RESCORE_EXAMPLES)[b - a - RESCORE_EXAMPLES:]
        first, lengths = self.starts[near], self.starts[near + 1] - self.starts[near]
        ends = np.cumsum(lengths)
        offsets = ends - lengths
        return self.rows[np.repeat(first - offsets, lengths) + np.arange(ends[-1])], offsets


@dataclass(frozen=True)
class FusedHead:
    """Everything the fused rule adds on top of the example index, for one set of capabilities."""

    names: tuple[str, ...]
    in_class: Floats  # mu_in [C]
    weight: Floats | None  # [dim, C]; None when over HEAD_BUDGET
    bias: Floats | None  # [C]
    lexicon: Lexicon
    tokens: ExampleTokens | None = None  # None: no second stage
    mix: float = MIX
    lexical_weight: float = LEXICAL_WEIGHT
    rescore_weight: float = RESCORE_WEIGHT
    key: str = ""  # the content hash it was fitted for (:func:`head_key`)

    def score(self, knn: Floats, vectors: Floats, texts: Sequence[str], tokens: TokenVectors | None = None,
              offsets: Floats | None = None) -> Scores:
        """``knn``: mean-of-top-k example cosines ``[n, C]``; ``vectors``: the messages' unit vectors;
        ``tokens``: their token vectors, for the second stage (without them there is none);
        ``offsets``: ``[C]`` added to every message's ``F`` last, after the second stage (the
        calibrated per-capability offsets, :func:`capd.offsets.fit_offsets`)."""
        weight, bias = self.weight, self.bias
        with_head = weight is not None and bias is not None and self.mix > 0
        fused = (1 - self.mix if with_head else 1.0) * log_softmax(knn / TEMPERATURE)
        if weight is not None and bias is not None and with_head:
            fused = fused + self.mix * log_softmax(np.asarray(vectors @ weight + bias, dtype=np.float32))
        if self.lexical_weight:
            fused = fused + (self.lexical_weight / TEMPERATURE) * self.lexicon.scores(texts)
        fused = np.asarray(fused, dtype=np.float32)
        coverage = np.full(fused.shape, np.nan, dtype=np.float32)
        if tokens is not None and self.tokens is not None:  # with one capability or β = 0 only coverage changes
            fused, coverage = self._rescore(fused, tokens, self.tokens, vectors)
        if offsets is not None:
            fused = np.asarray(fused + offsets[None, :], dtype=np.float32)
        n, columns = fused.shape
        winner = fused.argmax(axis=1)
        first = fused[np.arange(n), winner]
        if columns > 1:
            second = np.partition(fused, columns - 2, axis=1)[:, columns - 2]
        else:
            second = np.full(n, -np.inf, dtype=np.float32)
        return Scores(fused, np.asarray(knn - self.in_class, dtype=np.float32), winner.astype(np.int64),
                      np.asarray(first - second, dtype=np.float32), coverage, np.asarray(knn, dtype=np.float32))

    def _rescore(self, fused: Floats, tokens: TokenVectors, examples: ExampleTokens,
                 vectors: Floats) -> tuple[Floats, Floats]:
        """``F`` after the second stage, and the re-scored candidates' coverage (NaN elsewhere).

        The winner is always a candidate: the best-matching candidate keeps its score, which is
        at least any other capability's."""
        out = fused.copy()
        coverage = np.full(fused.shape, np.nan, dtype=np.float32)
        top = min(RESCORE_CANDIDATES, fused.shape[1])
        for row, message in enumerate(tokens):
            candidates = np.argpartition(-fused[row], top - 1)[:top]
            match, covered = examples.late_interaction(np.asarray(message, dtype=np.float32), candidates.tolist(),
                                                       sentence=vectors[row])
            out[row, candidates] += self.rescore_weight * (match - match.max())
            coverage[row, candidates] = covered
        return out, coverage


def in_class_similarity(vectors: Floats, labels: npt.NDArray[np.int64], columns: int, k: int = TOP_K) -> Floats:
    """mu_in: per capability, the mean over its examples of their mean top-k cosine to its *other* examples.

    A capability with one example gets 1.0 (nothing to compare with: its gate then asks
    for a message about as close as a paraphrase).
    """
    out = np.ones(columns, dtype=np.float32)
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(columns + 1))
    for column in range(columns):
        rows = order[bounds[column]:bounds[column + 1]]
        if len(rows) < 2:
            continue
        block = vectors[rows]
        sims = block @ block.T
        np.fill_diagonal(sims, -np.inf)
        kk = min(k, len(rows) - 1)
        top = -np.partition(-sims, kk - 1, axis=1)[:, :kk]
        out[column] = float(top.mean())
    return out


def _check(stop: Stop | None) -> None:
    """Raise :class:`~capd.errors.Stopping` once ``stop`` says the result is no longer wanted."""
    if stop is not None and stop():
        raise Stopping("capd is stopping")


def head_file(cache_dir: Path, key: str) -> Path:
    """Where :func:`build_head` caches the head fitted for ``key``."""
    return cache_dir / f"{key}.npz"


def fit_head(vectors: Floats, labels: npt.NDArray[np.int64], columns: int,
             stop: Stop | None = None) -> tuple[Floats, Floats]:
    """Multinomial logistic regression on the example embeddings: weight ``[dim, C]``, bias ``[C]``.

    The objective and stopping rule are scikit-learn's ``LogisticRegression(C=HEAD_C)`` with its
    default L-BFGS solver (mean cross-entropy plus ``‖W‖² / (2·HEAD_C·n)``, the bias unpenalised;
    from zero until no gradient component exceeds :data:`HEAD_TOL`). For two capabilities
    scikit-learn fits one binary row ``w`` (returned here as ``∓w/2``); two symmetric rows give the
    same model when penalised twice as hard, so they are. It is computed in float32 without a
    one-hot matrix: on the 1,000-capability benchmark tap (8,951 examples) the weights match
    scikit-learn's to 1e-5 relative, in about a third of its time on one core (``python -m
    benchmarks.bench_engine``, "Fused head fit"). A capability without examples gets a bias that
    never wins.

    Below :data:`ONE_THREAD_WORK` the fit keeps to one BLAS thread: its products are too small to
    share, and waking other threads for each of them made a 60-capability fit several times slower
    (``bench_engine``, "Fused head fit", the 60-capability rows).

    ``stop`` is asked before each evaluation of the loss; once it says so the fit raises
    :class:`~capd.errors.Stopping` (a 1,000-capability fit takes seconds, and a stopping daemon
    waited for it)."""
    from scipy.optimize import minimize  # imported only when a head is fitted

    present, column_of = np.unique(labels, return_inverse=True)
    weight = np.zeros((vectors.shape[1], columns), dtype=np.float32)
    bias = np.full(columns, -1e4, dtype=np.float32)  # a capability without examples never wins on the head
    if len(present) == 1:
        bias[present[0]] = 0.0
        return weight, bias
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    rows, dim = x.shape
    every = np.arange(rows)
    strength = (2.0 if len(present) == 2 else 1.0) / (HEAD_C * rows)  # two: scikit-learn's binary penalty
    buffers = (np.empty((rows, len(present)), dtype=np.float32),  # reused: fresh ones per call cost page faults
               np.empty((len(present), dim), dtype=np.float32))

    def loss_and_gradient(flat: npt.NDArray[np.float64]) -> tuple[float, npt.NDArray[np.float64]]:
        _check(stop)
        params = flat.astype(np.float32).reshape(len(present), dim + 1)
        coef, (logits, coef_gradient) = params[:, :dim], buffers
        np.matmul(x, np.ascontiguousarray(coef.T), out=logits)
        logits += params[:, dim]
        logits -= logits.max(axis=1, keepdims=True)
        own = logits[every, column_of].astype(np.float64)
        np.exp(logits, out=logits)
        total = logits.sum(axis=1)
        loss = float(np.log(total, dtype=np.float64).sum() - own.sum()) / rows
        loss += 0.5 * strength * float(np.square(coef, dtype=np.float64).sum())
        logits /= total[:, None]
        logits[every, column_of] -= 1.0  # softmax minus one-hot: the logits' gradient
        np.matmul(logits.T, x, out=coef_gradient)
        coef_gradient /= rows
        coef_gradient += strength * coef
        bias_gradient = logits.sum(axis=0, dtype=np.float64) / rows
        return loss, np.hstack([coef_gradient, bias_gradient[:, None]]).ravel().astype(np.float64)

    start = np.zeros(len(present) * (dim + 1))
    small = rows * len(present) * dim < ONE_THREAD_WORK
    with threadpool_limits(limits=1) if small else nullcontext():
        fitted = minimize(loss_and_gradient, start, jac=True, method="L-BFGS-B",
                          options={"maxiter": HEAD_MAX_ITER, "maxls": 50, "gtol": HEAD_TOL,
                                   "ftol": 64 * np.finfo(float).eps})
    if not fitted.success:
        log.info("fused rule: the head's fit stopped after %d iterations: %s", fitted.nit, fitted.message)
    params = fitted.x.astype(np.float32).reshape(len(present), dim + 1)
    weight[:, present] = params[:, :dim].T
    bias[present] = params[:, dim]
    return weight, bias


def head_key(model_id: str, names: Sequence[str], fingerprints: Sequence[str]) -> str:
    digest = hashlib.sha256(f"{VERSION}\n{model_id}\n".encode())
    for name, fingerprint in zip(names, fingerprints, strict=True):
        digest.update(f"{name}\t{fingerprint}\n".encode())
    return digest.hexdigest()


def build_head(names: Sequence[str], documents: Sequence[Sequence[str]], vectors: Floats,
               labels: npt.NDArray[np.int64], key: str, cache_dir: Path | None,
               embed_tokens: EmbedTokens | None = None,
               previous: ExampleTokens | None = None,
               fresh: Mapping[str, Floats] | None = None, stop: Stop | None = None) -> FusedHead:
    """Fit (or load from ``cache_dir``) the head for these examples; ``documents`` feed BM25
    and, flattened, are the examples' texts (in ``vectors`` order).

    A learned correction is an example like any trigger (an extra weight for them measured no
    better: ``benchmarks/quality/README.md``). ``embed_tokens`` gives texts' token vectors
    for the second stage (None: no second stage); texts already in ``previous`` or ``fresh``
    (token vectors kept as the index embedded them: :meth:`capd.embedder.CachedEmbedder.keeping_tokens`)
    are not embedded again. ``stop``: see :func:`fit_head` (the token vectors stop the same way).
    """
    columns = len(names)
    weight: Floats | None = None
    bias: Floats | None = None
    in_class: Floats | None = None
    tokens: ExampleTokens | None = None
    over_budget = False  # recorded in the cache file, so a restart does not embed them again to find out
    texts = [t for doc in documents for t in doc]
    path = head_file(cache_dir, key) if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            rows: npt.NDArray[Any] | None = None
            starts: npt.NDArray[Any] | None = None
            with np.load(path) as stored:
                in_class = stored["in_class"]
                if "weight" in stored:
                    weight, bias = stored["weight"], stored["bias"]
                if "token_rows" in stored and len(stored["token_starts"]) == len(texts) + 1:
                    rows, starts = stored["token_rows"], stored["token_starts"]
                over_budget = "over_token_budget" in stored
            _check_stored(in_class, weight, bias, rows, starts, columns, vectors.shape[1])
            if rows is not None and starts is not None:
                tokens = ExampleTokens.from_rows(texts, labels, rows, starts, columns)
        except (OSError, ValueError, TypeError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # corrupt or truncated
            log.warning("ignoring unreadable fused head %s: %s", path, exc)
            in_class = None
            tokens = None
    stale = in_class is None or in_class.shape != (columns,)
    if stale:
        in_class = in_class_similarity(vectors, labels, columns)
        weight = bias = None
        if len(vectors) * columns <= HEAD_BUDGET and columns > 0:
            weight, bias = fit_head(vectors, labels, columns, stop)
        elif columns > 0:
            log.warning("fused rule: %d examples x %d capabilities is over the head budget (%d); "
                        "ranking on nearest examples and BM25 only", len(vectors), columns, HEAD_BUDGET)
    fresh_tokens = embed_tokens is not None and tokens is None and not over_budget and len(texts) == len(labels)
    if embed_tokens is not None and fresh_tokens:
        tokens = _example_tokens(texts, labels, columns, embed_tokens, previous, fresh, stop)
        over_budget = tokens is None
    assert in_class is not None
    if path is not None and (stale or fresh_tokens):
        _store(path, in_class, weight, bias, tokens, over_budget)
    if tokens is not None and len(vectors) == len(tokens.texts):  # the examples' own vectors, in their order
        tokens = replace(tokens, sentences=np.asarray(vectors, dtype=np.float32))
    return FusedHead(tuple(names), in_class, weight, bias, Lexicon(documents), tokens, key=key)


def _check_stored(in_class: npt.NDArray[Any], weight: npt.NDArray[Any] | None, bias: npt.NDArray[Any] | None,
                  rows: npt.NDArray[Any] | None, starts: npt.NDArray[Any] | None, columns: int, dim: int) -> None:
    """Raise ValueError unless a head file's arrays fit ``columns`` capabilities of a ``dim``-wide model:
    a file that opens but holds other shapes, kinds or NaN (damaged, edited) failed every route, or
    the start, where a truncated one is refitted."""
    shapes = {"in_class": (in_class, (columns,)), "weight": (weight, (dim, columns)), "bias": (bias, (columns,))}
    if rows is not None:
        shapes["token_rows"] = (rows, (*rows.shape[:1], dim))
    for name, (array, shape) in shapes.items():
        if array is not None and (array.dtype.kind != "f" or array.shape != shape):
            raise ValueError(f"its {name} is {array.dtype} {array.shape}, not float {shape}")
    if not all(_finite(a) for a in (in_class, weight, bias, rows) if a is not None):
        raise ValueError("it holds NaN or inf (fitted on a damaged model's vectors)")
    if starts is not None and rows is not None and (
            starts.dtype.kind not in "iu" or starts[0] != 0 or starts[-1] != len(rows) or np.any(np.diff(starts) <= 0)):
        # every example has a token vector (ExampleTokens.build): an empty last one failed np.maximum.reduceat
        raise ValueError("its token_starts do not rise from 0 to the number of token rows")


def _finite(array: npt.NDArray[Any]) -> bool:
    """No NaN or inf in ``array``. The token rows (float16, up to 40M numbers) by their exponent bits:
    isfinite took ~60 ms on every start, this a quarter of it."""
    if array.dtype == np.float16:
        return bool((array.view(np.uint16) & 0x7C00).max(initial=0) != 0x7C00)
    return bool(np.isfinite(array).all())


def _example_tokens(texts: Sequence[str], labels: Ints, columns: int, embed_tokens: EmbedTokens,
                    previous: ExampleTokens | None,
                    fresh: Mapping[str, Floats] | None = None, stop: Stop | None = None) -> ExampleTokens | None:
    """The examples' token vectors (reusing ``previous``'s and ``fresh``), or None over :data:`TOKEN_BUDGET`."""
    wanted = dict.fromkeys(texts)
    known = {t: m for t, m in previous.matrices().items() if t in wanted} if previous is not None else {}
    known.update((t, m) for t, m in (fresh or {}).items() if t in wanted)
    missing = [t for t in wanted if t not in known]
    for start in range(0, len(missing), 256):  # in chunks, to stop early on a huge tap
        if sum(len(m) for m in known.values()) > TOKEN_BUDGET:
            break
        _check(stop)
        chunk = missing[start:start + 256]
        known.update(zip(chunk, embed_tokens(chunk)[1], strict=True))
    if len(known) < len(wanted) or sum(len(known[t]) for t in texts) > TOKEN_BUDGET:
        log.warning("fused rule: the examples have over %d token vectors; no second stage", TOKEN_BUDGET)
        return None
    return ExampleTokens.build(texts, labels, [known[t] for t in texts], columns)


def _store(path: Path, in_class: Floats, weight: Floats | None, bias: Floats | None,
           tokens: ExampleTokens | None, over_budget: bool = False) -> None:
    arrays: dict[str, Any] = {"in_class": in_class}
    if weight is not None and bias is not None:
        arrays.update(weight=weight, bias=bias)
    if tokens is not None:
        arrays.update(token_rows=tokens.rows.astype(np.float16), token_starts=tokens.starts)
    if over_budget:
        arrays["over_token_budget"] = np.array(True)
    try:
        write_with(path, lambda handle: np.savez(handle, **arrays))
    except OSError as exc:  # a read-only data directory only costs a refit next start
        log.warning("cannot cache the fused head in %s: %s", path.parent, exc)
