"""Load taps (directories of capability TOML files) into a :class:`~capd.catalog.Catalog`.

Reads existing octomind taps unchanged::

    <tap>/capabilities/<name>/config.toml      triggers, domains, description (all optional)
    <tap>/capabilities/<name>/<provider>.toml  [deps], [roles.mcp], [[mcp.servers]]
    <tap>/capabilities/<name>/default.toml     symlink to a provider file, or a provider itself
    <tap>/capd.toml                            capd's per-tap gates (written by ``capd calibrate``)

Decisions where octomind is silent:

- no ``config.toml`` (or no triggers): the capability loads but is never auto-routed; it
  can still be enabled by name (lint warns);
- no ``default.toml`` and exactly one provider file: that provider is the default; with
  several, the first by name is used and lint warns;
- any file of a capability that cannot be read, parsed or validated skips that
  capability only, with a :class:`~capd.catalog.Problem` naming the file and line;
- symlinks (to files or to capability folders) must stay inside the tap; files over 1 MiB,
  binary files, dangling or looping links and anything but regular files (a FIFO would
  block the loader) are errors. capd never writes into a tap.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import math
import os
import re
import stat
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from capd import toml_read
from capd.catalog import RULES, Capability, Catalog, Problem, Provider, ServerSpec, TapConfig, fingerprint
from capd.errors import TapFileError
from capd.fixtures import read_fixture_file
from capd.text import recall_key, strip_tags

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 1 << 20
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
TAP_CONFIG = "capd.toml"
TAP_VETOES = "vetoes.jsonl"  # messages none of the tap's capabilities may take (TapConfig.vetoes)
GATE_KEYS = ("threshold", "margin", "top_k")
TAP_CONFIG_KEYS = ("model", "gates", "rule")  # what capd reads at the top level of a tap's capd.toml
SWITCH = "abstain_corpus"  # a gate table's on/off key: veto with the shipped abstain corpus (capd/router.py)
_TOML_POS = re.compile(r"\s*\(at line (\d+), column (\d+)\)")
_HEADER = re.compile(r"^#\s*(Title|Description)\s*:\s*(.*?)\s*$")


def _resolve(path: Path) -> Path:
    try:
        return path.resolve()
    except RuntimeError:  # how pathlib before 3.13 reports a symlink loop
        raise TapFileError(path, "symlink loop: the link points (eventually) to itself") from None
    except OSError as exc:
        raise TapFileError(path, f"cannot resolve: {exc.strerror or exc}") from None


class _Folder:
    """A capability folder and its tap, each resolved once per load, for the containment checks.

    The real path of a file directly in the folder that is not a symlink, or is a link to a
    sibling that is not one (``default.toml -> postgres.toml``), is the folder's real path plus
    a name: one or two system calls instead of ``Path.resolve``'s ``lstat`` per component of
    the path. Resolving took a fifth of the time of loading a 10,000-capability tap.
    """

    def __init__(self, tap: Path, path: Path, real_tap: Path | None = None) -> None:
        self.real_tap = _resolve(tap) if real_tap is None else real_tap
        self.path = path
        self.real_path = _resolve(path)

    def real(self, path: Path) -> Path:
        if path.parent == self.path:
            if not path.is_symlink():
                return self.real_path / path.name
            try:
                link = os.readlink(path)
            except OSError:
                link = "/"  # let resolve report it
            if "/" not in link and link not in (".", "..") and not (self.path / link).is_symlink():
                return self.real_path / link
        return _resolve(path)

    def read(self, path: Path, target: Path | None = None) -> bytes:
        return _read(path, self.real_tap, self.real(path) if target is None else target)


def read_tap_file(path: Path, root: Path) -> bytes:
    """Read one tap file with the guards every tap file gets; raises :class:`TapFileError`."""
    return _read(path, _resolve(root), _resolve(path))


def _read(path: Path, real_root: Path, target: Path) -> bytes:
    """:func:`read_tap_file` given the real paths of the tap and of ``path``."""
    if path.is_symlink():
        if not target.exists():
            raise TapFileError(path, f"symlink points to {os.readlink(path)!r}, which does not exist")
        if not target.is_relative_to(real_root):
            raise TapFileError(path, f"symlink points outside the tap ({target})")
    elif not target.is_relative_to(real_root):  # reached through a symlinked folder
        raise TapFileError(path, f"resolves outside the tap ({target}) through a symlinked folder")
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise TapFileError(path, "is a directory, expected a TOML file")
        if not stat.S_ISREG(info.st_mode):  # reading a FIFO would block the loader (and the daemon) forever
            raise TapFileError(path, "is not a regular file (a pipe, socket or device), expected a TOML file")
        size = info.st_size
        if size > MAX_FILE_BYTES:
            raise TapFileError(path, f"file is {size} bytes; tap files are limited to {MAX_FILE_BYTES} bytes")
        data = path.read_bytes()
    except PermissionError:
        raise TapFileError(path, "cannot read: permission denied") from None
    except IsADirectoryError:
        raise TapFileError(path, "is a directory, expected a TOML file") from None
    except OSError as exc:
        raise TapFileError(path, f"cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise TapFileError(path, f"file is over {MAX_FILE_BYTES} bytes")
    if b"\x00" in data:
        raise TapFileError(path, "binary file (contains NUL bytes), expected TOML text")
    return data


def parse_toml(path: Path, root: Path) -> tuple[dict[str, Any], str, bytes]:
    """Parse a tap TOML file; returns (table, text, raw bytes). Errors carry the line."""
    return parse_toml_bytes(path, read_tap_file(path, root))


def parse_toml_bytes(path: Path, data: bytes) -> tuple[dict[str, Any], str, bytes]:
    """``data`` (read from ``path``) parsed as TOML, a leading BOM allowed; (table, text, data).
    Raises TapFileError with the line of a byte that is not UTF-8 or of the TOML error."""
    try:
        text = data.decode("utf-8-sig")  # a leading byte order mark, as octomind's TOML reader accepts
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TapFileError(path, f"not UTF-8 text (byte 0x{data[exc.start]:02x})", line) from None
    try:
        return toml_read.loads(text), text, data
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        match = _TOML_POS.search(message)
        where = int(match.group(1)) if match else None
        if where is None and "end of document" in message:
            where = max(1, text.count("\n") + (0 if text.endswith("\n") else 1))
        reason = _TOML_POS.sub("", message).replace(" (at end of document)", " at the end of the file")
        raise TapFileError(path, f"invalid TOML: {reason}", where) from None


def _key_match(text: str, key: str, start: int = 0, end: int | None = None) -> re.Match[str] | None:
    """The first ``key = …`` or ``[key]`` between offsets ``start`` and ``end``. Only spaces and tabs
    may precede it on its line (any whitespace would let a match start on a blank line above)."""
    pattern = re.compile(rf"^[ \t]*(\[\[?\s*{re.escape(key)}\s*\]\]?|[\"']?{re.escape(key)}[\"']?\s*=)", re.M)
    return pattern.search(text, start, len(text) if end is None else end)


def _line_of(text: str, key: str, start: int = 0, end: int | None = None) -> int | None:
    """Best-effort line of ``key = …`` or ``[key]`` (:func:`_key_match`) so schema errors point
    somewhere useful."""
    match = _key_match(text, key, start, end)
    return text.count("\n", 0, match.start()) + 1 if match else None


def _string_tokens(text: str, start: int) -> Iterable[tuple[str, int]]:
    """The TOML string literals of the array that opens at or after offset ``start``, each with its
    offset, up to the array's closing bracket (nested arrays are walked through)."""
    depth, at = 0, start
    while at < len(text):
        char = text[at]
        if char == "#":
            at = text.find("\n", at)
            at = len(text) if at < 0 else at
        elif char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth <= 0:
                return
        elif char in "\"'":
            quote = text[at:at + 3] if text.startswith(char * 3, at) else char
            end = at + len(quote)
            while end < len(text) and not text.startswith(quote, end):
                end += 2 if char == '"' and text[end] == "\\" else 1
            end += len(quote)
            for _ in range(2 if quote != char else 0):  # up to two quotes of the content may end a """…""" string
                end += text.startswith(char, end)
            yield text[at:end], at
            at = end
            continue
        at += 1


