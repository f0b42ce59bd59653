"""The daemon as a real process: restart persistence, Unix socket, exit codes, the README agent loop."""

from __future__ import annotations

import errno
import http.client
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from capd import daemon
from capd.client import CapdClient
from capd.errors import DaemonUnreachable
from capd.settings import Settings
from capd.transport import _still_open
from tests.conftest import isolated_data_dir
from tests.taputil import octomind_tap, write_capability

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start(args: list[str], env: dict[str, str] | None = None, ctrl_c: bool = False) -> subprocess.Popen[bytes]:
    """``capd serve`` in a child process; ``ctrl_c``: with SIGINT handled as at a terminal. A shell
    starts a background job (as CI runs the suite) with SIGINT ignored, and children inherit that."""
    reset = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if ctrl_c else None
    return subprocess.Popen([sys.executable, "-m", "capd", "serve", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, **(env or {})}, preexec_fn=reset)


def _wait_ready(client: CapdClient, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "daemon exited"
        try:
            if client.health()["ready"]:
                return
        except DaemonUnreachable:
            pass
        time.sleep(0.1)
    raise AssertionError("daemon did not become ready")


@pytest.fixture
def daemon_dirs(tmp_path: Path, model_settings: Settings) -> Iterator[tuple[Path, Path]]:
    settings = isolated_data_dir(model_settings, tmp_path)
    yield octomind_tap(tmp_path), settings.data_dir


def test_sessions_survive_kill_9(daemon_dirs: tuple[Path, Path]) -> None:
    tap, data = daemon_dirs
    port = _free_port()
    args = ["--tap", str(tap), "--data-dir", str(data), "--port", str(port)]
    first = _start(args)
    client = CapdClient(f"http://127.0.0.1:{port}")
    try:
        _wait_ready(client, first)
        client.enable("agent-a", "filesystem-read")
        client.enable("agent-a", "database-postgres")
        client.route("agent-b", "please run a query on the postgres database")
        client.tool_result("agent-a", "filesystem", "read_file", True)
        before = {s: client.session(s) for s in ("agent-a", "agent-b")}
        # private to this user: sessions hold what agents were told, learned corrections users' messages
        assert stat.S_IMODE((data / "sessions.sqlite3").stat().st_mode) == 0o600
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    second = _start(args)
    try:
        _wait_ready(client, second)
        after = {s: client.session(s) for s in ("agent-a", "agent-b")}
        assert after == before
        assert client.health()["embedded"] == 0  # warm start: every vector from the cache
    finally:
        second.terminate()
        second.wait(20)
        client.close()
    # SIGTERM is a graceful shutdown (uvicorn re-raises the signal once it has finished).
    assert second.stderr is not None and b"Application shutdown complete" in second.stderr.read()


def test_unix_socket_is_private(daemon_dirs: tuple[Path, Path]) -> None:
    tap, data = daemon_dirs
    sock = data / "capd.sock"
    proc = _start(["--tap", str(tap), "--data-dir", str(data), "--uds", str(sock)])
    client = CapdClient(uds=str(sock))
    try:
        _wait_ready(client, proc)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert client.discover("look at the postgres schema")[0]["name"] == "database-postgres"
    finally:
        proc.terminate()
        proc.wait(20)
        client.close()
    assert not sock.exists()


def test_port_in_use_exits_3(daemon_dirs: tuple[Path, Path]) -> None:
    tap, data = daemon_dirs
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _start(["--tap", str(tap), "--data-dir", str(data), "--port", str(port)])
        assert proc.wait(60) == 3
        assert proc.stderr is not None
        said = proc.stderr.read()
        assert b"cannot listen" in said and b"is another capd running? try --port" in said


def test_cli_without_daemon_exits_3() -> None:
    proc = subprocess.run([sys.executable, "-m", "capd", "status", "--port", str(_free_port())],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 3 and "capd serve" in proc.stderr


def test_readme_agent_loop_runs(daemon_dirs: tuple[Path, Path]) -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## For agent developers.*?```python\n(.*?)```", readme, re.S)
    assert block is not None
    code = block.group(1)
    _, data = daemon_dirs
    port = _free_port()
    proc = _start(["--tap", str(ROOT / "taps" / "core"), "--data-dir", str(data), "--port", str(port)])
    client = CapdClient(f"http://127.0.0.1:{port}")
    try:
        _wait_ready(client, proc)
        code = code.replace("CapdClient()", f"CapdClient('http://127.0.0.1:{port}')")
        for _ in range(2):  # run again, as an agent restarted under the same id: it gets its servers again
            run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                                 timeout=60)
            assert run.returncode == 0, run.stderr
            assert "'git': ['*']" in run.stdout  # the plan started the git server
            assert client.session("my-agent-1")["active"][0]["name"] == "git"
    finally:
        proc.terminate()
        proc.wait(20)
        client.close()


def test_debug_logging_leaves_out_the_file_event_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    """At debug, watchdog logged each file event: with the log file in a watched folder (a tap's
    parent) every line it wrote was an event, and the log grew by 24 MB in 11 s."""
    from capd.daemon import QUIET_AT_DEBUG, configure_logging

    for name in QUIET_AT_DEBUG:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    configure_logging("debug")
    assert logging.getLogger("watchdog.observers.inotify_buffer").getEffectiveLevel() == logging.INFO


# -- where the daemon listens: Unix sockets, IPv6, port 0, bind errors ------------------------------------

def _hash_args(tmp_path: Path) -> list[str]:
    """A daemon on the hash model: these tests are about sockets, not routing."""
    return ["--tap", str(octomind_tap(tmp_path / "tap")), "--model", "hash", "--data-dir", str(tmp_path / "data")]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(20)


def _capd_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "capd", *args], capture_output=True, text=True, check=False,
                          timeout=60, env={**os.environ, "CAPD_CONFIG": "", **(env or {})})


