"""Daemon benchmark: a real ``capd serve`` process over loopback HTTP, against the bare encoder.

Run: ``.venv/bin/python -m benchmarks.bench_daemon`` (about 14 minutes here once the cache is warm;
the first run also generates the taps and embeds about 100k triggers, a few minutes more)
or ``--quick`` (about 2 minutes: the 60 and 1,000 capability taps only, shorter loops),
``--overhead`` (the daemon's own cost per route only, printed) or ``--turns`` (one route per
turn only, both rules on the smallest tap, printed).
Writes ``benchmarks/results/daemon{,-quick}.json``, ``.md`` and ``.png``.

For taps of about 60, 1,000 and 10,000 generated capabilities (:mod:`benchmarks.gen_tap`):

- route latency p50 / p99, one keep-alive httpx client, distinct messages, each with a session
  id; in blocks interleaved with the bare ONNX encode of the same messages in this process,
  so that background load hits both alike; and the same routes from a minimal keep-alive
  HTTP/1.1 client on a plain socket (:class:`RawClient`), in the same blocks: httpx's own
  per-request CPU is part of the first figure (an agent may use any client), not of the daemon;
- one route per turn (:func:`per_turn`): each message encoded bare and routed through capd's own
  client, through httpx and through the raw client, each call after 50 ms of idle, as an agent's
  turns arrive; on the smallest tap also for a ``fused`` daemon;
- throughput with 1, 8 and 32 concurrent clients (threads, one keep-alive client each);
- RSS of the daemon after the load; warm start to ready (process spawn to ``/v1/health``
  ready) with the cached data dir, cold start with an empty one (ONNX export + embedding);
- keeping a rule's fitted state fresh (:func:`rule_upkeep`, 60 and 1,000 capabilities): per rule
  (``capd``, ``fused``), the first start, two tap edits while running, and a restart; and the
  route latency of one client meanwhile, idle and while the edits are applied;
- the daemon's own cost per route (:func:`daemon_overhead`): the same daemon on the hash model,
  whose encode takes microseconds, so what remains is HTTP, the framework and capd's own work;
- in this process: the bare single-message encode (ONNX and torch), capd's scoring
  (``TriggerIndex.top_capabilities``) and the anchor rule's scoring (mean of the top-3 trigger
  cosines of every capability, brute force in numpy) for the same message vectors.

Taps and data dirs are cached under ``benchmarks/.cache/`` so reruns are warm. The 10,000
capability cold start (about 90k triggers to embed) is measured only when that cache is built
and reported with its date. Every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from filelock import FileLock

from benchmarks import gen_tap
from capd.autogates import AUTO_REFIT_SHARE
from capd.client import CapdClient
from capd.embedder import CachedEmbedder
from capd.encoder import Encoder, open_encoder
from capd.index import TriggerIndex
from capd.settings import Settings
from capd.text import clean_message
from capd.vectorcache import VectorCache

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CACHE = ROOT / "benchmarks" / ".cache"
CLIENTS = (1, 8, 32)
TOP_K = 3
BLOCK = 50  # messages per interleaved block (bare encode, then route)
TURN_GAP_S = 0.05  # per_turn: idle before each timed call; an encode after 50 ms idle is as slow as after 1 s here


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...] = (60, 1_000, 10_000)
    latency_messages: int = 1_000
    latency_budget_s: float = 30.0
    torch_messages: int = 300
    level_seconds: float = 6.0
    level_max_requests: int = 20_000
    warm_runs: int = 3
    cold_sizes: tuple[int, ...] = (60, 1_000)
    torch_daemon: bool = True
    scoring_messages: int = 300
    ready_timeout_s: float = 900.0
    upkeep_sizes: tuple[int, ...] = (60, 1_000)  # rule_upkeep (the fused rule's fitting), not at 10,000
    probe_seconds: float = 5.0  # rule_upkeep: idle routing before the edits, the baseline for routing during them
    overhead_routes: int = 3_000  # daemon_overhead: routes on the hash model
    turn_messages: int = 200  # per_turn: routes (and bare encodes) one at a time after TURN_GAP_S idle


FULL = Plan()
QUICK = Plan(sizes=(60, 1_000), latency_messages=300, latency_budget_s=10.0, torch_messages=100, level_seconds=2.5,
             warm_runs=2, cold_sizes=(60,), torch_daemon=False, scoring_messages=100, upkeep_sizes=(60,),
             overhead_routes=1_000, turn_messages=80)


# -- small helpers ----------------------------------------------------------------------------

def stats(samples_ms: list[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)
    if not ordered:
        return {"n": 0}
    return {"n": len(ordered), "p50_ms": round(statistics.median(ordered), 3),
            "p99_ms": round(ordered[math.ceil(0.99 * len(ordered)) - 1], 3),  # nearest rank
            "mean_ms": round(statistics.fmean(ordered), 3)}


def tagged(message: str, tag: str) -> str:
    """``message`` made distinct per timed call, so that no route repeats a message, at the same length
    for every call: a one-letter ``tag`` adds the same four word pieces ("(", "turn", tag, ")") to each
    text, the bare encode's included. Untagged encodes against suffixed routes made the routes encode
    three to five more word pieces than the encode they were compared with: about 12 % of a short
    message's encode here."""
    return f"{message} (turn {tag})"


