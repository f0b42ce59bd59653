"""Micro-batching: concurrent embed calls share one model call.

:class:`MicroBatcher` wraps an :class:`~capd.encoder.Encoder` and is one itself. A single
worker thread owns the model. Policy:

- a request that finds the worker idle and nothing recently busy runs at once, alone:
  a lone caller pays only a thread hand-off, never a fixed wait;
- requests that arrive while the model is busy queue up and go together in the next call
  (at most ``max_batch`` texts; a larger request runs alone);
- under concurrent load (the previous call carried more than one request) the worker
  waits for more requests, but never past ``max_wait_s`` (2 ms) after the oldest one arrived.

A request may also ask for token vectors (:meth:`MicroBatcher.embed_tokens`); a batch holding
one such request makes the one model call that returns both.

Results are handed back through futures, so :meth:`MicroBatcher.aembed` awaits without
blocking an event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
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


_STOP = object()


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
        self._queue: queue.SimpleQueue[_Request | object] = queue.SimpleQueue()
        self._held: deque[_Request] = deque()
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
        request = _Request(list(texts), tokens)
        with self._gate:  # nothing is queued behind the stop marker
            if self._closed:
                raise ModelError("the encoder has been closed")
            if request.texts:
                self._queue.put(request)
        if not request.texts:
            request.future.set_result((np.zeros((0, self.dim), dtype=np.float32), []))
        return request.future

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
            self._queue.put(_STOP)
        self._worker.join()

    def __enter__(self) -> MicroBatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- worker ----------------------------------------------------------------------------

    def _next(self, timeout: float | None) -> _Request | object | None:
        if self._held:
            return self._held.popleft()
        try:
            return self._queue.get(timeout=timeout) if timeout is None or timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def _collect(self, first: _Request) -> tuple[list[_Request], bool]:
        """The batch led by ``first``; also whether a stop request was seen."""
        batch, size = [first], len(first.texts)
        while size < self.max_batch:
            wait = first.arrived + self.max_wait_s - time.monotonic() if self._busy else 0.0
            item = self._next(max(wait, 0.0))
            if item is None:
                break
            if item is _STOP:
                return batch, True
            assert isinstance(item, _Request)
            if size + len(item.texts) > self.max_batch:
                self._held.append(item)  # leads the next batch
                break
            batch.append(item)
            size += len(item.texts)
        return batch, False

    def _run(self) -> None:
        stopping = False
        while True:
            item = self._next(None) if not stopping else self._next(0.0)
            if item is None or item is _STOP:
                if item is _STOP:
                    stopping = True
                    continue
                return
            assert isinstance(item, _Request)
            batch, saw_stop = self._collect(item)
            stopping = stopping or saw_stop
            self._execute(batch)

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
