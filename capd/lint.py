"""``capd lint``: everything that is wrong or doubtful in a tap, each with its file and line.

Severities: ``error`` (exit 1: the tap does not work as written), ``warning`` (it works
but probably not as meant), ``info`` (worth knowing). Checks:

- load errors: unreadable / binary / oversized files, invalid TOML, schema errors,
  dangling or escaping symlinks (``default.toml`` pointing nowhere);
- ``server_refs`` naming a server no ``[[mcp.servers]]`` defines (error);
- two ``[[mcp.servers]]`` of one name in a provider (error: plans and teardown know servers by name),
  or one server name that two capabilities define differently (warning: a session runs one of them);
- ``allowed_tools`` scoped to a server the capability does not use (warning), or granting a
  server it references no tool (warning: that server is not started);
- ``[[mcp.servers]]`` entries octomind would skip: no ``type`` / ``timeout_seconds`` / ``tools``,
  stdio without ``command``, http without ``url``, or a type octomind does not know (warnings);
- no triggers (warning: never auto-routed, can still be enabled by name);
- triggers shorter than ``MIN_TRIGGER_CHARS`` non-space characters (warning: the router
  skips messages that short, so such a trigger can only match longer paraphrases);
- the same trigger twice in one capability (warning) or in two capabilities (error: one
  phrase cannot route to two places);
- a capability name defined in two taps (warning: the earlier tap wins);
- a ``config.toml`` key that is a near miss of one capd reads (warning: ``trigers`` is
  otherwise only "no triggers"; keys far from every known one may belong to other tools and
  are left alone);
- routing-only capabilities (info: no provider, plans carry no servers);
- with an encoder: near-duplicate triggers across capabilities (see :mod:`capd.lint_embed`);
- the tap's ``fixtures/*.jsonl`` and ``fixtures/floors.toml`` (:func:`lint_fixtures`): lines and a
  floors file ``capd test`` refuses, unknown expected capabilities (errors), repeated, conflicting,
  too-short and trigger-copying rows (warnings).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path

from capd.catalog import Capability, Catalog, Problem, Provider, TapConfig
from capd.errors import FixtureError
from capd.fixtures import Fixture, name_errors, read_fixture_file, tap_fixture_files
from capd.floors import load_floors
from capd.tap_files import line_in_table, line_of, trigger_lines
from capd.text import clean_message, recall_key

MIN_TRIGGER_CHARS = 8
CONFIG_KEYS = ("triggers", "domains", "description")


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def _trigger_line(capability: Capability, trigger: str, nth: int = 0,
                  key: Callable[[str], str] = str.strip) -> int | None:
    """The line of the ``nth`` trigger equal to ``trigger`` (compared through ``key``), else of ``triggers``."""
    config = capability.path / "config.toml"
    try:
        text = config.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError):
        return None
    lines = [line for value, line in trigger_lines(text) if key(value) == key(trigger)]
    return lines[nth] if len(lines) > nth else lines[-1] if lines else line_of(text, "triggers")


def _server_line(text: str, name: str, nth: int = 0) -> int | None:
    """The line of the ``nth`` ``name = "<name>"`` of a provider file, else of its first ``name``."""
    found = list(re.finditer(rf"^[ \t]*name\s*=\s*[\"']{re.escape(name)}[\"']", text, re.M))
    return text.count("\n", 0, found[nth].start()) + 1 if len(found) > nth else line_of(text, "name")


def _check_provider(capability: Capability) -> Iterable[Problem]:
    provider = capability.provider
    if provider is None:
        yield Problem("info", str(capability.path), "routing-only capability: no provider, plans carry no servers",
                      capability=capability.name, code="routing-only")
        return
    defined = {s.name for s in provider.servers}
    text = provider.path.read_text(encoding="utf-8", errors="replace")
    names = [s.name for s in provider.servers]
    for name in sorted({n for n in names if names.count(n) > 1}):
        yield Problem("error", str(provider.path), f"two [[mcp.servers]] entries are named {name!r}; plans, "
                      "server_refs and refcounted teardown know a server by its name, so they would be taken for one",
                      _server_line(text, name, 1), capability.name, "duplicate-server")
    for ref in provider.server_refs:
        if ref not in defined:
            yield Problem("error", str(provider.path), f"server_refs names {ref!r}, but no [[mcp.servers]] entry "
                          "has that name", line_of(text, "server_refs"), capability.name, "unknown-server-ref")
    if provider.servers and not provider.server_refs:
        yield Problem("warning", str(provider.path), "no [roles.mcp] server_refs: capd starts every server defined "
                      "here, octomind (which reads the same tap) starts none; name them in server_refs",
                      line_of(text, "roles.mcp") or _server_line(text, provider.servers[0].name), capability.name,
                      "no-server-refs")
    for name in capability.ungranted:
        yield Problem("warning", str(provider.path), f"server {name!r} is referenced, but allowed_tools grants it no "
                      "tool: it is not started (as in octomind)", line_of(text, "allowed_tools"), capability.name,
                      "ungranted-server")
    yield from _check_servers(capability, provider, text)
    used = set(provider.server_refs) or defined
    for pattern in provider.allowed_tools:
        scope, sep, _ = pattern.partition(":")
        if sep and scope not in used:
            yield Problem("warning", str(provider.path), f"allowed_tools entry {pattern!r} names server {scope!r}, "
                          "which this capability does not start; it is ignored", line_of(text, "allowed_tools"),
                          capability.name, "unknown-tool-server")


OCTOMIND_SERVER_TYPES = ("builtin", "http", "stdio")


def _check_servers(capability: Capability, provider: Provider, text: str) -> Iterable[Problem]:
    """``[[mcp.servers]]`` entries octomind (whose taps capd reads) would skip as malformed: it
    requires ``type`` (builtin, http or stdio), ``timeout_seconds`` and ``tools``, ``command`` for
    stdio and ``url`` for http. capd plans them as written (no type reads as stdio), so an agent
    reading capd's plan and octomind reading the tap would disagree. ``text`` is the provider file's."""
    for spec in provider.servers:
        raw = spec.spec
        line = _server_line(text, spec.name)
        needed = [key for key in ("type", "timeout_seconds", "tools") if key not in raw]
        kind = raw.get("type")
        if kind == "stdio" and "command" not in raw:
            needed.append("command")
        if kind == "http" and "url" not in raw:
            needed.append("url")
        if needed:
            yield Problem("warning", str(provider.path), f"server {spec.name!r} has no {', '.join(needed)}: "
                          "octomind skips such an entry" + (" (capd's plans say stdio)" if "type" in needed else ""),
                          line, capability.name, "server-incomplete")
        if kind is not None and kind not in OCTOMIND_SERVER_TYPES:
            yield Problem("warning", str(provider.path), f"server {spec.name!r} has type {kind!r}; octomind knows "
                          f"{', '.join(OCTOMIND_SERVER_TYPES)}", line, capability.name, "server-type")


def _check_triggers(capability: Capability) -> Iterable[Problem]:
    config = str(capability.path / "config.toml")
    if not capability.triggers:  # named by its folder when it has no config.toml to point at
        where = config if os.path.lexists(config) else str(capability.path)
        yield Problem("warning", where, "no triggers: never auto-activated (it can still be enabled by name)",
                      capability=capability.name, code="no-triggers")
        return
    seen: dict[str, int] = {}
    exact: dict[str, int] = {}
    for trigger in capability.triggers:
        nth = exact[trigger] = exact.get(trigger, -1) + 1
        if len("".join(trigger.split())) < MIN_TRIGGER_CHARS:
            yield Problem("warning", config, f"trigger {trigger!r} is shorter than {MIN_TRIGGER_CHARS} characters",
                          _trigger_line(capability, trigger, nth), capability.name, "short-trigger")
        key = _normal(trigger)
        repeat = seen[key] = seen.get(key, -1) + 1
        if repeat:
            yield Problem("warning", config, f"trigger {trigger!r} appears twice",
                          _trigger_line(capability, trigger, repeat, _normal), capability.name, "duplicate-trigger")


def _check_keys(capability: Capability) -> Iterable[Problem]:
    config = capability.path / "config.toml"
    try:
        text = config.read_text(encoding="utf-8-sig")
        table = tomllib.loads(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):  # a broken file is a load error already
        return
    for key in table:
        if key in CONFIG_KEYS:
            continue
        meant = difflib.get_close_matches(key, CONFIG_KEYS, n=1, cutoff=0.75)
        if meant:
            yield Problem("warning", str(config), f"key {key!r} is not one capd reads; did you mean {meant[0]!r}?",
                          line_of(text, key), capability.name, "unknown-key")


def _cross_duplicates(catalog: Catalog) -> Iterable[Problem]:
    owner: dict[str, Capability] = {}
    for capability in catalog:
        for trigger in dict.fromkeys(_normal(t) for t in capability.triggers):
            first = owner.setdefault(trigger, capability)
            if first is not capability:
                yield Problem("error", str(capability.path / "config.toml"),
                              f"trigger {trigger!r} is also a trigger of {first.name!r}; one phrase cannot route "
                              "to two capabilities", _trigger_line(capability, trigger, key=_normal), capability.name,
                              "shared-trigger")


def _server_conflicts(catalog: Catalog) -> Iterable[Problem]:
    """One server name, two specs: a session with both capabilities active runs the server once, by
    name, so one of them gets the other's (plans restart it only when its own spec changes)."""
    first: dict[str, tuple[Capability, str]] = {}
    for capability in catalog:
        if capability.provider is None:
            continue
        for spec in capability.servers:
            shape = json.dumps(spec.as_dict(), sort_keys=True, default=str)
            owner, seen = first.setdefault(spec.name, (capability, shape))
            if owner is not capability and seen != shape:
                text = capability.provider.path.read_text(encoding="utf-8", errors="replace")
                yield Problem("warning", str(capability.provider.path), f"server {spec.name!r} is also defined by "
                              f"{owner.name!r}, differently; a session with both runs one of the two",
                              _server_line(text, spec.name), capability.name, "server-conflict")


