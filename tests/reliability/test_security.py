"""Security: loopback by default, token on the Unix socket, ``{{ENV:…}}`` never resolved anywhere,
and no way out of the tap or the data directory through names.

Already covered elsewhere (not repeated here): the token on every endpoint over TCP
(tests/test_api.py) and the Unix socket's mode 0600 (tests/test_daemon.py)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capd.api import create_app
from capd.settings import Settings, load_settings
from tests.reliability.harness import (
    ENV_SECRETS,
    Daemon,
    DaemonFactory,
    clean_env,
    fleet_tap,
    free_port,
    write_config,
)

pytestmark = pytest.mark.reliability

SPEC = create_app(Settings(model="hash", taps=())).openapi()
OPERATIONS = [(m.upper(), p.replace("{session}", "s1")) for p, ms in SPEC["paths"].items() for m in ms]
MARKER = f"pwned-{uuid.uuid4().hex[:12]}"
SECRETS = {name: f"SENTINEL-{name}-{uuid.uuid4().hex}" for name in ENV_SECRETS}


# -- a token on the Unix socket ------------------------------------------------------------------------

def test_unix_socket_with_token_refuses_every_endpoint_without_it(tmp_path: Path,
                                                                  daemon_factory: DaemonFactory) -> None:
    token = uuid.uuid4().hex
    daemon = daemon_factory([fleet_tap(tmp_path)], uds=True, token=token)
    extra = [("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/no/such/path"), ("PUT", "/v1/health")]
    with daemon.client(token="") as anonymous, daemon.client(token="wrong" + token) as wrong, \
            daemon.client() as right:
        for method, path in OPERATIONS + extra:
            for client in (anonymous, wrong):
                response = client.request(method, path, json={"name": "db-postgres", "action": "list"})
                assert response.status_code == 401, (method, path, response.status_code)
                assert response.json()["error"] == "unauthorized"
                assert response.headers["www-authenticate"] == "Bearer"
        assert right.get("/v1/health").json()["ready"] is True
        assert right.post("/v1/sessions/u/enable", json={"name": "db-postgres"}).json()["active"] == ["db-postgres"]
        # Nothing reached the session while unauthenticated.
        assert [a["name"] for a in right.get("/v1/sessions/u").json()["active"]] == ["db-postgres"]
        assert right.get("/v1/sessions/s1").status_code == 404
    assert token not in daemon.log_text()


# -- binding ------------------------------------------------------------------------------------------

def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets process ``pid`` listens on, read from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                if width == 8:
                    host = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:
                    host = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                found.append((host, int(port, 16)))
    return found


# -- one daemon (`capd serve --port N`, nothing else) for binding, secrets and traversal ---------------------

@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon started without --host, with sentinel values in the environment under the {{ENV:…}} names its
    tap uses, debug logging, and a capability folder that is a symlink to a folder outside the tap."""
    root = tmp_path_factory.mktemp("guarded")
    tap = fleet_tap(root)
    outside = root / "outside-cap"
    outside.mkdir()
    write_config(outside, ["exfiltrate the secret capability"])
    os.symlink(outside, tap / "capabilities" / "escapee")
    data = root / "data"
    data.mkdir()
    daemon = Daemon((tap,), data, root / "daemon.log", port=free_port(),
                    env={**SECRETS, "CAPD_LOG_LEVEL": "debug"}).start()
    yield daemon
    daemon.stop()


def test_default_bind_is_loopback(guarded: Daemon) -> None:
    assert Settings().host == "127.0.0.1"
    assert load_settings(env={"CAPD_CONFIG": os.devnull}).host == "127.0.0.1"
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs /proc to see the daemon's sockets")
    # `capd serve --port N`: no --host, and no CAPD_HOST in its environment.
    assert "--host" not in guarded.command() and "CAPD_HOST" not in clean_env(guarded.env)
    assert guarded.proc is not None
    assert _listening(guarded.proc.pid) == [("127.0.0.1", guarded.port)]


