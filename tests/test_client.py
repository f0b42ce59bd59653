"""CapdClient's transport (capd/transport.py) against a stand-in HTTP server: connections kept
alive and reused, a connection the server closed replaced before it is written to, threads sharing
one client, and every way of getting no answer reported as DaemonUnreachable. The real daemon is
on the other end in tests/test_cli.py and tests/test_daemon.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import capd.transport as transport_module
from capd.client import CapdClient
from capd.daemon import KEEP_ALIVE_S
from capd.errors import DaemonUnreachable

HEALTH = {"status": "ok", "ready": True, "model": "hash", "capabilities": 0, "triggers": 0, "embedded": 0,
          "cached": 0, "errors": []}


class StandIn(ThreadingHTTPServer):
    """Answers like the daemon; counts connections and records each request."""

    daemon_threads = True
    close_after_answer = False  # drop the connection after each answer, as an idle timeout would
    delay_s = 0.0

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.connections = 0
        self.requests: list[tuple[str, str, bytes]] = []


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: StandIn

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests.append((self.command, self.path, body))
        time.sleep(self.server.delay_s)
        payload = HEALTH if self.path.endswith("/v1/health") else {"decision": "abstain", "capabilities": []}
        data = json.dumps(payload).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting (its timeout)
            self.close_connection = True
            return
        if self.server.close_after_answer:
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True

    do_GET = do_POST = _answer


@pytest.fixture
def server() -> Iterator[StandIn]:
    standin = StandIn()
    thread = threading.Thread(target=standin.serve_forever, daemon=True)
    thread.start()
    yield standin
    standin.shutdown()
    standin.server_close()


def url(server: StandIn) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_one_connection_serves_every_call(server: StandIn) -> None:
    with CapdClient(url(server)) as client:
        for i in range(5):
            assert client.route("s", f"message {i}")["decision"] == "abstain"
        assert client.health()["ready"] is True
        client.capabilities(session="a b")
    assert server.connections == 1
    method, path, body = server.requests[0]
    assert method == "POST" and path == "/v1/route"
    assert json.loads(body) == {"session": "s", "message": "message 0"}
    assert server.requests[-1][:2] == ("GET", "/v1/capabilities?session=a+b")


def test_a_connection_the_server_closed_is_replaced_before_it_is_used(server: StandIn) -> None:
    server.close_after_answer = True
    with CapdClient(url(server)) as client:
        for i in range(3):
            time.sleep(0.05)  # the close has arrived by the next call
            assert client.route("s", f"message {i}")["decision"] == "abstain"
    assert server.connections == 3 and len(server.requests) == 3  # each request sent once


def test_a_connection_idle_for_a_minute_is_not_reused(server: StandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon closes a connection idle for 75 s; reused at that moment, a route would fail (and
    is not sent again). The client retires one idle past MAX_IDLE_S, before the daemon's limit."""
    assert transport_module.MAX_IDLE_S < KEEP_ALIVE_S
    now = [1000.0]
    with CapdClient(url(server)) as client:
        monkeypatch.setattr(client._http, "_clock", lambda: now[0])  # white-box: the transport's clock
        client.route("s", "first")
        now[0] += transport_module.MAX_IDLE_S - 1
        client.route("s", "second")  # idle under the limit: the same connection
        assert server.connections == 1
        now[0] += transport_module.MAX_IDLE_S + 1
        client.route("s", "third")
    assert server.connections == 2 and len(server.requests) == 3


def test_threads_share_one_client(server: StandIn) -> None:
    server.delay_s = 0.05  # so that calls overlap
    with CapdClient(url(server)) as client, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: client.route(f"s{i}", "hello there")["decision"], range(12)))
    assert answers == ["abstain"] * 12
    assert 2 <= server.connections <= 4  # overlapping calls get a connection each, then reuse them


def test_a_url_path_prefixes_every_request(server: StandIn) -> None:
    with CapdClient(url(server) + "/capd/") as client:
        client.health()
    assert server.requests[0][1] == "/capd/v1/health"


def test_no_answer_is_daemon_unreachable(server: StandIn, tmp_path: Path) -> None:
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        closed_port = spare.getsockname()[1]  # nothing listens on it once closed
    with CapdClient(f"http://127.0.0.1:{closed_port}") as client, pytest.raises(
            DaemonUnreachable, match=r"no capd daemon answering at .*ConnectionRefusedError"):
        client.health()
    with CapdClient(uds=str(tmp_path / "no.sock")) as client, pytest.raises(DaemonUnreachable, match=r"no\.sock"):
        client.health()
    server.delay_s = 1.0
    with CapdClient(url(server), timeout=0.2) as client, pytest.raises(DaemonUnreachable, match=r"[Tt]imeout"):
        client.health()


def test_a_closed_client_refuses_calls(server: StandIn) -> None:
    client = CapdClient(url(server))
    client.health()
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.health()


def test_a_daemon_that_does_not_answer_in_time_is_not_said_to_be_missing(server: StandIn) -> None:
    """A daemon that is there but busy or stopped (SIGSTOP) was reported as "no capd daemon
    answering …; start one with `capd serve`": starting one then fails, its address being in use."""
    server.delay_s = 1.0
    with CapdClient(url(server), timeout=0.2) as client, pytest.raises(DaemonUnreachable) as caught:
        client.route("s", "hello there")
    said = str(caught.value)
    assert "did not answer within 0.2 s" in said and "start one" not in said, said