def timed(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


# -- the daemon process -----------------------------------------------------------------------

class Daemon:
    """One ``python -m capd serve`` process on a free loopback port; stderr goes to a log file."""

    def __init__(self, tap: Path, data_dir: Path, log_dir: Path, backend: str = "onnx", rule: str = "capd",
                 model: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"daemon-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CAPD_")}
        env["XDG_CONFIG_HOME"] = str(log_dir)  # no user config file leaks into the measurement
        command = [sys.executable, "-m", "capd", "serve", "--tap", str(tap), "--data-dir", str(data_dir),
                   "--port", str(self.port), "--backend", backend, "--rule", rule,
                   *(["--model", model] if model else [])]
        self._log = self.log_path.open("wb")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self._log, env=env, cwd=ROOT)

    def wait_ready(self, timeout: float) -> tuple[float, dict[str, Any]]:
        """Seconds from spawn to ``ready: true``, and the health payload."""
        health = self.wait_health(lambda h: bool(h.get("ready")), timeout, "ready")
        return time.perf_counter() - self.started, health

    def wait_health(self, condition: Callable[[dict[str, Any]], bool], timeout: float,
                    what: str) -> dict[str, Any]:
        """Poll ``/v1/health`` until ``condition`` holds for it; raise if the daemon dies or
        reports a startup error first, or after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    health: dict[str, Any] = client.get("/v1/health").json()
                    if condition(health):
                        return health
                    if health.get("startup_error"):
                        raise RuntimeError(f"daemon failed to start: {health['startup_error']}")
                except httpx.TransportError:
                    pass
                time.sleep(0.02)
        raise RuntimeError(f"daemon not {what} after {timeout} s:\n{self.log_tail()}")

    def memory_mb(self) -> dict[str, float]:
        fields: dict[str, float] = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = round(int(value.split()[0]) / 1024, 1)
        return {"rss_mb": fields["VmRSS"], "peak_rss_mb": fields["VmHWM"]}

    def cpu_seconds(self) -> float:
        parts = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

    def log_tail(self, lines: int = 20) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@contextmanager
def running(tap: Path, data_dir: Path, log_dir: Path, timeout: float, backend: str = "onnx",
            rule: str = "capd", model: str | None = None) -> Iterator[tuple[Daemon, float, dict[str, Any]]]:
    daemon = Daemon(tap, data_dir, log_dir, backend, rule, model)
    try:
        seconds, health = daemon.wait_ready(timeout)
        yield daemon, seconds, health
    finally:
        daemon.stop()


def copy_data_dir(data_dir: Path, dest: Path) -> None:
    """A working copy of a cached data dir: vectors, ONNX export and fits, no sessions or locks."""
    shutil.copytree(data_dir, dest, ignore=shutil.ignore_patterns("sessions.sqlite3*", "*.lock"))


def fresh_sessions(data_dir: Path) -> None:
    """Sessions from an earlier run would grow the store every rerun; vectors and ONNX stay."""
    for suffix in ("", "-wal", "-shm"):
        (data_dir / f"sessions.sqlite3{suffix}").unlink(missing_ok=True)


# -- measurements -----------------------------------------------------------------------------

class RawClient:
    """A minimal keep-alive HTTP/1.1 client on a plain socket (JSON POSTs, Content-Length replies
    only): what a route costs without an HTTP library's own per-request work in this process."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30.0)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        payload = json.dumps(body).encode()
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        status = self.reader.readline().split(b" ", 2)
        length = None
        while (line := self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None or len(status) < 2 or status[1] != b"200":
            raise RuntimeError(f"raw client: {path} answered {status!r} (content-length {length})")
        answer: dict[str, Any] = json.loads(self.reader.read(length))
        return answer

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def route_and_encode(daemon: Daemon, encoder: Encoder, messages: list[str], budget_s: float,
                     prefix: str) -> dict[str, Any]:
    """One client: route latency through httpx and through :class:`RawClient`, interleaved by block
    with the bare encode of the same messages (each route client sends each message once, with a
    suffix of its own, so that no message repeats)."""
    routes: list[float] = []
    raw_routes: list[float] = []
    encodes: list[float] = []
    decisions: dict[str, int] = {}
    deadline = time.monotonic() + budget_s
    raw = RawClient(daemon.port)
    try:
        with httpx.Client(base_url=daemon.url, timeout=30.0) as client:
            for i in range(20):  # warm the connections, the threadpool and the model
                warm = {"session": f"{prefix}-warm", "message": f"warm up {i}: {messages[i]}"}
                client.post("/v1/route", json=warm)
                raw.post("/v1/route", warm)
            for start in range(0, len(messages), BLOCK):
                if time.monotonic() > deadline:
                    break
                block = messages[start:start + BLOCK]
                for message in block:
                    text = clean_message(tagged(message, "e"), 0)[0]
                    encodes.append(timed(lambda t=text: encoder.embed([t])))  # type: ignore[misc]
                for offset, message in enumerate(block):
                    body = {"session": f"{prefix}-{(start + offset) // 25}", "message": tagged(message, "h")}
                    began = time.perf_counter()
                    response = client.post("/v1/route", json=body)
                    payload = response.json()
                    routes.append((time.perf_counter() - began) * 1000)
                    response.raise_for_status()
                    decisions[payload["decision"]] = decisions.get(payload["decision"], 0) + 1
                for offset, message in enumerate(block):
                    body = {"session": f"{prefix}-raw-{(start + offset) // 25}", "message": tagged(message, "r")}
                    raw_routes.append(timed(lambda b=body: raw.post("/v1/route", b)))  # type: ignore[misc]
    finally:
        raw.close()
    return {"route": stats(routes), "route_raw_client": stats(raw_routes), "encode": stats(encodes),
            "decisions": decisions}


def per_turn(daemon: Daemon, encoder: Encoder, messages: list[str], prefix: str) -> dict[str, Any]:
    """Route latency as an agent sees it: one route per turn, after idle time. Each message is
    encoded bare in this process and routed through capd's own client (:class:`CapdClient`),
    through httpx and through :class:`RawClient`, each call after :data:`TURN_GAP_S` of idle, so
    the bare encode and the routes start from the same idle machine (threads parked, caches and
    clocks cold) instead of back to back, where each call warms the next.
    :func:`route_and_encode` measures back to back."""
    capd_routes: list[float] = []
    routes: list[float] = []
    raw_routes: list[float] = []
    encodes: list[float] = []
    raw = RawClient(daemon.port)
    try:
        with httpx.Client(base_url=daemon.url, timeout=30.0) as client, CapdClient(daemon.url) as capd:
            capd.health()  # its connection is open, as the others' are
            for i, message in enumerate(messages):
                text = clean_message(tagged(message, "e"), 0)[0]
                time.sleep(TURN_GAP_S)
                encodes.append(timed(lambda t=text: encoder.embed([t])))  # type: ignore[misc]
                time.sleep(TURN_GAP_S)
                capd_message = tagged(message, "c")
                capd_routes.append(timed(lambda m=capd_message, s=f"{prefix}-capd-{i // 25}":  # type: ignore[misc]
                                         capd.route(s, m)))
                time.sleep(TURN_GAP_S)
                body = {"session": f"{prefix}-{i // 25}", "message": tagged(message, "h")}
                routes.append(timed(lambda b=body: client.post("/v1/route", json=b).raise_for_status()))  # type: ignore[misc]
                time.sleep(TURN_GAP_S)
                raw_body = {"session": f"{prefix}-raw-{i // 25}", "message": tagged(message, "r")}
                raw_routes.append(timed(lambda b=raw_body: raw.post("/v1/route", b)))  # type: ignore[misc]
    finally:
        raw.close()
    return {"gap_s": TURN_GAP_S, "route_capd_client": stats(capd_routes), "route": stats(routes),
            "route_raw_client": stats(raw_routes), "encode": stats(encodes)}


def daemon_overhead(plan: Plan, messages: list[str], log_dir: Path) -> dict[str, Any]:
    """What the daemon itself costs per route, apart from the model: a daemon on the hash model
    (an encode of microseconds) and the smallest tap, one :class:`RawClient`, routes with session
    ids. Latency p50 / p99 and the daemon's CPU per route (HTTP, the framework, the micro-batcher's
    and the decision's thread hand-offs, scoring, the session commit)."""
    tap = gen_tap.cached_tap(plan.sizes[0], CACHE)
    with tempfile.TemporaryDirectory(prefix="capd-bench-overhead-") as data_dir, \
            running(tap, Path(data_dir), log_dir, plan.ready_timeout_s, model="hash") as (daemon, _, _):
        raw = RawClient(daemon.port)
        try:
            for i in range(100):
                raw.post("/v1/route", {"session": "warm", "message": f"warm up {i}: {messages[i]}"})
            cpu, latencies = daemon.cpu_seconds(), []
            for i in range(plan.overhead_routes):
                body = {"session": f"overhead-{i // 25}", "message": messages[i % len(messages)]}
                latencies.append(timed(lambda b=body: raw.post("/v1/route", b)))  # type: ignore[misc]
            cpu_ms = (daemon.cpu_seconds() - cpu) / plan.overhead_routes * 1000
        finally:
            raw.close()
    return {"route": stats(latencies), "daemon_cpu_ms_per_route": round(cpu_ms, 3)}


def throughput(daemon: Daemon, messages: list[str], clients: int, seconds: float, max_requests: int,
               prefix: str) -> dict[str, Any]:
    """``clients`` threads, each with its own keep-alive client and session, for ``seconds``."""
    done = [0] * clients
    errors = [0] * clients
    latencies: list[list[float]] = [[] for _ in range(clients)]
    stop_at = [0.0]
    began = [0.0]
    cpu_before = [0.0, 0.0]  # the daemon's, this process's

    def open_window() -> None:
        """Run once every client has warmed up (its connection, its session's first route): the
        window, and the CPU counted, start here, not while the 32 clients are still connecting."""
        cpu_before[:] = [daemon.cpu_seconds(), time.process_time()]
        began[0] = time.perf_counter()
        stop_at[0] = began[0] + seconds

    start_line = threading.Barrier(clients + 1, action=open_window)
    per_client = max(1, max_requests // clients)

    def work(slot: int) -> None:
        with httpx.Client(base_url=daemon.url, timeout=30.0) as client:
            client.post("/v1/route", json={"session": f"{prefix}-{slot}", "message": messages[slot]})
            start_line.wait()
            i = slot * 97
            while time.perf_counter() < stop_at[0] and done[slot] < per_client:
                began = time.perf_counter()
                response = client.post("/v1/route", json={"session": f"{prefix}-{slot}",
                                                          "message": messages[i % len(messages)]})
                latencies[slot].append((time.perf_counter() - began) * 1000)
                if response.status_code != 200:
                    errors[slot] += 1
                done[slot] += 1
                i += 1

    workers = [threading.Thread(target=work, args=(slot,), daemon=True) for slot in range(clients)]
    for worker in workers:
        worker.start()
    start_line.wait()
    for worker in workers:
        worker.join(seconds + 60)
    wall = time.perf_counter() - began[0]
    merged = [x for per in latencies for x in per]
    daemon_cpu = daemon.cpu_seconds() - cpu_before[0]
    return {"clients": clients, "requests": sum(done), "errors": sum(errors), "seconds": round(wall, 2),
            "requests_per_s": round(sum(done) / wall, 1), "latency": stats(merged),
            "daemon_cpu_share": round(daemon_cpu / wall, 2),
            "daemon_cpu_ms_per_request": round(1000 * daemon_cpu / max(sum(done), 1), 2),
            "client_cpu_share": round((time.process_time() - cpu_before[1]) / wall, 2)}


def encoder_rates(encoder: Encoder, messages: list[str], seconds: float) -> dict[str, float]:
    """The bare encoder's own rates in this process: one message at a time, and batches of 32
    (what the micro-batcher hands it at best). Batched over single bounds any client speed-up."""
    rates: dict[str, float] = {}
    for label, size in (("single_per_s", 1), ("batch32_per_s", 32)):
        done, began = 0, time.perf_counter()
        while time.perf_counter() - began < seconds and done < 20_000:
            encoder.embed(messages[done % 3_000:done % 3_000 + size])
            done += size
        rates[label] = round(done / (time.perf_counter() - began), 1)
    return rates


def scoring(size: int, encoder: Encoder, data_dir: Path, messages: list[str]) -> dict[str, Any]:
    """capd's top-n scoring and the anchor's brute-force mean-top-3, per message vector."""
    names, texts, owner = [], [], []
    for number, (name, product, facet) in enumerate(gen_tap.pairs()[:size]):
        triggers = gen_tap.triggers_for(name, product, facet)
        names.append(name)
        texts += triggers
        owner += [number] * len(triggers)
    with VectorCache.open(data_dir) as cache:
        vectors, embedded, _ = CachedEmbedder(encoder, cache).embed(texts)
    index = TriggerIndex(encoder.dim)
    owners = np.array(owner)
    bounds = np.searchsorted(owners, np.arange(size))
    counts = np.diff(np.append(bounds, len(owners)))
    for number, name in enumerate(names):
        index.set_capability(name, "f", texts[bounds[number]:bounds[number] + counts[number]],
                             vectors[bounds[number]:bounds[number] + counts[number]])
    width = int(counts.max())
    gather = bounds[:, None] + np.minimum(np.arange(width)[None, :], counts[:, None] - 1)
    valid = np.arange(width)[None, :] < counts[:, None]
    queries = encoder.embed([clean_message(m, 0)[0] for m in messages])

    def anchor(vector: np.ndarray) -> tuple[int, int]:
        sims = vectors @ vector
        padded = np.where(valid, sims[gather], -np.inf)
        scores = -np.partition(-padded, TOP_K - 1, axis=1)[:, :TOP_K].mean(axis=1)
        best = np.argpartition(-scores, 1)[:2]
        return int(best[0]), int(best[1])

    for query in queries[:10]:
        anchor(query)
        index.top_capabilities(query, TOP_K, 5)
    return {"triggers": len(texts), "embedded_for_scoring": embedded,
            "capd_top5": stats([timed(partial(index.top_capabilities, q, TOP_K, 5)) for q in queries]),
            "anchor_brute": stats([timed(partial(anchor, q)) for q in queries])}


def torch_bare(plan: Plan, settings: Settings, messages: list[str]) -> tuple[Encoder, dict[str, Any]]:
    torch = open_encoder(replace(settings, backend="torch"))
    for message in messages[:10]:
        torch.embed([message])
    texts = [clean_message(tagged(m, "e"), 0)[0] for m in messages[:plan.torch_messages]]  # as the ONNX encode's
    return torch, stats([timed(lambda t=t: torch.embed([t])) for t in texts])  # type: ignore[misc]


def prime(size: int, tap: Path, data_dir: Path, log_dir: Path, plan: Plan) -> tuple[dict[str, Any], bool]:
    """Fill the size's cached data dir once; that first start is a cold start, kept with its date.
    Returns the record and whether it was made now.

    The cache is filled in a scratch directory and renamed into place when complete, under a
    file lock, so an interrupted or concurrent run never leaves or uses a half-filled cache.
    """
    marker = data_dir / "primed.json"
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(data_dir) + ".lock"):
        if marker.is_file():
            record: dict[str, Any] = json.loads(marker.read_text())
            return record, False
        print(f"   priming the cache for {size:,} capabilities (first run only)...", flush=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"{data_dir.name}-", dir=data_dir.parent))
        try:
            load = load_average()
            with running(tap, scratch, log_dir, plan.ready_timeout_s) as (_, seconds, health):
                record = {"seconds": round(seconds, 2), "embedded": health["embedded"], "load_average": load,
                          "when": time.strftime("%Y-%m-%d %H:%M")}
            (scratch / "primed.json").write_text(json.dumps(record))
            shutil.rmtree(data_dir, ignore_errors=True)
            scratch.rename(data_dir)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return record, True


