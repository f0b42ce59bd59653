"""Immutable records of what taps declare: capabilities, providers, MCP server specs.

The loader (:mod:`capd.taps`) builds these; everything downstream (index, router,
sessions, API) reads them and never re-parses TOML.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from capd.text import printable

Severity = Literal["error", "warning", "info"]
CapabilityKind = Literal["mcp", "toolchain", "routing-only"]


@dataclass(frozen=True)
class Problem:
    """One finding about a tap: a load error that skipped something, or a lint note."""

    severity: Severity
    file: str
    reason: str
    line: int | None = None
    capability: str | None = None
    code: str = "invalid"

    def as_dict(self) -> dict[str, object]:
        r"""For JSON: a path byte that is not UTF-8 (a folder named ``bad\xffname``) is written as
        ``\xff``, since JSON text cannot hold the lone surrogate Python keeps it as."""
        return {
            "severity": self.severity,
            "code": self.code,
            "file": printable(self.file),
            "line": self.line,
            "capability": None if self.capability is None else printable(self.capability),
            "reason": printable(self.reason),
        }

    def __str__(self) -> str:
        where = f"{self.file}: line {self.line}" if self.line is not None else self.file
        return f"{where}: {self.severity}: {self.reason} [{self.code}]"


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class ServerSpec:
    """An ``[[mcp.servers]]`` entry, kept verbatim (``{{ENV:…}}`` placeholders unresolved)."""

    name: str
    type: str
    spec: Mapping[str, Any] = field(compare=False, repr=False)

    @classmethod
    def from_table(cls, table: Mapping[str, Any]) -> ServerSpec:
        return cls(name=str(table["name"]), type=str(table.get("type", "stdio")), spec=_freeze(dict(table)))

    def as_dict(self) -> dict[str, Any]:
        """The spec as a plan carries it: name, type, command, args, url, timeout_seconds, …"""
        out: dict[str, Any] = {"name": self.name, "type": self.type, "command": None, "args": [], "url": None,
                               "timeout_seconds": None}
        out.update(_thaw(self.spec))
        return out


@dataclass(frozen=True)
class Provider:
    """One provider file of a capability (``postgres.toml``, or ``default.toml`` itself)."""

    name: str
    path: Path
    title: str | None
    description: str | None
    requires: tuple[str, ...]
    server_refs: tuple[str, ...]
    allowed_tools: tuple[str, ...]
    servers: tuple[ServerSpec, ...]
    digest: str  # sha256 of the file's bytes


def tools_for_server(allowed_tools: tuple[str, ...], server: str) -> tuple[str, ...]:
    """Resolve ``allowed_tools`` for one server: strip ``server:`` prefixes, drop other servers' patterns.

    Unscoped names (no ``:``) apply to every server. ``*`` means all tools. An empty
    ``allowed_tools`` list means all tools, as in octomind.
    """
    if not allowed_tools:
        return ("*",)
    tools: list[str] = []
    for pattern in allowed_tools:
        scope, sep, tool = pattern.partition(":")
        if not sep:
            tools.append(pattern)
        elif scope == server:
            tools.append(tool or "*")
    if "*" in tools:
        return ("*",)
    return tuple(dict.fromkeys(tools))


def tool_allowed(tools: tuple[str, ...], tool: str) -> bool:
    """Whether ``tool`` is one of ``tools``: names, or patterns where ``*`` stands for any run of
    characters (``*`` = every tool; ``agent_*``, as octomind's taps write it, = those starting so)."""
    return any(_tool_matches(pattern, tool) for pattern in tools)


def _tool_matches(pattern: str, tool: str) -> bool:
    if "*" not in pattern:
        return pattern == tool
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), tool, re.DOTALL) is not None


@dataclass(frozen=True)
class Capability:
    """A capability: trigger phrases to route on and, usually, MCP servers to start."""

    name: str
    tap: Path
    path: Path
    triggers: tuple[str, ...]
    domains: tuple[str, ...] = ()
    description: str | None = None
    provider: Provider | None = None
    providers: tuple[Provider, ...] = ()
    fingerprint: str = ""

    @property
    def kind(self) -> CapabilityKind:
        if self.provider is None or (not self.provider.servers and not self.provider.server_refs
                                     and not self.provider.requires):
            return "routing-only"
        if not self.provider.servers and not self.provider.server_refs:
            return "toolchain"
        return "mcp"

    @property
    def title(self) -> str | None:
        return self.provider.title if self.provider else None

    @property
    def servers(self) -> tuple[ServerSpec, ...]:
        """The servers this capability starts: those named by ``server_refs`` (or all defined, if none
        are named), less those ``allowed_tools`` grants no tool (as octomind drops them: a server
        started with no tool to call; :attr:`ungranted`)."""
        if self.provider is None:
            return ()
        defined = {s.name: s for s in self.provider.servers}
        refs = self.provider.server_refs or tuple(defined)
        return tuple(defined.get(ref) or ServerSpec(name=ref, type="unresolved", spec=MappingProxyType({}))
                     for ref in refs if ref not in self.ungranted)

    @property
    def ungranted(self) -> tuple[str, ...]:
        """Servers the provider references that a non-empty ``allowed_tools`` grants no tool."""
        if self.provider is None or not self.provider.allowed_tools:
            return ()
        refs = self.provider.server_refs or tuple(s.name for s in self.provider.servers)
        return tuple(ref for ref in dict.fromkeys(refs) if not tools_for_server(self.provider.allowed_tools, ref))

    @property
    def server_tools(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """``(server, allowed tool names or "*")`` for each server the capability starts."""
        allowed = self.provider.allowed_tools if self.provider else ()
        return tuple((s.name, tools_for_server(allowed, s.name)) for s in self.servers)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "title": self.title,
            "description": self.description or (self.provider.description if self.provider else None),
            "domains": list(self.domains),
            "triggers": len(self.triggers),
            "servers": [name for name, _ in self.server_tools],
            "requires": list(self.provider.requires) if self.provider else [],
            "tap": str(self.tap),
        }


