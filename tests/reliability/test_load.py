"""Load: N sessions x M mixed operations against a real daemon over HTTP, from a thread pool.

Each session is driven by one thread (its operations are sequential, so the client-side
model can predict every plan); the sessions run concurrently. Afterwards every session is
compared with the model and with the refcounts replayed from the plans the daemon returned.
Quick: 8 sessions x 25 operations. Full: 50 sessions x at least 200 operations for at least
60 s; the p99 latency goes to benchmarks/results/reliability.json.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.harness import (
    FLEET,
    FLEET_BY_NAME,
    FULL,
    RESULTS,
    Daemon,
    DaemonFactory,
    fleet_tap,
    percentile,
    sized,
)
from tests.reliability.sessionmodel import SessionModel, normalize

pytestmark = pytest.mark.reliability

SESSIONS = sized(8, 50)
OPS = sized(25, 200)  # per session, at least
MIN_SECONDS = sized(0.0, 60.0)  # keep going (up to MAX_OPS) until this long has passed
MAX_OPS = sized(25, 3000)
MAX_SECONDS = sized(40.0, 240.0)  # hard stop for the whole run
MAX_ACTIVE = 3
PINNED = ("fs-read",)
NONSENSE = ("quarterly budget meeting notes for the marketing team", "a poem about autumn leaves falling",
            "ok thanks", "hi", "<context>query the postgres database</context> ok")


@dataclass
class Tally:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    statuses: Counter[int] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    ops: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, kind: str, seconds: float, status: int) -> None:
        with self.lock:
            self.latencies.setdefault(kind, []).append(seconds)
            self.statuses[status] += 1
            self.ops += 1

    def fail(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)


class Driver:
    """One session's operations, each checked against the model as it returns."""

    def __init__(self, http: httpx.Client, model: SessionModel, rng: random.Random, tally: Tally) -> None:
        self.http, self.model, self.rng, self.tally = http, model, rng, tally

    def call(self, kind: str, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        started = time.perf_counter()
        response = self.http.request(method, path, json=body)
        self.tally.record(kind, time.perf_counter() - started, response.status_code)
        if response.status_code >= 500:
            self.tally.fail(f"{method} {path} {body} -> {response.status_code} {response.text[:300]}")
        return response

    def check_plan(self, what: str, response: httpx.Response, status: int, expected: dict[str, Any] | None,
                   plan_of: Any = lambda body: body) -> None:
        session = self.model.session
        if response.status_code != status:
            self.tally.fail(f"{session} {what}: status {response.status_code} != {status}: {response.text[:200]}")
            return
        if expected is None:
            return
        plan = plan_of(response.json())
        if normalize(plan) != expected:
            self.tally.fail(f"{session} {what}: plan {normalize(plan)} != expected {expected}")
        for problem in self.model.replay(plan):
            self.tally.fail(f"{session} {what}: {problem}")

    def enable(self) -> None:
        name = self.rng.choice([c.name for c in FLEET]) if self.rng.random() > 0.05 else "no-such-capability"
        status, expected = self.model.expect_enable(name, "manual")
        self.check_plan(f"enable {name}", self.call("enable", "POST", f"/v1/sessions/{self.model.session}/enable",
                                                    {"name": name}), status, expected)

    def disable(self) -> None:
        active = [n for n in self.model.replayed if n not in PINNED]
        roll = self.rng.random()
        name = (self.rng.choice(active) if active and roll < 0.7 else PINNED[0] if roll < 0.8
                else self.rng.choice([c.name for c in FLEET]))
        status, expected = self.model.expect_disable(name)
        self.check_plan(f"disable {name}", self.call("disable", "POST",
                                                     f"/v1/sessions/{self.model.session}/disable", {"name": name}),
                        status, expected)

    def tool_result(self) -> None:
        choices = [(s.name, t) for n in self.model.replayed for s in FLEET_BY_NAME[n].servers for t in s.tools]
        server, tool = self.rng.choice(choices) if choices and self.rng.random() < 0.8 else ("git", "push")
        tool = "some_tool" if tool == "*" else tool
        ok = self.rng.random() < 0.8
        status, bumped = self.model.expect_tool_result(server, tool, ok)
        response = self.call("tool-result", "POST", f"/v1/sessions/{self.model.session}/tool-result",
                             {"server": server, "tool": tool, "ok": ok})
        if response.status_code != status or (bumped is not None and response.json()["bumped"] != bumped):
            self.tally.fail(f"{self.model.session} tool-result {server}:{tool} ok={ok}: {response.status_code} "
                            f"{response.text[:200]} != {status} {bumped}")

    def route(self) -> None:
        roll = self.rng.random()
        message = self.rng.choice(self.rng.choice(FLEET).triggers) if roll < 0.7 else self.rng.choice(NONSENSE)
        response = self.call("route", "POST", "/v1/route", {"session": self.model.session, "message": message})
        if response.status_code != 200:
            self.tally.fail(f"{self.model.session} route {message!r}: {response.status_code} {response.text[:200]}")
            return
        body = response.json()
        if body["decision"] == "activate":
            if body["capability"] in self.model.active:
                self.tally.fail(f"{self.model.session}: activate of already active {body['capability']}")
            expected = self.model.expect_enable(body["capability"], "auto")[1]
        elif body["decision"] == "already_active":  # routed to again: its last_used is refreshed
            if body["capability"] not in self.model.active:
                self.tally.fail(f"{self.model.session}: already_active {body['capability']} is not active")
            expected = self.model.expect_enable(body["capability"], "auto")[1]
        else:
            expected = self.model.expect_reconcile()
        self.check_plan(f"route {message!r}", response, 200, expected, plan_of=lambda b: b["plan"])

    def verify(self) -> None:
        state = self.call("get", "GET", f"/v1/sessions/{self.model.session}")
        if state.status_code != 200:
            self.tally.fail(f"{self.model.session}: GET -> {state.status_code}")
            return
        for problem in self.model.check_state(state.json()):
            self.tally.fail(problem)


def _drive(daemon_url: str, index: int, tally: Tally, started: float) -> int:
    rng = random.Random(7000 + index)
    model = SessionModel(f"load-{index}", FLEET_BY_NAME, MAX_ACTIVE, PINNED)
    actions = ["route"] * 30 + ["enable"] * 25 + ["disable"] * 20 + ["tool_result"] * 20 + ["verify"] * 5
    done = 0
    with httpx.Client(base_url=daemon_url, timeout=30) as http:
        driver = Driver(http, model, rng, tally)
        driver.enable()
        while done < MAX_OPS and time.monotonic() - started < MAX_SECONDS:
            if done >= OPS and time.monotonic() - started >= MIN_SECONDS:
                break
            getattr(driver, rng.choice(actions))()
            done += 1
        driver.verify()
    return done


def test_sessions_under_load(tmp_path: Path, daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory([fleet_tap(tmp_path)], env={"CAPD_MAX_ACTIVE": str(MAX_ACTIVE),
                                                         "CAPD_PINNED": ",".join(PINNED), "CAPD_LOG_LEVEL": "warning"})
    tally = Tally()
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=SESSIONS, thread_name_prefix="load") as pool:
        done = list(pool.map(lambda i: _drive(daemon.url, i, tally, started), range(SESSIONS)))
    elapsed = time.monotonic() - started

    with daemon.client() as http:  # the whole picture once more, after the dust settled
        for index in range(SESSIONS):
            marked = {c["name"] for c in http.get("/v1/capabilities", params={"session": f"load-{index}"})
                      .json()["capabilities"] if c["active"]}
            state = {a["name"] for a in http.get(f"/v1/sessions/load-{index}").json()["active"]}
            assert marked == state
        metrics = http.get("/metrics").text

    everything = [s for values in tally.latencies.values() for s in values]
    report = {
        "sessions": SESSIONS, "operations": tally.ops, "min_ops_per_session": min(done), "seconds": round(elapsed, 2),
        "throughput_per_s": round(tally.ops / elapsed, 1), "statuses": dict(sorted(tally.statuses.items())),
        "p50_ms": round(percentile(everything, 50) * 1000, 2), "p99_ms": round(percentile(everything, 99) * 1000, 2),
        "max_ms": round(max(everything) * 1000, 2),
        "per_operation": {kind: {"n": len(v), "p50_ms": round(percentile(v, 50) * 1000, 2),
                                 "p99_ms": round(percentile(v, 99) * 1000, 2)} for kind, v in tally.latencies.items()},
        "model": "hash", "max_active": MAX_ACTIVE, "pinned": list(PINNED), "size": "full" if FULL else "quick",
    }
    print("\nreliability load:", json.dumps(report))
    if FULL:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / "reliability.json"
        existing = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**existing, "load": report}, indent=2) + "\n")

    _one_client_is_not_stalled(daemon)
    assert not tally.problems, f"{len(tally.problems)} problems, first ones:\n" + "\n".join(tally.problems[:15])
    assert not [s for s in tally.statuses if s >= 500]
    assert min(done) >= OPS and (elapsed >= MIN_SECONDS or not FULL)
    assert tally.statuses[200] > 0.8 * tally.ops
    assert 'status="500"' not in metrics and "Traceback" not in daemon.log_text()



def _one_client_is_not_stalled(daemon: Daemon) -> None:
    """Sequential requests on one keep-alive connection answer in milliseconds: without TCP_NODELAY on the
    daemon's sockets, Nagle's algorithm and delayed ACKs added ~40 ms to every response on loopback."""
    with daemon.client() as http:
        timings = []
        for i in range(40):
            started = time.perf_counter()
            response = http.post("/v1/sessions/one-client/enable", json={"name": FLEET[i % len(FLEET)].name})
            timings.append(time.perf_counter() - started)
            assert response.status_code == 200
    assert percentile(timings, 50) < 0.03, f"median {percentile(timings, 50) * 1000:.1f} ms"