def _listening_line(proc: subprocess.Popen[bytes]) -> str:
    """The daemon's first log line (``capd listening on …``), read from its stderr."""
    assert proc.stderr is not None
    for raw in proc.stderr:
        if b"capd listening on" in raw:
            return raw.decode()
    raise AssertionError("the daemon exited without saying where it listens")


def test_a_second_daemon_on_a_served_socket_exits_3_and_the_first_keeps_it(tmp_path: Path) -> None:
    """The second daemon unlinked the live socket and bound its own: the first kept running, unreachable."""
    sock = tmp_path / "capd.sock"
    first = _start([*_hash_args(tmp_path), "--uds", str(sock)])
    client = CapdClient(uds=str(sock))
    second: subprocess.Popen[bytes] | None = None
    try:
        _wait_ready(client, first)
        inode = sock.stat().st_ino
        second = _start([*_hash_args(tmp_path / "second"), "--uds", str(sock)])
        assert second.wait(60) == 3
        assert second.stderr is not None
        said = second.stderr.read().decode()
        assert f"cannot bind {sock}: another capd is serving there" in said, said
        assert sock.stat().st_ino == inode and client.health()["ready"]  # still the first one's, answering
    finally:
        for proc in (second, first):
            if proc is not None:
                _stop(proc)
        client.close()


def test_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    sock = tmp_path / "capd.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:  # as a daemon killed with -9 leaves it
        dead.bind(str(sock))
    proc = _start([*_hash_args(tmp_path), "--uds", str(sock)])
    client = CapdClient(uds=str(sock))
    try:
        _wait_ready(client, proc)
    finally:
        _stop(proc)
        client.close()
    assert not sock.exists() and not daemon.lock_path(sock).exists()


def test_two_daemons_starting_together_on_a_stale_socket_leave_one_serving(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both found the socket stale; the later one's unlink took the earlier one's fresh socket, which
    then ran unreachable. Here the second start runs between the first one's probe and its unlink."""
    sock = tmp_path / "capd.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:  # as a daemon killed with -9 leaves it
        dead.bind(str(sock))
    probe, second = daemon._refuse_if_served, []

    def then_a_second_start(path: Path) -> None:
        probe(path)  # stale
        if not second:
            second.append(None)
            try:
                second[0] = daemon._bind_unix(path)
            except daemon.BindError as exc:
                second[0] = exc

    monkeypatch.setattr(daemon, "_refuse_if_served", then_a_second_start)
    first, lock = daemon._bind_unix(sock)
    try:
        assert isinstance(second[0], daemon.BindError), "the second start bound too"
        assert f"cannot bind {sock}: another capd is serving there" in str(second[0])
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(sock))  # the path is the first one's socket
            first.settimeout(5)
            first.accept()[0].close()
    finally:
        first.close()
        lock.close()
    monkeypatch.undo()
    again, lock = daemon._bind_unix(sock)  # a lock released (the daemon gone) does not block a start
    again.close()
    lock.close()


