"""Helpers of the reliability suite (issue 7): load, faults, fuzz and security, against real daemons.

Two sizes. The quick size (default) runs inside ``make test``; ``CAPD_RELIABILITY=full``
switches every test to its full size (``make reliability``). Everything talks to loopback
or to a Unix socket only, and every loop is bounded in count and in time.

Helpers shared by the modules:

- :func:`sized` picks the quick or the full value of a knob;
- :func:`fleet_tap` writes a tap whose capabilities share servers (so teardown refcounts
  matter) and carry ``{{ENV:…}}`` placeholders;
- :class:`Daemon` / the ``daemon_factory`` fixture run ``python -m capd serve --model hash`` as
  a real process with its log in a file, on a free port or a Unix socket;
- :func:`wait_until` is the only way these tests wait: a bounded poll.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

FULL = os.environ.get("CAPD_RELIABILITY", "").strip().lower() == "full"
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def sized(quick: Any, full: Any) -> Any:
    """The full-size value under ``CAPD_RELIABILITY=full``, else the quick one."""
    return full if FULL else quick


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- the fleet tap -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Server:
    name: str
    tools: tuple[str, ...]  # allowed tools on this server ("*" = all)
    spec: str  # the [[mcp.servers]] body (without the name line)


@dataclass(frozen=True)
class Cap:
    name: str
    triggers: tuple[str, ...]
    servers: tuple[Server, ...] = ()
    requires: tuple[str, ...] = ()

    @property
    def server_tools(self) -> dict[str, tuple[str, ...]]:
        return {s.name: s.tools for s in self.servers}


def _stdio(package: str, *extra: str) -> str:
    args = ", ".join(f'"{a}"' for a in ("-y", package, *extra))
    return f'type = "stdio"\ncommand = "npx"\nargs = [{args}]\ntimeout_seconds = 30\n'


FS = "@modelcontextprotocol/server-filesystem"
PG = ("@modelcontextprotocol/server-postgres", "{{ENV:POSTGRES_CONNECTION_STRING}}")
FLEET: tuple[Cap, ...] = (
    Cap("fs-read", ("read a file from the disk", "list the files in this folder", "show me the file contents"),
        (Server("filesystem", ("read_file", "list_directory"), _stdio(FS, ".")),)),
    Cap("fs-write", ("write a new file to the disk", "save these changes into the file", "create a new directory"),
        (Server("filesystem", ("write_file", "create_directory"), _stdio(FS, ".")),)),
    Cap("fs-admin", ("move and rename files around", "delete the old backup files", "change file permissions"),
        (Server("filesystem", ("*",), _stdio(FS, ".")),)),
    Cap("git-history", ("show the git log of this branch", "who changed this line in git blame",
                        "diff between two commits"),
        (Server("git", ("log", "show", "blame"), _stdio("mcp-server-git")),)),
    Cap("git-commit", ("commit my staged changes", "stage all modified files with git add",
                       "amend the last commit message"),
        (Server("git", ("commit", "add"), _stdio("mcp-server-git")),)),
    Cap("db-postgres", ("query the postgres database", "describe the postgres table schema",
                        "run this SQL statement on postgres"),
        (Server("postgres", ("*",), _stdio(*PG)),)),
    Cap("db-sync", ("copy rows from postgres into sqlite", "synchronise the sqlite cache with postgres",
                    "export the postgres table to sqlite"),
        (Server("postgres", ("query",), _stdio(*PG)),
         Server("sqlite", ("*",), _stdio("mcp-server-sqlite", "{{ENV:SQLITE_PATH}}")))),
    Cap("web-fetch", ("fetch this web page for me", "download the html of that url", "get the content of a website"),
        (Server("fetch", ("fetch",), 'type = "http"\nurl = "https://fetch.example/mcp?key={{ENV:FETCH_API_KEY}}"\n'
                                     'timeout_seconds = 20\n[mcp.servers.headers]\n'
                                     'Authorization = "Bearer {{ENV:FETCH_API_KEY}}"\n'),)),
    Cap("docs-search", ("search the documentation index", "find the api reference for this function",
                        "look up the library manual"),
        (Server("fetch", ("fetch",), 'type = "http"\nurl = "https://fetch.example/mcp?key={{ENV:FETCH_API_KEY}}"\n'),
         Server("search", ("*",), _stdio("mcp-server-search") + '[mcp.servers.env]\n'
                                  'SEARCH_TOKEN = "{{ENV:SEARCH_TOKEN}}"\n'))),
    Cap("k8s", ("list the kubernetes pods", "scale the kubernetes deployment", "tail the logs of a pod"),
        (Server("kubectl", ("*",), _stdio("mcp-server-kubernetes")),)),
    Cap("python-toolchain", ("set up a python virtual environment", "run the pytest suite",
                             "install the python dependencies"), requires=("python3", "astral-sh/uv")),
    Cap("smalltalk", ("tell me about the weather today", "what is the capital of france", "tell me a joke")),
)
FLEET_BY_NAME: dict[str, Cap] = {c.name: c for c in FLEET}
ENV_SECRETS = ("POSTGRES_CONNECTION_STRING", "SQLITE_PATH", "FETCH_API_KEY", "SEARCH_TOKEN")


def provider_text(cap: Cap) -> str:
    allowed = ", ".join(f'"{s.name}:{t}"' for s in cap.servers for t in s.tools)
    refs = ", ".join(f'"{s.name}"' for s in cap.servers)
    text = f"# Title: {cap.name}\n# Description: the {cap.name} capability\n"
    text += "[deps]\nrequire = [" + ", ".join(f'"{r}"' for r in cap.requires) + "]\n"
    if cap.servers:
        text += f"[roles.mcp]\nserver_refs = [{refs}]\nallowed_tools = [{allowed}]\n"
    for server in cap.servers:
        text += f'\n[[mcp.servers]]\nname = "{server.name}"\n{server.spec}'
    return text


def write_config(directory: Path, triggers: Sequence[str], extra: str = "") -> None:
    body = "triggers = [\n" + "".join(f'    "{t}",\n' for t in triggers) + "]\n"
    (directory / "config.toml").write_text(body + extra, encoding="utf-8")


def fleet_tap(root: Path, caps: Sequence[Cap] = FLEET) -> Path:
    """Write the fleet tap under ``root/fleet``; providers are symlinked as default.toml, as octomind does."""
    tap = root / "fleet"
    for cap in caps:
        directory = tap / "capabilities" / cap.name
        directory.mkdir(parents=True)
        write_config(directory, cap.triggers, 'domains = ["developer"]\n')
        if cap.servers or cap.requires:
            (directory / "main.toml").write_text(provider_text(cap), encoding="utf-8")
            os.symlink("main.toml", directory / "default.toml")
    return tap


def plain_tap(root: Path, count: int, name: str = "plain") -> Path:
    """A tap of ``count`` routing-only capabilities with distinct triggers."""
    tap = root / name
    for i in range(count):
        directory = tap / "capabilities" / f"cap-{i:03d}"
        directory.mkdir(parents=True)
        write_config(directory, [f"capability number {i} original phrase", f"another trigger for item {i}"])
    return tap


# -- real daemons ------------------------------------------------------------------------------------

def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without any CAPD_* setting (so nothing leaks in), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPD_")}
    env["CAPD_CONFIG"] = os.devnull  # no user config file either: an empty file is an empty config
    env.update(extra or {})
    return env


@dataclass
class Daemon:
    """``python -m capd serve --model hash`` as a real process; stdout and stderr go to ``log``."""

    taps: tuple[Path, ...]
    data_dir: Path
    log: Path
    port: int | None = None
    uds: Path | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    token: str | None = None

    @property
    def url(self) -> str:
        return "http://capd" if self.uds else f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "capd", "serve", "--model", "hash", "--data-dir", str(self.data_dir)]
        for tap in self.taps:
            cmd += ["--tap", str(tap)]
        cmd += ["--uds", str(self.uds)] if self.uds else ["--port", str(self.port)]
        return cmd + list(self.args)

    def start(self, wait: bool = True, timeout: float = 60.0) -> Daemon:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, cwd=self.data_dir.parent,
                                         env=clean_env(self.env))
        if wait:
            self.wait_ready(timeout)
        return self

    def client(self, timeout: float = 30.0, token: str | None = None) -> httpx.Client:
        given = token if token is not None else self.token
        headers = {"Authorization": f"Bearer {given}"} if given else {}
        transport = httpx.HTTPTransport(uds=str(self.uds)) if self.uds else None
        return httpx.Client(base_url=self.url, timeout=timeout, headers=headers, transport=transport)

    def health(self) -> dict[str, Any] | None:
        try:
            with self.client(timeout=5) as http:
                response = http.get("/v1/health")
        except httpx.TransportError:
            return None
        return response.json() if response.status_code == 200 else None

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, f"daemon exited:\n{self.log_text()[-3000:]}"
            health = self.health()
            if health is not None and (health["ready"] or health["status"] == "error"):
                return health
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready after {timeout}s:\n{self.log_text()[-3000:]}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int | None:
        """Graceful stop (SIGTERM), SIGKILL after 20 s; returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill9()
            return None

    def log_text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace") if self.log.exists() else ""


DaemonFactory = Callable[..., Daemon]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]

