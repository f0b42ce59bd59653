"""A client-side model of one capd session, for checking a real daemon under load and after faults.

Two independent checks per plan the daemon returns:

- :meth:`SessionModel.replay` uses only what the API returned (and the tap the test wrote):
  it keeps per-server refcounts from start / teardown items and checks the invariants of
  DESIGN.md "Sessions, LRU and refcounted teardown" — at most ``max_active`` non-pinned
  capabilities, ``kill`` only when no capability left in the session references the server,
  ``strip`` only when one does, every capability entering or leaving with exactly its servers;
- the ``expect_*`` methods predict the exact plan from the rules (LRU by last use, ties by
  activation order; pinned never evicted; ``manual`` upgrades ``auto``), so a test compares
  the daemon's answer with the prediction. Operations on one session must be sequential.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.reliability.harness import Cap

Plan = dict[str, Any]


@dataclass
class Entry:
    name: str
    origin: str
    seq: int
    used: int  # logical time of the last use
    servers: dict[str, tuple[str, ...]]


def normalize(plan: Plan) -> Plan:
    """A plan with each start item's server spec reduced to its name (the model does not know specs)."""
    return {"start": [{**s, "server": s["server"]["name"]} for s in plan["start"]],
            "teardown": list(plan["teardown"]), "active": list(plan["active"])}


def allowed(tools: Sequence[str], tool: str) -> bool:
    return "*" in tools or tool in tools


