"""``Service.aroute`` (what ``POST /v1/route`` awaits) behaves exactly like ``Service.route``."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from capd import session_routing
from capd.api import create_app
from capd.service import Service
from capd.settings import Settings
from tests.conftest import HeldEncoder, SettingsFactory
from tests.taputil import octomind_tap

MESSAGES = [
    "please run a query on the postgres database",
    "please run a query on the postgres database",  # already active the second time
    "read the file in my project folder",
    "hi",  # too short: skipped, still reconciles the session
    "<context>only a tag</context>",
    "what a lovely afternoon for a walk by the river",
]


def _service(settings_factory: SettingsFactory, tmp_path: Path, name: str) -> Service:
    settings = settings_factory(taps=(octomind_tap(tmp_path / name),), max_active=2)
    return Service(settings, sessions=True).start()


@pytest.mark.parametrize("offload", [False, True], ids=["on-loop", "in-thread"])
def test_aroute_matches_route(settings_factory: SettingsFactory, tmp_path: Path, offload: bool,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    if offload:  # what a large index does: score in a worker thread
        monkeypatch.setattr(session_routing, "OFFLOAD_TRIGGERS", 0)
    blocking, awaiting = _service(settings_factory, tmp_path, "a"), _service(settings_factory, tmp_path, "b")
    try:
        for session in ("s1", None):
            for message in MESSAGES:
                expected = blocking.route(message, session)
                got = asyncio.run(awaiting.aroute(message, session))
                assert got.as_dict() == expected.as_dict(), message
                assert got.latency_ms > 0
        def active(service: Service) -> list[tuple[str, str]]:
            assert service.registry is not None
            return [(a["name"], a["origin"]) for a in service.registry.get("s1").as_dict()["active"]]

        assert active(awaiting) == active(blocking) == [("database-postgres", "auto"), ("filesystem-read", "auto")]
        decisions = [line for line in awaiting.metrics.render().splitlines()
                     if line.startswith("capd_decisions_total")]
        assert decisions == [line for line in blocking.metrics.render().splitlines()
                             if line.startswith("capd_decisions_total")]
        assert any('decision="skipped"' in line for line in decisions)
    finally:
        blocking.close()
        awaiting.close()


def test_aroute_while_warming_up(settings_factory: SettingsFactory) -> None:
    service = Service(settings_factory(), sessions=True)  # never started
    result = asyncio.run(service.aroute("please run a query on the postgres database", "s1"))
    assert result.decision.decision == "skipped" and "warming up" in result.decision.reason
    assert result.plan is None


def test_aroute_matches_route_with_the_fused_second_stage(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """``fused`` routes with the message's token vectors on both paths (the micro-batcher hands them back)."""
    services = [Service(settings_factory(taps=(octomind_tap(tmp_path / name),), rule="fused"), sessions=True).start()
                for name in ("a", "b")]
    blocking, awaiting = services
    try:
        assert awaiting.router.head is not None and awaiting.router.head.tokens is not None
        for message in MESSAGES:
            expected = blocking.route(message, "s1")
            assert asyncio.run(awaiting.aroute(message, "s1")).as_dict() == expected.as_dict(), message
    finally:
        for service in services:
            service.close()


def test_a_message_too_short_to_route_writes_its_session_off_the_event_loop(
        settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """Its plan (a session store write) ran on the event loop: with another process holding
    sessions.sqlite3 the write waited half a second, and every request in the daemon with it."""
    from tests.conftest import file_held

    service = _service(settings_factory, tmp_path, "tap")
    assert service.registry is not None

    async def longest_stall(message: str) -> tuple[float, str]:
        stalls: list[float] = []
        done = False

        async def tick() -> None:  # how long the loop goes without running it, every 5 ms asked
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                stalls.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        result = await service.aroute(message, "s")
        done = True
        await ticker
        return max(stalls), result.decision.decision

    try:
        service.registry.activate("s", "database-postgres")
        with file_held(service.registry.store.path):  # every write waits for it, then fails
            stall, decision = asyncio.run(longest_stall("hi"))
        assert decision == "skipped" and stall < 0.2, stall
    finally:
        service.close()


def test_a_capability_removed_while_its_message_is_routed_is_an_abstain(
        settings_factory: SettingsFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload between the decision (the old index) and the activation (the new catalog) raised
    UnknownCapability: `POST /v1/route` answered 404 unknown_capability for a valid request."""
    from capd.router import Router

    tap = octomind_tap(tmp_path / "tap")
    service = Service(settings_factory(taps=(tap,)), sessions=True).start()
    decide = Router.decide

    def decide_then_reload(router: Router, *args: object, **kwargs: object) -> object:
        decision = decide(router, *args, **kwargs)  # type: ignore[arg-type]
        shutil.rmtree(tap / "capabilities" / "database-postgres")  # the tap drops it at that moment
        service.reload()
        return decision

    monkeypatch.setattr(Router, "decide", decide_then_reload)
    try:
        result = asyncio.run(service.aroute("please run a query on the postgres database", "s"))
        assert result.decision.decision == "abstain" and "removed by a tap reload" in result.decision.reason
        assert result.plan is not None and result.plan.as_dict()["active"] == []
    finally:
        service.close()


def test_a_route_whose_client_left_changes_no_session_and_a_lost_plan_can_be_fetched_again(tmp_path: Path) -> None:
    """A route whose client gave up (a timeout, a dropped connection) was committed all the same: the
    agent never got the plan, the next route said already_active with nothing to start, and capd
    counted a server as running that the agent never started. The session is now left as it was;
    and GET /v1/sessions/{id}/plan gives back what to start for the session as capd holds it."""
    port, encoder = _free_port(), HeldEncoder()
    settings = Settings(taps=(octomind_tap(tmp_path / "tap"),), model="hash", data_dir=tmp_path / "data")
    server = uvicorn.Server(uvicorn.Config(create_app(settings, encoder=encoder, watch=False), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    body = json.dumps({"session": "s1", "message": "please run a query on the postgres database"}).encode()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            deadline = time.monotonic() + 30
            while not server.started or not http.get("/v1/health").json()["ready"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            encoder.hold.set()
            with socket.create_connection(("127.0.0.1", port)) as gone:
                gone.sendall(b"POST /v1/route HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                assert encoder.reached.wait(30)
            time.sleep(0.5)  # the server sees the connection closed
            encoder.hold.clear()
            encoder.release.set()
            time.sleep(0.5)  # where the old code went on to commit the route
            assert http.get("/v1/sessions/s1").status_code == 404  # never started
            routed = http.post("/v1/route", json=json.loads(body))
            assert routed.json()["decision"] == "activate" and routed.json()["plan"]["start"]
            resumed = http.get("/v1/sessions/s1/plan").json()
            assert resumed == {**routed.json()["plan"], "teardown": []}  # all there is to start, nothing to stop
            assert http.get("/v1/sessions/nobody/plan").status_code == 404
    finally:
        encoder.release.set()
        server.should_exit = True
        thread.join(30)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
