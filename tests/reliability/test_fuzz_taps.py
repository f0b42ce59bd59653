"""Fuzz the tap loader with hypothesis: random bytes, random TOML-ish text, TOML that parses but
breaks the schema, and ``default.toml`` symlinks to anywhere (loops, folders, outside the tap),
written into one capability of an otherwise good tap. ``load_catalog`` (and lint) must never
raise or hang; a capability that does not load has an error Problem naming its file; the
rest of the tap loads unchanged."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import threading
from datetime import date, datetime, time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capd.catalog import Catalog
from capd.lint import lint_catalog
from capd.taps import load_catalog
from tests.reliability.harness import FLEET_BY_NAME, FULL, provider_text, sized, write_config

pytestmark = pytest.mark.reliability

GOOD = ("db-postgres", "docs-search", "python-toolchain", "smalltalk")
KEYS = ("triggers", "domains", "description", "deps", "require", "roles", "mcp", "server_refs", "allowed_tools",
        "servers", "name", "type", "command", "args", "url", "timeout_seconds", "tools", "env", "gates",
        "threshold", "margin", "top_k", "model")
TOKENS = ("[", "]", "[[", "]]", "=", ",", ".", "{", "}", '"', "'", '"""', "'''", "\n", " ", "#", "\\", "\\u",
          "true", "1979-05-27T07:32:00Z", "inf", "nan", "0x1F", "1e400", "-0", "mcp.servers", "roles.mcp", *KEYS)
VALID_PROVIDER = provider_text(FLEET_BY_NAME["docs-search"])
VALID_CONFIG = 'triggers = ["search the fuzzed thing", "fuzz me please"]\ndescription = "fuzzed"\n'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string, except for lone surrogates (then: invalid TOML)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"


def _toml_document(table: dict[str, Any]) -> str:
    lines = []
    for key, value in table.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            for sub, body in value.items():  # [a.b] sections, as tap files write them
                lines.append(f"[{key}.{sub}]")
                lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in body.items()]
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for body in value:  # [[a]] arrays of tables
                lines.append(f"[[{key}]]")
                lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in body.items()]
        else:
            lines.insert(0, f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


keys = st.sampled_from(KEYS) | st.text(min_size=1, max_size=6)
scalars = (st.integers() | st.floats() | st.booleans() | st.text(max_size=20) | st.datetimes() | st.dates()
           | st.times())
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
                      max_leaves=12)