def cold_start(tap: Path, log_dir: Path, plan: Plan, rule: str = "capd") -> dict[str, Any]:
    data_dir = Path(tempfile.mkdtemp(prefix="capd-cold-"))
    try:
        with running(tap, data_dir, log_dir, plan.ready_timeout_s, rule=rule) as (_, seconds, health):
            return {"seconds": round(seconds, 2), "embedded": health["embedded"], "measured": "this run"}
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def bench_size(size: int, plan: Plan, onnx: Encoder, messages: list[str], log_dir: Path) -> dict[str, Any]:
    tap = gen_tap.cached_tap(size, CACHE)
    data_dir = CACHE / f"data-{size}-v{gen_tap.VERSION}"
    primed, now = prime(size, tap, data_dir, log_dir, plan)
    out: dict[str, Any] = {"capabilities": size}
    if size in plan.cold_sizes:
        out["cold_start"] = cold_start(tap, log_dir, plan)
    else:
        out["cold_start"] = {**primed, "measured": "in this run, building the cache" if now
                             else f"when the cache was built ({primed['when']}, load {primed['load_average'][0]})"}
    warm = []
    for _ in range(plan.warm_runs - 1):
        fresh_sessions(data_dir)
        with running(tap, data_dir, log_dir, plan.ready_timeout_s) as (_, seconds, health):
            warm.append(seconds)
    fresh_sessions(data_dir)
    with running(tap, data_dir, log_dir, plan.ready_timeout_s) as (daemon, seconds, health):
        warm.append(seconds)
        out["warm_start"] = {"seconds": round(statistics.median(warm), 3), "runs": [round(s, 3) for s in warm],
                             "embedded": health["embedded"], "cached": health["cached"],
                             "triggers": health["triggers"]}
        out["memory_idle"] = daemon.memory_mb()
        out["one_client"] = route_and_encode(daemon, onnx, messages[:plan.latency_messages], plan.latency_budget_s,
                                             f"lat{size}")
        out["per_turn"] = per_turn(daemon, onnx, messages[-plan.turn_messages:], f"turn{size}")
        out["encoder_rates"] = encoder_rates(onnx, messages, plan.level_seconds / 2)
        out["throughput"] = {}
        for clients in CLIENTS:
            out["throughput"][str(clients)] = throughput(daemon, messages, clients, plan.level_seconds,
                                                         plan.level_max_requests, f"tp{size}-{clients}")
        out["memory"] = daemon.memory_mb()
    if size == plan.sizes[0]:
        out["per_turn_fused"] = fused_per_turn(size, plan, onnx, messages, log_dir)
    out["scoring"] = scoring(size, onnx, data_dir, messages[:plan.scoring_messages])
    if size in plan.upkeep_sizes:
        out["upkeep"] = rule_upkeep(size, plan, log_dir)
    return out


