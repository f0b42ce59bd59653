"""Plans: what one change of a session asks the agent to tear down and start.

A :class:`SessionChange` is a working copy of one session during one registry operation (capabilities
added, removed or refreshed); :meth:`SessionChange.plan` diffs it against the session as it was, in
the shape DESIGN.md fixes ("Sessions, LRU and refcounted teardown"). Which capabilities change, and
when, is :class:`capd.sessions.SessionRegistry`'s.

Decisions where DESIGN.md is silent:

- **Start** items come one per server of the new capability, even when that server already
  runs for another capability of the session: the agent adds this capability's tools to the
  running server. Servers are identified by name within a session.
- **Teardown** is applied before start. ``kill`` is computed item by item within one plan,
  so a server shared by two capabilities removed together is killed exactly once (by the
  last item). ``tools`` is the capability's own grant as snapshotted; a server's tool
  surface is the union of the grants of the capabilities still referencing it, so a tool
  that another remaining capability also grants stays.
- **Snapshots**: servers, tools and specs are copied at activation, so teardown matches what
  was started even after the tap changes. A deleted capability is torn down by the session's
  next plan. An edited one (a server's spec or tool grant changed) is refreshed by it. A changed
  grant alone strips the old tools and adds the new (no ``kill``). A changed spec restarts the
  server for the whole session: one teardown item per capability running on it (the last one
  ``kill``), then a start item for each, an edited capability first, so that its new spec is the
  one started and every capability still has its tools.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from capd.catalog import Capability
from capd.state import ActiveCapability, Origin, ServerSnapshot, SessionRecord


@dataclass(frozen=True)
class StartItem:
    capability: str
    server: Mapping[str, Any]
    tools: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"capability": self.capability, "server": copy.deepcopy(dict(self.server)), "tools": list(self.tools)}


@dataclass(frozen=True)
class TeardownItem:
    capability: str
    server: str
    kill: bool
    tools: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"capability": self.capability, "server": self.server, "kill": self.kill, "tools": list(self.tools)}


@dataclass(frozen=True)
class Plan:
    """What the agent must do: tear down (first), then start. ``active`` is in stable order.

    ``activated`` and ``removed`` name the capabilities that entered and left the session
    (for logs and metrics); they are not part of :meth:`as_dict`.
    """

    start: tuple[StartItem, ...] = ()
    teardown: tuple[TeardownItem, ...] = ()
    active: tuple[str, ...] = ()
    activated: tuple[str, ...] = field(default=(), compare=False)
    removed: tuple[str, ...] = field(default=(), compare=False)

    @property
    def changed(self) -> bool:
        """True when the active set changed (a re-activation or origin upgrade alone is not a change)."""
        return bool(self.activated or self.removed)

    def as_dict(self) -> dict[str, Any]:
        return {"start": [s.as_dict() for s in self.start], "teardown": [t.as_dict() for t in self.teardown],
                "active": list(self.active)}


def in_session_order(entries: Iterable[ActiveCapability]) -> tuple[ActiveCapability, ...]:
    return tuple(sorted(entries, key=lambda a: (a.seq, a.name)))


def _snapshot(capability: Capability) -> tuple[ServerSnapshot, ...]:
    tools = dict(capability.server_tools)
    servers: dict[str, ServerSnapshot] = {}
    for spec in capability.servers:
        servers.setdefault(spec.name, ServerSnapshot(spec.name, tools.get(spec.name, ("*",)), spec.as_dict()))
    return tuple(servers.values())


def _references(entry: ActiveCapability, server: str) -> bool:
    return any(s.name == server for s in entry.servers)


def _stored_form(value: Any) -> str:
    """``value`` as the session file holds it: JSON with ``default=str`` (read back with lists for
    tuples and strings for TOML dates), so that a snapshot compares equal across a restart."""
    return json.dumps(value, sort_keys=True, default=str)


def _same(a: ServerSnapshot, b: ServerSnapshot) -> bool:
    """The same server, spec and tool grant (in memory they are usually equal as they stand)."""
    return a == b or (a.name == b.name and _stored_form(list(a.tools)) == _stored_form(list(b.tools))
                      and _same_spec(a, b))


def _same_spec(a: ServerSnapshot, b: ServerSnapshot) -> bool:
    return a.spec == b.spec or _stored_form(a.spec) == _stored_form(b.spec)


class SessionChange:
    """A working copy of one session during one operation; :meth:`plan` diffs it against the start."""

    def __init__(self, record: SessionRecord) -> None:
        self.session = record.session
        self.active = {a.name: a for a in record.active}
        self.next_seq = record.next_seq
        self.added: list[str] = []
        self.removed: list[ActiveCapability] = []
        self.refreshed: dict[str, ActiveCapability] = {}  # name -> the entry as the agent runs it

    def refresh(self, capability: Capability) -> None:
        """Bring an active capability's servers in line with the tap (an edited spec or grant): the
        plan restarts what changed, as a teardown of the old and a start of the new."""
        entry = self.active[capability.name]
        servers = _snapshot(capability)
        if len(servers) != len(entry.servers) or not all(map(_same, servers, entry.servers)):
            self.refreshed.setdefault(capability.name, entry)
            self.active[capability.name] = replace(entry, servers=servers)

    def add(self, capability: Capability, origin: Origin, now: float) -> None:
        self.active[capability.name] = ActiveCapability(capability.name, origin, self.next_seq, now,
                                                        _snapshot(capability))
        self.next_seq += 1
        self.added.append(capability.name)

    def remove(self, name: str) -> None:
        entry = self.active.pop(name)
        entry = self.refreshed.pop(name, entry)  # refreshed, then removed: tear down what the agent runs
        if name in self.added:  # came and went within one operation: nothing for the agent to do
            self.added.remove(name)
        else:
            self.removed.append(entry)

    def unpinned(self) -> list[ActiveCapability]:
        return [a for a in self.active.values() if a.origin != "pinned"]

    def _restarts(self) -> list[str]:
        """The servers whose spec a refreshed capability changed (a version bump in ``args``)."""
        names: list[str] = []
        for name, old in self.refreshed.items():
            now = {s.name: s for s in self.active[name].servers}
            for server in old.servers:
                new = now.get(server.name)
                if new is not None and not _same_spec(new, server) and server.name not in names:
                    names.append(server.name)
        return names

    def record(self, now: float) -> SessionRecord:
        return SessionRecord(self.session, now, self.next_seq, in_session_order(self.active.values()))

    def plan(self) -> Plan:
        final = in_session_order(self.active.values())
        teardown: list[TeardownItem] = []
        for index, entry in enumerate(self.removed):
            still = (*final, *self.removed[index + 1:])
            teardown.extend(TeardownItem(entry.name, s.name, not any(_references(o, s.name) for o in still), s.tools)
                            for s in entry.servers)
        start = [StartItem(name, s.spec, s.tools) for name in self.added for s in self.active[name].servers]
        restart = self._restarts()
        for name, old in self.refreshed.items():
            now = {s.name: s for s in self.active[name].servers}
            before = {s.name: s for s in old.servers}
            for server in old.servers:  # a grant changed (old tools off, new on), or the server is dropped
                new = now.get(server.name)
                if server.name not in restart and (new is None or not _same(new, server)):
                    last = new is None and not any(_references(o, server.name) for o in final)
                    teardown.append(TeardownItem(name, server.name, last, server.tools))
            start.extend(StartItem(name, s.spec, s.tools) for s in now.values()
                         if s.name not in restart and (s.name not in before or not _same(before[s.name], s)))
        for restarted in restart:
            # One process per server name: it is restarted for every capability that runs on it, each
            # one's tools stripped (the last item kills it) and added again, a refreshed capability
            # first, so that its new spec is the one started. Restarted for the refreshed capability
            # alone, the others lost their tools when it was killed, or kept running the old spec.
            users = [o for o in final if o.name not in self.added]
            running = [(o.name, t) for o in users for t in self.refreshed.get(o.name, o).servers if t.name == restarted]
            teardown.extend(TeardownItem(name, restarted, i == len(running) - 1, t.tools)
                            for i, (name, t) in enumerate(running))
            first = sorted(users, key=lambda o: o.name not in self.refreshed)  # stable: in session order
            start.extend(StartItem(o.name, t.spec, t.tools) for o in first for t in o.servers if t.name == restarted)
        return Plan(tuple(start), tuple(teardown), tuple(a.name for a in final), tuple(self.added),
                    tuple(e.name for e in self.removed))