def fingerprint(name: str, triggers: tuple[str, ...], description: str | None, domains: tuple[str, ...],
                provider: Provider | None) -> str:
    """Content hash of everything that defines a capability; changes iff a file's meaning changes."""
    payload = json.dumps(
        {
            "name": name,
            "triggers": list(triggers),
            "description": description,
            "domains": list(domains),
            "provider": provider.digest if provider else None,
        },
        sort_keys=True,
        ensure_ascii=False,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


RULES = ("capd", "anchor", "fused")  # the routing rules a setting or a tap's capd.toml may name (capd/router.py)


@dataclass(frozen=True)
class Example:
    """A row of ``<tap>/examples.jsonl``: ``message`` routes as one more trigger of ``capability``
    (rules ``capd`` and ``fused``), on the file's ``line``."""

    capability: str
    message: str
    line: int = 0


@dataclass(frozen=True)
class TapConfig:
    """``<tap>/capd.toml``: per-tap gate overrides written by ``capd calibrate --write``, and the rule
    the tap's author routes it with (``rule``, written by hand; see :func:`capd.settings.tap_rule`);
    with it the tap's vetoes, ``<tap>/vetoes.jsonl`` (messages none of its capabilities may take:
    :class:`capd.vetoes.Vetoes`), and its examples, ``<tap>/examples.jsonl``. Any file may be absent."""

    path: Path
    gates: Mapping[str, float | bool] = field(default_factory=lambda: MappingProxyType({}))  # anchor and capd rules
    model: str | None = None  # the model the gates were calibrated for; other models ignore them
    fused_gates: Mapping[str, float | bool] = field(default_factory=lambda: MappingProxyType({}))  # [gates.fused]
    rule: str | None = None  # the rule the tap asks for when no setting names one
    vetoes: tuple[str, ...] = ()  # <tap>/vetoes.jsonl's messages, in file order
    examples: tuple[Example, ...] = ()  # <tap>/examples.jsonl's rows, in file order
    # [gates.fused.offsets]: capability name -> what `capd calibrate` adds to its fused score
    offsets: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    def gates_for(self, rule: str) -> Mapping[str, float | bool]:
        return self.fused_gates if rule == "fused" else self.gates

    @functools.cached_property
    def examples_by_capability(self) -> Mapping[str, tuple[str, ...]]:
        """:attr:`examples`' messages per capability name, in file order (built once: every publish,
        lint and calibration asks per capability)."""
        grouped: dict[str, list[str]] = {}
        for example in self.examples:
            grouped.setdefault(example.capability, []).append(example.message)
        return MappingProxyType({name: tuple(messages) for name, messages in grouped.items()})


@dataclass(frozen=True)
class Catalog:
    """All capabilities of the configured taps, in precedence order, plus what failed to load."""

    taps: tuple[Path, ...]
    capabilities: Mapping[str, Capability]
    problems: tuple[Problem, ...] = ()
    tap_configs: Mapping[Path, TapConfig] = field(default_factory=lambda: MappingProxyType({}))

    def __iter__(self) -> Iterator[Capability]:
        return iter(self.capabilities.values())

    def __len__(self) -> int:
        return len(self.capabilities)

    def __contains__(self, name: object) -> bool:
        return name in self.capabilities

    def get(self, name: str) -> Capability | None:
        return self.capabilities.get(name)

    @property
    def errors(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.severity == "error")

    @property
    def trigger_count(self) -> int:
        return sum(len(c.triggers) for c in self)

    def changes_from(self, before: Catalog | None) -> tuple[list[str], list[str], list[str]]:
        """(added, removed, changed) capability names since ``before`` (None: all added), by
        content fingerprint: what a reload reports, whether or not a capability has triggers."""
        old = {c.name: c.fingerprint for c in before} if before is not None else {}
        new = {c.name: c.fingerprint for c in self}
        return ([n for n in new if n not in old], [n for n in old if n not in new],
                [n for n in new if n in old and new[n] != old[n]])

    def examples_of(self, capability: Capability) -> tuple[str, ...]:
        """The messages its own tap's ``examples.jsonl`` gives ``capability`` (a tap whose
        capability of that name another tap overrides gives it none)."""
        config = self.tap_configs.get(capability.tap)
        served = self.capabilities.get(capability.name)
        if config is None or served is None or served.tap != capability.tap:
            return ()
        return config.examples_by_capability.get(capability.name, ())

    def with_examples(self, examples: Mapping[str, Sequence[str]]) -> Catalog:
        """This catalog with every tap's examples replaced by ``examples`` (capability name ->
        messages, each given to the tap its capability comes from; unknown names are dropped):
        ``capd calibrate`` scores each fold with the examples of the other folds."""
        configs = dict(self.tap_configs)
        for tap in self.taps:
            config = configs.get(tap) or TapConfig(path=tap / "capd.toml")
            rows = tuple(Example(name, message) for name, messages in examples.items()
                         if (capability := self.get(name)) is not None and capability.tap == tap
                         for message in messages)
            configs[tap] = replace(config, examples=rows)
        return replace(self, tap_configs=MappingProxyType(configs))

    def gates_for(self, capability: Capability) -> Mapping[str, float]:
        config = self.tap_configs.get(capability.tap)
        return config.gates if config else MappingProxyType({})