def trigger_lines(text: str) -> list[tuple[str, int]]:
    """Each trigger of a ``config.toml`` in file order with the line its string starts on, decoded
    as TOML decodes it (escapes, literal and multi-line strings); empty when the file does not read."""
    key = _key_match(text, "triggers")
    if key is None:
        return []
    found = []
    for token, offset in _string_tokens(text, key.end()):
        try:
            value = tomllib.loads(f"v = {token}")["v"]
        except tomllib.TOMLDecodeError:
            return []
        found.append((value, text.count("\n", 0, offset) + 1))
    return found


def _line_in_table(text: str, table: str, key: str) -> int | None:
    """The line of ``key = …`` among the ``[table]`` header's own lines; None without that header
    or that key under it (``threshold`` in [gates] and in [gates.fused] are two lines)."""
    header = re.compile(rf"^[ \t]*\[\s*{re.escape(table)}\s*\]", re.M).search(text)
    if header is None:
        return None
    following = re.compile(r"^[ \t]*\[", re.M).search(text, header.end())
    return _line_of(text, key, header.end(), following.start() if following else None)


def _entry_line(text: str, array: str, index: int, key: str) -> int | None:
    """The line of ``key`` in the ``index``-th ``[[array]]`` table (its header line without the key)."""
    headers = list(re.finditer(rf"^[ \t]*\[\[\s*{re.escape(array)}\s*\]\]", text, re.M))
    if index >= len(headers):
        return _line_of(text, key)
    start = headers[index].start()
    following = re.compile(r"^[ \t]*\[", re.M).search(text, headers[index].end())
    return _line_of(text, key, start, following.start() if following else None) or text.count("\n", 0, start) + 1


