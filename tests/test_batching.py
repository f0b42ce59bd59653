"""Micro-batching: concurrent calls coalesce; a lone call is not held back."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from capd.batching import MicroBatcher, aembed
from capd.encoder import Encoder, HashEncoder, Vectors
from capd.errors import ModelError


class SlowEncoder(HashEncoder):
    """The hash fake with a fixed model time per call; records batches and time spent inside."""

    def __init__(self, seconds: float = 0.02, fail_on: str | None = None) -> None:
        super().__init__(dim=32)
        self.seconds = seconds
        self.fail_on = fail_on
        self.batches: list[list[str]] = []
        self.inside: list[float] = []

    def embed(self, texts: Sequence[str]) -> Vectors:
        started = time.perf_counter()
        self.batches.append(list(texts))
        time.sleep(self.seconds)
        if self.fail_on is not None and self.fail_on in texts:
            raise RuntimeError("model exploded")
        result = super().embed(texts)
        self.inside.append(time.perf_counter() - started)
        return result


def run_concurrently(batcher: MicroBatcher, requests: list[list[str]]) -> list[Vectors]:
    results: list[Vectors | None] = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def call(i: int) -> None:
        barrier.wait()
        results[i] = batcher.embed(requests[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def test_concurrent_calls_coalesce_into_few_model_calls() -> None:
    encoder = SlowEncoder()
    requests = [[f"message number {i}"] for i in range(16)] + [["two texts", "in one request"]]
    with MicroBatcher(encoder, max_batch=32) as batcher:
        results = run_concurrently(batcher, requests)
        assert batcher.model_id == encoder.model_id and batcher.dim == 32
        assert batcher.requests == len(requests)
    assert len(encoder.batches) <= 4  # 17 requests; one-at-a-time would take 17 calls
    assert max(len(b) for b in encoder.batches) > 1
    for request, result in zip(requests, results, strict=True):
        np.testing.assert_array_equal(result, HashEncoder(dim=32).embed(request))


def test_batches_are_bounded() -> None:
    encoder = SlowEncoder(seconds=0.01)
    requests = [[f"text {i}-{j}" for j in range(3)] for i in range(20)] + [[f"big {j}" for j in range(10)]]
    with MicroBatcher(encoder, max_batch=8) as batcher:
        run_concurrently(batcher, requests)
        huge = [f"huge {j}" for j in range(20)]
        np.testing.assert_array_equal(batcher.embed(huge), HashEncoder(dim=32).embed(huge))
    assert all(len(b) <= 8 for b in encoder.batches)  # a request larger than a batch is run in chunks
    assert all(all(t.startswith("big") for t in b) or not any(t.startswith("big") for t in b) for b in encoder.batches)
    assert sorted(t for b in encoder.batches for t in b) == sorted([t for r in requests for t in r] + huge)


def test_bulk_work_yields_to_a_single_request() -> None:
    """A route that arrives while a reload embeds many texts waits for one chunk, not for all of
    them; the bulk caller still gets every vector in its own order."""
    encoder = SlowEncoder(seconds=0.02)
    texts = [f"example {'x' * (j % 7)} {j}" for j in range(20)]
    with MicroBatcher(encoder, max_batch=4) as batcher:
        bulk = batcher.submit(texts)
        time.sleep(0.005)  # the worker is inside the first chunk (or about to start it)
        single = batcher.embed(["route this message"])
        vectors = bulk.result()[0]
    position = encoder.batches.index(["route this message"])
    assert position <= 1 < len(encoder.batches) - 1  # ahead of the remaining chunks
    assert len(encoder.batches) == 6 and all(len(b) <= 4 for b in encoder.batches)
    np.testing.assert_array_equal(vectors, HashEncoder(dim=32).embed(texts))
    np.testing.assert_array_equal(single, HashEncoder(dim=32).embed(["route this message"]))


def test_bulk_token_vectors_come_back_in_order() -> None:
    texts = [f"{'long ' * (j % 5)}text number {j}" for j in range(11)]
    with MicroBatcher(SlowEncoder(seconds=0.0), max_batch=4) as batcher:
        vectors, tokens = batcher.embed_tokens(texts)
    want_vectors, want_tokens = HashEncoder(dim=32).embed_tokens(texts)
    np.testing.assert_array_equal(vectors, want_vectors)
    assert len(tokens) == len(texts)
    for got, want in zip(tokens, want_tokens, strict=True):
        np.testing.assert_array_equal(got, want)


def test_bulk_work_cancelled_or_failed_runs_no_further_chunk() -> None:
    encoder = SlowEncoder(seconds=0.02, fail_on="bad 5")
    with MicroBatcher(encoder, max_batch=4) as batcher:
        blocker = batcher.submit(["keeps the model busy"])
        time.sleep(0.005)
        dropped = batcher.submit([f"dropped {j}" for j in range(12)])
        assert dropped.cancel()  # before its first chunk ran
        failing = batcher.submit([f"bad {j}" for j in range(12)])  # "bad 5" is in the second chunk
        blocker.result()
        with pytest.raises(RuntimeError, match="model exploded"):
            failing.result()
        assert batcher.embed(["still works"]).shape == (1, 32)
    sent = [t for b in encoder.batches for t in b]
    assert not any(t.startswith("dropped") for t in sent)
    assert sum(t.startswith("bad") for t in sent) == 8  # the chunk after the failing one never ran


def test_a_lone_request_is_not_delayed() -> None:
    encoder = SlowEncoder(seconds=0.003)
    with MicroBatcher(encoder) as batcher:
        batcher.embed(["warm up"])
        overheads = []
        for i in range(40):
            started = time.perf_counter()
            batcher.embed([f"lone {i}"])
            overheads.append(time.perf_counter() - started - encoder.inside[-1])
    assert statistics.median(overheads) < 0.002
    assert len(encoder.batches) == 41  # nobody to wait for: one call each


def test_wait_under_load_is_bounded() -> None:
    encoder = SlowEncoder(seconds=0.01)
    with MicroBatcher(encoder, max_wait_s=0.002) as batcher:
        run_concurrently(batcher, [[f"burst {i}"] for i in range(8)])  # leaves the batcher in "busy" mode
        started = time.perf_counter()
        batcher.embed(["alone after the burst"])
        elapsed = time.perf_counter() - started - encoder.inside[-1]
    assert elapsed < 0.002 + 0.008  # at most the bounded wait plus scheduling slack


def test_errors_reach_every_caller_of_the_batch_and_the_batcher_survives() -> None:
    encoder = SlowEncoder(seconds=0.02, fail_on="boom")
    with MicroBatcher(encoder) as batcher:
        errors: list[BaseException] = []

        def call(texts: list[str]) -> None:
            try:
                batcher.embed(texts)
            except RuntimeError as exc:
                errors.append(exc)

        blocker = threading.Thread(target=call, args=(["first"],))
        blocker.start()
        time.sleep(0.005)  # the model is busy with "first": the next two queue up together
        threads = [threading.Thread(target=call, args=(t,)) for t in (["boom"], ["innocent bystander"])]
        for thread in threads:
            thread.start()
        for thread in [blocker, *threads]:
            thread.join()
        assert len(errors) == 2 and all("model exploded" in str(e) for e in errors)
        assert batcher.embed(["still works"]).shape == (1, 32)


def test_empty_input_and_close() -> None:
    encoder = SlowEncoder(seconds=0.0)
    batcher = MicroBatcher(encoder)
    assert batcher.embed([]).shape == (0, 32) and encoder.batches == []
    future = batcher.submit(["queued before close"])
    batcher.close()
    assert future.result()[0].shape == (1, 32)  # queued work finishes
    with pytest.raises(ModelError):
        batcher.embed(["after close"])
    batcher.close()  # idempotent


def test_aembed_coalesces_in_an_event_loop() -> None:
    encoder = SlowEncoder(seconds=0.02)

    async def main(batcher: MicroBatcher) -> list[Vectors]:
        return await asyncio.gather(*(batcher.aembed([f"async {i}"]) for i in range(10)))

    with MicroBatcher(encoder) as batcher:
        results = asyncio.run(main(batcher))
    assert len(results) == 10 and len(encoder.batches) <= 3


def test_real_model_vectors_are_unchanged_by_batching(real_encoder: Encoder) -> None:
    texts = [f"please deploy service number {i} to the {'staging' if i % 2 else 'production'} cluster" * (1 + i % 3)
             for i in range(12)]
    with MicroBatcher(real_encoder) as batcher:
        batched = np.vstack(run_concurrently(batcher, [[t] for t in texts]))
        assert batcher.calls < len(texts)
    alone = np.vstack([real_encoder.embed([t]) for t in texts])
    assert float(np.min(np.sum(batched * alone, axis=1))) >= 0.9999


def test_a_cancelled_aembed_does_not_stop_the_worker() -> None:
    """A request whose awaiting task is cancelled while it waits behind a model call is
    skipped; the worker lives on and serves the next caller."""
    encoder = SlowEncoder(seconds=0.05)

    async def main(batcher: MicroBatcher) -> Vectors:
        busy = asyncio.ensure_future(batcher.aembed(["keeps the model busy"]))
        await asyncio.sleep(0.01)  # the worker is inside the model call now
        waiting = asyncio.ensure_future(batcher.aembed(["given up on"]))
        await asyncio.sleep(0)
        waiting.cancel()
        await busy
        return await batcher.aembed(["after the cancellation"])

    with MicroBatcher(encoder) as batcher:
        vectors = asyncio.run(main(batcher))
        assert batcher.embed(["and a blocking call"]).shape == (1, 32)
    assert vectors.shape == (1, 32)
    assert ["given up on"] not in encoder.batches


def test_aembed_helper_takes_any_encoder() -> None:
    plain = HashEncoder(dim=32)
    vectors = asyncio.run(aembed(plain, ["a plain encoder runs in a worker thread"]))
    assert np.array_equal(vectors, plain.embed(["a plain encoder runs in a worker thread"]))


def test_token_requests_share_a_batch_with_plain_ones() -> None:
    """A batch that holds one token request makes one model call; each caller gets what it asked for."""
    encoder = SlowEncoder(seconds=0.05)
    with MicroBatcher(encoder) as batcher:
        busy = batcher.submit(["keeps the model busy"])
        time.sleep(0.01)
        plain = batcher.submit(["plain request"])
        with_tokens = batcher.submit(["two words", "three short words"], tokens=True)
        busy.result()
        (vectors, tokens), (plain_vectors, plain_tokens) = with_tokens.result(), plain.result()
    assert encoder.batches[-1] == ["plain request", "two words", "three short words"]
    assert plain_vectors.shape == (1, 32) and plain_tokens == []
    assert vectors.shape == (2, 32) and [t.shape for t in tokens] == [(2, 32), (3, 32)]
    np.testing.assert_allclose(vectors, encoder.embed(["two words", "three short words"]))
    np.testing.assert_allclose(np.linalg.norm(tokens[1], axis=1), 1.0, rtol=1e-5)