def test_a_daemon_removes_only_the_socket_it_created(tmp_path: Path) -> None:
    """A daemon that stopped unlinked the path even when it was by then another daemon's socket,
    which kept running unreachable."""
    sock = tmp_path / "capd.sock"
    proc = _start([*_hash_args(tmp_path), "--uds", str(sock)])
    client = CapdClient(uds=str(sock))
    try:
        _wait_ready(client, proc)
        sock.unlink()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as newer:  # the newer daemon's socket
            newer.bind(str(sock))
            newer.listen()
            inode = sock.stat().st_ino
            proc.terminate()
            proc.wait(20)
            assert sock.exists() and sock.stat().st_ino == inode
    finally:
        _stop(proc)
        client.close()


def test_port_0_logs_the_port_it_bound(tmp_path: Path) -> None:
    proc = _start([*_hash_args(tmp_path), "--port", "0"])
    try:
        found = re.search(r"listening on http://127\.0\.0\.1:(\d+);", _listening_line(proc))
        assert found is not None and found.group(1) != "0"
        with CapdClient(f"http://127.0.0.1:{found.group(1)}") as client:
            _wait_ready(client, proc)
    finally:
        _stop(proc)
    assert proc.stderr is not None
    rest = proc.stderr.read().decode()  # uvicorn's own lines had no time: a log file did not say when it stopped
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO uvicorn\.error: Finished server process", rest,
                     re.MULTILINE), rest


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("serve_host", ["::1", "[::1]"])
def test_ipv6_host_works_for_serve_and_every_client(tmp_path: Path, serve_host: str) -> None:
    """Clients built ``http://::1:PORT`` and died with a traceback; serve could not bind ``[::1]``."""
    port = _free_port()
    proc = _start([*_hash_args(tmp_path), "--host", serve_host, "--port", str(port)])
    try:
        assert f"listening on http://[::1]:{port};" in _listening_line(proc)
        with CapdClient(f"http://[::1]:{port}") as client:
            _wait_ready(client, proc)
        for args, env in ((["status", "--host", "::1", "--port", str(port)], {}),
                          (["status", "--host", "[::1]", "--port", str(port)], {}),
                          (["status"], {"CAPD_HOST": "::1", "CAPD_PORT": str(port)}),
                          (["list", "--host", "::1", "--port", str(port)], {}),
                          (["discover", "postgres schema", "--host", "::1", "--port", str(port)], {}),
                          (["route", "show me the commits", "--host", "::1", "--port", str(port)], {}),
                          (["enable", "s1", "filesystem-read", "--host", "::1", "--port", str(port)], {})):
            result = _capd_cli(*args, env=env)
            assert result.returncode == 0 and not result.stderr, (args, result.stderr)
    finally:
        _stop(proc)


def test_a_port_flag_beats_capd_uds_from_the_environment(tmp_path: Path) -> None:
    """flags > environment: an exported CAPD_UDS made serve and the clients ignore --port."""
    sock, port = tmp_path / "env.sock", _free_port()
    env = {"CAPD_UDS": str(sock)}
    proc = _start([*_hash_args(tmp_path), "--port", str(port)], env=env)
    try:
        with CapdClient(f"http://127.0.0.1:{port}") as client:
            _wait_ready(client, proc)
        assert not sock.exists()
        result = _capd_cli("status", "--port", str(port), env=env)
        assert result.returncode == 0, result.stderr
        assert _capd_cli("status", "--host", "127.0.0.1", env={**env, "CAPD_PORT": str(port)}).returncode == 0
    finally:
        _stop(proc)


def test_bind_errors_say_what_went_wrong(tmp_path: Path) -> None:
    """A socket path too long said "None"; every bind error blamed another capd."""
    args, long_path = _hash_args(tmp_path), tmp_path / ("a" * 120 + ".sock")
    too_long = _start([*args, "--uds", str(long_path)])
    assert too_long.wait(60) == 3 and too_long.stderr is not None
    said = too_long.stderr.read().decode()
    assert "path too long" in said and "None" not in said, said
    unassigned = _start([*args, "--host", "192.0.2.1", "--port", str(_free_port())])  # TEST-NET-1
    assert unassigned.wait(60) == 3 and unassigned.stderr is not None
    said = unassigned.stderr.read().decode()
    assert "cannot listen on 192.0.2.1:" in said and "another capd" not in said, said