def test_env_placeholders_never_resolved(guarded: Daemon) -> None:
    bodies: list[str] = []
    with guarded.client() as http:
        def call(method: str, path: str, body: Any = None) -> Any:
            response = http.request(method, path, json=body)
            bodies.append(response.text)
            assert response.status_code < 500, (path, response.text)
            return response.json() if "json" in response.headers.get("content-type", "") else response.text

        for message in ("query the postgres database", "fetch this web page for me",
                        "search the documentation index", "copy rows from postgres into sqlite"):
            call("POST", "/v1/route", {"session": "sec", "message": message})
        plans = [call("POST", "/v1/sessions/sec2/enable", {"name": n})
                 for n in ("db-postgres", "web-fetch", "docs-search")]
        plans.append(call("POST", "/v1/sessions/sec2/capability", {"action": "enable", "name": "db-sync"})["plan"])
        call("POST", "/v1/sessions/sec2/capability", {"action": "list"})
        call("POST", "/v1/sessions/sec2/tool-result", {"server": "postgres", "tool": "query", "ok": True})
        for path in ("/v1/health", "/v1/capabilities?session=sec2", "/v1/sessions/sec", "/v1/sessions/sec2",
                     "/metrics", "/openapi.json", "/v1/capability-tool"):
            call("GET", path)
        call("POST", "/v1/discover", {"intent": "postgres connection string"})
        call("POST", "/v1/sessions/sec2/disable", {"name": "web-fetch"})
        call("POST", "/v1/reload")
        call("DELETE", "/v1/sessions/sec")
    cli = subprocess.run([sys.executable, "-m", "capd", "enable", "sec3", "db-postgres", "--port", str(guarded.port),
                          "--json"], capture_output=True, text=True, timeout=60, env=clean_env(SECRETS), check=False)
    assert cli.returncode == 0, cli.stderr
    bodies += [cli.stdout, cli.stderr]

    starts = {(s["capability"], s["server"]["name"]): s["server"] for p in plans for s in p["start"]}
    assert "{{ENV:POSTGRES_CONNECTION_STRING}}" in starts[("db-postgres", "postgres")]["args"]
    assert starts[("web-fetch", "fetch")]["url"].endswith("key={{ENV:FETCH_API_KEY}}")
    assert starts[("web-fetch", "fetch")]["headers"] == {"Authorization": "Bearer {{ENV:FETCH_API_KEY}}"}
    assert starts[("docs-search", "search")]["env"] == {"SEARCH_TOKEN": "{{ENV:SEARCH_TOKEN}}"}
    assert "{{ENV:SQLITE_PATH}}" in starts[("db-sync", "sqlite")]["args"]
    assert "{{ENV:POSTGRES_CONNECTION_STRING}}" in json.loads(cli.stdout)["start"][0]["server"]["args"]

    stored = b"".join(p.read_bytes() for p in guarded.data_dir.iterdir() if p.is_file())
    log = guarded.log_text()
    assert "DEBUG" in log  # the log was as talkative as it gets
    for secret in SECRETS.values():
        assert not any(secret in body for body in bodies)
        assert secret not in log
        assert secret.encode() not in stored


# -- names that try to leave the tap or the data directory ------------------------------------------------

