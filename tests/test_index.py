"""The trigger index against a brute-force numpy reference, incremental sync, concurrency."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest

import capd.index as index_module
from capd.catalog import Capability, Catalog, fingerprint
from capd.embedder import CachedEmbedder
from capd.encoder import HashEncoder, Vectors
from capd.errors import UnknownCapability
from capd.index import TriggerIndex, segment_topk_mean
from capd.vectorcache import VectorCache


def reference_scores(caps: Mapping[str, np.ndarray], names: Sequence[str], queries: np.ndarray, k: int) -> np.ndarray:
    """Mean of the top-k cosines per capability, in float64, the slow obvious way."""
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    out = np.zeros((len(q), len(names)))
    for j, name in enumerate(names):
        vectors = caps[name].astype(np.float64)
        sims = q @ (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).T
        take = min(k, len(vectors))
        out[:, j] = np.sort(sims, axis=1)[:, -take:].mean(axis=1)
    return out


def reference_top(caps: Mapping[str, np.ndarray], names: Sequence[str], query: np.ndarray, k: int,
                  n: int) -> list[tuple[str, float]]:
    scores = reference_scores(caps, names, query[None, :], k)[0]
    order = np.argsort(-scores, kind="stable")[:n]
    return [(names[i], float(scores[i])) for i in order]


def assert_same_ranking(got: list[tuple[str, float]], want: list[tuple[str, float]]) -> None:
    assert len(got) == len(want)
    np.testing.assert_allclose([s for _, s in got], [s for _, s in want], atol=2e-6)
    for position, ((name, _), (expected, score)) in enumerate(zip(got, want, strict=True)):
        neighbours = [s for _, s in want[max(0, position - 1):position + 2]]
        if name != expected:  # only a float tie may reorder
            assert sum(abs(s - score) < 2e-6 for s in neighbours) > 1, (got, want)


def random_caps(rng: np.random.Generator, count: int, dim: int, prefix: str = "c") -> dict[str, np.ndarray]:
    caps = {}
    for i in range(count):
        vectors = rng.normal(size=(int(rng.integers(1, 9)), dim)).astype(np.float32)
        if i % 11 == 0 and len(vectors) > 2:
            vectors[1] = vectors[0]  # exact ties inside a capability
        caps[f"{prefix}{i}"] = vectors
    return caps


def put(index: TriggerIndex, name: str, vectors: np.ndarray, fp: str = "fp") -> None:
    index.set_capability(name, fp, [f"{name}/{i}" for i in range(len(vectors))], vectors)


def test_segment_topk_mean_handles_ties_and_short_segments() -> None:
    sims = np.array([[0.5, 0.5, 0.5, 0.1, 0.9, 0.2, 0.3, 0.3]], dtype=np.float32)
    bounds, counts = np.array([0, 4, 6]), np.array([4, 2, 2])
    got = segment_topk_mean(sims, bounds, counts, 3)
    np.testing.assert_allclose(got, [[0.5, 0.55, 0.3]], atol=1e-7)
    np.testing.assert_allclose(segment_topk_mean(sims, bounds, counts, 1), [[0.5, 0.9, 0.3]], atol=1e-7)


def test_incremental_changes_match_the_reference() -> None:
    rng = np.random.default_rng(7)
    dim = 24
    caps = random_caps(rng, 1200, dim)
    index = TriggerIndex(dim)
    for name, vectors in caps.items():
        put(index, name, vectors)
    for name in list(caps)[::3]:  # remove a third
        assert index.remove(name)
        del caps[name]
    assert not index.remove("never-there")
    for name in list(caps)[::5]:  # change some in place
        caps[name] = rng.normal(size=(int(rng.integers(1, 9)), dim)).astype(np.float32)
        put(index, name, caps[name], fp="fp2")
    for name, vectors in random_caps(rng, 150, dim, prefix="new").items():
        caps[name] = vectors
        put(index, name, vectors)
    names = index.names
    assert sorted(names) == sorted(caps) and index.capability_count == len(caps)
    assert index.trigger_count == sum(len(v) for v in caps.values())
    assert index.fingerprint_of(next(iter(caps))) in {"fp", "fp2"} and index.fingerprint_of("c0") is None
    queries = rng.normal(size=(40, dim)).astype(np.float32)
    for k in (1, 3, 5):
        np.testing.assert_allclose(index.capability_scores(queries, k), reference_scores(caps, names, queries, k),
                                   atol=2e-6)


@pytest.mark.parametrize("small_rows", [10**9, 0])  # every capability scored, then the FAISS nearest-trigger path
def test_top_capabilities_is_exact(monkeypatch: pytest.MonkeyPatch, small_rows: int) -> None:
    monkeypatch.setattr(index_module, "SMALL_ROWS", small_rows)
    rng = np.random.default_rng(11)
    dim = 32
    centres = rng.normal(size=(60, dim))
    caps = {}
    for i in range(1500):  # clustered like real taps: capabilities share topics
        centre = centres[i % 60]
        count = int(rng.integers(1, 12))
        caps[f"cap{i}"] = (centre + rng.normal(scale=1.2, size=(count, dim))).astype(np.float32)
    index = TriggerIndex(dim)
    for name, vectors in caps.items():
        put(index, name, vectors)
    for name in list(caps)[::4]:
        index.remove(name)
        del caps[name]
    names = index.names
    queries = rng.normal(size=(25, dim)).astype(np.float32)
    all_scores = reference_scores(caps, names, queries, 3)
    for query, scores in zip(queries, all_scores, strict=True):
        order = np.argsort(-scores, kind="stable")
        for n in (1, 2, 5, 40):
            want = [(names[i], float(scores[i])) for i in order[:n]]
            assert_same_ranking(index.top_capabilities(query, 3, n), want)
    far = -np.ones(dim, dtype=np.float32)  # a query far from everything still gets an exact answer
    assert_same_ranking(index.top_capabilities(far, 3, 3), reference_top(caps, names, far, 3, 3))


def test_compaction_keeps_results_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_module, "COMPACT_MIN_DEAD", 8)
    rng = np.random.default_rng(3)
    caps = random_caps(rng, 200, 16)
    index = TriggerIndex(16)
    for round_ in range(6):
        for name, vectors in caps.items():
            if rng.random() < 0.5 or round_ == 0:
                caps[name] = rng.normal(size=vectors.shape).astype(np.float32)
                put(index, name, caps[name])
    snapshot = index._snap  # white-box: compaction must have kept the matrix small
    assert snapshot.n_rows <= 2 * index.trigger_count + 64
    queries = rng.normal(size=(10, 16)).astype(np.float32)
    np.testing.assert_allclose(index.capability_scores(queries, 3),
                               reference_scores(caps, index.names, queries, 3), atol=2e-6)


@pytest.mark.parametrize(("big", "after"), [(40, 40), (50, 1), (50, 3)])
def test_replacing_a_block_that_forces_compaction(big: int, after: int) -> None:
    """A capability rewritten when its old rows outnumber the live ones: the old block is not
    copied as live, the new one lands inside the array, and capability order is kept."""
    rng = np.random.default_rng(big + after)
    caps = {"big": rng.normal(size=(big, 16)).astype(np.float32)}
    if after < big:
        caps["small"] = rng.normal(size=(14, 16)).astype(np.float32)
    index = TriggerIndex(16)
    for name, vectors in caps.items():
        put(index, name, vectors)
    for _ in range(3):  # each rewrite must leave a sound index for the next
        caps["big"] = rng.normal(size=(after, 16)).astype(np.float32)
        put(index, "big", caps["big"], fp="fp2")
        assert index.names == tuple(caps) and index.trigger_count == sum(len(v) for v in caps.values())
        queries = rng.normal(size=(5, 16)).astype(np.float32)
        np.testing.assert_allclose(index.capability_scores(queries, 3),
                                   reference_scores(caps, index.names, queries, 3), atol=2e-6)
        want = reference_top(caps, index.names, queries[0], 3, 2)
        assert_same_ranking(index.top_capabilities(queries[0], 3, 2), want)


def test_similarities_top_triggers_and_errors() -> None:
    index = TriggerIndex(3)
    index.set_capability("a", "f", ["x", "y"], np.array([[1, 0, 0], [0, 1, 0]], dtype=np.float32))
    index.set_capability("b", "f", ["z"], np.array([[0, 0, 2]], dtype=np.float32))  # normalised on insert
    sims, owners = index.similarities(np.array([[0, 0, 5], [1, 1, 0]], dtype=np.float32))
    np.testing.assert_allclose(sims, np.array([[0, 0, 1], [2 ** -0.5, 2 ** -0.5, 0]]), atol=1e-6)
    assert owners.tolist() == [0, 0, 1]
    top = index.top_triggers(np.array([0.9, 0.1, 0], dtype=np.float32), "a", 5)
    assert [t for t, _ in top] == ["x", "y"] and top[0][1] > top[1][1]
    assert index.triggers("b") == ("z",)
    with pytest.raises(UnknownCapability):
        index.top_triggers(np.ones(3, dtype=np.float32), "nope", 1)
    with pytest.raises(ValueError):
        index.set_capability("c", "f", ["one"], np.ones((2, 3), dtype=np.float32))
    with pytest.raises(ValueError):
        index.capability_scores(np.ones((1, 4), dtype=np.float32), 3)
    index.set_capability("a", "f", [], np.zeros((0, 3), dtype=np.float32))  # no triggers: not indexed
    assert index.names == ("b",)


def test_empty_index() -> None:
    index = TriggerIndex(8)
    assert index.capability_scores(np.ones((3, 8), dtype=np.float32), 3).shape == (3, 0)
    assert index.top_capabilities(np.ones(8, dtype=np.float32), 3, 5) == []
    assert index.similarities(np.ones((2, 8), dtype=np.float32))[0].shape == (2, 0)
    assert (index.capability_count, index.trigger_count, index.names) == (0, 0, ())


class CountingEncoder(HashEncoder):
    def __init__(self) -> None:
        super().__init__(dim=64)
        self.seen: list[str] = []

    def embed(self, texts: Sequence[str]) -> Vectors:
        self.seen.extend(texts)
        return super().embed(texts)


def make_catalog(spec: Mapping[str, tuple[str, ...]], tap: Path) -> Catalog:
    caps = {name: Capability(name=name, tap=tap, path=tap / "capabilities" / name, triggers=triggers,
                             fingerprint=fingerprint(name, triggers, None, (), None))
            for name, triggers in spec.items()}
    return Catalog(taps=(tap,), capabilities=MappingProxyType(caps))


def test_sync_is_incremental_by_fingerprint(tmp_path: Path) -> None:
    encoder = CountingEncoder()
    with VectorCache.open(tmp_path / "data") as cache:
        embedder = CachedEmbedder(encoder, cache)
        index = TriggerIndex(64)
        spec = {"git": ("commit my changes", "push the branch"), "db": ("query the database", "run sql"),
                "web": ("search the web",), "empty": ()}
        first = index.sync(make_catalog(spec, tmp_path), embedder)
        assert (first.added, first.removed, first.changed) == (("git", "db", "web"), (), ())
        assert (first.embedded, first.cached) == (5, 0) and index.names == ("git", "db", "web")
        start_of = {name: index._snap.blocks[index._snap.position[name]].start for name in index.names}

        encoder.seen.clear()
        spec2 = {"web": ("search the web",), "db": ("query the database", "run sql", "describe the table"),
                 "docs": ("read the docs",)}
        second = index.sync(make_catalog(spec2, tmp_path), embedder)
        assert (second.added, second.removed, second.changed, second.unchanged) == (
            ("docs",), ("git",), ("db",), ("web",))
        assert sorted(encoder.seen) == ["describe the table", "read the docs"]  # only new trigger texts
        assert (second.embedded, second.cached) == (2, 2)
        assert index.names == ("web", "db", "docs")  # catalog order
        assert index._snap.blocks[index._snap.position["web"]].start == start_of["web"]  # untouched
        assert second.as_dict()["unchanged"] == 1

        encoder.seen.clear()
        third = index.sync(make_catalog(spec2, tmp_path), embedder)
        assert (third.added, third.removed, third.changed, third.embedded, third.cached) == ((), (), (), 0, 0)
        assert encoder.seen == []

        fresh = TriggerIndex(64)  # a restart: everything comes from the cache
        warm = fresh.sync(make_catalog(spec2, tmp_path), embedder)
        assert (warm.embedded, warm.cached) == (0, 5) and encoder.seen == []
        query = encoder.embed(["run sql on the table"])
        np.testing.assert_allclose(fresh.capability_scores(query, 3), index.capability_scores(query, 3), atol=1e-6)

        with pytest.raises(ValueError):
            TriggerIndex(32).sync(make_catalog(spec2, tmp_path), embedder)


@pytest.mark.parametrize("small_rows", [10**9, 0])
def test_searches_during_updates_see_whole_capabilities(monkeypatch: pytest.MonkeyPatch, small_rows: int) -> None:
    monkeypatch.setattr(index_module, "SMALL_ROWS", small_rows)
    dim, count = 48, 30
    rng = np.random.default_rng(5)
    versions = {v: rng.normal(size=(count, dim)).astype(np.float32) for v in ("a", "b")}
    for v in versions.values():
        v /= np.linalg.norm(v, axis=1, keepdims=True)
    query = rng.normal(size=dim).astype(np.float32)
    query /= np.linalg.norm(query)
    expected = {v: versions[v] @ query for v in versions}  # all triggers of a version share one vector
    index = TriggerIndex(dim)
    for i in range(count):
        index.set_capability(f"c{i}", "a", ["t"] * 4, np.repeat(versions["a"][i:i + 1], 4, axis=0))
    stop = time.monotonic() + 0.8
    failures: list[str] = []

    def writer() -> None:
        flip = 0
        while time.monotonic() < stop:
            flip += 1
            version = "ab"[flip % 2]
            for i in rng.permutation(count)[:7]:
                index.set_capability(f"c{i}", version, ["t"] * 4, np.repeat(versions[version][i:i + 1], 4, axis=0))
            if flip % 5 == 0:
                index.remove("c0")
                index.set_capability("c0", "a", ["t"] * 4, np.repeat(versions["a"][:1], 4, axis=0))

    def reader() -> None:
        while time.monotonic() < stop:
            names = index.names
            scores = index.capability_scores(query[None, :], 3)[0]
            if len(scores) != len(names):
                failures.append("scores and names disagree")
            for name, score in zip(names, scores, strict=False):
                i = int(name[1:])
                if min(abs(score - expected["a"][i]), abs(score - expected["b"][i])) > 1e-5:
                    failures.append(f"{name} scored {score}: a mix of versions")
            for name, score in index.top_capabilities(query, 3, 3):
                i = int(name[1:])
                if min(abs(score - expected["a"][i]), abs(score - expected["b"][i])) > 1e-5:
                    failures.append(f"{name} top score {score}")

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_nearest_trigger_search_widens_when_single_triggers_mislead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many capabilities with one trigger next to the query (and the rest far) crowd the nearest
    triggers, while the true winners have three moderately close ones: the search must widen."""
    monkeypatch.setattr(index_module, "SMALL_ROWS", 0)
    rng = np.random.default_rng(9)
    dim = 32
    query = np.zeros(dim, dtype=np.float32)
    query[0] = 1.0
    caps: dict[str, np.ndarray] = {}

    def around(cosine: float, count: int) -> np.ndarray:
        noise = rng.normal(size=(count, dim))
        noise[:, 0] = 0
        noise /= np.linalg.norm(noise, axis=1, keepdims=True)
        return np.asarray(cosine * query + np.sqrt(1 - cosine ** 2) * noise, dtype=np.float32)

    for i in range(300):
        caps[f"spiky{i}"] = np.vstack([around(0.95, 1), around(-0.5, 5)])
    for i in range(3):
        caps[f"steady{i}"] = around(0.6 - 0.1 * i, 3)
    index = TriggerIndex(dim)
    for name, vectors in caps.items():
        put(index, name, vectors)
    lengths: list[int] = []
    original = index_module._Snapshot.nearest_rows

    def spy(self: index_module._Snapshot, q: Vectors, length: int) -> tuple[Vectors, np.ndarray]:
        lengths.append(length)
        return original(self, q, length)

    monkeypatch.setattr(index_module._Snapshot, "nearest_rows", spy)
    got = index.top_capabilities(query, 3, 2)
    assert [name for name, _ in got] == ["steady0", "steady1"] and len(lengths) > 1
    assert_same_ranking(got, reference_top(caps, index.names, query, 3, 2))
