"""Session registry against a reference model (hypothesis, stateful), plus a threaded hammer test.

Plans are replayed into per-session server references: start adds (capability, server),
teardown removes it, and ``kill`` must be true exactly when nothing references the server
any more. The replayed references must always match what the registry says is active.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from capd.catalog import Catalog
from capd.errors import PinnedCapability, UnknownCapability, UnknownSession
from capd.plans import Plan
from capd.sessions import SessionRegistry
from capd.state import FILENAME, SessionStore
from capd.taps import load_catalog
from tests.taputil import write_capability

MAX_ACTIVE = 2
PINNED = ("docker",)
SESSIONS = ("a", "b", "c")
NAMES = ("fs-read", "fs-write", "git", "docker", "web", "rust", "notes")
DELETABLE = ("git", "fs-write", "docker")
CALLS = (("filesystem", "read_file"), ("filesystem", "write_file"), ("filesystem", "list_directory"),
         ("git", "git_status"), ("fetch", "fetch"), ("search", "web_search"), ("search", "other"), ("docker", "ps"))


def _provider(refs: list[str], allowed: list[str], servers: tuple[str, ...] = (), deps: tuple[str, ...] = ()) -> str:
    text = f"[deps]\nrequire = {json.dumps(list(deps))}\n" if deps else ""
    text += f"[roles.mcp]\nserver_refs = {json.dumps(refs)}\nallowed_tools = {json.dumps(allowed)}\n"
    for server in servers:
        text += f'[[mcp.servers]]\nname = "{server}"\ncommand = "run-{server}"\nargs = ["{{{{ENV:X}}}}"]\n'
    return text


TAP: dict[str, str | None] = {
    "fs-read": _provider(["filesystem"], ["filesystem:read_file", "filesystem:list_directory"], ("filesystem",)),
    "fs-write": _provider(["filesystem"], ["filesystem:write_file", "filesystem:read_file"], ("filesystem",)),
    "git": _provider(["git"], ["git:*"], ("git",)),
    "docker": _provider(["docker"], [], ("docker",)),
    "web": _provider(["fetch", "search"], ["fetch:*", "search:web_search"], ("fetch", "search")),
    "rust": _provider([], [], deps=("rust-lang/rustup",)),
    "notes": None,
}


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Catalog:
    tap = tmp_path_factory.mktemp("tap")
    for name, text in TAP.items():
        write_capability(tap, name, [f"use {name}"], {name: text} if text else None,
                         default="<inline>" if text else None)
    loaded = load_catalog([tap])
    assert set(loaded.capabilities) == set(NAMES) and not loaded.problems
    return loaded


def without(catalog: Catalog, deleted: set[str]) -> Catalog:
    """The catalog a reload returns after those capability folders were deleted."""
    kept = {n: c for n, c in catalog.capabilities.items() if n not in deleted}
    return Catalog(taps=catalog.taps, capabilities=MappingProxyType(kept))


References = dict[str, set[str]]  # server -> capabilities referencing it


def replay(refs: References, plan: Plan) -> None:
    """Apply a plan to the references. The agent tears down first, then starts; a server whose only
    remaining reference is a capability this same plan starts is kept running (kill false)."""
    for start in plan.start:
        server = str(start.server["name"])
        assert start.capability not in refs.get(server, set()), f"{start} started twice"
        refs.setdefault(server, set()).add(start.capability)
    started = {(s.capability, str(s.server["name"])) for s in plan.start}
    for item in plan.teardown:
        holders = refs.get(item.server, set())
        assert item.capability in holders and (item.capability, item.server) not in started, item
        holders.discard(item.capability)
        assert item.kill == (not holders), f"{item}: kill must be true exactly when unreferenced ({holders})"
        if not holders:
            refs.pop(item.server, None)


def references_of(registry: SessionRegistry, session: str) -> References:
    refs: References = {}
    for entry in registry.get(session).active:
        for server in entry.servers:
            refs.setdefault(server.name, set()).add(entry.name)
    return refs


@dataclass
class Entry:
    last_used: float
    seq: int
    origin: str


class Model:
    """The reference: a dict per session, written the obvious way."""

    def __init__(self, catalog: Catalog) -> None:
        self.grants = {c.name: dict(c.server_tools) for c in catalog}
        self.present = set(NAMES)
        self.sessions: dict[str, dict[str, Entry]] = {}
        self.next_seq: dict[str, int] = {}

    def _add(self, session: str, name: str, origin: str, now: float) -> None:
        self.sessions[session][name] = Entry(now, self.next_seq[session], origin)
        self.next_seq[session] += 1

    def ensure(self, session: str, now: float) -> dict[str, Entry]:
        if session not in self.sessions:
            self.sessions[session], self.next_seq[session] = {}, 0
        active = self.sessions[session]
        for name in self.order(session):
            if name not in self.present:
                del active[name]
        for name in PINNED:
            if name in self.present and name not in active:
                self._add(session, name, "pinned", now)
        return active

    def order(self, session: str) -> tuple[str, ...]:
        active = self.sessions.get(session, {})
        return tuple(sorted(active, key=lambda n: active[n].seq))

    def activate(self, session: str, name: str, origin: str, now: float) -> None:
        if name not in self.present:
            raise UnknownCapability(name)
        active = self.ensure(session, now)
        if name in active:
            active[name].last_used = now
            if origin == "manual" and active[name].origin == "auto":
                active[name].origin = "manual"
            return
        unpinned = [n for n in active if active[n].origin != "pinned"]
        if len(unpinned) >= MAX_ACTIVE:
            del active[min(unpinned, key=lambda n: (active[n].last_used, active[n].seq))]
        self._add(session, name, origin, now)

    def deactivate(self, session: str, name: str, now: float) -> None:
        if name in PINNED and name in self.present:  # a pinned name no tap provides is ignored
            raise PinnedCapability(name)
        if name not in self.present and name not in self.sessions.get(session, {}):
            raise UnknownCapability(name)
        self.ensure(session, now).pop(name, None)

    def tool_result(self, session: str, server: str, tool: str, ok: bool, now: float) -> list[str]:
        if session not in self.sessions:
            raise UnknownSession(session)
        bumped = [n for n in self.order(session) if ok and server in self.grants[n]
                  and ("*" in self.grants[n][server] or tool in self.grants[n][server])]
        for name in bumped:
            self.sessions[session][name].last_used = now
        return bumped

    def drop(self, session: str) -> None:
        if self.sessions.pop(session, None) is None:
            raise UnknownSession(session)


def expect_same(model_call: Callable[[], object], registry_call: Callable[[], object]) -> object:
    """Run both; they must return the same or raise the same error type. Returns the registry's result."""
    try:
        expected = model_call()
    except (UnknownCapability, UnknownSession, PinnedCapability) as exc:
        with pytest.raises(type(exc)):
            registry_call()
        return None
    result = registry_call()
    if expected is not None:
        assert result == expected
    return result


