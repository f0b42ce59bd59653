"""The daemon as a real process: restart persistence, Unix socket, exit codes, the README agent loop."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from capd.client import CapdClient
from capd.errors import DaemonUnreachable
from capd.settings import Settings
from tests.conftest import isolated_data_dir
from tests.taputil import octomind_tap

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "capd", "serve", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, **(env or {})})


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
        assert proc.stderr is not None and b"cannot listen" in proc.stderr.read()


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
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60)
        assert run.returncode == 0, run.stderr
        assert "git" in run.stdout  # the plan started the git server
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