schema_toml = st.dictionaries(keys, values, max_size=6).map(_toml_document).map(str.encode)
token_soup = st.lists(st.sampled_from(TOKENS) | st.text(max_size=6), max_size=40).map("".join).map(str.encode)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid provider or config file, cut, spliced or with bytes flipped."""
    data = bytearray(draw(st.sampled_from([VALID_PROVIDER, VALID_CONFIG])).encode())
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["cut", "flip", "insert"]))
        if action == "cut":
            del data[at:]
        elif action == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        else:
            data[at:at] = draw(st.binary(max_size=8))
    return bytes(data)


contents = st.binary(max_size=512) | token_soup | schema_toml | mutated()
LINK_TARGETS = ("main.toml", "config.toml", "missing.toml", "default.toml", "loop-a.toml", "folder.toml", ".",
                "../db-postgres/main.toml", "../../../outside.toml", "<outside-absolute>", "fifo.toml")


def _base_tap(root: Path) -> Path:
    tap = root / "tap"
    for name in GOOD:
        cap = FLEET_BY_NAME[name]
        directory = tap / "capabilities" / name
        directory.mkdir(parents=True)
        write_config(directory, cap.triggers)
        if cap.servers or cap.requires:
            (directory / "main.toml").write_text(provider_text(cap))
            os.symlink("main.toml", directory / "default.toml")
    (root / "outside.toml").write_text(VALID_PROVIDER)  # a valid file the tap must not reach
    return tap


def _load_within(tap: Path, seconds: float) -> Catalog:
    """load_catalog in a daemon thread, so that a loader blocked on a FIFO fails the test instead of hanging it."""
    done: list[Catalog | BaseException] = []

    def run() -> None:
        try:
            done.append(load_catalog([tap]))
        except BaseException as exc:  # handed to the test thread below
            done.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert done, f"load_catalog still running after {seconds}s: blocked on a file?"
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]


_BASELINE: dict[str, Any] = {}


def _baseline() -> dict[str, Any]:
    if not _BASELINE:
        with tempfile.TemporaryDirectory() as tmp:
            catalog = load_catalog([_base_tap(Path(tmp))])
            _BASELINE.update({c.name: (c.triggers, c.fingerprint, c.kind) for c in catalog})
    return _BASELINE


def _plant(directory: Path, config: bytes | None, provider: bytes | None, default: bytes | str | None,
           tap_config: bytes | None, specials: frozenset[str]) -> dict[str, Path]:
    """Write the fuzzed capability; returns the files it was given."""
    directory.mkdir(parents=True)
    written: dict[str, Path] = {}
    for name, data in (("config.toml", config), ("main.toml", provider)):
        if data is not None:
            (directory / name).write_bytes(data)
            written[name] = directory / name
    # What a provider file must not be: a folder, a FIFO (reading it would block), a link loop.
    if "folder" in specials:
        (directory / "folder.toml").mkdir()
    if "fifo" in specials:
        os.mkfifo(directory / "fifo.toml")
    if "loop" in specials:
        os.symlink("loop-b.toml", directory / "loop-a.toml")
        os.symlink("loop-a.toml", directory / "loop-b.toml")
    if isinstance(default, bytes):
        (directory / "default.toml").write_bytes(default)
    elif isinstance(default, str):
        outside = directory.parents[3] / "outside.toml"
        os.symlink(str(outside) if default == "<outside-absolute>" else default, directory / "default.toml")
    if default is not None:
        written["default.toml"] = directory / "default.toml"
    if tap_config is not None:
        (directory.parents[1] / "capd.toml").write_bytes(tap_config)
        written["capd.toml"] = directory.parents[1] / "capd.toml"
    return written


def _check(tap: Path, written: dict[str, Path], specials: frozenset[str]) -> None:
    catalog = _load_within(tap, 5.0)  # must not raise, nor hang (a FIFO may sit in the folder)
    lint_catalog(catalog)
    baseline = _baseline()
    for name in GOOD:  # the rest of the tap loads, unchanged
        capability = catalog.capabilities[name]
        assert (capability.triggers, capability.fingerprint, capability.kind) == baseline[name]
    directory = tap / "capabilities" / "fuzzed"
    for problem in catalog.problems:
        assert problem.file and problem.reason and problem.severity in ("error", "warning", "info")
        assert problem.line is None or problem.line >= 1
        assert problem.file.startswith(str(tap)), problem  # every finding names a file of the tap
        assert "Traceback" not in problem.reason
    mine = [p for p in catalog.errors if p.capability == "fuzzed"]
    if specials:  # refused, by the name of the first one the loader met
        assert "fuzzed" not in catalog
    if "fuzzed" not in catalog:  # skipped: an error names the file (or the link) of the capability that failed
        assert mine and all(Path(p.file).parent == directory for p in mine), mine
    else:
        assert not mine, mine
    loaded = catalog.capabilities.get("fuzzed")
    if loaded is not None and loaded.provider is not None:  # whatever loaded came from inside the tap
        assert loaded.provider.path.resolve().is_relative_to(tap.resolve())
    if "capd.toml" in written:  # the tap's own config: loaded, or an error naming it
        named = [p for p in catalog.errors if p.file == str(written["capd.toml"])]
        assert (tap in catalog.tap_configs) != bool(named), named
    assert not (tap / "capabilities" / "outside.toml").exists()


EXAMPLES = sized(150, 3000)


@given(config=st.none() | contents, provider=st.none() | contents,
       default=st.none() | contents | st.sampled_from(LINK_TARGETS), tap_config=st.none() | contents,
       specials=st.frozensets(st.sampled_from(["folder", "fifo", "loop"])))
@settings(max_examples=EXAMPLES, deadline=None, derandomize=not FULL, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_loader_never_crashes(config: bytes | None, provider: bytes | None, default: bytes | str | None,
                              tap_config: bytes | None, specials: frozenset[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="capd-fuzz-"))
    try:
        tap = _base_tap(root)
        written = _plant(tap / "capabilities" / "fuzzed", config, provider, default, tap_config, specials)
        _check(tap, written, specials)
    finally:
        shutil.rmtree(root)


def test_escapes_are_refused(tmp_path: Path) -> None:
    """Files and folders that lead out of the tap are refused, naming the link; nothing outside is read."""
    tap = _base_tap(tmp_path)
    secret = tmp_path / "secret"
    secret.mkdir()
    write_config(secret, ["trigger text from outside the tap"])
    (secret / "main.toml").write_text(VALID_PROVIDER)
    caps = tap / "capabilities"
    os.symlink(secret, caps / "linked-folder")  # a whole capability folder elsewhere
    (caps / "linked-config").mkdir()
    os.symlink(secret / "config.toml", caps / "linked-config" / "config.toml")
    (caps / "linked-provider").mkdir()
    os.symlink(secret / "main.toml", caps / "linked-provider" / "extra.toml")
    (caps / "linked-default").mkdir()
    os.symlink("../../../secret/main.toml", caps / "linked-default" / "default.toml")
    catalog = load_catalog([tap])
    assert set(catalog.capabilities) == set(GOOD)
    by_cap = {p.capability: p for p in catalog.errors}
    assert by_cap["linked-folder"].file == str(caps / "linked-folder")
    assert by_cap["linked-config"].file == str(caps / "linked-config" / "config.toml")
    assert by_cap["linked-provider"].file == str(caps / "linked-provider" / "extra.toml")
    assert by_cap["linked-default"].file == str(caps / "linked-default" / "default.toml")
    assert all("outside the tap" in p.reason for p in by_cap.values())
    assert not any("outside the tap" in t for c in catalog for t in c.triggers)