def test_a_closed_output_pipe_ends_quietly_with_141(tmp_path: Path) -> None:
    """``capd list | head -1``: click exits 1 on EPIPE, which capd documents as an error."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read: the first write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "capd", "list", "--tap", str(octomind_tap(tmp_path))],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, check=False, timeout=60)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (141, "")


@pytest.mark.slow
def test_an_idle_connection_outlives_uvicorns_five_seconds(daemon_dirs: tuple[Path, Path]) -> None:
    """An agent's turns are often more than 5 s apart (uvicorn's default keep-alive): the daemon
    keeps an idle connection for ``KEEP_ALIVE_S``, so the next turn's route reuses it."""
    tap, data = daemon_dirs
    port = _free_port()
    proc = _start(["--tap", str(tap), "--data-dir", str(data), "--port", str(port)])
    client = CapdClient(f"http://127.0.0.1:{port}")
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        _wait_ready(client, proc)
        for turn in range(2):
            if turn:
                time.sleep(6.0)
                assert _still_open(connection)  # nothing to read: the daemon has not closed it
            connection.request("GET", "/v1/health")
            response = connection.getresponse()
            assert response.status == 200 and json.loads(response.read())["ready"] is True
    finally:
        connection.close()
        proc.terminate()
        proc.wait(20)
        client.close()


def _inotify_limits_can_be_lowered() -> str | None:
    """None when a process may lower its own inotify limits: in a user namespace of its own, whose
    limits (``/proc/sys/user/max_inotify_*``) are its alone. Else why not (no ``unshare``, or user
    namespaces turned off)."""
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c",
                            "echo 0 > /proc/sys/user/max_inotify_instances"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"inotify limits cannot be lowered here: {probe.stderr.strip()}"