@dataclass
class SessionModel:
    session: str
    caps: Mapping[str, Cap]
    max_active: int
    pinned: tuple[str, ...] = ()
    exists: bool = False
    active: dict[str, Entry] = field(default_factory=dict)
    tick: int = 0
    seq: int = 0
    running: dict[str, set[str]] = field(default_factory=dict)  # server -> capabilities, from plans only
    replayed: list[str] = field(default_factory=list)  # the active list of the last plan

    # -- prediction ---------------------------------------------------------------------------------
    def ordered(self) -> list[Entry]:
        return sorted(self.active.values(), key=lambda e: (e.seq, e.name))

    def _add(self, name: str, origin: str) -> None:
        self.active[name] = Entry(name, origin, self.seq, self.tick, dict(self.caps[name].server_tools))
        self.seq += 1

    def _begin(self) -> list[str]:
        self.tick += 1
        if self.exists:
            return []
        self.exists = True
        added = [p for p in self.pinned if p in self.caps]
        for name in added:
            self._add(name, "pinned")
        return added

    def _plan(self, added: list[str], removed: list[Entry]) -> Plan:
        final = self.ordered()
        teardown = []
        for index, entry in enumerate(removed):
            still = [*final, *removed[index + 1:]]
            teardown += [{"capability": entry.name, "server": server, "tools": list(tools),
                          "kill": not any(server in other.servers for other in still)}
                         for server, tools in entry.servers.items()]
        start = [{"capability": name, "server": server, "tools": list(tools)}
                 for name in added for server, tools in self.active[name].servers.items()]
        return {"start": start, "teardown": teardown, "active": [e.name for e in final]}

    def expect_enable(self, name: str, origin: str = "manual") -> tuple[int, Plan | None]:
        if name not in self.caps:
            return 404, None
        added = self._begin()
        removed: list[Entry] = []
        entry = self.active.get(name)
        if entry is not None:
            entry.used = self.tick
            if origin == "manual" and entry.origin == "auto":
                entry.origin = "manual"
        else:
            unpinned = [e for e in self.active.values() if e.origin != "pinned"]
            if len(unpinned) >= self.max_active:
                victim = min(unpinned, key=lambda e: (e.used, e.seq))
                removed.append(self.active.pop(victim.name))
            self._add(name, origin)
            added.append(name)
        return 200, self._plan(added, removed)

    def expect_disable(self, name: str) -> tuple[int, Plan | None]:
        if name in self.pinned and name in self.caps:  # a pinned name no tap provides is ignored
            return 409, None
        if name not in self.caps and name not in self.active:
            return 404, None
        added = self._begin()
        removed = [self.active.pop(name)] if name in self.active else []
        return 200, self._plan(added, removed)

    def expect_reconcile(self) -> Plan:
        return self._plan(self._begin(), [])

    def expect_tool_result(self, server: str, tool: str, ok: bool) -> tuple[int, list[str] | None]:
        if not self.exists:
            return 404, None
        self.tick += 1
        bumped = [e for e in self.ordered() if ok and server in e.servers and allowed(e.servers[server], tool)]
        for entry in bumped:
            entry.used = self.tick
        return 200, [e.name for e in bumped]

    # -- replay of returned plans: invariants ----------------------------------------------------------
    def replay(self, plan: Plan) -> list[str]:
        """Apply a plan the daemon returned; returns the invariant violations found (empty if none)."""
        problems: list[str] = []
        before, after = set(self.replayed), list(plan["active"])
        final = set(after)
        refs = {name: set(self.caps[name].server_tools) for name in final if name in self.caps}
        unpinned = [n for n in after if n not in self.pinned]
        if len(unpinned) > self.max_active:
            problems.append(f"{len(unpinned)} non-pinned capabilities active (max {self.max_active}): {after}")
        if len(after) != len(final):
            problems.append(f"duplicate names in active: {after}")
        torn: dict[str, set[str]] = {}
        for index, item in enumerate(plan["teardown"]):
            cap, server = item["capability"], item["server"]
            torn.setdefault(cap, set()).add(server)
            holders = self.running.setdefault(server, set())
            if cap not in holders:
                problems.append(f"teardown of {server} for {cap}, which was not running it")
            holders.discard(cap)
            later = {t["capability"] for t in plan["teardown"][index + 1:] if t["server"] == server}
            referenced = any(server in servers for servers in refs.values()) or bool(later - {cap})
            if item["kill"] and referenced:
                problems.append(f"{server} killed for {cap} while still referenced ({after})")
            if not item["kill"] and not referenced:
                problems.append(f"{server} only stripped for {cap}, but nothing references it any more")
        started: dict[str, set[str]] = {}
        for item in plan["start"]:
            cap, server = item["capability"], item["server"]["name"]
            started.setdefault(cap, set()).add(server)
            self.running.setdefault(server, set()).add(cap)
        for cap in before - final:
            if torn.get(cap, set()) != set(self.caps[cap].server_tools):
                problems.append(f"{cap} left the session but its teardown covered {torn.get(cap)}")
        for cap in final - before:
            if started.get(cap, set()) != set(self.caps[cap].server_tools):
                problems.append(f"{cap} entered the session but its start covered {started.get(cap)}")
        for cap in set(torn) & final | set(started) & before:
            problems.append(f"{cap} stayed active but the plan started or tore down its servers")
        self.replayed = after
        return problems

    def check_state(self, state: Mapping[str, Any]) -> list[str]:
        """Compare ``GET /v1/sessions/{id}`` with the model and the replayed refcounts."""
        problems: list[str] = []
        got = [(a["name"], a["origin"], {s["name"]: tuple(s["tools"]) for s in a["servers"]})
               for a in state["active"]]
        want = [(e.name, e.origin, e.servers) for e in self.ordered()]
        if got != want:
            problems.append(f"{self.session}: state {got} != model {want}")
        if [a["name"] for a in state["active"]] != self.replayed:
            problems.append(f"{self.session}: state {[a['name'] for a in state['active']]} != last plan "
                            f"{self.replayed}")
        refcounts: dict[str, int] = {}
        for active in state["active"]:
            for server in active["servers"]:
                refcounts[server["name"]] = refcounts.get(server["name"], 0) + 1
        replayed = {s: len(c) for s, c in self.running.items() if c}
        if refcounts != replayed:
            problems.append(f"{self.session}: refcounts {refcounts} != replayed from plans {replayed}")
        by_use = [a["name"] for a in sorted(state["active"], key=lambda a: (a["last_used"],))]
        model_by_use = [e.name for e in sorted(self.ordered(), key=lambda e: e.used)]
        if [n for n in by_use if n not in self.pinned] != [n for n in model_by_use if n not in self.pinned]:
            problems.append(f"{self.session}: LRU order {by_use} != model {model_by_use}")
        return problems

    # -- snapshots ------------------------------------------------------------------------------------
    def snapshot(self) -> list[tuple[str, str, dict[str, tuple[str, ...]]]]:
        """What must survive a restart: (name, origin, servers with tools) in stable order."""
        return [(e.name, e.origin, dict(e.servers)) for e in self.ordered()]

    @classmethod
    def from_state(cls, state: Mapping[str, Any], caps: Mapping[str, Cap], max_active: int,
                   pinned: tuple[str, ...] = ()) -> SessionModel:
        """A model of a session as ``GET /v1/sessions/{id}`` shows it (after a restart, say)."""
        model = cls(state["session"], caps, max_active, pinned, exists=True)
        uses = sorted({a["last_used"] for a in state["active"]})
        for seq, active in enumerate(state["active"]):
            servers = {s["name"]: tuple(s["tools"]) for s in active["servers"]}
            model.active[active["name"]] = Entry(active["name"], active["origin"], seq,
                                                 uses.index(active["last_used"]) + 1, servers)
            for server in servers:
                model.running.setdefault(server, set()).add(active["name"])
        model.seq, model.tick = len(state["active"]), len(uses) + 1
        model.replayed = [a["name"] for a in state["active"]]
        return model


def state_snapshot(state: Mapping[str, Any]) -> list[tuple[str, str, dict[str, tuple[str, ...]]]]:
    return [(a["name"], a["origin"], {s["name"]: tuple(s["tools"]) for s in a["servers"]}) for a in state["active"]]
