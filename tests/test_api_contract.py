"""The HTTP API's documented contract at its edges: a failed start, requests rejected before
routing, non-finite numbers, the capability tool's schema, the metrics text. The real app
(TestClient) with the hash model."""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from capd.api import create_app
from capd.api_http import MAX_BODY_BYTES
from capd.encoder import HashEncoder, Vectors
from capd.metrics import Metrics
from tests.conftest import GatedEncoder, SettingsFactory
from tests.taputil import docker_and_postgres, local_client, write_capability

# Every endpoint of the README's table, with a body it would accept.
ENDPOINTS: list[tuple[str, str, object]] = [
    ("GET", "/v1/capabilities", None), ("POST", "/v1/discover", {"intent": "list the containers"}),
    ("POST", "/v1/route", {"session": "s", "message": "list the running containers"}),
    ("GET", "/v1/sessions/s", None), ("DELETE", "/v1/sessions/s", None),
    ("POST", "/v1/sessions/s/enable", {"name": "docker"}), ("POST", "/v1/sessions/s/disable", {"name": "docker"}),
    ("POST", "/v1/sessions/s/tool-result", {"tool": "ps", "server": "docker", "ok": True}),
    ("POST", "/v1/reload", None), ("GET", "/metrics", None), ("GET", "/v1/capability-tool", None),
    ("POST", "/v1/sessions/s/capability", {"action": "list"}),
]


def test_metrics_render_every_value_exactly() -> None:
    """``{value:g}`` printed 1234567 as 1.23457e+06."""
    metrics = Metrics()
    metrics.inc("capd_requests_total", "HTTP requests.", amount=1234567, path="/v1/route")
    metrics.inc("capd_requests_total", "HTTP requests.", amount=2.0**53, path="/v1/discover")
    for name, value in [("big", 2345678), ("fraction", 0.1 + 0.2), ("tiny", 1.5e-7), ("up", math.inf),
                        ("down", -math.inf), ("nan", math.nan), ("zero", 0.0)]:
        metrics.gauge(f"capd_{name}", "A value.", lambda value=value: value)
    samples = dict(line.rsplit(" ", 1) for line in metrics.render().splitlines() if not line.startswith("#"))
    assert samples['capd_requests_total{path="/v1/route"}'] == "1234567"
    assert samples['capd_requests_total{path="/v1/discover"}'] == "9007199254740992"
    assert (samples["capd_big"], samples["capd_fraction"], samples["capd_tiny"]) == ("2345678", "0.30000000000000004",
                                                                                      "1.5e-07")
    assert (samples["capd_up"], samples["capd_down"], samples["capd_nan"], samples["capd_zero"]) == (
        "+Inf", "-Inf", "NaN", "0")


def test_a_failed_start_is_503_failed_to_start_on_every_endpoint_but_health(settings_factory: SettingsFactory,
                                                                            tmp_path: Path) -> None:
    """README: after a failed start every endpoint but /v1/health answers 503 ``warming_up`` with
    ``failed to start: <reason>``. Most said the bare reason; /metrics and the tool schema said 200."""
    settings = settings_factory(model=str(tmp_path / "no-such-model"), taps=(docker_and_postgres(tmp_path / "tap"),))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        health = client.get("/v1/health")
        assert health.status_code == 200 and health.json()["status"] == "error"
        for method, path, body in ENDPOINTS:
            response = client.request(method, path, json=body)
            assert response.status_code == 503, (path, response.text)
            error = response.json()
            assert error["error"] == "warming_up" and error["detail"].startswith("failed to start: "), (path, error)
            assert "no-such-model" in error["detail"], path
        # The API's own description is not an endpoint of it: it still answers.
        assert client.get("/openapi.json").status_code == 200 and client.get("/docs").status_code == 200


def test_while_loading_metrics_and_the_tool_schema_answer(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """Neither needs the model: while it loads they answer 200; the catalog's endpoints say 503."""
    gate = threading.Event()
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),))
    with local_client(create_app(settings, encoder=GatedEncoder(gate), watch=False)) as client:
        try:
            assert client.get("/metrics").status_code == 200
            assert client.get("/v1/capability-tool").json()["name"] == "capability"
            loading = client.get("/v1/capabilities")
            assert loading.status_code == 503 and loading.json()["detail"] == "the model and index are still loading"
        finally:
            gate.set()


