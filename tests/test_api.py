"""The HTTP API end to end: the real app (TestClient) with the real bundled model."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from starlette.types import Receive, Scope, Send

import capd.api
import capd.api_guard
from capd.api import create_app, upkeep
from capd.encoder import HashEncoder, Vectors
from capd.errors import ModelError
from capd.service import Service
from capd.settings import Settings
from tests.conftest import GatedEncoder, SettingsFactory, isolated_data_dir
from tests.taputil import docker_and_postgres, local_client, octomind_tap, write_capability


@pytest.fixture
def api(tmp_path: Path, model_settings: Settings) -> Iterator[TestClient]:
    settings = replace(isolated_data_dir(model_settings, tmp_path), max_active=2, taps=(octomind_tap(tmp_path),))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        yield client


def test_health_and_capabilities(api: TestClient) -> None:
    health = api.get("/v1/health").json()
    assert health["ready"] is True and health["status"] == "ok"
    assert health["capabilities"] == 5 and health["triggers"] == 11 and health["errors"] == []
    assert health["embedded"] + health["cached"] == 11
    assert (health["rule"], health["rule_from"]) == ("capd", "default")
    caps = api.get("/v1/capabilities").json()["capabilities"]
    assert {c["name"] for c in caps} >= {"database-postgres", "filesystem-read"}
    assert all(c["active"] is False for c in caps)


def test_a_daemon_routes_with_the_rule_its_tap_names(tmp_path: Path, model_settings: Settings) -> None:
    """Settings built as ``capd serve`` builds them: the tap's capd.toml names fused, nothing else
    names a rule, so the daemon routes with fused (its scores are levels, its margins log-odds gaps)."""
    from capd.settings import load_settings

    tap = octomind_tap(tmp_path)
    (tap / "capd.toml").write_text('rule = "fused"\n')
    env = {"CAPD_TAPS": str(tap), "CAPD_CONFIG": "", "CAPD_DATA_DIR": str(tmp_path / "data")}
    settings = replace(load_settings(env=env), models_dir=model_settings.models_dir)
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        health = client.get("/v1/health").json()
        assert (health["rule"], health["rule_from"]) == ("fused", str(tap / "capd.toml"))
        routed = client.post("/v1/route", json={"message": "please run a query on the postgres database"}).json()
        assert routed["capability"] == "database-postgres" and "level" in routed["reason"]


def test_route_activates_then_already_active(api: TestClient) -> None:
    body = {"session": "s1", "message": "please run a query on the postgres database"}
    first = api.post("/v1/route", json=body).json()
    assert first["decision"] == "activate" and first["capability"] == "database-postgres"
    (start,) = first["plan"]["start"]
    assert start["capability"] == "database-postgres" and start["tools"] == ["*"]
    assert start["server"]["name"] == "postgres" and start["server"]["command"] == "npx"
    assert "{{ENV:POSTGRES_CONNECTION_STRING}}" in start["server"]["args"]
    assert set(first) == {"decision", "capability", "score", "margin", "reason", "plan", "candidates"}
    api.post("/v1/sessions/s1/enable", json={"name": "filesystem-read"})
    second = api.post("/v1/route", json=body).json()
    assert second["decision"] == "already_active"
    assert second["plan"] == {"start": [], "teardown": [], "active": ["database-postgres", "filesystem-read"]}
    # routed to again, postgres is the most recently used: the next activation evicts the other one
    evicting = api.post("/v1/sessions/s1/enable", json={"name": "smalltalk"}).json()
    assert [t["capability"] for t in evicting["teardown"]] == ["filesystem-read"]
    caps = api.get("/v1/capabilities", params={"session": "s1"}).json()["capabilities"]
    assert [c["name"] for c in caps if c["active"]] == ["database-postgres", "smalltalk"]


def test_enable_disable_kill_flags_and_eviction(api: TestClient) -> None:
    read = api.post("/v1/sessions/s2/enable", json={"name": "filesystem-read"}).json()
    assert read["active"] == ["filesystem-read"]
    write = api.post("/v1/sessions/s2/enable", json={"name": "filesystem-write"}).json()
    assert write["start"][0]["tools"] == ["write_file", "edit_file"]
    assert api.post("/v1/sessions/s2/enable", json={"name": "filesystem-write"}).json()["start"] == []  # idempotent
    # Both reference server "filesystem": disabling one strips its tools but keeps the server.
    off = api.post("/v1/sessions/s2/disable", json={"name": "filesystem-read"}).json()
    assert off["teardown"] == [{"capability": "filesystem-read", "server": "filesystem", "kill": False,
                                "tools": ["read_file", "list_directory"]}]
    assert api.post("/v1/sessions/s2/disable", json={"name": "filesystem-read"}).json()["teardown"] == []
    api.post("/v1/sessions/s2/enable", json={"name": "database-postgres"})
    # max_active is 2: a third activation evicts exactly one, the least recently used.
    assert api.post("/v1/sessions/s2/tool-result", json={"server": "filesystem", "tool": "write_file",
                                                         "ok": True}).json()["bumped"] == ["filesystem-write"]
    third = api.post("/v1/sessions/s2/enable", json={"name": "python-toolchain"}).json()
    assert [t["capability"] for t in third["teardown"]] == ["database-postgres"]
    assert third["teardown"][0]["kill"] is True
    assert third["active"] == ["filesystem-write", "python-toolchain"]
    state = api.get("/v1/sessions/s2").json()
    assert [a["name"] for a in state["active"]] == ["filesystem-write", "python-toolchain"]
    assert state["active"][1]["servers"] == []  # a toolchain capability has no servers
    # ... so what it needs installed comes from the listing: its provider's [deps] require, and the tap
    # (octomind runs <tap>/deps/<org>/<tool>.sh for each); plans carry servers only, as DESIGN says
    listed = {c["name"]: c for c in api.get("/v1/capabilities").json()["capabilities"]}
    assert listed["python-toolchain"]["requires"] == ["python3", "astral-sh/uv"]
    assert listed["database-postgres"]["requires"] == ["modelcontextprotocol/postgres"]
    assert listed["smalltalk"]["requires"] == []  # routing-only


def test_failed_tool_result_does_not_touch(api: TestClient) -> None:
    api.post("/v1/sessions/s3/enable", json={"name": "filesystem-read"})
    api.post("/v1/sessions/s3/enable", json={"name": "database-postgres"})
    failed = api.post("/v1/sessions/s3/tool-result", json={"server": "filesystem", "tool": "read_file", "ok": False})
    assert failed.json()["bumped"] == []
    plan = api.post("/v1/sessions/s3/enable", json={"name": "smalltalk"}).json()
    assert [t["capability"] for t in plan["teardown"]] == ["filesystem-read"]  # still the LRU


def test_errors_are_json_4xx(api: TestClient) -> None:
    missing = api.get("/v1/sessions/nobody")
    assert missing.status_code == 404 and missing.json()["error"] == "unknown_session"
    assert api.delete("/v1/sessions/nobody").status_code == 404
    unknown = api.post("/v1/sessions/s4/enable", json={"name": "no-such-cap"})
    assert unknown.status_code == 404 and unknown.json()["error"] == "unknown_capability"
    bad_json = api.post("/v1/route", content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 422 and set(bad_json.json()) == {"error", "detail"}
    wrong_type = api.post("/v1/route", json={"session": "s", "message": 42})
    assert wrong_type.status_code == 422
    bad_id = api.post("/v1/route", json={"session": "../../etc", "message": "hello there friend"})
    assert bad_id.status_code == 422
    huge = api.post("/v1/route", json={"session": "s", "message": "x" * (64 * 1024 + 1)})
    assert huge.status_code == 413 and huge.json()["error"] == "too_large"
    body = api.post("/v1/discover", content=b"{" + b" " * (300 * 1024) + b"}",
                    headers={"content-type": "application/json"})
    assert body.status_code == 413
    assert api.post("/v1/discover", json={"intent": "x", "limit": 0}).status_code == 422


def test_discover_limit_is_an_integer_as_json_schema_has_it(api: TestClient) -> None:
    """The OpenAPI document says ``integer``, which JSON Schema defines as a number without a
    fractional part: ``2.0`` is 2 (a schema-driven client may send it); ``2.5``, ``"2"`` and ``true``
    (pydantic's lax mode would take the last two) are refused."""
    for limit in (2, 2.0):
        assert len(api.post("/v1/discover", json={"intent": "postgres", "limit": limit}).json()["candidates"]) == 2
    for limit, reason in ((2.5, "fractional part"), ("2", "must be a JSON integer"), (True, "must be a JSON integer")):
        answer = api.post("/v1/discover", json={"intent": "postgres", "limit": limit})
        assert answer.status_code == 422 and answer.json()["error"] == "invalid_request", answer.text
        assert reason in answer.json()["detail"], answer.text


def test_the_capability_tool_says_what_changed(tmp_path: Path) -> None:
    """It answered "Disabled X." for X that was not active, and did not name what an enable evicted."""
    settings = Settings(taps=(octomind_tap(tmp_path),), data_dir=tmp_path / "d", model="hash", max_active=1)
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        def call(action: str, name: str) -> str:
            text = client.post("/v1/sessions/t/capability", json={"action": action, "name": name}).json()["text"]
            return str(text)

        assert call("enable", "filesystem-read") == "Enabled filesystem-read. Active now: filesystem-read."
        assert call("enable", "filesystem-read") == "filesystem-read was already active. Active now: filesystem-read."
        assert call("enable", "smalltalk") == ("Enabled smalltalk. Unloaded: filesystem-read. "
                                               "Active now: smalltalk.")
        assert call("disable", "filesystem-read") == "filesystem-read was not active. Active now: smalltalk."
        assert call("disable", "smalltalk") == "Disabled smalltalk. Active now: none."


def test_drop_session_and_capability_tool(api: TestClient) -> None:
    schema = api.get("/v1/capability-tool").json()
    assert schema["name"] == "capability"
    assert schema["parameters"]["properties"]["action"]["enum"] == ["list", "discover", "enable", "disable"]
    found = api.post("/v1/sessions/s5/capability", json={"action": "discover",
                                                         "intent": "look at the postgres schema"}).json()
    assert found["candidates"][0]["name"] == "database-postgres" and "database-postgres" in found["text"]
    names = [c["name"] for c in found["candidates"]]  # in the ranking's order, and no scores to re-rank by
    assert found["text"] == f"Best matches, best first: {', '.join(names)}. Enable one with action 'enable'."
    enabled = api.post("/v1/sessions/s5/capability", json={"action": "enable", "name": "database-postgres"}).json()
    assert enabled["plan"]["active"] == ["database-postgres"] and "Enabled" in enabled["text"]
    listed = api.post("/v1/sessions/s5/capability", json={"action": "list"}).json()
    assert "* database-postgres" in listed["text"]
    unknown = api.post("/v1/sessions/s5/capability", json={"action": "enable", "name": "nope"}).json()
    assert unknown["plan"] is None and unknown["error"] == "unknown_capability"  # the HTTP API's code
    dropped = api.delete("/v1/sessions/s5").json()
    assert dropped["plan"]["teardown"][0]["kill"] is True
    assert api.get("/v1/sessions/s5").status_code == 404


def test_the_fast_route_path_answers_exactly_as_the_fastapi_route(tmp_path: Path, model_settings: Settings,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``POST /v1/route`` skips FastAPI's routing (capd.api_guard.FastRoute). Every request here, good or
    bad, gets the same status, body and content type with it as from the FastAPI route alone."""
    json_type = {"content-type": "application/json"}
    requests: list[tuple[bytes, dict[str, str]]] = [
        (json.dumps(body).encode(), json_type) for body in (
            {"session": "a", "message": "please run a query on the postgres database"},
            {"session": "a", "message": "show me the postgres tables"},  # already active
            {"message": "ok"},
            {"session": "a", "message": "x" * (64 * 1024 + 1)},  # 413 from the handler
            {"sesion": "a", "message": "please run a query on the postgres database"},
            {"session": "a", "message": 42},
            {"session": "../../etc", "message": "hello there friend"},
            {"message": None},
            [],
        )] + [
        (b"{not json", json_type),
        (b'{"session": "a", "message": "\\ud800 broken"}', json_type),
    ] + [(b'{"message": "please run a query on the postgres database"}', headers) for headers in (
        {},  # no content type
        {"content-type": "text/plain"},
        {"content-type": "application/json; charset=utf-8"},
    )]

    def answers(name: str) -> list[tuple[int, str, object]]:
        settings = replace(isolated_data_dir(model_settings, tmp_path / name), taps=(octomind_tap(tmp_path / name),))
        with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
            out = []
            for content, headers in requests:
                response = client.post("/v1/route", content=content, headers=headers)
                out.append((response.status_code, response.headers["content-type"], response.json()))
            metrics = [line for line in client.get("/metrics").text.splitlines() if "capd_requests_total{" in line]
            out.append((0, "metrics", metrics))
            return out

    fast = answers("fast")

    async def to_fastapi(self: capd.api_guard.FastRoute, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    monkeypatch.setattr(capd.api_guard.FastRoute, "__call__", to_fastapi)  # every request through FastAPI's route
    assert answers("fastapi") == fast
    statuses = [status for status, _, _ in fast[:-1]]
    assert statuses == [200, 200, 200, 413, 422, 422, 422, 422, 422, 422, 422, 422, 422, 200], statuses


def test_metrics_and_reload(api: TestClient) -> None:
    api.post("/v1/route", json={"session": "m", "message": "please run a query on the postgres database"})
    api.post("/v1/route", json={"message": "ok"})
    text = api.get("/metrics").text
    assert 'capd_decisions_total{decision="activate"}' in text
    assert 'capd_decisions_total{decision="skipped"}' in text
    assert "capd_route_latency_seconds_count 2" in text and "capd_capabilities 5" in text
    assert 'capd_requests_total{method="POST",path="/v1/route",status="200"} 2' in text
    reloaded = api.post("/v1/reload").json()
    assert reloaded["capabilities"] == 5 and reloaded["embedded"] == 0


def test_token_required_on_every_endpoint(tmp_path: Path) -> None:
    settings = Settings(taps=(octomind_tap(tmp_path),), data_dir=tmp_path / "d", model="hash", token="s3cret")
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        paths = [("GET", "/v1/health"), ("GET", "/v1/capabilities"), ("POST", "/v1/discover"),
                 ("POST", "/v1/route"), ("GET", "/v1/sessions/a"), ("DELETE", "/v1/sessions/a"),
                 ("POST", "/v1/sessions/a/enable"), ("POST", "/v1/sessions/a/disable"),
                 ("POST", "/v1/sessions/a/tool-result"), ("POST", "/v1/reload"), ("GET", "/metrics"),
                 ("GET", "/v1/capability-tool"), ("POST", "/v1/sessions/a/capability"), ("GET", "/docs"),
                 ("GET", "/openapi.json")]
        for method, path in paths:
            response = client.request(method, path)
            assert response.status_code == 401, path
            assert client.request(method, path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = client.get("/v1/health", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_warm_up_never_blocks_a_turn(tmp_path: Path) -> None:
    gate = threading.Event()
    settings = Settings(taps=(octomind_tap(tmp_path),), data_dir=tmp_path / "d", model="hash")
    with local_client(create_app(settings, encoder=GatedEncoder(gate), watch=False)) as client:
        health = client.get("/v1/health").json()
        assert health["ready"] is False and health["status"] == "starting"
        routed = client.post("/v1/route", json={"session": "w", "message": "run a query on postgres"}).json()
        assert routed["decision"] == "skipped" and routed["reason"].startswith("warming up")
        assert client.post("/v1/discover", json={"intent": "postgres"}).status_code == 503
        gate.set()
        for _ in range(200):
            if client.get("/v1/health").json()["ready"]:
                break
            threading.Event().wait(0.05)
        assert client.get("/v1/health").json()["ready"] is True


class CountingEncoder(HashEncoder):
    """The deterministic fake, a little slow, counting its model calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.second = threading.Event()

    def embed(self, texts: Sequence[str]) -> Vectors:
        self.calls += 1
        if self.calls == 2:
            self.second.set()
        time.sleep(0.02)
        return super().embed(texts)


def test_a_stop_during_the_first_load_does_not_wait_for_every_trigger(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM while a large tap loads: the shutdown waited until every trigger was embedded
    (minutes on a large tap or a first fused start), with the listener already gone."""
    tap = tmp_path / "tap"
    for i in range(100):
        write_capability(tap, f"cap{i}", [f"capability {i} trigger {j}" for j in range(20)])  # 2,000 texts: 32 batches
    encoder = CountingEncoder()
    settings = Settings(taps=(tap,), data_dir=tmp_path / "d", model="hash")
    with caplog.at_level(logging.INFO, logger="capd.api"), local_client(create_app(settings, encoder=encoder,
                                                                               watch=False)):
        assert encoder.second.wait(10)
    assert encoder.calls <= 4, encoder.calls
    assert "start interrupted: capd is stopping" in caplog.text and "Traceback" not in caplog.text


def test_a_stop_during_a_reloads_fit_does_not_wait_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM while the tap watcher reloaded a fused tap: the shutdown joined the watcher, whose
    reload finished fitting the head first (5-7 s on 1,000 capabilities), and only then told the
    service to stop. The fit stands in for one of minutes here; the stop now ends it."""
    from capd import fused

    tap = docker_and_postgres(tmp_path / "tap")
    settings = Settings(taps=(tap,), data_dir=tmp_path / "d", model="hash", rule="fused")
    fitting = threading.Event()
    real_fit = fused.fit_head

    def endless_fit(vectors: np.ndarray, labels: np.ndarray, columns: int,
                    stop: fused.Stop | None = None) -> tuple[np.ndarray, np.ndarray]:
        fitting.set()
        deadline = time.monotonic() + 60
        while not (stop is not None and stop()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return real_fit(vectors, labels, columns, stop)  # raises Stopping at its first step

    with caplog.at_level(logging.INFO, logger="capd"):
        with local_client(create_app(settings, watch=True, warm_in_background=False)) as client:
            assert client.get("/v1/health").json()["ready"]
            monkeypatch.setattr(fused, "fit_head", endless_fit)  # the start's fit is done
            write_capability(tap, "weather", ["what is the weather like tomorrow", "will it rain in Oslo"])
            assert fitting.wait(20), "the watcher never reloaded"
            began = time.monotonic()
        stopped = time.monotonic() - began
    assert stopped < 10, stopped
    assert "reload after file changes cut short: capd is stopping" in caplog.text
    assert "Traceback" not in caplog.text


def test_a_stop_while_the_watcher_is_being_made_leaves_none_running(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The shutdown read the warm-up thread's watcher before the thread had made it: the watcher
    made afterwards was never stopped and kept watching the taps (inotify watches, a thread)."""
    made: list[capd.api.TapWatcher] = []
    making = threading.Event()

    class SlowWatcher(capd.api.TapWatcher):
        def __init__(self, service: Service) -> None:
            making.set()
            time.sleep(0.5)  # the shutdown comes meanwhile
            super().__init__(service)
            made.append(self)

    monkeypatch.setattr(capd.api, "TapWatcher", SlowWatcher)
    settings = Settings(taps=(octomind_tap(tmp_path / "tap"),), data_dir=tmp_path / "d", model="hash")
    with local_client(create_app(settings)):
        assert making.wait(10)
    time.sleep(1.0)  # anything the warm-up thread still does after the shutdown
    assert made
    for watcher in made:
        observer = watcher._observer
        assert observer is None or not observer.is_alive()
        assert watcher._thread is None or not watcher._thread.is_alive()


def test_lone_surrogates_in_text_fields_are_422(api: TestClient) -> None:
    # JSON may escape a lone UTF-16 surrogate; such a string is not text any encoder accepts.
    for path, body in [("/v1/route", b'{"session": "a", "message": "\\ud800 broken"}'),
                       ("/v1/discover", b'{"intent": "\\ud800 broken"}'),
                       ("/v1/sessions/a/capability", b'{"action": "discover", "intent": "\\udfff x"}'),
                       ("/v1/sessions/a/enable", b'{"name": "\\ud800"}')]:
        response = api.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 422, (path, response.text)
        assert response.json()["error"] == "invalid_request", path


def test_a_field_the_api_does_not_know_is_422_naming_it(api: TestClient) -> None:
    """``{"sesion": …}`` routed without a session, silently (and the capability tool's schema, which
    says additionalProperties false, was not what the endpoint did)."""
    for path, body in [("/v1/route", {"sesion": "a", "message": "please run a query on the postgres database"}),
                       ("/v1/discover", {"intent": "postgres", "limits": 3}),
                       ("/v1/sessions/a/capability", {"action": "list", "extra": 1}),
                       ("/v1/sessions/a/enable", {"name": "database-postgres", "session": "a"}),
                       ("/v1/reload", {"tap": "taps/core"})]:  # it takes no fields: no body, or {}
        response = api.post(path, json=body)
        assert response.status_code == 422, (path, response.text)
        assert response.json()["error"] == "invalid_request"
        unknown = (set(body) - {"message", "intent", "action", "name"}).pop()
        assert unknown in response.json()["detail"], response.text
    assert api.get("/v1/sessions/a").status_code == 404  # nothing was done
    assert api.post("/v1/reload", json={}).status_code == 200


def test_json_sent_as_a_form_is_422_saying_what_to_send(api: TestClient) -> None:
    """``curl -d '{…}'`` sends a form: the 422 said only "Input should be a valid dictionary"."""
    body = b'{"message": "please run a query on the postgres database"}'
    form = "application/x-www-form-urlencoded"
    for headers, sent in [({"content-type": form}, f"as {form}"), ({}, "without a content type")]:
        response = api.post("/v1/route", content=body, headers=headers)
        assert response.status_code == 422 and response.json()["error"] == "invalid_request", response.text
        assert response.json()["detail"].endswith(f"(the body was sent {sent}; send Content-Type: application/json)")
    assert "Content-Type" not in api.post("/v1/route", json=[1]).json()["detail"]  # JSON, of the wrong shape


def test_chunked_body_over_the_limit_is_413(api: TestClient) -> None:
    def chunks(padding: int) -> Iterator[bytes]:  # a generator body goes out chunked, without Content-Length
        yield b'{"session": "c", "message": "please run a query on the postgres database"'
        for _ in range(padding):
            yield b" " * 64 * 1024
        yield b"}"

    headers = {"content-type": "application/json"}
    small = api.post("/v1/route", content=chunks(2), headers=headers)
    assert small.status_code == 200 and small.request.headers.get("transfer-encoding") == "chunked"
    huge = api.post("/v1/route", content=chunks(80), headers=headers)  # 5 MB
    assert huge.status_code == 413
    assert huge.json() == {"error": "too_large", "detail": "request body over 262144 bytes"}
    assert 'capd_requests_total{method="POST",path="/v1/route",status="413"} 1' in api.get("/metrics").text


def test_whitespace_only_intent_is_empty(api: TestClient) -> None:
    for intent in ("", "   ", "\n\t "):
        assert api.post("/v1/discover", json={"intent": intent}).json() == {"candidates": []}
    called = api.post("/v1/sessions/w/capability", json={"action": "discover", "intent": "  "}).json()
    assert called["error"] == "missing_intent"


def test_an_unknown_pinned_name_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings(taps=(octomind_tap(tmp_path),), data_dir=tmp_path / "d", model="hash",
                        pinned=("smalltalk", "nosuchcap"))
    app = create_app(settings, watch=False, warm_in_background=False)
    with caplog.at_level(logging.WARNING, logger="capd"), local_client(app) as client:
        plan = client.post("/v1/sessions/p/enable", json={"name": "filesystem-read"}).json()
        assert sorted(plan["active"]) == ["filesystem-read", "smalltalk"]  # the known pinned name applies
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "pinned" in r.getMessage()]
    assert warned == ["pinned capability not in the catalog, ignored until a tap provides it: nosuchcap"]


def test_a_pinned_winner_is_already_active_in_a_new_session(tmp_path: Path) -> None:
    """It said "activate" for a session's first message, as if the capability had not been active."""
    settings = Settings(taps=(docker_and_postgres(tmp_path / "tap"),), data_dir=tmp_path / "d", model="hash",
                        pinned=("docker",))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        routed = client.post("/v1/route", json={"session": "new", "message": "list the running containers"}).json()
        assert routed["decision"] == "already_active" and routed["capability"] == "docker", routed
        assert routed["plan"]["active"] == ["docker"]


def test_docs_page_works_offline_and_lists_every_endpoint(api: TestClient) -> None:
    """FastAPI's Swagger page loads its script from a CDN; capd's /docs is one self-contained page."""
    response = api.get("/docs")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    page = response.text
    assert "<script" not in page and "http://" not in page and "https://" not in page
    for path, methods in api.get("/openapi.json").json()["paths"].items():
        assert f"<code>{path}</code>" in page
        assert all(f">{m.upper()}<" in page for m in methods)
    assert "id='RouteBody'" in page and "<code>message</code>" in page
    assert api.get("/redoc").status_code == 404


def test_upkeep_checks_learning_often_sessions_each_minute_and_survives_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The daemon's periodic loop: the learned-file check on its short period, session upkeep on
    its own (here both shortened 20-fold-plus); a check that raises is logged and the loop goes on."""
    monkeypatch.setattr(capd.api, "LEARNED_CHECK_INTERVAL", 0.02)
    monkeypatch.setattr(capd.api, "UPKEEP_INTERVAL", 0.3)
    settings = Settings(data_dir=tmp_path / "d", model="hash", taps=(octomind_tap(tmp_path / "tap"),))
    with closing(Service(settings, sessions=True).start()) as service:
        assert service.registry is not None
        calls = {"refresh": 0, "expire": 0}
        refresh, expire = service.refresh_learned, service.registry.expire

        def failing_once() -> bool:
            calls["refresh"] += 1
            if calls["refresh"] == 1:
                raise RuntimeError("a bug in a learning pass")
            return refresh()

        def counted() -> list[str]:
            calls["expire"] += 1
            return expire()

        monkeypatch.setattr(service, "refresh_learned", failing_once)
        monkeypatch.setattr(service.registry, "expire", counted)
        stop = threading.Event()
        loop = threading.Thread(target=upkeep, args=(service, stop))
        with caplog.at_level(logging.ERROR, logger="capd.api"):
            loop.start()
            time.sleep(0.7)
            stop.set()
            loop.join(5)
    assert not loop.is_alive() and "a bug in a learning pass" in caplog.text
    assert calls["refresh"] >= 10 and 1 <= calls["expire"] <= 3, calls


class _PoisonEncoder(HashEncoder):
    """A damaged model that still runs: NaN for every text that says "poison"."""

    def embed(self, texts: Sequence[str]) -> Vectors:
        vectors = super().embed(texts)
        vectors[["poison" in text for text in texts]] = np.nan
        return vectors


def test_nan_scores_never_make_a_500_or_invalid_json(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    tap = tmp_path / "tap"
    docker_and_postgres(tap)
    app = create_app(settings_factory(taps=(tap,)), encoder=_PoisonEncoder(), watch=False, warm_in_background=False)
    with local_client(app) as client:
        for path, body in (("/v1/route", {"session": "s", "message": "poison: restart a container"}),
                           ("/v1/discover", {"intent": "poison containers"})):
            response = client.post(path, json=body)
            assert response.status_code == 200, response.text
            assert "NaN" not in response.text
            json.loads(response.text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
        routed = client.post("/v1/route", json={"session": "s", "message": "poison: restart a container"}).json()
        assert routed["decision"] == "abstain" and routed["score"] is None


def test_a_daemon_that_failed_to_start_answers_503_with_the_reason(settings_factory: SettingsFactory,
                                                                   tmp_path: Path) -> None:
    """Its routes used to say "warming up: the model and index are loading" forever."""
    settings = settings_factory(model=str(tmp_path / "no-such-model"))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        assert client.get("/v1/health").json()["status"] == "error"
        response = client.post("/v1/route", json={"session": "s", "message": "list the running containers"})
        assert response.status_code == 503, response.text
        error = response.json()
        assert error["error"] == "warming_up" and error["detail"].startswith("failed to start: ")
        assert "no-such-model" in error["detail"]


class _FailingEncoder(HashEncoder):
    """A model that fails while serving (the ONNX encoder raises ModelError on NaN output)."""

    def embed(self, texts: Sequence[str]) -> Vectors:
        if any("broken" in text for text in texts):
            raise ModelError("the model gave non-finite vectors")
        return super().embed(texts)


def test_a_model_failing_while_serving_is_503_not_the_requests_fault(settings_factory: SettingsFactory,
                                                                     tmp_path: Path) -> None:
    tap = tmp_path / "tap"
    docker_and_postgres(tap)
    app = create_app(settings_factory(taps=(tap,)), encoder=_FailingEncoder(), watch=False, warm_in_background=False)
    with local_client(app) as client:
        response = client.post("/v1/route", json={"session": "s", "message": "broken: restart a container"})
        assert (response.status_code, response.json()["error"]) == (503, "model_unavailable"), response.text
        assert client.post("/v1/route", json={"session": "s", "message": "restart a container"}).status_code == 200


def test_a_server_spec_with_toml_dates_and_times_is_served_as_iso_strings(settings_factory: SettingsFactory,
                                                                          tmp_path: Path) -> None:
    """A server spec passes every key through to the plan, and TOML has dates and times JSON lacks."""
    provider = ('[[mcp.servers]]\nname = "db"\ncommand = "db-mcp"\nsince = 1979-05-27\nat = 07:32:00\n'
                'until = 1979-05-27T07:32:00Z\n')
    tap = tmp_path / "tap"
    write_capability(tap, "dated", ["a capability whose server has dates"], {"p": provider}, default="p")
    settings = settings_factory(taps=(tap,))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        answer = client.post("/v1/sessions/s1/enable", json={"name": "dated"})
        assert answer.status_code == 200, answer.text
        server = answer.json()["start"][0]["server"]
        assert (server["since"], server["at"], server["until"]) == ("1979-05-27", "07:32:00",
                                                                    "1979-05-27T07:32:00+00:00")
        assert client.get("/v1/sessions/s1").status_code == 200 and client.get("/v1/capabilities").status_code == 200
        routed = client.post("/v1/route", json={"session": "s2", "message": "a capability whose server has dates"})
        assert routed.status_code == 200, routed.text  # the route's own JSON encoder (capd.api_http.json_response)
        assert routed.json()["plan"]["start"][0]["server"]["since"] == "1979-05-27"