def _raw(port: int, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send the request line exactly as given (no client-side normalisation of ``..`` or ``%2F``)."""
    head = (f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("latin-1")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    response = b"".join(chunks)
    return int(response.split(b" ", 2)[1]), response.partition(b"\r\n\r\n")[2]


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and
            not p.is_symlink() else os.readlink(p) if p.is_symlink() else "dir" for p in sorted(root.rglob("*"))}


TRAVERSAL_IDS = ("..%2F..%2F{m}", "..%2f..%2f..%2fetc%2f{m}", "%2Ftmp%2F{m}", "{m}%00", "%00{m}", "..", ".",
                 "%2e%2e%2f{m}", "..%5C..%5C{m}", "{m}%2F..%2F..", "%252e%252e%252f{m}", "~%2F{m}",
                 "a" * 129)
TRAVERSAL_PATHS = ("/v1/sessions/../../{m}", "/v1/sessions/../../../tmp/{m}/enable", "/v1/sessions//tmp/{m}",
                   "/v1/sessions/./../{m}/disable")
BAD_NAMES = ("../../../etc/passwd", "/etc/passwd", "../fleet/capabilities/k8s", "k8s/../../{m}", "k8s\u0000",
             "\u0000", "%2e%2e%2f{m}", "..\\..\\{m}", "db-postgres/config.toml", "~/{m}", ".", "..")


def test_names_cannot_escape(guarded: Daemon) -> None:
    assert guarded.port is not None
    tap, data = guarded.taps[0], guarded.data_dir
    before_tap, before_data = _tree(tap), set(os.listdir(data))
    statuses: list[tuple[str, int]] = []

    def expect_4xx(method: str, target: str, body: dict[str, Any] | None = None) -> bytes:
        status, text = _raw(guarded.port or 0, method, target, json.dumps(body).encode() if body else b"")
        statuses.append((f"{method} {target} {body}", status))
        return text

    for pattern in TRAVERSAL_IDS:
        session = pattern.format(m=MARKER)
        expect_4xx("GET", f"/v1/sessions/{session}")
        expect_4xx("DELETE", f"/v1/sessions/{session}")
        for action in ("enable", "disable"):
            expect_4xx("POST", f"/v1/sessions/{session}/{action}", {"name": "db-postgres"})
        expect_4xx("POST", f"/v1/sessions/{session}/tool-result", {"server": "git", "tool": "log", "ok": True})
        expect_4xx("POST", f"/v1/sessions/{session}/capability", {"action": "enable", "name": "db-postgres"})
        expect_4xx("GET", f"/v1/capabilities?session={session}")
    for pattern in TRAVERSAL_PATHS:
        expect_4xx("POST", pattern.format(m=MARKER), {"name": "db-postgres"})
    for session in ("../" + MARKER, "/tmp/" + MARKER, MARKER + "\u0000"):
        expect_4xx("POST", "/v1/route", {"session": session, "message": "query the postgres database"})
    for name in BAD_NAMES:
        name = name.format(m=MARKER)
        for action in ("enable", "disable"):
            expect_4xx("POST", f"/v1/sessions/safe/{action}", {"name": name})
    assert all(400 <= status < 500 for _, status in statuses), [s for s in statuses if not 400 <= s[1] < 500]

    with guarded.client() as http:  # the tool interface answers the model, not with a status, but creates nothing
        for name in BAD_NAMES:
            answer = http.post("/v1/sessions/safe/capability", json={"action": "enable",
                                                                      "name": name.format(m=MARKER)}).json()
            assert answer["plan"] is None and answer["error"] == "unknown_capability"
        assert http.get("/v1/sessions/safe").status_code == 404  # no session was made by any of it
        assert not any(c["name"] == "escapee" for c in http.get("/v1/capabilities").json()["capabilities"])
        errors = http.get("/v1/health").json()["errors"]
        assert [e for e in errors if e["file"].endswith("/escapee") and "outside the tap" in e["reason"]]
        routed = http.post("/v1/route", json={"message": "exfiltrate the secret capability"}).json()
        assert routed["capability"] != "escapee" and all(c["name"] != "escapee" for c in routed["candidates"])

    assert _tree(tap) == before_tap  # capd never writes into a tap
    assert set(os.listdir(data)) <= before_data | {"sessions.sqlite3-wal", "sessions.sqlite3-shm",
                                                   "vectors.sqlite3-wal", "vectors.sqlite3-shm"}
    for root, depth in ((tap.parents[1], 6), (data.parent, 3), (Path("/tmp"), 1), (Path.cwd(), 1)):
        leaked = [str(p) for p in _walk(root, depth) if MARKER in p.name]
        assert not leaked, leaked


def _walk(root: Path, depth: int) -> Iterator[Path]:
    if depth < 0:
        return
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for entry in entries:
        yield Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(Path(entry.path), depth - 1)