def test_401s_and_413s_by_content_length_are_counted(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """Both were answered before the request counter: a token guesser or an oversized client left no trace."""
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),), token="s3cret")
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        wrong = {"Authorization": "Bearer wrong"}
        assert client.post("/v1/route", json={"message": "hi"}, headers=wrong).status_code == 401
        assert client.post("/v1/sessions/a/enable", json={"name": "docker"}).status_code == 401
        assert client.get("/nowhere", headers=wrong).status_code == 401
        token = {"Authorization": "Bearer s3cret"}
        big = b'{"intent": "' + b"x" * MAX_BODY_BYTES + b'"}'
        too_large = client.post("/v1/discover", content=big, headers={**token, "content-type": "application/json"})
        assert too_large.status_code == 413 and "content-length" in too_large.request.headers
        text = client.get("/metrics", headers=token).text
    for series in ('{method="POST",path="/v1/route",status="401"} 1',
                   '{method="POST",path="/v1/sessions/{session}/enable",status="401"} 1',
                   '{method="GET",path="unmatched",status="401"} 1',
                   '{method="POST",path="/v1/discover",status="413"} 1'):
        assert f"capd_requests_total{series}\n" in text, series


def test_the_tool_schema_bounds_name_as_the_endpoint_does(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """A name the schema allowed got an HTTP 422 instead of a tool result."""
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        call = client.get("/openapi.json").json()["components"]["schemas"]["CapabilityCall"]["properties"]["name"]
        (limit,) = [option["maxLength"] for option in call["anyOf"] if option.get("type") == "string"]
        assert client.get("/v1/capability-tool").json()["parameters"]["properties"]["name"]["maxLength"] == limit
        longest = client.post("/v1/sessions/s/capability", json={"action": "enable", "name": "x" * limit})
        assert longest.status_code == 200 and longest.json()["error"] == "unknown_capability"
        over = client.post("/v1/sessions/s/capability", json={"action": "enable", "name": "x" * (limit + 1)})
        assert over.status_code == 422
        assert client.post("/v1/sessions/s/enable", json={"name": "x" * (limit + 1)}).status_code == 422


def test_an_intent_of_only_tags_is_a_missing_intent(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """Tags are stripped before discovery: nothing was left to match, and the model read "Best matches: ."."""
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        for intent in ("<context>x</context>", "<b></b>", " <br/> \n"):
            called = client.post("/v1/sessions/s/capability", json={"action": "discover", "intent": intent}).json()
            assert called == {"text": "discover needs an 'intent'.", "plan": None, "error": "missing_intent"}, intent
        kept = client.post("/v1/sessions/s/capability", json={"action": "discover",
                                                              "intent": "<context>x</context> restart a container"})
        assert kept.json()["candidates"][0]["name"] == "docker"


class _NonFiniteEncoder(HashEncoder):
    """A custom encoder gone wrong: NaN (or inf) for every text that says "poison"."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def embed(self, texts: Sequence[str]) -> Vectors:
        vectors = super().embed(texts)
        vectors[["poison" in text for text in texts]] = self.value
        return vectors


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf / inf, normalising
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_scores_are_dropped_from_discover_and_the_tool(settings_factory: SettingsFactory, tmp_path: Path,
                                                                 value: float) -> None:
    """/v1/discover said ``"score": null`` where OpenAPI says number; the tool's discover was a 500."""
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),))
    app = create_app(settings, encoder=_NonFiniteEncoder(value), watch=False, warm_in_background=False)
    with local_client(app, raise_server_exceptions=False) as client:
        discovered = client.post("/v1/discover", json={"intent": "poison the containers"})
        assert discovered.status_code == 200 and discovered.json() == {"candidates": []}
        called = client.post("/v1/sessions/s/capability", json={"action": "discover", "intent": "poison containers"})
        assert called.status_code == 200, called.text
        assert called.json() == {"text": "No capability matches that intent.", "plan": None, "candidates": []}
        fine = client.post("/v1/discover", json={"intent": "restart a container"}).json()["candidates"]
        assert fine[0]["name"] == "docker" and all(isinstance(c["score"], float) for c in fine)