class _Checker:
    """Schema checks for one parsed file; each failure raises a TapFileError with a line."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.text = text

    def fail(self, key: str, reason: str) -> TapFileError:
        return TapFileError(self.path, f"{key} {reason}", self._line(key))

    def _line(self, key: str) -> int | None:
        """The line of a dotted ``key``: within its table's lines when the table has a header, else
        its first mention."""
        table, _, name = key.rpartition(".")
        return (_line_in_table(self.text, table, name) if table else None) or _line_of(self.text, name)

    def table(self, parent: Mapping[str, Any], key: str, label: str | None = None) -> Mapping[str, Any]:
        value = parent.get(key, {})
        if not isinstance(value, dict):
            raise self.fail(label or key, "must be a table")
        return value

    def strings(self, parent: Mapping[str, Any], key: str, label: str | None = None) -> tuple[str, ...]:
        value = parent.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(label or key, "must be a list of strings")
        return tuple(value)

    def optional_str(self, parent: Mapping[str, Any], key: str, label: str | None = None) -> str | None:
        value = parent.get(key)
        if value is not None and not isinstance(value, str):
            raise self.fail(label or key, "must be a string")
        return value


def _header(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        match = _HEADER.match(stripped)
        if match and match.group(2):
            found.setdefault(match.group(1).lower(), match.group(2))
    return found


class _EntryChecker(_Checker):
    """:class:`_Checker` inside the ``index``-th ``[[array]]`` table: a failure points at a line of
    that entry, not at the first entry's key of the same name."""

    def __init__(self, check: _Checker, array: str, index: int) -> None:
        super().__init__(check.path, check.text)
        self.array, self.index = array, index

    def fail(self, key: str, reason: str) -> TapFileError:
        return TapFileError(self.path, f"{key} {reason}",
                            _entry_line(self.text, self.array, self.index, key.split(".")[-1]))


def _server(check: _Checker, index: int, table: object) -> ServerSpec:
    label = f"mcp.servers[{index}]"
    if not isinstance(table, dict):
        raise check.fail("mcp.servers", f"entry {index} must be a table")
    entry = _EntryChecker(check, "mcp.servers", index)
    if not isinstance(table.get("name"), str) or not table["name"]:
        raise entry.fail(f"{label}.name", "must be a non-empty string")
    for key in ("type", "command", "url"):
        entry.optional_str(table, key, f"{label}.{key}")
    entry.strings(table, "args", f"{label}.args")
    entry.strings(table, "tools", f"{label}.tools")
    timeout = table.get("timeout_seconds")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < math.inf):  # NaN fails this too
        raise entry.fail(f"{label}.timeout_seconds", "must be a positive, finite number of seconds")
    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise entry.fail(f"{label}.env", "must be a table of strings")
    return ServerSpec.from_table(table)