class SessionMachine(RuleBasedStateMachine):
    def __init__(self, catalog: Catalog, directory: Path) -> None:
        super().__init__()
        self.full = catalog
        self.path = directory / FILENAME
        self.now = 0.0
        self.model = Model(catalog)
        self.refs: dict[str, References] = {}
        self.store = SessionStore(self.path)
        self.registry = self._registry()

    def _registry(self) -> SessionRegistry:
        return SessionRegistry(self.store, lambda: without(self.full, set(NAMES) - self.model.present),
                               max_active=MAX_ACTIVE, pinned=PINNED, clock=lambda: self.now)

    def _planned(self, session: str, plan: object) -> None:
        if isinstance(plan, Plan):
            replay(self.refs.setdefault(session, {}), plan)
            assert plan.active == self.model.order(session)

    @rule(session=st.sampled_from(SESSIONS), name=st.sampled_from((*NAMES, "nope")),
          origin=st.sampled_from(("auto", "manual")), tick=st.integers(0, 1))
    def activate(self, session: str, name: str, origin: str, tick: int) -> None:
        self.now += tick
        plan = expect_same(lambda: self.model.activate(session, name, origin, self.now),
                           lambda: self.registry.activate(session, name, origin))  # type: ignore[arg-type]
        self._planned(session, plan)

    @rule(session=st.sampled_from(SESSIONS), name=st.sampled_from((*NAMES, "nope")), tick=st.integers(0, 1))
    def deactivate(self, session: str, name: str, tick: int) -> None:
        self.now += tick
        plan = expect_same(lambda: self.model.deactivate(session, name, self.now),
                           lambda: self.registry.deactivate(session, name))
        self._planned(session, plan)

    @rule(session=st.sampled_from(SESSIONS), call=st.sampled_from(CALLS), ok=st.booleans(), tick=st.integers(0, 1))
    def tool_result(self, session: str, call: tuple[str, str], ok: bool, tick: int) -> None:
        self.now += tick
        expect_same(lambda: self.model.tool_result(session, *call, ok, self.now),
                    lambda: self.registry.tool_result(session, *call, ok))

    @rule(session=st.sampled_from(SESSIONS))
    def drop(self, session: str) -> None:
        plan = expect_same(lambda: self.model.drop(session), lambda: self.registry.drop(session))
        if isinstance(plan, Plan):
            replay(self.refs.setdefault(session, {}), plan)
            assert self.refs.pop(session) == {}, "dropping a session must release every server"

    @rule(name=st.sampled_from(DELETABLE))
    def toggle_in_catalog(self, name: str) -> None:
        self.model.present ^= {name}

    @rule(session=st.sampled_from(SESSIONS))
    def reconcile(self, session: str) -> None:
        self.model.ensure(session, self.now)
        self._planned(session, self.registry.reconcile(session))

    @rule(dice=st.integers(0, 3))
    def restart(self, dice: int) -> None:
        if dice:  # restart on a quarter of the draws: closing checkpoints the WAL, which costs an fsync
            return
        self.store.close()
        self.store = SessionStore(self.path)
        self.registry = self._registry()

    @invariant()
    def matches_the_model(self) -> None:
        assert self.registry.sessions() == tuple(sorted(self.model.sessions))
        for session, active in self.model.sessions.items():
            state = self.registry.get(session)
            assert state.names == self.model.order(session)
            assert {a.name: Entry(a.last_used, a.seq, a.origin) for a in state.active} == active
            assert sum(a.origin != "pinned" for a in state.active) <= MAX_ACTIVE
            assert self.refs.get(session, {}) == references_of(self.registry, session)

    def teardown(self) -> None:
        self.store.close()