def test_a_non_finite_number_in_a_server_spec_is_null_not_a_500(settings_factory: SettingsFactory,
                                                                tmp_path: Path) -> None:
    """A server spec passes tap-defined keys through, and TOML has inf and nan: enable, disable and the
    tool's enable rendered through FastAPI's encoder, which raises on them (after changing the session)."""
    provider = '[[mcp.servers]]\nname = "jobs"\ncommand = "jobs-mcp"\nretry_seconds = inf\nbackoff = nan\n'
    tap = tmp_path / "tap"
    write_capability(tap, "longjob", ["run the long batch job"], {"p": provider}, default="p")
    with local_client(create_app(settings_factory(taps=(tap,)), watch=False, warm_in_background=False),
                    raise_server_exceptions=False) as client:
        for path, body in (("/v1/sessions/a/enable", {"name": "longjob"}),
                           ("/v1/sessions/b/capability", {"action": "enable", "name": "longjob"}),
                           ("/v1/sessions/a/disable", {"name": "longjob"}), ("/v1/sessions/b", None)):
            response = client.request("GET" if body is None else "POST", path, json=body)
            assert response.status_code == 200, (path, response.text)
            json.loads(response.text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
        started = client.post("/v1/sessions/c/enable", json={"name": "longjob"}).json()["start"][0]["server"]
        assert (started["retry_seconds"], started["backoff"]) == (None, None)


@pytest.mark.parametrize(("headers", "allowed"), [
    ({"Host": "127.0.0.1:7171"}, True), ({"Host": "localhost:7171"}, True), ({"Host": "[::1]:7171"}, True),
    ({"Host": "capd.localhost"}, True), ({"Host": "192.168.1.20:7171"}, True),
    ({"Host": "localhost:7171", "Origin": "http://localhost:3000"}, True),
    ({"Host": "rebound.attacker.example:7171"}, False),  # DNS rebinding: the page's name, our address
    ({"Host": "localhost.attacker.example"}, False),
    ({"Host": "127.0.0.1:7171", "Origin": "https://attacker.example"}, False),
    ({"Host": "127.0.0.1:7171", "Origin": "null"}, False),
    ({"Host": "127.0.0.1:7171", "Origin": "http://127.0.0.1:3000"}, True),
    ({"Host": "127.0.0.1:7171", "Origin": "http://203.0.113.5"}, False),  # a page on a public address
    ({"Host": "127.0.0.1:7171", "Origin": "http://[::ffff:203.0.113.5]"}, False),
    ({"Host": "127.0.0.1:7171", "Origin": "http://[::1"}, False),  # unparseable: was a plain-text 500
    ({"Host": "127.0.0.1:7171", "Origin": "http://]"}, False),
])
def test_a_daemon_without_a_token_answers_only_to_this_machine(settings_factory: SettingsFactory, tmp_path: Path,
                                                               headers: dict[str, str], allowed: bool) -> None:
    """A web page that rebinds its own host name to 127.0.0.1 could drive a token-less daemon (read
    sessions, enable capabilities whose plans start MCP servers): its requests name its host."""
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        for method, path, body in [("POST", "/v1/sessions/s/enable", {"name": "docker"}),
                                   ("GET", "/v1/sessions/s", None),
                                   ("POST", "/v1/route", {"session": "s", "message": "list the running containers"})]:
            response = client.request(method, path, json=body, headers=headers)
            if allowed:
                assert response.status_code in (200, 404), (path, response.text)
            else:
                assert response.status_code == 403, (path, response.text)
                assert response.json()["error"] == "forbidden_host" and "set a token" in response.json()["detail"]
        if not allowed:
            assert client.get("/v1/sessions/s").status_code == 404  # nothing was enabled
            assert 'status="403"' in client.get("/metrics").text


def test_with_a_token_or_a_listen_name_other_hosts_are_accepted(settings_factory: SettingsFactory,
                                                                tmp_path: Path) -> None:
    tap = docker_and_postgres(tmp_path / "tap")
    for extra, headers in [({"token": "s3cret-token"}, {"Authorization": "Bearer s3cret-token"}),
                           ({"host": "MyBox.lan"}, {})]:
        with local_client(create_app(settings_factory(taps=(tap,), **extra), watch=False,
                                     warm_in_background=False)) as client:
            response = client.get("/v1/capabilities", headers={"Host": "mybox.lan:7171", **headers})
            assert response.status_code == 200, response.text


def test_a_reload_cut_short_by_shutdown_is_503_stopping(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """It was a 400 ``bad_request``, as if the request were at fault."""
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),))
    app = create_app(settings, watch=False, warm_in_background=False)
    with local_client(app) as client:
        app.state.service.close()  # what the daemon's shutdown does while a request is still in flight
        response = client.post("/v1/reload")
        assert (response.status_code, response.json()["error"]) == (503, "stopping"), response.text


