"""Write real tap files into a temporary directory for tests."""

from __future__ import annotations

import os
from pathlib import Path
from textwrap import dedent
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

EVALSETS = Path(__file__).resolve().parents[2] / "shared" / "evalsets"  # read in place, never copied

POSTGRES_PROVIDER = """\
# Title: PostgreSQL Database
# Description: Query and inspect PostgreSQL
[deps]
require = ["modelcontextprotocol/postgres"]

[roles.mcp]
server_refs = ["postgres"]
allowed_tools = ["postgres:*"]

[[mcp.servers]]
name = "postgres"
type = "stdio"
command = "npx"
args = ["-y", "@modelcontextprotocol/server-postgres@0.6.2", "{{ENV:POSTGRES_CONNECTION_STRING}}"]
timeout_seconds = 60
tools = []
"""


def fs_provider(tools: list[str]) -> str:
    allowed = ", ".join(f'"filesystem:{t}"' for t in tools)
    return dedent(f"""\
        # Title: Filesystem
        [roles.mcp]
        server_refs = ["filesystem"]
        allowed_tools = [{allowed}]

        [[mcp.servers]]
        name = "filesystem"
        type = "stdio"
        command = "npx"
        args = ["-y", "@modelcontextprotocol/server-filesystem", "."]
        timeout_seconds = 30
        tools = []
        """)


def write_capability(tap: Path, name: str, triggers: list[str] | None = None, providers: dict[str, str] | None = None,
                     default: str | None = None, extra_config: str = "") -> Path:
    """Create ``<tap>/capabilities/<name>/`` with a config.toml and provider files.

    ``default`` names a provider to symlink ``default.toml`` to; ``"<inline>"`` writes the
    first provider's text as ``default.toml`` itself.
    """
    directory = tap / "capabilities" / name
    directory.mkdir(parents=True, exist_ok=True)
    if triggers is not None:
        body = "triggers = [\n" + "".join(f"    {t!r},\n".replace("'", '"') for t in triggers) + "]\n"
        (directory / "config.toml").write_text(body + extra_config, encoding="utf-8")
    for provider, text in (providers or {}).items():
        (directory / f"{provider}.toml").write_text(text, encoding="utf-8")
    if default == "<inline>":
        (directory / "default.toml").write_text(next(iter((providers or {}).values())), encoding="utf-8")
        for provider in providers or {}:
            (directory / f"{provider}.toml").unlink()
    elif default is not None:
        os.symlink(f"{default}.toml", directory / "default.toml")
    return directory


def octomind_tap(root: Path) -> Path:
    """A small tap in the octomind layout: symlinked default, header comments, toolchain, routing-only."""
    tap = root / "tap"
    write_capability(tap, "database-postgres", ["query a postgres database", "look at the postgres schema",
                                                "run SQL against postgres"],
                     {"postgres": POSTGRES_PROVIDER}, default="postgres",
                     extra_config='domains = ["developer", "devops"]\n')
    write_capability(tap, "filesystem-read", ["read a file from disk", "list the files in a folder"],
                     {"octofs": fs_provider(["read_file", "list_directory"])})
    write_capability(tap, "filesystem-write", ["write a new file to disk", "edit the contents of a file"],
                     {"octofs": fs_provider(["write_file", "edit_file"])}, default="<inline>")
    write_capability(tap, "python-toolchain", ["set up a python virtual environment", "run the pytest suite"],
                     {"uv": '# Title: Python toolchain\n[deps]\nrequire = ["python3", "astral-sh/uv"]\n'},
                     default="uv")
    write_capability(tap, "smalltalk", ["tell me about the weather today", "what is the capital of france"])
    return tap


def docker_and_postgres(tap: Path) -> Path:
    """A two-capability tap (two triggers each) for tests that need any small routable tap."""
    write_capability(tap, "docker", ["list running containers", "restart a container"])
    write_capability(tap, "postgres", ["run a sql query", "show database tables"])
    return tap


def local_client(app: FastAPI, **kwargs: Any) -> TestClient:
    """A TestClient addressing the app as ``127.0.0.1``: its default host name (``testserver``) is one
    a daemon without a token refuses (``capd/origin.py``)."""
    return TestClient(app, base_url="http://127.0.0.1", **kwargs)


def calibrated_evalset(settings: Any, name: str, variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``capd calibrate``'s report on a shared eval set's tap and ``dev.jsonl`` with the fused rule and
    the real model, once per variant (``calibrate``'s keyword arguments; ``add_examples`` is False
    unless a variant sets it: each measures one part, not what plain ``capd calibrate`` chooses),
    from one started service."""
    from dataclasses import replace

    from capd.calibrate import calibrate
    from capd.fixtures import load_fixtures
    from capd.service import Service

    root = EVALSETS / name
    rows = load_fixtures([root / "dev.jsonl"])
    service = Service(replace(settings, taps=(root / "tap",), rule="fused")).start()
    try:
        return {label: calibrate(service.router, rows, rebuild=service.router_with_examples,
                                 **{"add_examples": False, **kwargs})
                for label, kwargs in variants.items()}
    finally:
        service.close()
