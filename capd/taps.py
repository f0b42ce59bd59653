"""Load taps (directories of capability TOML files) into a :class:`~capd.catalog.Catalog`.

Reads existing octomind taps unchanged::

    <tap>/capabilities/<name>/config.toml      triggers, domains, description (all optional)
    <tap>/capabilities/<name>/<provider>.toml  [deps], [roles.mcp], [[mcp.servers]]
    <tap>/capabilities/<name>/default.toml     symlink to a provider file, or a provider itself
    <tap>/capd.toml                            capd's per-tap gates (written by ``capd calibrate``)
    <tap>/vetoes.jsonl, <tap>/examples.jsonl   messages no capability may take; more triggers (the same)

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

A tap's own ``capd.toml``, ``vetoes.jsonl`` and ``examples.jsonl`` are read by :mod:`capd.tap_config`; every file
with the guards of :mod:`capd.tap_files`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import MappingProxyType

from capd.catalog import Capability, Catalog, Problem, Provider, ServerSpec, TapConfig, fingerprint
from capd.errors import TapFileError
from capd.tap_config import load_tap_config, unknown_examples
from capd.tap_files import Checker, Folder, entry_line, line_of, parse_toml_bytes, resolve, trigger_lines

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEADER = re.compile(r"^#\s*(Title|Description)\s*:\s*(.*?)\s*$")


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


class _EntryChecker(Checker):
    """:class:`Checker` inside the ``index``-th ``[[array]]`` table: a failure points at a line of
    that entry, not at the first entry's key of the same name."""

    def __init__(self, check: Checker, array: str, index: int) -> None:
        super().__init__(check.path, check.text)
        self.array, self.index = array, index

    def fail(self, key: str, reason: str) -> TapFileError:
        return TapFileError(self.path, f"{key} {reason}",
                            entry_line(self.text, self.array, self.index, key.split(".")[-1]))


def _server(check: Checker, index: int, table: object) -> ServerSpec:
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


def _load_provider(path: Path, folder: Folder, name: str | None = None) -> Provider:
    table, text, data = parse_toml_bytes(path, folder.read(path))
    check = Checker(path, text)
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


def _load_config(path: Path, folder: Folder) -> tuple[tuple[str, ...], tuple[str, ...], str | None]:
    table, text, _ = parse_toml_bytes(path, folder.read(path))
    check = Checker(path, text)
    triggers = check.strings(table, "triggers")
    for trigger in triggers:
        if not trigger.strip():
            empty = [line for value, line in trigger_lines(text) if not value.strip()]
            raise TapFileError(path, "triggers must not contain empty strings",
                               empty[0] if empty else line_of(text, "triggers"))
    domains = check.strings(table, "domains")
    description = check.optional_str(table, "description")
    return tuple(t.strip() for t in triggers), domains, description


def _pick_default(folder: Folder, providers: dict[str, Provider], problems: list[Problem],
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
        folder = Folder(tap, directory, real_tap)
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
                resolve(path)  # a loop raises here
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
        real_tap: Path | None = resolve(tap)
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
            problems.extend(unknown_examples(config, (c.name for c in capabilities_of_tap)))
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