def _load_provider(path: Path, folder: _Folder, name: str | None = None) -> Provider:
    table, text, data = parse_toml_bytes(path, folder.read(path))
    check = _Checker(path, text)
    deps = check.table(table, "deps")
    roles = check.table(table, "roles")
    mcp_role = check.table(roles, "mcp", "roles.mcp")
    mcp = check.table(table, "mcp")
    servers_raw = mcp.get("servers", [])
    if not isinstance(servers_raw, list):
        raise check.fail("mcp.servers", "must be an array of tables ([[mcp.servers]])")
    servers = tuple(_server(check, i, s) for i, s in enumerate(servers_raw))
    header = _header(text)
    return Provider(
        name=name or path.stem,
        path=path,
        title=header.get("title"),
        description=header.get("description"),
        requires=check.strings(deps, "require", "deps.require"),
        server_refs=check.strings(mcp_role, "server_refs", "roles.mcp.server_refs"),
        allowed_tools=check.strings(mcp_role, "allowed_tools", "roles.mcp.allowed_tools"),
        servers=servers,
        digest=hashlib.sha256(data).hexdigest(),
    )


def _load_config(path: Path, folder: _Folder) -> tuple[tuple[str, ...], tuple[str, ...], str | None]:
    table, text, _ = parse_toml_bytes(path, folder.read(path))
    check = _Checker(path, text)
    triggers = check.strings(table, "triggers")
    for trigger in triggers:
        if not trigger.strip():
            empty = [line for value, line in trigger_lines(text) if not value.strip()]
            raise TapFileError(path, "triggers must not contain empty strings",
                               empty[0] if empty else _line_of(text, "triggers"))
    domains = check.strings(table, "domains")
    description = check.optional_str(table, "description")
    return tuple(t.strip() for t in triggers), domains, description


def _pick_default(folder: _Folder, providers: dict[str, Provider], problems: list[Problem],
                  name: str) -> Provider | None:
    default = folder.path / "default.toml"
    if default.is_symlink():
        target = folder.real(default)
        folder.read(default, target)  # raises for dangling, looping or escaping links
        for provider in providers.values():
            if folder.real(provider.path) == target:
                return provider
        return _load_provider(target, folder)
    if default.exists():
        return _load_provider(default, folder, name="default")
    if not providers:
        return None
    chosen = sorted(providers)[0]
    if len(providers) > 1:
        problems.append(Problem("warning", str(folder.path), f"no default.toml; using {chosen}.toml of "
                                f"{len(providers)} providers", capability=name, code="no-default"))
    return providers[chosen]


def _toml_files(directory: Path) -> list[Path]:
    """The folder's ``*.toml`` files, sorted, in one ``listdir``; hidden ones (an editor's
    ``.#postgres.toml`` lock link, ``.config.toml.swp`` …) are not tap files."""
    try:
        names = os.listdir(directory)
    except OSError as exc:
        raise TapFileError(directory, f"cannot list the capability folder: {exc.strerror or exc}") from None
    return [directory / name for name in sorted(names) if name.endswith(".toml") and not name.startswith(".")]