EDIT_TRIGGERS = ("rotate the staging signing keys", "which signing keys expire this month",
                 "revoke the signing key for the old build server", "list every signing key and its owner",
                 "create a signing key for the release pipeline")


def add_capability(tap: Path, name: str) -> None:
    """A tap edit: one new capability (a config.toml with a description and five triggers)."""
    folder = tap / "capabilities" / name
    scratch = tap.parent / f".{name}.tmp"  # written whole, then moved in: the watcher sees one complete file
    scratch.mkdir(parents=True)
    quoted = ", ".join(json.dumps(f"{t} ({name})") for t in EDIT_TRIGGERS)
    (scratch / "config.toml").write_text(f'description = "Signing keys ({name})."\ntriggers = [{quoted}]\n',
                                         encoding="utf-8")
    scratch.rename(folder)


def wait_for(daemon: Daemon, capabilities: int, timeout: float) -> float:
    """Seconds until ``/v1/health`` reports ``capabilities`` (the new catalog is live)."""
    started = time.perf_counter()
    daemon.wait_health(lambda h: h.get("capabilities") == capabilities, timeout, "showing the edit")
    return time.perf_counter() - started


class RouteProbe:
    """One client routing distinct messages back to back in a thread, as an agent's turns would
    arrive while the daemon is busy with something else. Latencies (ms) of 200 answers in
    ``samples``; any other status or a transport error counts in ``errors``."""

    def __init__(self, daemon: Daemon, messages: list[str], prefix: str, enabled: bool = True) -> None:
        self.samples: list[float] = []
        self.errors = 0
        self.enabled = enabled  # False: no client at all (what an edit costs with nothing routing)
        self._daemon, self._messages, self._prefix = daemon, messages, prefix
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="route-probe", daemon=True)

    def __enter__(self) -> RouteProbe:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join(60)

    def _run(self) -> None:
        with httpx.Client(base_url=self._daemon.url, timeout=60.0) as client:
            try:  # untimed: opens the connection, which the probe's other routes reuse (a new probe, a new client)
                warm = {"session": f"{self._prefix}-warm", "message": f"warm up: {self._messages[0]}"}
                client.post("/v1/route", json=warm)
            except httpx.TransportError:
                self.errors += 1
            i = 0
            while not self._stop.is_set():
                body = {"session": f"{self._prefix}-{i // 25}", "message": self._messages[i % len(self._messages)]}
                began = time.perf_counter()
                try:
                    ok = client.post("/v1/route", json=body).status_code == 200
                except httpx.TransportError:
                    ok = False
                if ok:
                    self.samples.append((time.perf_counter() - began) * 1000)
                else:
                    self.errors += 1
                i += 1


