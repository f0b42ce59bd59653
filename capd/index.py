"""The trigger index: every trigger vector, which capability owns it, and exact scoring.

A capability's score is the anchor's: the mean of its top-k trigger cosines (mean of all
when it has fewer than k). Scores are exact for every capability, never approximated from
a global nearest-neighbour list, so top-1 and top-2 (and thus the margin gate) are exact.

Storage is one float32 matrix in which each capability owns a contiguous block of rows.
Adding or changing a capability appends a block; removing one only marks its rows dead;
nothing else is touched or re-embedded. Dead rows are compacted away once they outnumber
the live ones. Every mutation publishes a new immutable :class:`_Snapshot`; readers take
the current snapshot with one attribute read and never lock. Rows a published snapshot
covers are never written again (appends go past them; growth and compaction copy into a
new array), so a search running during a sync sees the old or the new state of every
capability, never a mix.

Scoring (measurements in ``benchmarks/results/index_choice.md``):

- :meth:`TriggerIndex.capability_scores` (many queries, all capabilities; ``capd eval``): one
  BLAS matrix product, then a segmented top-k over each capability's block (k rounds of
  ``np.maximum.reduceat``, exact with ties). Throughput is what counts there.
- :meth:`TriggerIndex.top_capabilities` (one query, best n; the router's hot path) never
  waits on a thread team: BLAS spreads even a small matrix-vector product over all cores,
  and when another process holds one of them the product stalls for a scheduler slice
  (measured on a busy 2-core box: p50 of 8-30 ms instead of under 1 ms at 2k-10k triggers,
  depending on the run; one thread stayed at 0.3-1.9 ms).
  Up to ``SMALL_ROWS`` triggers, every cosine comes from ``np.einsum`` (one thread, no
  BLAS) and every capability is scored. Above, ``faiss.knn`` held to one thread (flat and
  exact, over the snapshot's own rows: no copy and no FAISS index object) fetches the L
  nearest triggers, and only capabilities owning one are scored, exactly; L grows until
  the n-th best exact score is above the L-th cosine, which proves that no other
  capability can enter the top n (each of its cosines, hence its mean, is lower).
  The cut-over is where the two meet for one query (k = 3, n = 7) on real MiniLM vectors of
  the benchmark taps (:mod:`benchmarks.gen_tap`, ~9 triggers per capability), p50 in ms on
  this 2-core machine, two runs at load 2-4 (``benchmarks.bench_engine.crossover``):
  5,405 triggers 0.83 vs 1.25 (every capability vs nearest first); 8,951: 1.26-1.41 vs
  1.46-1.77; 12,606: 1.80-2.04 vs 1.93-2.19; 14,423: 2.27-2.42 vs 2.41-2.49; 16,202:
  2.74-2.92 vs 2.54-2.96; 18,015: 2.73-2.85 vs 2.62-2.76; 27,025: 4.56 vs 4.27; 90,063:
  13.7 vs 9.6. Hence ``SMALL_ROWS`` = 16,384 (it was 8,192, which sent the 1,000-capability
  tap down the slower path).
- No FAISS index object is kept: ``IndexIDMap2`` rewrites itself on every removal, while
  one numpy matrix with per-capability blocks gives O(changed) updates and lock-free
  consistent snapshots.
- A per-capability cone bound (centroid plus angular radius) was measured and dropped: on
  real MiniLM embeddings of the shipped tap it excluded no capability at all.
- Exactness means reading every trigger once per query: several ms at 100k triggers on
  this machine, more than one encode (memory bandwidth, not arithmetic, is the limit).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from capd.catalog import Catalog
from capd.embedder import CachedEmbedder, Progress
from capd.encoder import Vectors, l2_normalize
from capd.errors import UnknownCapability

Ints = npt.NDArray[np.int64]

SMALL_ROWS = 16_384  # up to here one query scores every capability; above, the nearest triggers first (measured)
COMPACT_MIN_DEAD = 4096
CHUNK_ELEMENTS = 1 << 22  # queries x rows per block in capability_scores (16 MiB of float32)


@dataclass(frozen=True)
class SyncReport:
    """What :meth:`TriggerIndex.sync` did. ``embedded`` / ``cached`` count distinct trigger texts."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    embedded: int = 0
    cached: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"added": list(self.added), "removed": list(self.removed), "changed": list(self.changed),
                "unchanged": len(self.unchanged), "embedded": self.embedded, "cached": self.cached}