def load_capability(tap: Path, directory: Path,
                    real_tap: Path | None = None) -> tuple[Capability | None, list[Problem]]:
    """Load one capability folder. Returns (capability or None if skipped, problems).

    ``real_tap`` is ``tap`` resolved, when the caller loads many folders of one tap.
    """
    name = directory.name
    problems: list[Problem] = []
    if not NAME_RE.match(name):
        problems.append(Problem("error", str(directory), "capability names must match [A-Za-z0-9][A-Za-z0-9._-]*",
                                capability=name, code="bad-name"))
        return None, problems
    try:
        folder = _Folder(tap, directory, real_tap)
        if not folder.real_path.is_relative_to(folder.real_tap):
            raise TapFileError(directory, "capability folder is a symlink pointing outside the tap")
        files = _toml_files(directory)
        config = directory / "config.toml"
        triggers: tuple[str, ...] = ()
        domains: tuple[str, ...] = ()
        description: str | None = None
        if config in files:
            triggers, domains, description = _load_config(config, folder)
        providers: dict[str, Provider] = {}
        for path in files:
            if path.name in ("config.toml", "default.toml"):
                continue
            providers[path.stem] = _load_provider(path, folder)
        default = _pick_default(folder, providers, problems, name)
    except TapFileError as exc:
        problems.append(Problem("error", str(exc.path), exc.reason, exc.line, capability=name, code="invalid"))
        return None, problems
    except OSError as exc:  # a folder that can be listed but not entered (no x permission), and the like
        where = Path(exc.filename) if isinstance(exc.filename, str) else directory
        problems.append(Problem("error", str(where), f"cannot read: {exc.strerror or exc}", capability=name,
                                code="invalid"))
        return None, problems
    all_providers = tuple(providers.values())
    if default is not None and default not in all_providers:
        all_providers = (default, *all_providers)
    capability = Capability(
        name=name,
        tap=tap,
        path=directory,
        triggers=triggers,
        domains=domains,
        description=description,
        provider=default,
        providers=all_providers,
        fingerprint=fingerprint(name, triggers, description, domains, default),
    )
    return capability, problems


def load_tap_config(tap: Path) -> tuple[TapConfig | None, list[Problem]]:
    """``<tap>/capd.toml`` and ``<tap>/vetoes.jsonl`` (None when neither is there, or when capd.toml
    is broken: the daemon then keeps the last good one). A vetoes line that cannot be used is
    reported on its line and skipped; the other lines stay in force."""
    path = tap / TAP_CONFIG
    vetoes, problems = load_tap_vetoes(tap)
    if not os.path.lexists(path):  # a link to nothing is an error to report, not a missing file
        found = os.path.lexists(tap / TAP_VETOES)
        return (TapConfig(path=path, vetoes=vetoes) if found else None), problems
    try:
        table, text, _ = parse_toml(path, tap)
        return replace(tap_config(path, table, text), vetoes=vetoes), problems
    except TapFileError as exc:
        return None, [Problem("error", str(exc.path), exc.reason, exc.line, code="invalid"), *problems]


def load_tap_vetoes(tap: Path) -> tuple[tuple[str, ...], list[Problem]]:
    """The messages of ``<tap>/vetoes.jsonl`` (fixture rows that expect nothing, as ``capd calibrate
    --write`` writes them from the fixtures' null rows), and a problem per line that cannot be used."""
    path = tap / TAP_VETOES
    if not os.path.lexists(path):
        return (), []
    try:  # the guards of every tap file: no link out of the tap, no pipe to block on, a size limit
        data = read_tap_file(path, tap)
    except TapFileError as exc:
        return (), [Problem("error", str(exc.path), f"{exc.reason}; the tap has no vetoes", code="invalid-veto")]
    rows, errors = read_fixture_file(path, data)
    problems = [Problem("error", str(e.path), f"{e.reason}; this line vetoes nothing", e.line, code="invalid-veto")
                for e in errors if rows or e.line is not None]  # a file of comments only is no error
    first: dict[str, int] = {}  # a routed text -> the line that vetoes it
    for row in rows:
        line = int(row.source.rsplit(":", 1)[1])
        if row.positive:
            problems.append(Problem("error", str(path), "a veto expects nothing (\"expect\": null), not "
                                    f"{', '.join(row.expect)}; this line vetoes nothing", line, code="invalid-veto"))
            continue
        key = recall_key(strip_tags(row.message))
        if not key:
            problems.append(Problem("error", str(path), "nothing is left of the message once its tags are removed "
                                    "(a message routes without them); this line vetoes nothing", line,
                                    code="invalid-veto"))
        elif key in first:
            problems.append(Problem("warning", str(path), f"the same message as line {first[key]} once case, "
                                    "spacing and tags are set aside (the model sees one message): it counts as one "
                                    "veto with it, and a veto needs two different messages to agree", line,
                                    code="duplicate-veto"))
        else:
            first[key] = line
    return tuple(r.message for r in rows if not r.positive), problems