def _ignored_rules(catalog: Catalog) -> Iterable[Problem]:
    """A tap naming a rule after another tap named a different one: the first decides for every tap
    (:func:`capd.settings.tap_rule`), so this tap routes with a rule its author did not name."""
    first: TapConfig | None = None
    for tap in catalog.taps:
        config = catalog.tap_configs.get(tap)
        if config is None or config.rule is None:
            continue
        if first is None:
            first = config
        elif config.rule != first.rule:
            try:
                line = line_of(config.path.read_text(encoding="utf-8", errors="replace"), "rule")
            except OSError:
                line = None
            yield Problem("warning", str(config.path), f"rule {config.rule!r} is not used: {first.path} names "
                          f"{first.rule!r} first, and the first tap naming a rule decides for all of them "
                          "(a setting beats both)", line, code="rule-ignored")


def _stray_offsets(catalog: Catalog) -> Iterable[Problem]:
    """An offset in ``[gates.fused.offsets]`` for a capability the tap does not route (renamed,
    removed, or defined first by another tap): it changes nothing, and a capability that comes back
    under that name gets it unmeasured."""
    for tap, config in catalog.tap_configs.items():
        text: str | None = None  # read once per file, only when it has a stray offset
        for name in config.offsets:
            capability = catalog.get(name)
            if capability is not None and capability.tap == tap:
                continue
            if text is None:
                try:
                    text = config.path.read_text(encoding="utf-8", errors="replace")
                except OSError:
                    text = ""
            line = line_in_table(text, "gates.fused.offsets", name)
            owner = "" if capability is None else f" ({name!r} is {capability.tap}'s, which comes first)"
            yield Problem("warning", str(config.path), f"offset for {name!r}, which this tap does not route{owner}: "
                          "it changes nothing; calibrate again (capd calibrate --offsets --write) or delete the line",
                          line, code="stray-offset")