def test_registry_matches_reference_model(catalog: Catalog, tmp_path: Path) -> None:
    counter = itertools.count()

    class Machine(SessionMachine):
        def __init__(self) -> None:
            directory = tmp_path / f"run{next(counter)}"
            directory.mkdir()
            super().__init__(catalog, directory)

    run_state_machine_as_test(Machine, settings=settings(
        max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]))


def _hammer(registry: SessionRegistry, sessions: list[str], seed: int, ops: int,
            log: Callable[[str, Plan], None]) -> None:
    rng = random.Random(seed)
    for _ in range(ops):
        session, roll = rng.choice(sessions), rng.random()
        try:
            if roll < 0.45:
                log(session, registry.activate(session, rng.choice(NAMES), rng.choice(("auto", "manual"))))
            elif roll < 0.7:
                log(session, registry.deactivate(session, rng.choice([n for n in NAMES if n not in PINNED])))
            elif roll < 0.95:
                registry.tool_result(session, *rng.choice(CALLS), ok=rng.random() < 0.8)
            else:
                log(session, registry.drop(session))
        except UnknownSession:
            pass


def _run_threads(target: Callable[[int], None], count: int) -> None:
    errors: list[BaseException] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up in a few hundred calls

    def guarded(index: int) -> None:
        try:
            target(index)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors


@pytest.fixture
def hammered(catalog: Catalog, tmp_path: Path) -> tuple[SessionStore, SessionRegistry]:
    ticks = itertools.count()
    store = SessionStore(tmp_path / FILENAME)
    registry = SessionRegistry(store, lambda: catalog, max_active=MAX_ACTIVE, pinned=PINNED,
                               clock=lambda: float(next(ticks)))
    return store, registry


def _check_final(store: SessionStore, registry: SessionRegistry) -> None:
    for session in registry.sessions():
        state = registry.get(session)
        assert sum(a.origin != "pinned" for a in state.active) <= MAX_ACTIVE
        assert len({a.seq for a in state.active}) == len(state.active)
    store.close()
    with SessionStore(store.path) as reopened:  # what is on disk is what was in memory
        assert reopened.ids() == registry.sessions()
        for session in reopened.ids():
            assert reopened.get(session) == store.get(session)


def test_threads_with_plans_replayed_in_lock_order(hammered: tuple[SessionStore, SessionRegistry]) -> None:
    store, registry = hammered
    refs: dict[str, References] = {}

    def log(session: str, plan: Plan) -> None:
        replay(refs.setdefault(session, {}), plan)

    def work(index: int) -> None:
        rng = random.Random(index)
        for _ in range(200):
            session = rng.choice(["s0", "s1", "s2", f"own{index}"])
            # Holding the session lock around call + replay gives the replay the registry's serial order.
            with registry.locked(session):
                _hammer(registry, [session], rng.randrange(1 << 30), 1, log)

    _run_threads(work, 8)
    for session, session_refs in refs.items():
        expected = references_of(registry, session) if session in registry.sessions() else {}
        assert session_refs == expected, session
    _check_final(store, registry)


def test_threads_without_caller_locks_keep_per_session_accounting(
        hammered: tuple[SessionStore, SessionRegistry]) -> None:
    store, registry = hammered
    plans: list[tuple[str, Plan]] = []  # list.append is atomic; the order across threads is unknown

    def work(index: int) -> None:
        _hammer(registry, ["s0", "s1", f"own{index}"], index, 250, lambda s, p: plans.append((s, p)))

    _run_threads(work, 8)
    # Whatever the interleaving, each (session, capability, server) was started once more than torn
    # down iff it is active now, and each capability entered once more than it left iff active now.
    balance: dict[tuple[str, str, str], int] = {}
    entries: dict[tuple[str, str], int] = {}
    for session, plan in plans:
        for start in plan.start:
            key = (session, start.capability, str(start.server["name"]))
            balance[key] = balance.get(key, 0) + 1
        for item in plan.teardown:
            balance[(session, item.capability, item.server)] = balance.get(
                (session, item.capability, item.server), 0) - 1
        for name in plan.activated:
            entries[(session, name)] = entries.get((session, name), 0) + 1
        for name in plan.removed:
            entries[(session, name)] = entries.get((session, name), 0) - 1
    active = {(s, a.name): a for s in registry.sessions() for a in registry.get(s).active}
    assert {k for k, v in entries.items() if v} == set(active)
    assert all(v in (0, 1) for v in entries.values())
    assert {k for k, v in balance.items() if v} == {(s, n, srv.name) for (s, n), a in active.items()
                                                    for srv in a.servers}
    assert all(v in (0, 1) for v in balance.values())
    _check_final(store, registry)