@dataclass(frozen=True, eq=False)
class _Block:
    name: str
    fingerprint: str
    texts: tuple[str, ...]
    start: int
    count: int


def _ranges(starts: Ints, counts: Ints) -> Ints:
    """Concatenated ``arange(start, start + count)`` for each pair, vectorised."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    before = np.cumsum(counts) - counts
    return np.repeat(starts - before, counts) + np.arange(total, dtype=np.int64)


def segment_topk_mean(sims: npt.NDArray[np.float32], bounds: Ints, counts: Ints, k: int) -> npt.NDArray[np.float32]:
    """Mean of the top-k values of each column segment of ``sims [q, n]``.

    ``bounds`` are the ascending segment starts (the first is 0, segments cover all n columns,
    none is empty), ``counts`` their lengths. A segment shorter than k averages all its values.
    Exact, ties included: each round takes the segment maximum as often as it occurs.
    """
    if sims.shape[1] == 0 or len(bounds) == 0:
        return np.zeros((sims.shape[0], len(bounds)), dtype=np.float32)
    wanted = np.minimum(counts, k)
    if int(counts.max()) <= k:
        return np.asarray(np.add.reduceat(sims, bounds, axis=1, dtype=np.float64) / wanted, dtype=np.float32)
    work = np.array(sims, dtype=np.float32, copy=True)
    total = np.zeros((sims.shape[0], len(bounds)), dtype=np.float64)
    remaining = np.broadcast_to(wanted, total.shape).copy()
    for _ in range(k):
        top = np.maximum.reduceat(work, bounds, axis=1)
        hit = work == np.repeat(top, counts, axis=1)
        ties = np.add.reduceat(hit, bounds, axis=1, dtype=np.int64)
        take = np.minimum(ties, remaining)
        total += take * np.where(take > 0, top, 0.0)
        remaining -= take
        if not remaining.any():
            break
        np.putmask(work, hit, -np.inf)
    return np.asarray(total / wanted, dtype=np.float32)


@dataclass(frozen=True, eq=False)
class _Snapshot:
    """An immutable view of the index; rows ``[0, n_rows)`` of ``matrix`` never change under it."""

    matrix: Vectors
    n_rows: int
    blocks: tuple[_Block, ...]
    names: tuple[str, ...] = field(init=False)
    position: dict[str, int] = field(init=False)
    starts: Ints = field(init=False)
    counts: Ints = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(b.name for b in self.blocks))
        object.__setattr__(self, "position", {b.name: i for i, b in enumerate(self.blocks)})
        object.__setattr__(self, "starts", np.array([b.start for b in self.blocks], dtype=np.int64))
        object.__setattr__(self, "counts", np.array([b.count for b in self.blocks], dtype=np.int64))

    @cached_property
    def segments(self) -> tuple[Ints, Ints, Ints]:
        """Segment starts and lengths covering rows ``[0, n_rows)`` (dead gaps included) and each
        capability's segment number."""
        if not self.blocks:
            bounds = np.array([0], dtype=np.int64) if self.n_rows else np.zeros(0, dtype=np.int64)
            return bounds, np.diff(np.append(bounds, self.n_rows)), np.zeros(0, dtype=np.int64)
        order = np.argsort(self.starts, kind="stable")
        starts = self.starts[order]
        ends = starts + self.counts[order]
        previous_end = np.concatenate([[0], ends[:-1]])
        gaps = previous_end[starts > previous_end]
        tail = [ends[-1]] if ends[-1] < self.n_rows else []
        bounds = np.sort(np.concatenate([starts, gaps, np.array(tail, dtype=np.int64)])).astype(np.int64)
        lengths = np.diff(np.append(bounds, self.n_rows)).astype(np.int64)
        return bounds, lengths, np.searchsorted(bounds, self.starts).astype(np.int64)

    @cached_property
    def live_rows(self) -> Ints:
        return _ranges(self.starts, self.counts)

    @cached_property
    def row_capability(self) -> Ints:
        return np.repeat(np.arange(len(self.blocks), dtype=np.int64), self.counts)

    @cached_property
    def row_owner(self) -> Ints:
        """Capability index of every row in ``[0, n_rows)``; -1 for dead rows."""
        owner = np.full(self.n_rows, -1, dtype=np.int64)
        owner[self.live_rows] = self.row_capability
        return owner

    @property
    def rows(self) -> Vectors:
        return self.matrix[: self.n_rows]

    def exact(self, query: Vectors, which: Ints, k: int) -> npt.NDArray[np.float32]:
        """Exact scores of the capabilities ``which`` for one query, from their own rows."""
        counts = self.counts[which]
        sims = _dot(self.matrix[_ranges(self.starts[which], counts)], query)
        return np.asarray(segment_topk_mean(sims[None, :], np.cumsum(counts) - counts, counts, k)[0],
                          dtype=np.float32)

    def nearest_rows(self, query: Vectors, length: int) -> tuple[Vectors, Ints]:
        """The ``length`` rows with the highest cosines (dead rows included), and those cosines."""
        faiss = _faiss()
        values, rows = faiss.knn(query[None, :], self.rows, length, metric=faiss.METRIC_INNER_PRODUCT)
        return np.asarray(values[0], dtype=np.float32), np.asarray(rows[0], dtype=np.int64)

    def top_by_triggers(self, query: Vectors, k: int, n: int) -> tuple[Ints, npt.NDArray[np.float32]]:
        """Exact scores of a set of capabilities that provably contains the n best.

        A capability owning none of the L nearest rows has every cosine at or below the L-th
        one, so its mean is too; once the n-th best exact score among owners is above it, no
        other capability can enter the top n. Otherwise L grows (x4) up to the whole index.
        """
        length = min(self.n_rows, max(64, 16 * n * k))
        while True:
            values, rows = self.nearest_rows(query, length)
            owners = self.row_owner[rows]
            which = np.unique(owners[owners >= 0])
            complete = length >= self.n_rows
            if len(which) >= n or complete:
                scores = self.exact(query, which, k)
                nth = float(np.partition(scores, len(scores) - n)[len(scores) - n])
                if complete or nth > float(values.min()):
                    return which, scores
            length = min(self.n_rows, length * 4)

    def all_scores(self, queries: Vectors, k: int) -> npt.NDArray[np.float32]:
        out = np.zeros((queries.shape[0], len(self.blocks)), dtype=np.float32)
        if not self.blocks or not len(queries):
            return out
        bounds, lengths, segment_of = self.segments
        step = max(1, CHUNK_ELEMENTS // max(self.n_rows, 1))
        for i in range(0, queries.shape[0], step):
            sims = queries[i:i + step] @ self.rows.T
            out[i:i + step] = segment_topk_mean(sims, bounds, lengths, k)[:, segment_of]
        return out


def _dot(rows: Vectors, query: Vectors) -> Vectors:
    """``rows @ query`` on the calling thread: ``np.einsum`` does not hand the product to BLAS."""
    return np.asarray(np.einsum("ij,j->i", rows, query), dtype=np.float32)


@functools.cache
def _faiss() -> Any:
    """FAISS, imported on first use (it costs ~0.2 s of start-up) and held to one OpenMP thread:
    for one query, its thread team only adds synchronisation. capd is its only user."""
    import faiss

    faiss.omp_set_num_threads(1)
    return faiss


def _queries(queries: npt.ArrayLike, dim: int) -> Vectors:
    array = np.asarray(queries, dtype=np.float32)
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or array.shape[1] != dim:
        raise ValueError(f"queries must have shape (n, {dim}), got {np.shape(queries)}")
    return l2_normalize(array)


def _best(scores: npt.NDArray[np.float32], which: Ints, n: int) -> Ints:
    """The n best of ``which`` by score, ties broken by capability order (as a stable sort)."""
    order = np.lexsort((which, -scores.astype(np.float64)))
    return which[order[:n]]


class TriggerIndex:
    """All trigger vectors of a catalog with exact per-capability mean-of-top-k scoring.

    Capabilities without triggers are not indexed (they are never auto-routed).
    Queries are L2-normalised before scoring, so any encoder output can be passed.
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._lock = threading.RLock()
        self._matrix: Vectors = np.zeros((0, dim), dtype=np.float32)
        self._used = 0
        self._dead = 0
        self._blocks: dict[str, _Block] = {}
        self._snap = _Snapshot(self._matrix, 0, ())

    # -- mutation (serialised by the lock; each publishes one snapshot) ------------------------

    def set_capability(self, name: str, fingerprint: str, texts: Sequence[str], vectors: npt.ArrayLike) -> None:
        """Insert or replace one capability; an empty ``texts`` removes it."""
        with self._lock:
            self._put(name, fingerprint, tuple(texts), vectors)
            self._publish()

    def remove(self, name: str) -> bool:
        """Drop a capability; returns whether it was indexed."""
        with self._lock:
            found = self._drop(name)
            if found:
                self._publish()
            return found

    def sync(self, catalog: Catalog, embedder: CachedEmbedder, progress: Progress | None = None) -> SyncReport:
        """Bring the index in line with ``catalog``, touching only what changed (by fingerprint).

        Added and changed capabilities are embedded (through the cache) in one batch and
        re-inserted; removed ones are dropped; the rest is left alone. Capability order
        becomes the catalog's. Readers see the old state until the new one is complete.
        """
        if embedder.dim != self.dim:
            raise ValueError(f"the embedder makes {embedder.dim}-d vectors, this index holds {self.dim}-d ones")
        with self._lock:
            wanted = {c.name: c for c in catalog if c.triggers}
            removed = tuple(n for n in self._blocks if n not in wanted)
            added = tuple(n for n in wanted if n not in self._blocks)
            changed = tuple(n for n in wanted if n in self._blocks and self._blocks[n].fingerprint
                            != wanted[n].fingerprint)
            unchanged = tuple(n for n in wanted if n in self._blocks and n not in changed)
            texts = [t for n in (*added, *changed) for t in wanted[n].triggers]
            vectors, embedded, cached = embedder.embed(texts, progress)
            for name in removed:
                self._drop(name)
            offset = 0
            for name in (*added, *changed):
                count = len(wanted[name].triggers)
                self._put(name, wanted[name].fingerprint, wanted[name].triggers, vectors[offset:offset + count])
                offset += count
            self._blocks = {n: self._blocks[n] for n in wanted}
            self._publish()
        return SyncReport(added, removed, changed, unchanged, embedded, cached)

    def _put(self, name: str, fingerprint: str, texts: tuple[str, ...], vectors: npt.ArrayLike) -> None:
        array = np.asarray(vectors, dtype=np.float32)
        if array.ndim != 2 or array.shape != (len(texts), self.dim):
            raise ValueError(f"{name}: expected vectors of shape ({len(texts)}, {self.dim}), got {array.shape}")
        if not texts:
            self._drop(name)
            return
        array = l2_normalize(array)
        old = self._blocks.get(name)
        if old is not None:
            self._dead += old.count
        count = len(texts)
        self._reserve(count, replacing=name if old is not None else None)
        start = self._used
        self._matrix[start:start + count] = array  # rows no published snapshot covers
        self._used += count
        self._blocks[name] = _Block(name, fingerprint, texts, start, count)

    def _drop(self, name: str) -> bool:
        block = self._blocks.pop(name, None)
        if block is None:
            return False
        self._dead += block.count
        return True

    def _reserve(self, count: int, replacing: str | None = None) -> None:
        """Make room for ``count`` more rows; ``replacing`` names a block already counted dead."""
        capacity = self._matrix.shape[0]
        if self._used + count <= capacity:
            return
        live = self._used - self._dead
        if self._dead > live:
            self._compact(count, replacing)
            return
        grown = np.empty((max(2 * capacity, self._used + count, 64), self.dim), dtype=np.float32)
        grown[: self._used] = self._matrix[: self._used]
        self._matrix = grown

    def _compact(self, extra: int = 0, replacing: str | None = None) -> None:
        """Copy the live blocks into a new array, in capability order; old snapshots keep the old one.

        ``replacing`` is a block being rewritten (its rows already counted dead): it is not
        copied, and its entry keeps its place in the order for the caller to overwrite.
        """
        live = self._used - self._dead
        fresh = np.empty((max(64, (live + extra) * 3 // 2), self.dim), dtype=np.float32)
        cursor = 0
        for name, block in list(self._blocks.items()):
            if name == replacing:
                continue
            fresh[cursor:cursor + block.count] = self._matrix[block.start:block.start + block.count]
            self._blocks[name] = _Block(block.name, block.fingerprint, block.texts, cursor, block.count)
            cursor += block.count
        self._matrix, self._used, self._dead = fresh, cursor, 0

    def _publish(self) -> None:
        if self._dead > max(COMPACT_MIN_DEAD, self._used - self._dead):
            self._compact()
        self._snap = _Snapshot(self._matrix, self._used, tuple(self._blocks.values()))

    # -- reading (lock-free: one snapshot per call) -------------------------------------------

    def fingerprint_of(self, name: str) -> str | None:
        snap = self._snap
        index = snap.position.get(name)
        return snap.blocks[index].fingerprint if index is not None else None

    @property
    def names(self) -> tuple[str, ...]:
        """Indexed capabilities, in catalog order after a sync (score columns follow it)."""
        return self._snap.names

    @property
    def capability_count(self) -> int:
        return len(self._snap.blocks)

    @property
    def trigger_count(self) -> int:
        return int(self._snap.counts.sum())

    def triggers(self, name: str) -> tuple[str, ...]:
        snap = self._snap
        if name not in snap.position:
            raise UnknownCapability(name)
        return snap.blocks[snap.position[name]].texts

    def similarities(self, queries: npt.ArrayLike) -> tuple[npt.NDArray[np.float32], Ints]:
        """Raw cosines ``[q, n_triggers]`` (triggers grouped by capability, in ``names`` order)
        and, per column, the index of its capability in ``names``."""
        snap = self._snap
        sims = _queries(queries, self.dim) @ snap.matrix[snap.live_rows].T
        return np.asarray(sims, dtype=np.float32), snap.row_capability

    def capability_scores(self, queries: npt.ArrayLike, k: int) -> npt.NDArray[np.float32]:
        """Exact mean of the top-k trigger cosines of every capability: ``[q, len(names)]``."""
        if k < 1:
            raise ValueError("k must be at least 1")
        return self._snap.all_scores(_queries(queries, self.dim), k)

    def top_capabilities(self, query: npt.ArrayLike, k: int, n: int) -> list[tuple[str, float]]:
        """The n best capabilities by exact mean-of-top-k, best first (ties: capability order)."""
        if k < 1:
            raise ValueError("k must be at least 1")
        snap = self._snap
        n = min(n, len(snap.blocks))
        if n <= 0:
            return []
        q = _queries(query, self.dim)[0]
        if snap.n_rows <= SMALL_ROWS:
            bounds, lengths, segment_of = snap.segments
            sims = _dot(snap.rows, q)[None, :]
            return self._ranked(snap, segment_topk_mean(sims, bounds, lengths, k)[0][segment_of], n)
        which, scores = snap.top_by_triggers(q, k, n)
        best = _best(scores, which, n)
        lookup = dict(zip(which.tolist(), scores.tolist(), strict=True))
        return [(snap.names[i], float(lookup[i])) for i in best.tolist()]

    @staticmethod
    def _ranked(snap: _Snapshot, scores: npt.NDArray[np.float32], n: int) -> list[tuple[str, float]]:
        best = _best(scores, np.arange(len(scores), dtype=np.int64), n)
        return [(snap.names[i], float(scores[i])) for i in best.tolist()]

    def top_triggers(self, query: npt.ArrayLike, name: str, k: int) -> list[tuple[str, float]]:
        """A capability's k closest triggers with their cosines, best first (for explanations)."""
        snap = self._snap
        if name not in snap.position:
            raise UnknownCapability(name)
        block = snap.blocks[snap.position[name]]
        sims = _dot(snap.matrix[block.start:block.start + block.count], _queries(query, self.dim)[0])
        order = np.argsort(-sims, kind="stable")[:k]
        return [(block.texts[i], float(sims[i])) for i in order.tolist()]

    def examples(self) -> tuple[tuple[str, ...], Vectors, Ints]:
        """From one snapshot: the names, every live trigger vector, and each vector's position in names."""
        snap = self._snap
        return snap.names, snap.matrix[snap.live_rows], snap.row_capability

    def named_scores(self, queries: npt.ArrayLike, k: int) -> tuple[tuple[str, ...], npt.NDArray[np.float32]]:
        """:meth:`capability_scores` with the names its columns follow, read from one snapshot."""
        if k < 1:
            raise ValueError("k must be at least 1")
        snap = self._snap
        q = _queries(queries, self.dim)
        if len(q) == 1 and snap.blocks:  # one query: one thread, as in top_capabilities
            bounds, lengths, segment_of = snap.segments
            sims = _dot(snap.rows, q[0])[None, :]
            return snap.names, np.asarray(segment_topk_mean(sims, bounds, lengths, k)[:, segment_of],
                                          dtype=np.float32)
        return snap.names, snap.all_scores(q, k)
