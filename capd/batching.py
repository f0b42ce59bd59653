"""Micro-batching: concurrent embed calls share one model call.

:class:`MicroBatcher` wraps an :class:`~capd.encoder.Encoder` and is one itself. A single
worker thread owns the model. Policy:

- a request that finds the worker idle and nothing recently busy runs at once, alone:
  a lone caller pays only a thread hand-off, never a fixed wait;
- requests that arrive while the model is busy queue up and go together in the next call
  (at most ``max_batch`` texts);
- under concurrent load (the previous call carried more than one request) the worker
  waits for more requests, but never past ``max_wait_s`` (2 ms) after the oldest one arrived;
- a request larger than ``max_batch`` (a reload embedding new examples, the abstain corpus,
  a tuned model re-embedding a tap) is bulk work: it is sorted by length and run as chunks of
  ``max_batch`` (the batches the ONNX encoder would have made of it anyway), and single
  requests queued before a chunk starts go first. A route that arrives during a reload waits
  for one chunk at most, not for the whole reload's embedding (``benchmarks/bench_daemon.py``,
  routing during the edits).

A request may also ask for token vectors (:meth:`MicroBatcher.embed_tokens`); a batch holding
one such request makes the one model call that returns both.

Results are handed back through futures, so :meth:`MicroBatcher.aembed` awaits without
blocking an event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from capd.encoder import Embedded, Encoder, TokenVectors, Vectors
from capd.errors import ModelError

log = logging.getLogger(__name__)


@dataclass
class _Request:
    texts: list[str]
    tokens: bool = False
    future: Future[Embedded] = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Bulk:
    """A request larger than a batch, run as chunks; it resolves ``future`` when the last one has run."""

    size: int
    tokens: bool
    future: Future[Embedded] = field(default_factory=Future)
    vectors: Vectors | None = None
    rows: TokenVectors = field(default_factory=list)
    pending: int = 0
    started: bool = False


@dataclass(eq=False)
class _Chunk:
    """Up to ``max_batch`` texts of a :class:`_Bulk`, and their positions in it."""

    bulk: _Bulk
    positions: list[int]
    texts: list[str]


_STOP = object()
_SINGLE, _BULK, _LAST = 0, 1, 2  # queue priorities: single requests first, then bulk chunks, then the stop marker


class MicroBatcher:
    """An :class:`Encoder` that coalesces concurrent calls into bounded model batches."""

    def __init__(self, encoder: Encoder, max_batch: int = 32, max_wait_s: float = 0.002) -> None:
        if max_batch < 1 or max_wait_s < 0:
            raise ValueError("max_batch must be at least 1 and max_wait_s not negative")
        self.encoder = encoder
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.calls = 0  # model calls made
        self.requests = 0  # embed requests served
        self._queue: queue.PriorityQueue[tuple[int, int, _Request | _Chunk | object]] = queue.PriorityQueue()
        self._order = itertools.count()  # first in, first out within a priority
        self._front = itertools.count(1)  # an item put back goes ahead of its priority's queue
        self._closed = False
        self._gate = threading.Lock()
        self._busy = False
        self._worker = threading.Thread(target=self._run, name="capd-microbatcher", daemon=True)
        self._worker.start()

    @property
    def model_id(self) -> str:
        return self.encoder.model_id

    @property
    def dim(self) -> int:
        return self.encoder.dim

    def submit(self, texts: Sequence[str], tokens: bool = False) -> Future[Embedded]:
        """Queue texts for embedding; the future resolves to their vectors and (with ``tokens``)
        their token vectors, else an empty list in their place."""
        if isinstance(texts, str):
            raise TypeError("embed() takes a sequence of texts, not one string")
        texts = list(texts)
        if len(texts) > self.max_batch:
            return self._submit_bulk(texts, tokens)
        request = _Request(texts, tokens)
        with self._gate:  # nothing is queued behind the stop marker
            if self._closed:
                raise ModelError("the encoder has been closed")
            if request.texts:
                self._put(_SINGLE, request)
        if not request.texts:
            request.future.set_result((np.zeros((0, self.dim), dtype=np.float32), []))
        return request.future

    def _submit_bulk(self, texts: list[str], tokens: bool) -> Future[Embedded]:
        bulk = _Bulk(len(texts), tokens)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths pad less
        chunks = [order[start:start + self.max_batch] for start in range(0, len(order), self.max_batch)]
        bulk.pending = len(chunks)
        with self._gate:
            if self._closed:
                raise ModelError("the encoder has been closed")
            for positions in chunks:
                self._put(_BULK, _Chunk(bulk, positions, [texts[i] for i in positions]))
        return bulk.future

    def _put(self, priority: int, item: _Request | _Chunk | object) -> None:
        self._queue.put((priority, next(self._order), item))

    def embed(self, texts: Sequence[str]) -> Vectors:
        return self.submit(texts).result()[0]

    def embed_tokens(self, texts: Sequence[str]) -> Embedded:
        return self.submit(texts, tokens=True).result()

    async def aembed(self, texts: Sequence[str]) -> Vectors:
        return (await asyncio.wrap_future(self.submit(texts)))[0]

    async def aembed_tokens(self, texts: Sequence[str]) -> Embedded:
        return await asyncio.wrap_future(self.submit(texts, tokens=True))

    def close(self) -> None:
        """Finish queued work, stop the worker; later calls raise :class:`ModelError`."""
        with self._gate:
            if self._closed:
                return
            self._closed = True
            self._put(_LAST, _STOP)
        self._worker.join()

    def __enter__(self) -> MicroBatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- worker ----------------------------------------------------------------------------

    def _next(self, timeout: float | None) -> _Request | _Chunk | object | None:
        """The next queued item, waiting up to ``timeout`` seconds (None: for ever), or None."""
        try:
            entry = self._queue.get(timeout=timeout) if timeout is None or timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        return entry[2]

    def _collect(self, first: _Request) -> list[_Request]:
        """The batch led by ``first``: single requests that fit beside it. Anything else goes back
        to the queue with its place, so it leads a later call."""
        batch, size = [first], len(first.texts)
        while size < self.max_batch:
            wait = first.arrived + self.max_wait_s - time.monotonic() if self._busy else 0.0
            item = self._next(max(wait, 0.0))
            if item is None:
                break
            if not isinstance(item, _Request) or size + len(item.texts) > self.max_batch:
                self._requeue(item)
                break
            batch.append(item)
            size += len(item.texts)
        return batch

    def _requeue(self, item: _Request | _Chunk | object) -> None:
        priority = _SINGLE if isinstance(item, _Request) else _BULK if isinstance(item, _Chunk) else _LAST
        self._queue.put((priority, -next(self._front), item))

    def _run(self) -> None:
        while True:
            item = self._next(None)
            if item is _STOP:  # queued last: everything submitted before close() has run
                return
            if isinstance(item, _Chunk):
                self._execute_chunk(item)
            elif isinstance(item, _Request):
                self._execute(self._collect(item))

    def _execute(self, batch: list[_Request]) -> None:
        # A caller that gave up (an ``aembed`` whose task was cancelled cancels its future) is
        # skipped; the others' futures are marked running, so they can no longer be cancelled and
        # setting their results below cannot fail and stop the worker.
        batch = [request for request in batch if request.future.set_running_or_notify_cancel()]
        if not batch:
            return
        texts = [t for request in batch for t in request.texts]
        tokens: TokenVectors = []
        try:
            if any(request.tokens for request in batch):
                vectors, tokens = self.encoder.embed_tokens(texts)
            else:
                vectors = self.encoder.embed(texts)
        except BaseException as exc:  # every caller of this batch gets the model's error
            for request in batch:
                request.future.set_exception(exc)
            return
        finally:
            self.calls += 1
            self.requests += len(batch)
            self._busy = len(batch) > 1
        offset = 0
        for request in batch:
            end = offset + len(request.texts)
            request.future.set_result((vectors[offset:end], tokens[offset:end] if request.tokens else []))
            offset = end

    def _execute_chunk(self, chunk: _Chunk) -> None:
        """One model call for a chunk of bulk work; the last one resolves the bulk future. Once the
        future is cancelled (before its first chunk ran) or failed, its other chunks are skipped."""
        bulk = chunk.bulk
        if not bulk.started:
            bulk.started = True
            if not bulk.future.set_running_or_notify_cancel():
                return
        if bulk.future.done():
            return
        try:
            if bulk.tokens:
                vectors, tokens = self.encoder.embed_tokens(chunk.texts)
            else:
                vectors, tokens = self.encoder.embed(chunk.texts), []
        except BaseException as exc:
            bulk.future.set_exception(exc)
            return
        finally:
            self.calls += 1
            self._busy = False
        if bulk.vectors is None:
            bulk.vectors = np.empty((bulk.size, vectors.shape[1]), dtype=vectors.dtype)
            bulk.rows = [vectors[:0]] * bulk.size if bulk.tokens else []
        bulk.vectors[chunk.positions] = vectors
        if bulk.tokens:
            for position, matrix in zip(chunk.positions, tokens, strict=True):
                bulk.rows[position] = matrix
        bulk.pending -= 1
        if bulk.pending == 0:
            self.requests += 1
            bulk.future.set_result((bulk.vectors, bulk.rows))


async def aembed(encoder: Encoder, texts: Sequence[str]) -> Vectors:
    """Embed from an event loop without blocking it: a :class:`MicroBatcher` hands back a future;
    any other encoder runs in a worker thread."""
    if isinstance(encoder, MicroBatcher):
        return await encoder.aembed(texts)
    return await asyncio.to_thread(encoder.embed, texts)


async def aembed_tokens(encoder: Encoder, texts: Sequence[str]) -> Embedded:
    """:func:`aembed` with token vectors (:meth:`Encoder.embed_tokens`)."""
    if isinstance(encoder, MicroBatcher):
        return await encoder.aembed_tokens(texts)
    return await asyncio.to_thread(encoder.embed_tokens, texts)