def rule_upkeep(size: int, plan: Plan, log_dir: Path) -> dict[str, Any]:
    """Per rule (``capd``, ``fused``), on copies of the size's tap and primed data dir (trigger
    vectors cached, nothing fitted): the first start with that rule, two successive tap edits
    (one capability added each; seconds until ``/v1/health`` shows it, the watcher's debounce
    included) and a restart. What ``fused`` adds: its head, the examples' token vectors and
    its auto gates, fitted on the first start and refreshed on each edit (and each applied
    learned correction, which takes the same path). For ``fused`` also a cold start (empty data
    dir: ONNX export, every example embedded with its token vectors, the fits).

    One client routes back to back throughout: for ``plan.probe_seconds`` before the edits
    (idle) and from each edit's write until it is live (while the daemon reloads and refits),
    so the cost of a refit to the agents being served shows as a latency ratio. With
    ``probe_seconds`` 0 nothing routes (what an edit costs an idle daemon)."""
    tap, data_dir = gen_tap.cached_tap(size, CACHE), CACHE / f"data-{size}-v{gen_tap.VERSION}"
    messages = gen_tap.messages(1_000, tap_size=size)
    out: dict[str, Any] = {}
    for rule in ("capd", "fused"):
        scratch = Path(tempfile.mkdtemp(prefix=f"capd-upkeep-{size}-{rule}-"))
        try:
            work_tap, work_data = scratch / "tap", scratch / "data"
            shutil.copytree(tap, work_tap)
            copy_data_dir(data_dir, work_data)
            row: dict[str, Any] = {}
            with running(work_tap, work_data, log_dir, plan.ready_timeout_s, rule=rule) as (daemon, seconds, health):
                row["first_start_s"] = round(seconds, 2)
                probing = plan.probe_seconds > 0
                with RouteProbe(daemon, messages, f"idle-{rule}", probing) as idle:
                    time.sleep(plan.probe_seconds)
                count, edits, during, errors = health["capabilities"], [], [], idle.errors
                for edit in range(2):
                    count += 1
                    with RouteProbe(daemon, messages, f"busy-{rule}-{edit}", probing) as busy:
                        add_capability(work_tap, f"bench-edit-{edit}")
                        edits.append(round(wait_for(daemon, count, plan.ready_timeout_s), 2))
                    during += busy.samples
                    errors += busy.errors
                row["edit_live_s"] = edits
                row["route_idle"], row["route_during_edits"] = stats(idle.samples), stats(during)
                row["route_errors"] = errors
            with running(work_tap, work_data, log_dir, plan.ready_timeout_s, rule=rule) as (_, seconds, _):
                row["restart_s"] = round(seconds, 2)
            if rule == "fused":
                row["cold_start_s"] = cold_start(tap, log_dir, plan, rule)["seconds"]
            out[rule] = row
            print(f"   {rule}: {row}", flush=True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return out


def torch_route(plan: Plan, torch: Encoder, messages: list[str], log_dir: Path) -> dict[str, Any]:
    """A torch-backend daemon on the smallest tap: route vs bare torch encode, interleaved."""
    size = plan.sizes[0]
    tap, data_dir = gen_tap.cached_tap(size, CACHE), CACHE / f"data-{size}-v{gen_tap.VERSION}"
    fresh_sessions(data_dir)
    with running(tap, data_dir, log_dir, plan.ready_timeout_s, backend="torch") as (daemon, seconds, _):
        result = route_and_encode(daemon, torch, messages[:plan.torch_messages], plan.latency_budget_s, "torch")
        return {"capabilities": size, "start_s": round(seconds, 2), **result}


# -- targets, report --------------------------------------------------------------------------

def turn_ratios(turn: dict[str, Any]) -> dict[str, float]:
    """:func:`per_turn`'s routes over its bare encodes (p50s)."""
    encode = turn["encode"]["p50_ms"]
    return {"turn_capd_client_route_p50_over_encode_p50": ratio(turn["route_capd_client"]["p50_ms"], encode),
            "turn_route_p50_over_encode_p50": ratio(turn["route"]["p50_ms"], encode),
            "turn_raw_client_route_p50_over_encode_p50": ratio(turn["route_raw_client"]["p50_ms"], encode)}


def derive(result: dict[str, Any]) -> None:
    """Ratios and pass / fail per target, from the measured figures."""
    sizes = result["sizes"]
    small, large = sizes[0], sizes[-1]
    targets: list[dict[str, Any]] = []

    def target(name: str, value: float, limit: float, unit: str, higher_is_better: bool = False) -> None:
        ok = value >= limit if higher_is_better else value <= limit
        targets.append({"target": name, "value": value, "limit": limit, "unit": unit,
                        "pass": bool(ok), "comparison": ">=" if higher_is_better else "<="})

    for size in sizes:
        row = result["by_size"][str(size)]
        one, tp = row["one_client"], row["throughput"]
        enc, route = one["encode"]["p50_ms"], one["route"]["p50_ms"]
        batched = row["encoder_rates"]["batch32_per_s"]
        anchor = row["scoring"]["anchor_brute"]["p50_ms"]
        row["ratios"] = {
            "route_p50_over_encode_p50": ratio(route, enc),
            "raw_client_route_p50_over_encode_p50": ratio(one["route_raw_client"]["p50_ms"], enc),
            "route_p99_over_route_p50": ratio(one["route"]["p99_ms"], route),
            "route_p50_over_anchor_in_process": ratio(route, enc + anchor),
            "capd_scoring_over_encode": ratio(row["scoring"]["capd_top5"]["p50_ms"], enc),
            "anchor_scoring_over_encode": ratio(anchor, enc),
            "throughput_8_over_1": ratio(tp["8"]["requests_per_s"], tp["1"]["requests_per_s"]),
            "throughput_32_over_1": ratio(tp["32"]["requests_per_s"], tp["1"]["requests_per_s"]),
            "route_p50_over_smallest": ratio(route, result["by_size"][str(small)]["one_client"]["route"]["p50_ms"]),
            "throughput_32_over_encoder_batch32": ratio(tp["32"]["requests_per_s"], batched),
            "encoder_batch32_over_1_client": ratio(batched, tp["1"]["requests_per_s"]),
        }
        label = f"{size:,} caps"
        target(f"route p50 / bare ONNX encode p50 ({label})", row["ratios"]["route_p50_over_encode_p50"], 1.3, "x")
        row["per_turn"]["ratios"] = turn_ratios(row["per_turn"])
        target(f"route p50 (CapdClient) / bare ONNX encode p50, one route per turn ({label})",
               row["per_turn"]["ratios"]["turn_capd_client_route_p50_over_encode_p50"], 1.3, "x")
        if "per_turn_fused" in row:
            row["per_turn_fused"]["ratios"] = turn_ratios(row["per_turn_fused"])
            target(f"`fused` rule: route p50 (CapdClient) / bare ONNX encode p50, one route per turn ({label}; "
                   "the quality issue's limit)",
                   row["per_turn_fused"]["ratios"]["turn_capd_client_route_p50_over_encode_p50"], 1.5, "x")
        target(f"route p99 / p50 ({label})", row["ratios"]["route_p99_over_route_p50"], 3.0, "x")
        target(f"throughput 32 clients / 1 client ({label})", row["ratios"]["throughput_32_over_1"], 4.0, "x",
               higher_is_better=True)
        target(f"warm start to ready ({label})", row["warm_start"]["seconds"], 3.0, "s")
    if "torch" in result:
        torch = result["torch"]
        torch["route_p50_over_encode_p50"] = ratio(torch["route"]["p50_ms"], torch["encode"]["p50_ms"])
        target(f"route p50 / bare torch encode p50 ({small:,} caps, torch daemon)",
               torch["route_p50_over_encode_p50"], 1.3, "x")
    if large >= 10_000:
        target(f"RSS after load ({large:,} caps)", result["by_size"][str(large)]["memory"]["rss_mb"], 600, "MB")
        target(f"route p50 {large:,} caps / {small:,} caps",
               result["by_size"][str(large)]["ratios"]["route_p50_over_smallest"], 1.2, "x")
    result["targets"] = targets


def turn_cell(turn: dict[str, Any]) -> str:
    ratios = turn["ratios"]
    capd, route, raw, encode = (turn[k]["p50_ms"] for k in ("route_capd_client", "route", "route_raw_client", "encode"))
    return (f"{capd:.2f} / {route:.2f} / {raw:.2f}; {encode:.2f}; "
            f"**{ratios['turn_capd_client_route_p50_over_encode_p50']}x** "
            f"({ratios['turn_route_p50_over_encode_p50']}x / {ratios['turn_raw_client_route_p50_over_encode_p50']}x)")


def markdown(result: dict[str, Any]) -> str:
    sizes = result["sizes"]
    rows = result["by_size"]

    def cells(getter: Callable[[dict[str, Any]], object]) -> str:
        return " | ".join(str(getter(rows[str(s)])) for s in sizes)

    head = "| measure | " + " | ".join(f"{s:,} caps" for s in sizes) + " |"
    lines = [
        f"# Daemon benchmark{' (quick)' if result['quick'] else ''}",
        "",
        f"`{result['command']}` on {result['machine']}; load average {result['load_before']} before, "
        f"{result['load_after']} after; {result['minutes']} min. Real `capd serve` process, loopback HTTP, "
        "keep-alive httpx clients (and one raw-socket HTTP client), ONNX backend, distinct messages with session ids.",
        "",
        head,
        "|---|" + "---|" * len(sizes),
        "| triggers | " + cells(lambda r: f"{r['warm_start']['triggers']:,}") + " |",
        "| route p50 / p99, 1 client (ms) | " + cells(
            lambda r: f"{r['one_client']['route']['p50_ms']:.2f} / {r['one_client']['route']['p99_ms']:.2f}") + " |",
        "| bare ONNX encode p50 / p99, same messages (ms) | " + cells(
            lambda r: f"{r['one_client']['encode']['p50_ms']:.2f} / {r['one_client']['encode']['p99_ms']:.2f}") + " |",
        "| **route p50 / bare encode p50** | " + cells(lambda r: f"**{r['ratios']['route_p50_over_encode_p50']}x**")
        + " |",
        "| route p50 / p99, 1 raw-socket HTTP client (ms; p50 / bare encode p50) | " + cells(
            lambda r: f"{r['one_client']['route_raw_client']['p50_ms']:.2f} / "
                      f"{r['one_client']['route_raw_client']['p99_ms']:.2f} "
                      f"({r['ratios']['raw_client_route_p50_over_encode_p50']}x)") + " |",
        f"| one route per turn (each call after {TURN_GAP_S * 1000:.0f} ms idle): route p50, CapdClient / httpx / "
        "raw socket; bare encode p50 (ms); **route through CapdClient / encode** (httpx / raw socket) | "
        + cells(lambda r: turn_cell(r["per_turn"])) + " |",
        "| the same, `fused` rule daemon | " + cells(
            lambda r: turn_cell(r["per_turn_fused"]) if "per_turn_fused" in r else "—") + " |",
        "| route p99 / route p50 | " + cells(lambda r: f"{r['ratios']['route_p99_over_route_p50']}x") + " |",
        "| capd scoring, top-5 exact (ms; / encode) | " + cells(
            lambda r: f"{r['scoring']['capd_top5']['p50_ms']:.3f} ({r['ratios']['capd_scoring_over_encode']}x)")
        + " |",
        "| anchor rule scoring, brute mean-top-3 (ms; / encode) | " + cells(
            lambda r: f"{r['scoring']['anchor_brute']['p50_ms']:.3f} ({r['ratios']['anchor_scoring_over_encode']}x)")
        + " |",
        "| route p50 / in-process anchor (encode + brute scoring) | " + cells(
            lambda r: f"{r['ratios']['route_p50_over_anchor_in_process']}x") + " |",
        "| route p50 / route p50 of the smallest tap | " + cells(
            lambda r: f"{r['ratios']['route_p50_over_smallest']}x") + " |",
    ]
    for clients in CLIENTS:
        def level(r: dict[str, Any], c: int = clients) -> str:
            row = r["throughput"][str(c)]
            return f"{row['requests_per_s']} ({row['latency']['p50_ms']:.1f} / {row['latency']['p99_ms']:.1f})"
        lines.append(f"| throughput, {clients} client{'s' if clients > 1 else ''} (req/s; p50 / p99 ms) | "
                     + cells(level) + " |")
    lines += [
        "| **throughput 32 / 1 client** | " + cells(lambda r: f"**{r['ratios']['throughput_32_over_1']}x**") + " |",
        "| bare ONNX encoder in process: 1 at a time / batches of 32 (msg/s) | " + cells(
            lambda r: f"{r['encoder_rates']['single_per_s']} / {r['encoder_rates']['batch32_per_s']}") + " |",
        "| ceiling for 32 / 1 client: batched encoder / 1-client throughput | " + cells(
            lambda r: f"{r['ratios']['encoder_batch32_over_1_client']}x") + " |",
        "| daemon CPU per request, 1 / 32 clients (ms) | " + cells(
            lambda r: f"{r['throughput']['1']['daemon_cpu_ms_per_request']} / "
                      f"{r['throughput']['32']['daemon_cpu_ms_per_request']}") + " |",
        "| RSS idle / after load (MB) | " + cells(lambda r: f"{r['memory_idle']['rss_mb']:.0f} / "
                                                 f"{r['memory']['rss_mb']:.0f}") + " |",
        "| warm start to ready (s, median) | " + cells(lambda r: f"{r['warm_start']['seconds']:.2f}") + " |",
        "| cold start to ready (s; empty data dir) | " + cells(
            lambda r: f"{r['cold_start']['seconds']:.1f}" + ("" if r["cold_start"]["measured"] == "this run"
                                                            else "†")) + " |",
        "",
    ]
    torch = result.get("torch")
    if torch:
        lines += [f"Torch backend ({torch['capabilities']} caps): route p50 / p99 {torch['route']['p50_ms']:.2f} / "
                  f"{torch['route']['p99_ms']:.2f} ms, bare torch encode p50 {torch['encode']['p50_ms']:.2f} ms: "
                  f"**{torch['route_p50_over_encode_p50']}x**. Bare ONNX / torch encode p50: "
                  f"{result['onnx_over_torch']}x.", ""]
    elif "torch_encode" in result:
        lines += [f"Bare torch encode p50 / p99: {result['torch_encode']['p50_ms']:.2f} / "
                  f"{result['torch_encode']['p99_ms']:.2f} ms (ONNX / torch: {result['onnx_over_torch']}x).", ""]
    overhead = result.get("overhead")
    if overhead:
        lines += [f"The daemon's own cost per route (hash model, whose encode takes microseconds; {sizes[0]:,} caps, "
                  f"one raw-socket client, session ids): p50 / p99 {overhead['route']['p50_ms']:.2f} / "
                  f"{overhead['route']['p99_ms']:.2f} ms, daemon CPU {overhead['daemon_cpu_ms_per_route']:.2f} ms "
                  "per route.", ""]
    cold_notes = [f"{s:,}: {rows[str(s)]['cold_start']['measured']}" for s in sizes
                  if rows[str(s)]["cold_start"]["measured"] != "this run"]
    if cold_notes:
        lines += [f"† not measured like the others (those start from an empty temporary data dir each run): "
                  f"{'; '.join(cold_notes)}.", ""]
    lines += upkeep_lines(result)
    lines += ["## Targets", "", "| target | measured | limit | |", "|---|---|---|---|"]
    for t in result["targets"]:
        lines.append(f"| {t['target']} | {t['value']} {t['unit']} | {t['comparison']} {t['limit']} {t['unit']} | "
                     f"{'pass' if t['pass'] else '**miss**'} |")
    lines.append("")
    return "\n".join(lines)


def upkeep_lines(result: dict[str, Any]) -> list[str]:
    sizes = [s for s in result["sizes"] if "upkeep" in result["by_size"][str(s)]]
    if not sizes:
        return []
    lines = ["## Keeping a rule's fitted state fresh", "",
             "On copies of each tap and its data dir (trigger vectors cached, nothing fitted): the first start "
             "with the rule, two tap edits while it runs (one capability added each; seconds until `/v1/health` "
             "shows it, the watcher's debounce included), then a restart. `fused` fits its head, its examples' "
             "token vectors and its auto gates on the first start; an edit refits the head, and the auto gates "
             f"carry over until more than {AUTO_REFIT_SHARE:.0%} of the capabilities changed since their fit.", "",
             "| rule | " + " | ".join(f"{s:,} caps: first start / edit 1, edit 2 / restart (s)" for s in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for rule in ("capd", "fused"):
        cells = []
        for size in sizes:
            row = result["by_size"][str(size)]["upkeep"][rule]
            cells.append(f"{row['first_start_s']:.1f} / {', '.join(f'{e:.1f}' for e in row['edit_live_s'])} / "
                         f"{row['restart_s']:.1f}")
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    cold = [(s, result["by_size"][str(s)]["upkeep"]["fused"].get("cold_start_s")) for s in sizes]
    if all(seconds is not None for _, seconds in cold):
        lines += ["", "`fused` from an empty data dir (ONNX export, every example embedded once with its token "
                  "vectors, the fits): " + ", ".join(f"{s:,} caps {seconds:.1f} s" for s, seconds in cold) + "."]
    rows = [result["by_size"][str(size)]["upkeep"][rule] for size in sizes for rule in ("capd", "fused")]
    if not all(row.get("route_idle", {}).get("n") for row in rows):
        return [*lines, "", "Nothing routed meanwhile (`--probe-seconds 0`).", ""]
    lines += ["", "Routing meanwhile: one client routing back to back, idle before the edits and from each edit's "
              "write until it is live (ms; errors counted over both).", "",
              "| rule | " + " | ".join(f"{s:,} caps: p50 idle → during edits | p99 idle → during edits"
                                        for s in sizes) + " |",
              "|---|" + "---|---|" * len(sizes)]
    for rule in ("capd", "fused"):
        cells = []
        for size in sizes:
            row = result["by_size"][str(size)]["upkeep"][rule]
            idle, busy = row["route_idle"], row["route_during_edits"]
            cells.append(f"{idle['p50_ms']:.1f} → {busy['p50_ms']:.1f} | {idle['p99_ms']:.1f} → {busy['p99_ms']:.1f}"
                         + (f" ({row['route_errors']} errors)" if row["route_errors"] else ""))
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def upkeep_only(sizes: list[int], plan: Plan) -> dict[str, Any]:
    """:func:`rule_upkeep` alone (priming each size's cache first if needed)."""
    log_dir = Path(tempfile.mkdtemp(prefix="capd-bench-upkeep-"))
    result: dict[str, Any] = {"command": ".venv/bin/python -m benchmarks.bench_daemon --upkeep "
                              + ",".join(map(str, sizes)) + f" --probe-seconds {plan.probe_seconds:g}",
                              "machine": f"{os.cpu_count()} CPUs", "load_before": load_average(),
                              "sizes": sizes, "by_size": {}}
    try:
        for size in sizes:
            print(f"== {size:,} capabilities", flush=True)
            prime(size, gen_tap.cached_tap(size, CACHE), CACHE / f"data-{size}-v{gen_tap.VERSION}", log_dir, plan)
            result["by_size"][str(size)] = {"upkeep": rule_upkeep(size, plan, log_dir)}
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    result["load_after"] = load_average()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "upkeep.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    text = "\n".join([f"# rule upkeep ({result['command']})", "", *upkeep_lines(result)])
    (RESULTS / "upkeep.md").write_text(text, encoding="utf-8")
    print(text)
    return result


def fused_per_turn(size: int, plan: Plan, onnx: Encoder, messages: list[str], log_dir: Path) -> dict[str, Any]:
    """:func:`per_turn` for a ``fused`` daemon, on a copy of the size's data dir (the fits it
    caches would otherwise make :func:`rule_upkeep`'s first start a warm one)."""
    tap, data_dir = gen_tap.cached_tap(size, CACHE), CACHE / f"data-{size}-v{gen_tap.VERSION}"
    with tempfile.TemporaryDirectory(prefix=f"capd-turns-{size}-fused-") as scratch:
        work = Path(scratch) / "data"
        copy_data_dir(data_dir, work)
        with running(tap, work, log_dir, plan.ready_timeout_s, rule="fused") as (daemon, _, _):
            warm_routes(daemon, messages)
            return per_turn(daemon, onnx, messages[-plan.turn_messages:], f"turn{size}-fused")


def warm_routes(daemon: Daemon, messages: list[str]) -> None:
    with httpx.Client(base_url=daemon.url, timeout=30.0) as client:
        for i in range(20):  # the connection, the threadpool and the model
            client.post("/v1/route", json={"session": "warm", "message": f"warm up {i}: {messages[i]}"})


def turns_only(plan: Plan) -> dict[str, Any]:
    """``--turns``: :func:`per_turn` on the smallest tap, with the ``capd`` rule and with ``fused``,
    printed with their ratios."""
    size = plan.sizes[0]
    tap, data_dir = gen_tap.cached_tap(size, CACHE), CACHE / f"data-{size}-v{gen_tap.VERSION}"
    messages = gen_tap.messages(4_000, tap_size=size)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="capd-bench-turns-") as logs:
        prime(size, tap, data_dir, Path(logs), plan)
        onnx = open_encoder(Settings(data_dir=data_dir, backend="onnx", taps=()))
        for message in messages[:20]:
            onnx.embed([message])
        fresh_sessions(data_dir)
        with running(tap, data_dir, Path(logs), plan.ready_timeout_s) as (daemon, _, _):
            warm_routes(daemon, messages)
            out["capd"] = per_turn(daemon, onnx, messages[-plan.turn_messages:], f"turn{size}")
        out["fused"] = fused_per_turn(size, plan, onnx, messages, Path(logs))
    for turn in out.values():
        turn["ratios"] = turn_ratios(turn)
    print(json.dumps(out))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="capd daemon benchmark")
    parser.add_argument("--quick", action="store_true", help="60 and 1,000 capabilities, short loops (~1.5 min)")
    parser.add_argument("--upkeep", metavar="SIZES", help="only rule_upkeep, on these tap sizes (e.g. 60,1000): "
                        "benchmarks/results/upkeep.{json,md}")
    parser.add_argument("--probe-seconds", type=float, default=FULL.probe_seconds,
                        help="rule_upkeep's idle routing before the edits; 0: no client routes at all")
    parser.add_argument("--turns", action="store_true",
                        help="only one route per turn on the smallest tap, against the bare encode, printed (~1 min)")
    parser.add_argument("--overhead", action="store_true",
                        help="only the daemon's own cost per route (hash model), printed (~15 s)")
    args = parser.parse_args(argv if argv is not None else [])
    plan = replace(QUICK if args.quick else FULL, probe_seconds=args.probe_seconds)
    if args.upkeep:
        return upkeep_only([int(size) for size in args.upkeep.split(",")], plan)
    if args.turns:
        return turns_only(plan)
    if args.overhead:
        with tempfile.TemporaryDirectory(prefix="capd-bench-daemon-") as logs:
            overhead = daemon_overhead(plan, gen_tap.messages(4_000, tap_size=plan.sizes[0]), Path(logs))
        print(json.dumps(overhead))
        return overhead
    began = time.perf_counter()
    load_before = load_average()
    log_dir = Path(tempfile.mkdtemp(prefix="capd-bench-daemon-"))
    messages = gen_tap.messages(4_000, tap_size=plan.sizes[0])
    result: dict[str, Any] = {
        "command": ".venv/bin/python -m benchmarks.bench_daemon" + (" --quick" if args.quick else ""),
        "machine": f"{os.cpu_count()} CPUs", "quick": args.quick, "plan": asdict(plan), "load_before": load_before,
        "sizes": list(plan.sizes), "by_size": {},
    }
    try:
        settings = Settings(data_dir=CACHE / f"data-{plan.sizes[0]}-v{gen_tap.VERSION}", backend="onnx", taps=())
        gen_tap.cached_tap(plan.sizes[0], CACHE)
        prime(plan.sizes[0], gen_tap.cached_tap(plan.sizes[0], CACHE), settings.data_dir, log_dir, plan)
        onnx = open_encoder(settings)
        for message in messages[:20]:
            onnx.embed([message])
        print("== the daemon's own cost per route (hash model)", flush=True)
        result["overhead"] = daemon_overhead(plan, messages, log_dir)
        for size in plan.sizes:
            print(f"== {size:,} capabilities", flush=True)
            result["by_size"][str(size)] = bench_size(size, plan, onnx, messages, log_dir)
        torch, result["torch_encode"] = torch_bare(plan, settings, messages)
        if plan.torch_daemon:
            print("== torch backend", flush=True)
            result["torch"] = torch_route(plan, torch, messages, log_dir)
            torch_p50 = result["torch"]["encode"]["p50_ms"]
        else:
            torch_p50 = result["torch_encode"]["p50_ms"]
        result["onnx_over_torch"] = ratio(result["by_size"][str(plan.sizes[0])]["one_client"]["encode"]["p50_ms"],
                                          torch_p50)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    result["load_after"] = load_average()
    result["minutes"] = round((time.perf_counter() - began) / 60, 1)
    derive(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "daemon-quick" if args.quick else "daemon"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    text = markdown(result)
    (RESULTS / f"{stem}.md").write_text(text, encoding="utf-8")
    try:
        from benchmarks.plot import plot
        plot(result, RESULTS / f"{stem}.png")
    except ImportError as exc:
        print(f"no plot: {exc} (pip install matplotlib)", file=sys.stderr)
    print(text)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