MAX_OFFSET = 20.0  # log-odds units: beyond this an offset alone would decide every message


def tap_config(path: Path, table: Mapping[str, Any], text: str) -> TapConfig:
    """A parsed ``capd.toml`` checked (``text`` for the lines of errors); raises TapFileError."""
    check = _Checker(path, text)
    for key in table:  # other keys are the author's own (notes, owners): kept and not read
        if key in TAP_CONFIG_KEYS:
            continue
        if key in (*GATE_KEYS, "coverage", SWITCH, "fused"):  # a gate above [gates] would be ignored
            raise check.fail(key, "is a gate: it goes in [gates] (rules capd, anchor) or [gates.fused]")
        if near := difflib.get_close_matches(key, TAP_CONFIG_KEYS, n=1, cutoff=0.75):
            raise check.fail(key, f"is not read by capd: did you mean {near[0]}?")
    gates_raw = dict(check.table(table, "gates"))
    fused_raw = dict(check.table(gates_raw, "fused")) if "fused" in gates_raw else {}
    gates_raw.pop("fused", None)
    offsets = _offsets(check, check.table(fused_raw, "offsets", "gates.fused.offsets"))
    fused_raw.pop("offsets", None)
    gates = _gate_values(check, "gates", gates_raw, GATE_KEYS)
    fused_gates = _gate_values(check, "gates.fused", fused_raw, ("threshold", "margin", "coverage"))
    model = check.optional_str(table, "model")
    rule = check.optional_str(table, "rule")
    if rule is not None and rule not in RULES:
        raise check.fail("rule", f"must be one of {', '.join(RULES)} (got {rule!r})")
    return TapConfig(path=path, gates=MappingProxyType(gates), model=model, fused_gates=MappingProxyType(fused_gates),
                     rule=rule, offsets=MappingProxyType(offsets))


def _offsets(check: _Checker, raw: Mapping[str, Any]) -> dict[str, float]:
    """``[gates.fused.offsets]``: capability name -> a number added to its fused score (``capd
    calibrate``'s per-capability offsets, :func:`capd.offsets.fit_offsets`). A name the tap does
    not define is kept and changes nothing (the capability may come back)."""
    offsets: dict[str, float] = {}
    for name, value in raw.items():
        label = f"gates.fused.offsets.{name}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise check.fail(label, "must be a number")
        if not (math.isfinite(value) and -MAX_OFFSET <= value <= MAX_OFFSET):
            raise check.fail(label, f"must be a number between -{MAX_OFFSET:g} and {MAX_OFFSET:g} (got {value})")
        offsets[name] = float(value)
    return offsets


def _gate_values(check: _Checker, where: str, raw: Mapping[str, Any],
                 known: Sequence[str]) -> dict[str, float | bool]:
    gates: dict[str, float | bool] = {}
    for key, value in raw.items():
        if key not in (*known, SWITCH):
            raise check.fail(f"{where}.{key}", f"is not a gate (known: {', '.join((*known, SWITCH))})")
        if key == SWITCH:
            if not isinstance(value, bool):
                raise check.fail(f"{where}.{key}", "must be true or false")
            gates[key] = value
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise check.fail(f"{where}.{key}", "must be a number")
        elif not math.isfinite(value):
            raise check.fail(f"{where}.{key}", f"must be a finite number (got {value})")
        elif key == "top_k" and not (isinstance(value, int) and value >= 1):  # how many triggers' cosines to average
            raise check.fail(f"{where}.{key}", f"must be a whole number of at least 1 (got {value})")
        elif key == "coverage" and not 0.0 <= value <= 1.0:  # a mean of cosines; above 1 nothing would fire
            raise check.fail(f"{where}.{key}", "must be between 0 and 1 (0 turns the coverage gate off)")
        elif key == "threshold" and not -1.0 <= value <= 1.0:  # as CAPD_THRESHOLD: a cosine or a level
            raise check.fail(f"{where}.{key}", f"must be between -1 and 1 (got {value})")
        elif key == "margin" and not 0.0 <= value <= 100.0:  # as CAPD_MARGIN: a cosine or a log-odds gap
            raise check.fail(f"{where}.{key}", f"must be between 0 and 100 (got {value})")
        else:
            gates[key] = float(value)
    return gates