def lint_catalog(catalog: Catalog) -> list[Problem]:
    """All static findings for a loaded catalog (load problems included), errors first."""
    problems = list(catalog.problems)
    for capability in catalog:
        problems.extend(_check_provider(capability))
        problems.extend(_check_triggers(capability))
        problems.extend(_check_keys(capability))
    problems.extend(_cross_duplicates(catalog))
    problems.extend(_server_conflicts(catalog))
    problems.extend(_ignored_rules(catalog))
    problems.extend(_stray_offsets(catalog))
    return ordered(problems)


def ordered(problems: Iterable[Problem]) -> list[Problem]:
    """Errors first, then warnings, then notes; by file and line within each."""
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(problems, key=lambda p: (order[p.severity], p.file, p.line or 0))


def lint_fixtures(catalog: Catalog, min_chars: int = MIN_TRIGGER_CHARS) -> list[Problem]:
    """Findings about each tap's ``fixtures/*.jsonl``: every line ``capd test`` would refuse, each
    row expecting a capability the taps lack, and rows that measure nothing useful: one message
    given twice (once with another answer: one of the two rows always fails), a positive too short
    to route (under ``min_chars`` it is skipped, so it always fails), a message that is word for word
    a trigger of the capability it expects (it measures memory, not routing)."""
    broken = {p.capability for p in catalog.errors if p.capability is not None}
    triggers = {c.name: {recall_key(t) for t in c.triggers} for c in catalog}
    problems: list[Problem] = []
    for tap in catalog.taps:
        first: dict[str, Fixture] = {}  # across the tap's files: `capd test` runs them together
        for path in tap_fixture_files(tap):
            rows, errors = read_fixture_file(path)
            errors.extend(name_errors(rows, catalog.capabilities, broken))
            problems.extend(Problem("error", str(e.path), e.reason, e.line, code="fixture-invalid") for e in errors)
            problems.extend(_doubtful_rows(triggers, rows, min_chars, first))
        try:
            load_floors(tap)  # every rule's table: a mistake in any of them stops `capd test`
        except FixtureError as exc:
            problems.append(Problem("error", str(exc.path), exc.reason, exc.line, code="floors-invalid"))
    return problems


