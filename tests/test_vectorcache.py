"""The SQLite vector cache and the cached embedder, on real files in tmp_path."""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from filelock import FileLock

from capd import vectorcache
from capd.embedder import CachedEmbedder
from capd.encoder import HashEncoder, Vectors
from capd.errors import CacheError, ModelError
from capd.vectorcache import CACHE_FILE, KEEP_SET_ASIDE, VectorCache, text_hash


class CountingEncoder(HashEncoder):
    """The hash fake, recording every text it is asked to embed."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__(dim=dim)
        self.seen: list[str] = []
        self.calls = 0

    def embed(self, texts: Sequence[str]) -> Vectors:
        self.calls += 1
        self.seen.extend(texts)
        return super().embed(texts)


class RenamedEncoder(CountingEncoder):
    @property
    def model_id(self) -> str:
        return "another-model"


def _vectors(n: int, dim: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)


def test_roundtrip_is_exact_and_misses_are_absent(tmp_path: Path) -> None:
    with VectorCache.open(tmp_path) as cache:
        assert cache.persistent and cache.path == tmp_path / CACHE_FILE
        vectors = _vectors(3)
        assert cache.put_many("m", [("a", vectors[0]), ("b", vectors[1])]) == 2
        assert cache.put_many("m", [("a", vectors[2])]) == 0  # first writer wins
        found = cache.get_many("m", ["a", "b", "c", "a"])
        assert set(found) == {"a", "b"}
        np.testing.assert_array_equal(found["a"], vectors[0])
        assert found["a"].dtype == np.float32
        assert cache.get_many("other-model", ["a"]) == {}
    with VectorCache.open(tmp_path) as reopened:  # persisted
        np.testing.assert_array_equal(reopened.get_many("m", ["b"])["b"], vectors[1])


def test_text_hash_is_of_the_exact_text() -> None:
    assert text_hash("deploy") != text_hash("deploy ") != text_hash("Deploy")
    assert text_hash("é") == hashlib.sha256("é".encode()).hexdigest()
    assert len(text_hash("x")) == 64


def test_hits_and_misses_are_counted_exactly(tmp_path: Path) -> None:
    encoder = CountingEncoder()
    with VectorCache.open(tmp_path) as cache:
        embedder = CachedEmbedder(encoder, cache, batch_size=2)
        vectors, embedded, cached = embedder.embed(["a b", "c d", "a b", "e f", "c d"])
        assert (embedded, cached) == (3, 0)
        assert sorted(encoder.seen) == ["a b", "c d", "e f"]  # each distinct text once
        np.testing.assert_array_equal(vectors, HashEncoder(dim=32).embed(["a b", "c d", "a b", "e f", "c d"]))
        encoder.seen.clear()
        progress: list[tuple[int, int]] = []
        again, embedded, cached = embedder.embed(["e f", "g h", "a b", "g h"],
                                                 progress=lambda done, total: progress.append((done, total)))
        assert (embedded, cached) == (1, 2) and encoder.seen == ["g h"]
        assert progress == [(0, 1), (1, 1)]
        np.testing.assert_array_equal(again[0], vectors[3])
        empty, embedded, cached = embedder.embed([])
        assert empty.shape == (0, 32) and (embedded, cached) == (0, 0)


def test_a_new_model_id_uses_new_keys(tmp_path: Path) -> None:
    with VectorCache.open(tmp_path) as cache:
        first = CachedEmbedder(CountingEncoder(), cache)
        second = CachedEmbedder(RenamedEncoder(), cache)
        assert first.embed(["x y", "z"])[1:] == (2, 0)
        assert second.embed(["x y", "z"])[1:] == (2, 0)
        assert first.embed(["x y", "z"])[1:] == (0, 2)
        assert cache.counts() == {first.model_id: 2, "another-model": 2}


def test_prune_keeps_what_taps_use_and_other_models(tmp_path: Path) -> None:
    with VectorCache.open(tmp_path) as cache:
        vectors = _vectors(4)
        cache.put_many("m1", [("a", vectors[0]), ("b", vectors[1]), ("c", vectors[2])])
        cache.put_many("m2", [("a", vectors[3])])
        assert cache.prune("m1", {"a", "zzz"}) == 2
        assert cache.counts() == {"m1": 1, "m2": 1}
        assert set(cache.get_many("m1", ["a", "b", "c"])) == {"a"}
        assert cache.prune("m1", []) == 1


def test_concurrent_writer_threads(tmp_path: Path) -> None:
    shared = VectorCache.open(tmp_path)
    errors: list[BaseException] = []

    def write(worker: int, cache: VectorCache) -> None:
        try:
            for batch in range(20):
                keys = [f"k{(worker * 7 + batch * 13 + i) % 400}" for i in range(10)]  # overlapping keys
                cache.put_many("m", [(k, np.full(4, float(k[1:]), dtype=np.float32)) for k in keys])
                cache.get_many("m", keys)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    own = [VectorCache.open(tmp_path) for _ in range(3)]  # separate connections too
    threads = [threading.Thread(target=write, args=(w, shared)) for w in range(5)]
    threads += [threading.Thread(target=write, args=(10 + i, c)) for i, c in enumerate(own)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stored = shared.get_many("m", [f"k{i}" for i in range(400)])
    assert all(float(v[0]) == float(k[1:]) for k, v in stored.items())
    assert shared.counts()["m"] == len(stored) > 100
    for cache in [shared, *own]:
        cache.close()


WRITER = """
import sys
from pathlib import Path
import numpy as np
from capd.vectorcache import VectorCache
cache = VectorCache.open(Path(sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()
for batch in range(40):
    cache.put_many("m", [(f"{sys.argv[2]}{batch}-{i}", np.ones(16, dtype=np.float32)) for i in range(25)])
cache.close()
"""


def test_concurrent_writer_processes(tmp_path: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), prefix], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for prefix in ("p", "q")]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    with VectorCache.open(tmp_path) as cache:
        for proc in procs:  # release both at once, then write from here as well
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for batch in range(40):
            cache.put_many("m", [(f"r{batch}-{i}", np.ones(16, dtype=np.float32)) for i in range(25)])
        for proc in procs:
            assert proc.wait(timeout=60) == 0
        assert cache.counts() == {"m": 3 * 40 * 25}


class _Holder:
    """Another connection holding the cache file exclusively (readers get "database is locked"
    at once, as while another process switches the file to WAL), released after ``seconds``."""

    def __init__(self, path: Path, seconds: float) -> None:
        self.path, self.seconds = path, seconds
        self.held = threading.Event()
        self.thread = threading.Thread(target=self._hold)

    def _hold(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None)
        conn.execute("PRAGMA locking_mode = EXCLUSIVE")
        conn.execute("BEGIN EXCLUSIVE")
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        self.held.set()
        time.sleep(self.seconds)
        conn.execute("COMMIT")
        conn.close()

    def __enter__(self) -> _Holder:
        self.thread.start()
        self.held.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join()


def _filled(data_dir: Path) -> None:
    with VectorCache.open(data_dir) as cache:
        cache.put_many("m", [("a", np.ones(4, dtype=np.float32))])


def test_a_file_locked_while_opening_is_waited_for_not_set_aside(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock is not corruption: opening waits it out and keeps every vector (it used to move the
    file aside as "not a readable SQLite database (database is locked)" and start empty)."""
    _filled(tmp_path)
    monkeypatch.setattr(vectorcache, "BUSY_TIMEOUT_S", 0.05)  # SQLite's own wait, per statement
    with _Holder(tmp_path / CACHE_FILE, 0.5), VectorCache.open(tmp_path) as cache:
        assert cache.persistent
        assert cache.counts() == {"m": 1}
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_a_file_locked_past_the_retry_window_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    _filled(tmp_path)
    monkeypatch.setattr(vectorcache, "BUSY_TIMEOUT_S", 0.05)
    monkeypatch.setattr(vectorcache, "OPEN_RETRY_S", 0.2)
    with caplog.at_level(logging.WARNING, logger="capd.vectorcache"), _Holder(tmp_path / CACHE_FILE, 1.0):
        cache = VectorCache.open(tmp_path)
        assert not cache.persistent  # this process works from memory; the file is not touched
        cache.close()
    assert "stayed locked by another process" in caplog.text
    assert not list(tmp_path.glob("*.corrupt-*"))
    with VectorCache.open(tmp_path) as cache:
        assert cache.counts() == {"m": 1}


def test_corrupt_file_is_set_aside_and_rebuilt(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / CACHE_FILE).write_bytes(b"this is not a database" * 500)
    with caplog.at_level(logging.WARNING, logger="capd.vectorcache"), VectorCache.open(tmp_path) as cache:
        assert cache.persistent
        assert cache.put_many("m", [("a", np.ones(3, dtype=np.float32))]) == 1
    (aside,) = tmp_path.glob(f"{CACHE_FILE}.corrupt-*")
    assert aside.read_bytes().startswith(b"this is not a database")
    assert "unusable" in caplog.text and str(aside) in caplog.text


def test_only_the_newest_set_aside_copies_are_kept(tmp_path: Path) -> None:
    """A disk that keeps damaging the file must not fill up with whole caches: four corruptions
    within one second leave the two newest copies, each under its own name (a second set-aside
    within a second renamed over the first)."""
    for n in range(4):
        (tmp_path / CACHE_FILE).write_bytes(f"damaged copy {n} ".encode() * 500)
        with VectorCache.open(tmp_path) as cache:
            assert cache.persistent
    kept = sorted(p.read_bytes()[:14] for p in tmp_path.glob(f"{CACHE_FILE}.corrupt-*"))
    assert kept == [b"damaged copy 2", b"damaged copy 3"]
    assert KEEP_SET_ASIDE == 2


def test_foreign_database_is_set_aside(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / CACHE_FILE) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
        conn.execute("INSERT INTO notes VALUES ('precious')")
    with VectorCache.open(tmp_path) as cache:
        assert cache.counts() == {}
    (aside,) = (p for p in tmp_path.glob(f"{CACHE_FILE}.corrupt-*") if not p.name.endswith(("-wal", "-shm")))
    with sqlite3.connect(aside) as conn:
        assert conn.execute("SELECT body FROM notes").fetchall() == [("precious",)]


def test_corruption_found_mid_file_is_recovered(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with VectorCache.open(tmp_path) as cache:
        cache.put_many("m", [(f"k{i}", np.ones(64, dtype=np.float32)) for i in range(2000)])
    path = tmp_path / CACHE_FILE
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    page = 4096
    data[2 * page:len(data) - page] = b"\xa5" * (len(data) - 3 * page)  # keep the header, smash the pages
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="capd.vectorcache"), VectorCache.open(tmp_path) as cache:
        found = cache.get_many("m", [f"k{i}" for i in range(2000)])
        assert found == {}
        assert cache.put_many("m", [("fresh", np.ones(2, dtype=np.float32))]) == 1
    assert list(tmp_path.glob(f"{CACHE_FILE}.corrupt-*")) and "unusable" in caplog.text


def test_a_damaged_file_that_cannot_be_set_aside_carries_on_in_memory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Damage found while serving, when the file cannot be replaced (here its lock is held; the data
    directory remounted read-only after disk errors does the same): every later lookup used to
    raise OSError (filelock's Timeout, PermissionError) past CachedEmbedder, a traceback in a route."""
    with VectorCache.open(tmp_path) as cache:
        cache.put_many("m", [(f"k{i}", np.ones(64, dtype=np.float32)) for i in range(2000)])
    cache = VectorCache.open(tmp_path)
    path = tmp_path / CACHE_FILE
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(path.read_bytes())
    page = 4096
    data[2 * page:len(data) - page] = b"\xa5" * (len(data) - 3 * page)
    with path.open("r+b") as handle:  # in place: the open connection reads the damage
        handle.write(bytes(data))
    monkeypatch.setattr(vectorcache, "BUSY_TIMEOUT_S", 0.05)
    with FileLock(str(path) + ".lock"):
        embedder = CachedEmbedder(CountingEncoder(), cache)
        assert embedder.embed(["k1", "k2"])[1:] == (2, 0)  # embedded, not a traceback
        assert embedder.embed(["k1", "k3"])[1:] == (1, 1)  # and cached in memory from now on
    assert not cache.persistent
    cache.close()


def test_unwritable_data_dir_falls_back_to_memory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("the data dir cannot be created under a file")
    with caplog.at_level(logging.WARNING, logger="capd.vectorcache"):
        cache = VectorCache.open(blocker / "data")
    assert not cache.persistent and cache.path is None and "in-memory" in caplog.text
    embedder = CachedEmbedder(CountingEncoder(), cache)
    assert embedder.embed(["a", "b"])[1:] == (2, 0)
    assert embedder.embed(["a", "b"])[1:] == (0, 2)  # still de-duplicates within the process
    cache.close()


def test_a_full_disk_falls_back_to_memory_and_sets_nothing_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A full disk is not corruption: opening a new cache on one used to set the empty file aside as
    "not a readable SQLite database (database or disk is full)", then fail the same way on the fresh
    file and escape as a traceback (`capd index`, the daemon's start)."""
    connect = sqlite3.connect

    def full(database: str, *args: object, **kwargs: object) -> sqlite3.Connection:
        conn = connect(database, *args, **kwargs)  # type: ignore[arg-type]
        if database != ":memory:":  # SQLite's own SQLITE_FULL once the file would grow
            conn.execute("PRAGMA max_page_count = 1")
        return conn

    monkeypatch.setattr(vectorcache.sqlite3, "connect", full)
    with caplog.at_level(logging.WARNING, logger="capd.vectorcache"):
        cache = VectorCache.open(tmp_path)
    monkeypatch.undo()
    assert not cache.persistent and "database or disk is full" in caplog.text
    embedder = CachedEmbedder(CountingEncoder(), cache)
    assert embedder.embed(["a", "b"])[1:] == (2, 0)  # still serves, from memory
    cache.close()
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_other_schema_version_is_set_aside(tmp_path: Path) -> None:
    with VectorCache.open(tmp_path) as cache:
        cache.put_many("m", [("a", np.ones(2, dtype=np.float32))])
    with sqlite3.connect(tmp_path / CACHE_FILE) as conn:
        conn.execute("PRAGMA user_version = 99")
    with VectorCache.open(tmp_path) as cache:
        assert cache.counts() == {}
    (aside,) = (p for p in tmp_path.glob(f"{CACHE_FILE}.corrupt-*") if not p.name.endswith(("-wal", "-shm")))
    with sqlite3.connect(aside) as conn:  # moved with its WAL, so nothing in it is lost
        assert conn.execute("PRAGMA user_version").fetchone() == (99,)


class TokenCountingEncoder(CountingEncoder):
    """Also records the texts asked for token vectors (HashEncoder's embed_tokens calls embed once)."""

    def __init__(self) -> None:
        super().__init__()
        self.token_texts: list[str] = []

    def embed_tokens(self, texts: Sequence[str]) -> tuple[Vectors, list[Vectors]]:
        self.token_texts.extend(texts)
        return super().embed_tokens(texts)


def test_keeping_tokens_embeds_each_missing_text_once_with_its_token_vectors(tmp_path: Path) -> None:
    encoder = TokenCountingEncoder()
    with VectorCache.open(tmp_path) as cache:
        embedder = CachedEmbedder(encoder, cache, batch_size=2)
        embedder.embed(["cached already"])
        encoder.seen.clear()
        with embedder.keeping_tokens(limit=1000) as sink:
            texts = ["run a query", "cached already", "list the tables", "run a query"]
            vectors, embedded, cached = embedder.embed(texts)
        assert (embedded, cached) == (2, 1)
        assert encoder.seen == encoder.token_texts == ["run a query", "list the tables"]  # one model pass each
        assert set(sink.matrices) == {"run a query", "list the tables"}  # nothing for a cached text
        plain_vectors, plain_tokens = HashEncoder(dim=32).embed_tokens(["run a query", "list the tables"])
        np.testing.assert_array_equal(vectors[[0, 2]], plain_vectors)  # the vectors cached are the usual ones
        np.testing.assert_array_equal(sink.matrices["list the tables"], plain_tokens[1])
        encoder.token_texts.clear()
        embedder.embed(["a new text outside the block"])
        assert encoder.token_texts == []  # outside the block: vectors only


def test_a_token_sink_over_its_limit_empties_and_stops(tmp_path: Path) -> None:
    encoder = TokenCountingEncoder()
    with VectorCache.open(tmp_path) as cache:
        embedder = CachedEmbedder(encoder, cache, batch_size=1)
        with embedder.keeping_tokens(limit=4) as sink:  # HashEncoder: one token vector per word (2 + 3 > 4)
            embedder.embed(["two words", "three more words", "and the rest of them"])
        assert not sink.open and sink.matrices == {}
        assert encoder.token_texts == ["two words", "three more words"]  # the third went without tokens
        encoder.token_texts.clear()
        with embedder.keeping_tokens(limit=0) as closed:  # a rule without a second stage
            embedder.embed(["nothing kept"])
        assert encoder.token_texts == [] and closed.matrices == {}


class NanEncoder(CountingEncoder):
    """A damaged model that still runs: NaN for every text that says "poison"."""

    def embed(self, texts: Sequence[str]) -> Vectors:
        vectors = super().embed(texts)
        vectors[["poison" in text for text in texts]] = np.nan
        return vectors


def test_a_non_finite_vector_is_never_stored(tmp_path: Path) -> None:
    with VectorCache.open(tmp_path) as cache:
        for bad in (np.nan, np.inf, -np.inf):
            vector = np.ones(4, dtype=np.float32)
            vector[2] = bad
            with pytest.raises(CacheError, match="refusing to store 1 vector"):
                cache.put_many("m", [("good", np.ones(4, dtype=np.float32)), ("bad", vector)])
        assert cache.counts() == {}  # nothing of the batch
        embedder = CachedEmbedder(NanEncoder(), cache)
        with pytest.raises(ModelError, match="NaN or inf for 1 of 2"):
            embedder.embed(["fine", "poison"])
        assert cache.counts() == {}


def test_a_poisoned_row_is_embedded_again_and_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rows an earlier capd stored from a damaged model (NaN), or torn ones, read as missing; the
    vector embedded again replaces them. A usable row stays as the first writer stored it."""
    encoder = CountingEncoder()
    with VectorCache.open(tmp_path) as cache:
        cache.put_many(encoder.model_id, [(text_hash("good"), np.full(encoder.dim, 0.5, dtype=np.float32))])
    nan_row = np.full(encoder.dim, np.nan, dtype="<f4").tobytes()
    with sqlite3.connect(tmp_path / CACHE_FILE) as conn:
        conn.executemany("INSERT INTO vectors (model_id, text_hash, dim, vector) VALUES (?, ?, ?, ?)",
                         [(encoder.model_id, text_hash("nan"), encoder.dim, nan_row),
                          (encoder.model_id, text_hash("torn"), encoder.dim, nan_row[:10])])
    with VectorCache.open(tmp_path) as cache, caplog.at_level(logging.WARNING, logger="capd.vectorcache"):
        embedder = CachedEmbedder(encoder, cache)
        vectors, embedded, cached = embedder.embed(["nan", "good", "torn"])
        assert (embedded, cached) == (2, 1) and sorted(encoder.seen) == ["nan", "torn"]
        np.testing.assert_array_equal(vectors[[0, 2]], HashEncoder(dim=encoder.dim).embed(["nan", "torn"]))
        assert "2 stored vector(s)" in caplog.text
        assert embedder.embed(["nan", "good", "torn"])[1:] == (0, 3)  # repaired in place
        assert cache.counts() == {encoder.model_id: 3}
    with sqlite3.connect(tmp_path / CACHE_FILE) as conn:
        stored = dict(conn.execute("SELECT text_hash, vector FROM vectors"))
    assert np.isfinite(np.frombuffer(stored[text_hash("nan")], dtype="<f4")).all()
    assert np.all(np.frombuffer(stored[text_hash("good")], dtype="<f4") == 0.5)


def test_a_row_stored_as_text_is_embedded_again(tmp_path: Path) -> None:
    """A vector stored as TEXT (an edited file) failed the start: the chunk's blobs were joined
    as bytes ("expected a bytes-like object, str found"). It reads as missing, as a torn row does."""
    encoder = CountingEncoder()
    with VectorCache.open(tmp_path) as cache:
        CachedEmbedder(encoder, cache).embed(["text", "good"])
    with sqlite3.connect(tmp_path / CACHE_FILE) as conn:
        conn.execute("UPDATE vectors SET vector = ? WHERE text_hash = ?", ("x" * encoder.dim * 4, text_hash("text")))
    encoder.seen.clear()
    with VectorCache.open(tmp_path) as cache:
        embedder = CachedEmbedder(encoder, cache)
        vectors, embedded, cached = embedder.embed(["text", "good"])
        assert (embedded, cached) == (1, 1) and encoder.seen == ["text"]
        np.testing.assert_array_equal(vectors, HashEncoder(dim=encoder.dim).embed(["text", "good"]))
        assert embedder.embed(["text", "good"])[1:] == (0, 2)  # replaced by the vector embedded again