@pytest.mark.parametrize("limit", ["max_inotify_instances", "max_inotify_watches"])
def test_a_daemon_at_the_kernels_inotify_limit_scans_its_taps(tmp_path: Path, limit: str) -> None:
    """The kernel's own refusal, not a fake: the daemon runs in a user namespace whose inotify
    instance (or watch) limit is 0, the rest of the machine keeping its own. It used to stay
    "starting" for good; it is ready, says in health why its tap is scanned, and an edit goes live."""
    if (why := _inotify_limits_can_be_lowered()) is not None:
        pytest.skip(why)
    tap, port = octomind_tap(tmp_path), _free_port()
    serve = shlex.join([sys.executable, "-m", "capd", "serve", "--tap", str(tap), "--data-dir", str(tmp_path / "data"),
                        "--model", "hash", "--port", str(port)])
    proc = subprocess.Popen(["unshare", "--user", "--map-root-user", "sh", "-c",
                             f"echo 0 > /proc/sys/user/{limit} && exec {serve}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = CapdClient(f"http://127.0.0.1:{port}")
    try:
        _wait_ready(client, proc)
        [note] = client.health()["errors"]
        assert note["file"] == str(tap) and "limit reached" in note["reason"], note
        write_capability(tap, "database-mysql", ["query the mysql database", "show mysql tables"])
        deadline = time.monotonic() + 15
        while "database-mysql" not in {c["name"] for c in client.capabilities()} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "database-mysql" in {c["name"] for c in client.capabilities()}
    finally:
        client.close()
        proc.terminate()
        proc.communicate(timeout=10)


# -- stopping: a stalled client, a failed start ----------------------------------------------------------

def _start_with(tmp_path: Path, port: int, constant: str, value: float,
                module: str = "daemon") -> subprocess.Popen[bytes]:
    """``capd serve`` (hash model) with one of ``capd.<module>``'s timing constants shortened."""
    shortened = (f"import sys; from capd import {module}; {module}.{constant} = {value!r}; "
                 "from capd.cli import main; main(prog_name='capd')")
    return subprocess.Popen([sys.executable, "-c", shortened, "serve", *_hash_args(tmp_path), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_a_client_stalled_mid_request_does_not_keep_the_daemon_from_stopping(tmp_path: Path) -> None:
    """uvicorn waits for every request under way before it stops, with no limit: one client that
    sent half a body (a suspended agent) kept a SIGTERM-ed daemon running for good, its sessions
    not stored. The wait is bounded (``SHUTDOWN_GRACE_S``, shortened here) and the shutdown completes."""
    port = _free_port()
    proc = _start_with(tmp_path, port, "SHUTDOWN_GRACE_S", 0.5)
    client = CapdClient(f"http://127.0.0.1:{port}")
    try:
        _wait_ready(client, proc)
        with socket.create_connection(("127.0.0.1", port)) as stalled:
            stalled.sendall(b"POST /v1/route HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 100\r\n\r\n{\"session\"")
            time.sleep(0.2)  # the daemon has read the head: a request is under way
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pytest.fail("the daemon did not stop while a client stalled mid-request")
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.stderr is not None and b"Application shutdown complete" in proc.stderr.read()


def _response(conn: socket.socket) -> bytes:
    """One whole HTTP response (head and ``Content-Length`` body), however the reads split it."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_connection_that_sends_no_request_head_in_time_is_closed(tmp_path: Path) -> None:
    """uvicorn times a connection out only after a response: one that sent nothing, or half a
    request line, held its descriptor for good (400 of them took a daemon from 32 to 432). Each
    request's head now has ``HEADERS_S`` (shortened here); an idle keep-alive connection stays."""
    port = _free_port()
    proc = _start_with(tmp_path, port, "HEADERS_S", 0.5)
    client = CapdClient(f"http://127.0.0.1:{port}")
    try:
        _wait_ready(client, proc)
        silent = socket.create_connection(("127.0.0.1", port))
        partial = socket.create_connection(("127.0.0.1", port))
        partial.sendall(b"GET /v1/hea")
        served = socket.create_connection(("127.0.0.1", port))
        served.sendall(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        for conn in (silent, partial, served):
            conn.settimeout(5)
        assert _response(served).startswith(b"HTTP/1.1 200")
        assert silent.recv(1) == b"" and partial.recv(1) == b""  # closed by the daemon, within seconds
        served.settimeout(1.5)
        with pytest.raises(TimeoutError):  # kept alive between requests, as before (KEEP_ALIVE_S)
            served.recv(1)
        served.sendall(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _response(served).startswith(b"HTTP/1.1 200")
        for conn in (silent, partial, served):
            conn.close()
        assert client.health()["ready"]
    finally:
        client.close()
        _stop(proc)


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_the_connection_closed(tmp_path: Path) -> None:
    """A client that sent a request's head and part of its body, then stalled (a suspended agent),
    held its connection and a request task for good: ``HEADERS_S`` bounds the head only. The body
    now has ``BODY_S`` from the head (shortened here); one that arrives in pieces within it is served."""
    port = _free_port()
    proc = _start_with(tmp_path, port, "BODY_S", 0.5, module="api_http")
    client = CapdClient(f"http://127.0.0.1:{port}")
    head = b"HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: "
    try:
        _wait_ready(client, proc)
        for path in (b"/v1/route", b"/v1/sessions/s1/enable"):  # the guard's fast path, and FastAPI's reading
            with socket.create_connection(("127.0.0.1", port)) as stalled:
                stalled.settimeout(5)
                stalled.sendall(b"POST " + path + b" " + head + b'100\r\n\r\n{"session"')
                answer = _response(stalled)
                assert answer.startswith(b"HTTP/1.1 408"), answer
                assert b'"error":"timeout"' in answer and b"did not arrive within 0.5 s" in answer
                assert stalled.recv(1) == b""  # closed: the rest of the body would read as a new request
        body = b'{"session": "s1", "message": "read the file notes.txt in this folder"}'
        with socket.create_connection(("127.0.0.1", port)) as slow:
            slow.settimeout(5)
            slow.sendall(b"POST /v1/route " + head + str(len(body)).encode() + b"\r\n\r\n" + body[:20])
            time.sleep(0.2)
            slow.sendall(body[20:])
            assert _response(slow).startswith(b"HTTP/1.1 200")
        scrape = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        scrape.request("GET", "/metrics")
        metrics = scrape.getresponse().read().decode()
        scrape.close()
        for path in ("/v1/route", "/v1/sessions/{session}/enable"):
            assert f'path="{path}",status="408"' in metrics, metrics
        assert client.health()["ready"]
    finally:
        client.close()
        _stop(proc)


def _sigint_stop(tmp_path: Path, presses: int) -> tuple[int, str]:
    """Start a daemon, stall one request when ``presses`` > 1 (so that the second Ctrl-C finds the
    stop still waiting for it), press Ctrl-C ``presses`` times: its exit status and what it said."""
    port = _free_port()
    proc = _start([*_hash_args(tmp_path), "--port", str(port)], ctrl_c=True)
    client = CapdClient(f"http://127.0.0.1:{port}")
    try:
        _wait_ready(client, proc)
        client.enable("s1", "filesystem-read")
        with socket.create_connection(("127.0.0.1", port)) as stalled:
            if presses > 1:
                stalled.sendall(b"POST /v1/route HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 50\r\n\r\n{")
                time.sleep(0.2)
            for _ in range(presses):
                proc.send_signal(signal.SIGINT)
                time.sleep(0.3)
            code = proc.wait(20)
    finally:
        client.close()
        _stop(proc)
    assert proc.stderr is not None
    return code, proc.stderr.read().decode()


def test_ctrl_c_stops_the_daemon_quietly_with_130(tmp_path: Path) -> None:
    """A stop by Ctrl-C ended with click's "Aborted!" and exit 1, which capd documents as an error."""
    code, said = _sigint_stop(tmp_path, 1)
    assert code == 130 and "Aborted!" not in said, said
    assert "Application shutdown complete" in said, said


def test_a_second_ctrl_c_still_stops_the_app(tmp_path: Path) -> None:
    """uvicorn's forced quit (a second Ctrl-C) skipped the app's shutdown: the lifespan was cancelled
    at exit instead, with a traceback. (The stalled request's own cancellation is uvicorn's to log.)"""
    code, said = _sigint_stop(tmp_path, 2)
    assert code == 130 and "Aborted!" not in said, said
    assert "Application shutdown complete" in said and "in lifespan" not in said, said


def test_a_failed_unix_bind_leaves_no_lock_file(tmp_path: Path) -> None:
    """``--uds`` on a regular file (or a path too long) was refused, but left ``PATH.lock`` beside it."""
    not_a_socket = tmp_path / "notes.txt"
    not_a_socket.write_text("mine")
    for path in (not_a_socket, tmp_path / ("a" * 120 + ".sock")):
        with pytest.raises(daemon.BindError):
            daemon._bind_unix(path)
        assert not daemon.lock_path(path).exists(), path
    assert not_a_socket.read_text() == "mine"


def test_a_stale_socket_that_cannot_be_removed_is_a_bind_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale socket in a folder this user may not write (another user's in a sticky /tmp) raised
    PermissionError from unlink: a traceback and exit 1 instead of a reason and exit 3."""
    sock = tmp_path / "capd.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:  # as a daemon killed with -9 leaves it
        dead.bind(str(sock))
    unlink = Path.unlink

    def refused(self: Path, missing_ok: bool = False) -> None:
        if self == sock:
            raise PermissionError(1, "Operation not permitted", str(self))
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refused)
    with pytest.raises(daemon.BindError, match="cannot remove it: Operation not permitted"):
        daemon._bind_unix(sock)
    monkeypatch.undo()
    assert sock.is_socket() and not daemon.lock_path(sock).exists()


def test_a_bound_port_is_listened_on_at_once(tmp_path: Path) -> None:
    """With SO_REUSEADDR two sockets may bind one port as long as neither listens yet: two daemons
    started together both bound it, the later one's listen (in uvicorn) failed silently, and it ran
    "ready" for good, unreachable. Listening in :func:`daemon.bind` makes the later one fail there."""
    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # the other daemon, mid-start
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    other.bind(("127.0.0.1", 0))
    port = other.getsockname()[1]
    try:
        settings = Settings(taps=(), data_dir=tmp_path, model="hash", host="127.0.0.1", port=port)
        sock, _ = daemon.bind(settings)
        try:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
            with pytest.raises(OSError) as caught:
                other.listen()  # the other daemon, with this fix, says so in bind() and exits 3
            assert caught.value.errno == errno.EADDRINUSE
        finally:
            sock.close()
    finally:
        other.close()


@pytest.mark.parametrize(("host", "token", "uds", "exposed"), [
    ("127.0.0.1", None, None, False), ("127.0.0.2", None, None, False), ("::1", None, None, False),
    ("[::1]", None, None, False), ("localhost", None, None, False), ("LocalHost", None, None, False),
    ("0.0.0.0", None, None, True), ("192.168.1.20", None, None, True), ("mybox.lan", None, None, True),
    ("0.0.0.0", "s3cret-token", None, False), ("0.0.0.0", None, "/tmp/capd.sock", False),
])
def test_the_no_token_warning_is_for_addresses_beyond_this_machine(host: str, token: str | None, uds: str | None,
                                                                   exposed: bool) -> None:
    """It warned for 127.0.0.2 (loopback too) and for ``LocalHost``."""
    settings = Settings(host=host, token=token, uds=Path(uds) if uds else None)
    assert daemon.exposed_without_token(settings) is exposed