def _doubtful_rows(triggers: dict[str, set[str]], rows: list[Fixture], min_chars: int,
                   first: dict[str, Fixture]) -> Iterable[Problem]:
    for row in rows:
        file, _, line = row.source.rpartition(":")
        text, long_enough = clean_message(row.message, min_chars)
        key = recall_key(row.message)  # as written: one text with and without tags tests tag removal
        earlier = first.setdefault(key, row)
        if earlier is not row:
            where, _, at = earlier.source.rpartition(":")
            seen = f"line {at}" if where == file else f"{Path(where).name} line {at}"
            if set(earlier.expect) == set(row.expect):
                yield Problem("warning", file, f"the same message as {seen}, with the same answer: it is counted "
                              "twice", int(line), code="fixture-duplicate")
            else:
                yield Problem("warning", file, f"the same message as {seen}, with another answer: one of the two "
                              "rows always fails", int(line), code="fixture-conflict")
        if row.positive and not long_enough:
            yield Problem("warning", file, f"a positive shorter than {min_chars} characters after removing tags: "
                          "the router skips it, so it always fails", int(line), code="fixture-short")
        for name in row.expect:
            if recall_key(text) in triggers.get(name, ()):
                yield Problem("warning", file, f"the message is a trigger of {name!r}: it measures memory, "
                              "not routing (use a paraphrase)", int(line), name, "fixture-is-trigger")


def summarise(problems: list[Problem], taps: Iterable[Path]) -> dict[str, object]:
    counts = {s: sum(1 for p in problems if p.severity == s) for s in ("error", "warning", "info")}
    return {"taps": [str(t) for t in taps], "counts": counts, "problems": [p.as_dict() for p in problems]}