def capability_dirs(tap: Path) -> tuple[list[Path], list[Problem]]:
    """The tap's capability folders (hidden ones skipped), and what is wrong in ``capabilities/``:
    it cannot be listed, or an entry is a dangling or looping link (a folder link that no longer
    resolves would otherwise drop its capability without a word). Other files there are ignored."""
    root = tap / "capabilities"
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        return [], [Problem("error", str(root), f"cannot list: {exc.strerror or exc}", code="unreadable-tap")]
    folders: list[Path] = []
    problems: list[Problem] = []
    for name in names:
        if name.startswith("."):
            continue
        path = root / name
        try:
            if path.is_dir():
                folders.append(path)
            elif path.is_symlink() and not path.exists():
                _resolve(path)  # a loop raises here
                raise TapFileError(path, f"symlink points to {os.readlink(path)!r}, which does not exist")
        except TapFileError as exc:
            problems.append(Problem("error", str(exc.path), exc.reason, capability=name, code="invalid"))
        except OSError as exc:
            problems.append(Problem("error", str(path), f"cannot read: {exc.strerror or exc}", capability=name,
                                    code="invalid"))
    return folders, problems


def not_a_tap_directory(tap: Path) -> str | None:
    """Why ``tap`` is no directory at all (a file, or nothing there), or None when it is one."""
    if tap.is_dir():
        return None
    return "is a file, not a tap directory" if tap.exists() else "tap directory does not exist"


def load_tap(tap: Path) -> TapLoad:
    """Load every capability of one tap; broken ones are reported and skipped."""
    problems: list[Problem] = []
    if (reason := not_a_tap_directory(tap)) is not None:
        return [], [Problem("error", str(tap), reason, code="missing-tap")], None
    if not (tap / "capabilities").is_dir():
        problems.append(Problem("error", str(tap), "not a tap: no capabilities/ directory", code="missing-tap"))
        return [], problems, None
    capabilities: list[Capability] = []
    try:
        real_tap: Path | None = _resolve(tap)
    except TapFileError:
        real_tap = None  # each capability then reports it
    folders, unusable = capability_dirs(tap)
    problems.extend(unusable)
    for directory in folders:
        capability, found = load_capability(tap, directory, real_tap)
        problems.extend(found)
        if capability is not None:
            capabilities.append(capability)
    config, found = load_tap_config(tap)
    problems.extend(found)
    return capabilities, problems, config


TapLoad = tuple[list[Capability], list[Problem], TapConfig | None]


def assemble(taps: Sequence[Path], loaded: Iterable[TapLoad]) -> Catalog:
    """Merge per-tap loads in precedence order: a name defined twice keeps the first."""
    capabilities: dict[str, Capability] = {}
    problems: list[Problem] = []
    configs: dict[Path, TapConfig] = {}
    for capabilities_of_tap, found, config in loaded:
        problems.extend(found)
        if config is not None:
            configs[config.path.parent] = config
        for capability in capabilities_of_tap:
            first = capabilities.get(capability.name)
            if first is not None:
                problems.append(Problem("warning", str(capability.path),
                                        f"capability {capability.name!r} is also defined in {first.tap}; "
                                        "that one wins (earlier tap)", capability=capability.name,
                                        code="duplicate-name"))
                continue
            capabilities[capability.name] = capability
    return Catalog(taps=tuple(taps), capabilities=MappingProxyType(capabilities), problems=tuple(problems),
                   tap_configs=MappingProxyType(configs))


def load_catalog(taps: Sequence[Path]) -> Catalog:
    """Load all taps; order is precedence. Problems are returned in ``catalog.errors``, not logged
    above debug: the caller reports them (``capd lint`` prints them, the daemon logs them on reload)."""
    resolved = [Path(t).expanduser().absolute() for t in taps]
    catalog = assemble(resolved, (load_tap(t) for t in resolved))
    for problem in catalog.errors:
        log.debug("tap problem: %s", problem)
    return catalog
