"""An encoder in front of the vector cache (:mod:`capd.vectorcache`).

:class:`CachedEmbedder` embeds only the texts whose content hashes the cache lacks, each distinct
text once, in batches it can stop between (capd is stopping), and stores what it embedded. While
the index is built it can keep the token vectors of what it embeds (:class:`TokenSink`), which the
fused rule's second stage needs for the same texts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from capd.encoder import Encoder, Vectors, check_finite
from capd.errors import CacheError, Stopping
from capd.vectorcache import LOOKUP_SLICE, VectorCache, text_hash

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # progress(done, total) over the texts to embed


class TokenSink:
    """Token vectors by text, kept while an embedder embeds (:meth:`CachedEmbedder.keeping_tokens`).

    Up to ``limit`` token rows: past it the sink empties itself and takes no more (a catalog
    over the second stage's budget has no use for any of them, and they would only hold memory)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.matrices: dict[str, Vectors] = {}
        self.rows = 0
        self.open = limit > 0  # a sink of 0 rows keeps nothing: the embedder embeds as usual

    def add(self, texts: Sequence[str], matrices: Sequence[Vectors]) -> None:
        for text, matrix in zip(texts, matrices, strict=True):
            self.matrices[text] = matrix
            self.rows += len(matrix)
        if self.rows > self.limit:
            self.matrices.clear()
            self.open = False


class CachedEmbedder:
    """An encoder behind the cache: only missing hashes are embedded, each distinct text once."""

    def __init__(self, encoder: Encoder, cache: VectorCache, batch_size: int = 64,
                 stopping: threading.Event | None = None) -> None:
        self.encoder = encoder
        self.cache = cache
        self.batch_size = batch_size
        # Set when capd stops: embed() raises Stopping before its next batch (what is embedded so far
        # is cached). A SIGTERM during the reload of an edited 1,140-capability tap waited 26-30 s for
        # every batch, past the daemon's 10 s grace.
        self.stopping = stopping
        self._tokens: TokenSink | None = None

    @contextlib.contextmanager
    def keeping_tokens(self, limit: int) -> Iterator[TokenSink]:
        """Within the block, the texts this embedder has to embed are embedded with their token
        vectors (one forward pass: :meth:`Encoder.embed_tokens` pools the vectors from the same
        states, so the cached vectors are the same) and those are kept in the sink yielded: the
        fused rule's second stage needs them for the same texts, and embedding them again doubled a
        cold start's model time. Texts served from the cache have none to keep."""
        sink = TokenSink(limit)
        self._tokens = sink
        try:
            yield sink
        finally:
            self._tokens = None

    @property
    def model_id(self) -> str:
        return self.encoder.model_id

    @property
    def dim(self) -> int:
        return self.encoder.dim

    def embed(self, texts: Sequence[str], progress: Progress | None = None) -> tuple[Vectors, int, int]:
        """``(vectors [len(texts), dim], embedded, cached)``.

        ``embedded`` counts distinct texts this call had to embed, ``cached`` distinct texts
        served from the cache; together they are the number of distinct texts. ``progress``
        is called as ``progress(done, total)`` over the texts to embed, starting at (0, total).
        """
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of texts, not one string")
        distinct = list(dict.fromkeys(texts))
        hashes = {t: text_hash(t) for t in distinct}
        row_of = {t: i for i, t in enumerate(distinct)}
        unique = np.zeros((len(distinct), self.dim), dtype=np.float32)
        missing: list[str] = []
        readable = True
        # Read in slices, copying each straight into ``unique``: holding one small array per text for a
        # whole large catalog (90k triggers: ~150 MB) left that much heap that glibc never gave back.
        for start in range(0, len(distinct), LOOKUP_SLICE):
            chunk = distinct[start:start + LOOKUP_SLICE]
            found: dict[str, Vectors] = {}
            if readable:
                try:
                    found = self.cache.get_many(self.model_id, [hashes[t] for t in chunk])
                except CacheError as exc:
                    log.warning("vector cache read failed (%s); embedding everything", exc)
                    readable = False
            for text in chunk:
                vector = found.get(hashes[text])  # a non-finite row is not found: get_many leaves it out
                if vector is not None and vector.shape[0] == self.dim:
                    unique[row_of[text]] = vector
                else:
                    missing.append(text)
        if progress:
            progress(0, len(missing))
        for start in range(0, len(missing), self.batch_size):
            if self.stopping is not None and self.stopping.is_set():
                raise Stopping("capd is stopping")
            chunk = missing[start:start + self.batch_size]
            sink = self._tokens
            if sink is not None and sink.open:
                embedded, matrices = self.encoder.embed_tokens(chunk)
                sink.add(chunk, matrices)
            else:
                embedded = self.encoder.embed(chunk)
            # Encoders raise on NaN themselves; this guards any other Encoder before it reaches the cache.
            check_finite(self.model_id, np.asarray(embedded), [], "nothing was cached")
            self._store([(hashes[t], v) for t, v in zip(chunk, embedded, strict=True)])
            unique[[row_of[t] for t in chunk]] = embedded
            if progress:
                progress(start + len(chunk), len(missing))
        if len(distinct) == len(texts):
            return unique, len(missing), len(distinct) - len(missing)
        out = unique[np.fromiter((row_of[t] for t in texts), dtype=np.int64, count=len(texts))]
        return out, len(missing), len(distinct) - len(missing)

    def _store(self, items: list[tuple[str, Vectors]]) -> None:
        try:
            self.cache.put_many(self.model_id, items)
        except CacheError as exc:  # the vectors are still good; only the next start pays for them
            log.warning("vector cache write failed (%s); continuing without caching", exc)