def test_a_file_name_that_is_not_utf8_is_reported_not_a_500(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """A tap folder whose name is not UTF-8 (a byte such as 0xff, kept by Python as a lone
    surrogate) made health and reload answer 500 for as long as it was there: its problem's file
    could not be written as JSON. It is reported with the byte escaped."""
    tap = docker_and_postgres(tmp_path / "tap")
    folder = os.fsdecode(bytes(tap / "capabilities") + b"/bad\xffname")
    os.mkdir(folder)
    Path(folder, "config.toml").write_text('description = "no triggers here"\ntriggers = "one"\n')
    settings = settings_factory(taps=(tap,))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        for response in (client.get("/v1/health"), client.post("/v1/reload")):
            assert response.status_code == 200, response.text
            files = [e["file"] for e in response.json()["errors"]]
            assert any("bad\\xffname" in f for f in files), files
        assert client.post("/v1/route", json={"message": "list the running containers"}).status_code == 200


def test_a_tap_whose_path_is_not_utf8_serves(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """A tap under a folder named with a 0xff byte failed the start (SQLite takes text only, and the
    learned corrections are keyed by the tap's path), then answered 500 where a capability's tap is
    shown. Everything answers, the byte shown as ``\\xff``."""
    tap = Path(os.fsdecode(bytes(tmp_path) + b"/t\xffap"))
    docker_and_postgres(tmp_path / "tap").rename(tap)
    with local_client(create_app(settings_factory(taps=(tap,)), watch=False, warm_in_background=False)) as client:
        assert client.get("/v1/health").json()["status"] == "ok"
        capabilities = client.get("/v1/capabilities").json()["capabilities"]
        assert {c["tap"] for c in capabilities} == {str(tmp_path) + "/t\\xffap"}
        routed = client.post("/v1/route", json={"session": "s", "message": "list the running containers"})
        assert routed.status_code == 200 and routed.json()["decision"] == "activate", routed.text
        for action in ("disable", "enable"):  # a correction is learned under the tap's key
            assert client.post(f"/v1/sessions/s/{action}", json={"name": "docker"}).status_code == 200
        assert client.post("/v1/reload").status_code == 200


def test_an_unknown_query_parameter_is_a_422_naming_it(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """``POST /v1/route?session=zz`` routed without a session (nothing started, session zz never
    made), and ``GET /v1/capabilities?sesion=q`` listed q's capabilities as inactive: the query was
    not checked as the body is."""
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        client.post("/v1/sessions/q/enable", json={"name": "docker"})
        for method, path, body in [("POST", "/v1/route?session=zz", {"message": "list the running containers"}),
                                   ("GET", "/v1/capabilities?sesion=q", None),
                                   ("POST", "/v1/sessions/q/disable?name=docker", {"name": "postgres"})]:
            answer = client.request(method, path, json=body)
            assert answer.status_code == 422, (path, answer.text)
            assert answer.json() == {"error": "invalid_request", "detail":
                                     f"query.{path.split('?')[1].split('=')[0]}: Extra inputs are not permitted"}
        assert client.get("/v1/sessions/zz").status_code == 404
        listed = client.get("/v1/capabilities?session=q").json()["capabilities"]
        assert [c["name"] for c in listed if c["active"]] == ["docker"]
        assert client.get("/metrics?name=x").status_code == 200  # not the API's own: a scraper may add its own


def test_a_query_parameter_given_twice_is_refused(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """``?session=a&session=b`` listed session b's capabilities: the framework keeps the last of a
    repeated parameter, as JSON parsers keep the last of a repeated key (refused in a body)."""
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        client.post("/v1/sessions/b/enable", json={"name": "docker"})
        answer = client.get("/v1/capabilities?session=a&session=b")
        assert answer.status_code == 422 and answer.json() == {"error": "invalid_request",
                                                               "detail": "query.session: given 2 times"}
        both = client.get("/v1/capabilities?session=a&sesion=x&session=a")
        assert both.json()["detail"] == "query.sesion: Extra inputs are not permitted; query.session: given 2 times"
        listed = client.get("/v1/capabilities?session=b").json()["capabilities"]
        assert [c["name"] for c in listed if c["active"]] == ["docker"]


def test_every_invalid_session_id_answers_one_code(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """A session id that broke its pattern or length answered ``invalid_request`` from the path, the
    query and a body, but ``invalid_session_id`` from an encoded slash and the capability tool: a
    client had two codes to check for one mistake."""
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        for method, path, body in [("GET", "/v1/sessions/bad%20id", None), ("GET", "/v1/sessions/...", None),
                                   ("GET", "/v1/capabilities?session=", None),
                                   ("GET", f"/v1/capabilities?session={'s' * 129}", None),
                                   ("POST", "/v1/route", {"session": "a b", "message": "list the running containers"}),
                                   ("POST", "/v1/route", {"session": "a b", "message": 42}),  # and another problem
                                   ("POST", "/v1/sessions/a%2Fb/enable", {"name": "docker"})]:
            answer = client.request(method, path, json=body)
            assert answer.status_code == 422 and answer.json()["error"] == "invalid_session_id", (path, answer.text)
            assert "session: invalid session id: use 1 to 128 characters" in answer.json()["detail"], answer.text
        mixed = client.post("/v1/route", json={"session": "a b", "message": 42}).json()["detail"]
        assert "body.session: invalid session id" in mixed and "body.message" in mixed
        assert client.post("/v1/route", json={"session": "ab", "message": 42}).json()["error"] == "invalid_request"


def test_an_encoded_slash_in_a_session_id_is_refused(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """``POST /v1/sessions/victim%2Fenable`` was decoded before routing and enabled the capability in
    session ``victim``."""
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        for method, path in [("POST", "/v1/sessions/victim%2Fenable"), ("POST", "/v1/sessions/victim%2fenable"),
                             ("GET", "/v1/sessions/a%2Fb"), ("DELETE", "/v1/sessions/a%2F..%2Fb")]:
            answer = client.request(method, path, json={"name": "docker"} if method == "POST" else None)
            assert answer.status_code == 422 and answer.json()["error"] == "invalid_session_id", (path, answer.text)
        assert client.get("/v1/sessions/victim").status_code == 404


@pytest.mark.parametrize(("body", "reason"), [
    (b'{"session": "d1", "session": "d2", "message": "list the running containers"}', 'key "session" given twice'),
    (b'{"session": "d1", "message": "caf\xe9 containers"}', "not UTF-8"),
    (b'{"session": "d1", "message": "x", "extra": ' + b"9" * 5000 + b"}", "more than 4300 digits"),
    (b"[" * 100_000, "nested too deeply"),
    (b'{"message": }', "invalid JSON: Expecting value"),
], ids=["duplicate-key", "latin-1", "long-number", "deep", "syntax"])
def test_a_body_that_is_not_plain_json_is_a_422_saying_why(settings_factory: SettingsFactory, tmp_path: Path,
                                                           body: bytes, reason: str) -> None:
    """A key given twice routed with the last one (session d2) without a word; bytes that are not
    UTF-8, a 5,000-digit number or deep nesting were a bare 400 "There was an error parsing the body";
    a syntax error said "JSON decode error" without what the parser found."""
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        for path in ("/v1/route", "/v1/sessions/d1/enable"):  # the fast route and the app's own reading
            answer = client.post(path, content=body, headers={"content-type": "application/json"})
            assert answer.status_code == 422 and answer.json()["error"] == "invalid_request", answer.text
            assert reason in answer.json()["detail"], answer.text
        assert client.get("/v1/sessions/d2").status_code == 404 and client.get("/v1/sessions/d1").status_code == 404


def test_head_is_answered_where_get_is_and_a_405_lists_every_method(settings_factory: SettingsFactory,
                                                                    tmp_path: Path) -> None:
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        client.post("/v1/sessions/s/enable", json={"name": "docker"})
        for path in ("/v1/health", "/v1/capabilities", "/metrics", "/docs", "/openapi.json", "/v1/sessions/s"):
            got, head = client.get(path), client.head(path)
            assert head.status_code == got.status_code == 200 and head.content == b"", path
            if path != "/metrics":  # its counters move between the two
                assert head.headers["content-length"] == got.headers["content-length"], path
        put = client.put("/v1/sessions/s")
        assert put.status_code == 405 and put.headers["allow"] == "DELETE, GET, HEAD"
        assert client.head("/v1/route").headers["allow"] == "POST"
        text = client.get("/metrics").text
    assert 'capd_requests_total{method="HEAD",path="/v1/health",status="200"} 1\n' in text


def test_a_json_body_sent_as_another_type_says_so(settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """The hint was skipped for any content type with "json" in it, application/x-ndjson too."""
    settings = settings_factory(taps=(docker_and_postgres(tmp_path / "tap"),))
    with local_client(create_app(settings, watch=False, warm_in_background=False)) as client:
        answer = client.post("/v1/discover", content=b'{"intent": "containers"}',
                             headers={"content-type": "application/x-ndjson"})
    assert answer.status_code == 422 and "send Content-Type: application/json" in answer.json()["detail"]
