"""Session registry: LRU eviction, pinning, refcounted teardown, plan shape, expiry. Real SQLite, fake clock."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from capd.catalog import Catalog
from capd.errors import InvalidSessionId, PinnedCapability, UnknownCapability, UnknownSession
from capd.plans import Plan
from capd.sessions import ENDED_KEPT, SessionRegistry
from capd.state import FILENAME, SessionStore
from capd.taps import load_catalog
from tests.taputil import write_capability

FILESYSTEM = """
[[mcp.servers]]
name = "filesystem"
type = "stdio"
command = "npx"
args = ["-y", "@modelcontextprotocol/server-filesystem@2025.1.1", "{{ENV:HOME}}"]
timeout_seconds = 30
tools = []
"""


def provider(refs: list[str], allowed: list[str], servers: str = "", deps: list[str] | None = None) -> str:
    head = f"[deps]\nrequire = {json.dumps(deps)}\n" if deps else ""
    return (f"# Title: test\n{head}[roles.mcp]\nserver_refs = {json.dumps(refs)}\n"
            f"allowed_tools = {json.dumps(allowed)}\n{servers}")


PROVIDERS: dict[str, str | None] = {
    "fs-read": provider(["filesystem"], ["filesystem:read_file", "filesystem:list_directory"], FILESYSTEM),
    "fs-write": provider(["filesystem"], ["filesystem:write_file", "filesystem:read_file"], FILESYSTEM),
    "git": provider(["git"], ["git:*"], '[[mcp.servers]]\nname = "git"\ntype = "stdio"\ncommand = "uvx"\n'
                    'args = ["mcp-server-git"]\n'),
    "github": provider(["github"], ["github:create_issue", "github:list_issues"],
                       '[[mcp.servers]]\nname = "github"\ntype = "http"\nurl = "https://api.example.com/mcp/"\n'
                       '[mcp.servers.env]\nGITHUB_TOKEN = "{{ENV:GITHUB_TOKEN}}"\n'),
    "docker": provider(["docker"], [], '[[mcp.servers]]\nname = "docker"\ncommand = "docker-mcp"\n'),
    "web": provider(["fetch", "search"], ["fetch:*", "search:web_search"],
                    '[[mcp.servers]]\nname = "fetch"\ncommand = "uvx"\nargs = ["mcp-server-fetch"]\n'
                    '[[mcp.servers]]\nname = "search"\ntype = "http"\nurl = "http://127.0.0.1:9/mcp"\n'),
    "rust": provider([], [], deps=["rust-lang/rustup"]),  # toolchain: deps, no servers
    "notes": None,  # routing-only: config.toml alone
}


def write_tap(root: Path, providers: dict[str, str | None] = PROVIDERS) -> Path:
    for name, text in providers.items():
        write_capability(root, name, [f"use {name}", f"work with {name}"], {name: text} if text else None,
                         default="<inline>" if text else None)
    return root


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, seconds: float = 1.0) -> float:
        self.t += seconds
        return self.t


class Catalogs:
    """A swappable catalog, as the daemon's reload would provide."""

    def __init__(self, tap: Path) -> None:
        self.tap = tap
        self.current = load_catalog([tap])

    def __call__(self) -> Catalog:
        return self.current

    def reload(self) -> None:
        self.current = load_catalog([self.tap])


@pytest.fixture
def tap(tmp_path: Path) -> Path:
    return write_tap(tmp_path / "tap")


@pytest.fixture
def catalogs(tap: Path) -> Catalogs:
    return Catalogs(tap)


@pytest.fixture
def clock() -> Clock:
    return Clock()


Make = Callable[..., SessionRegistry]


@pytest.fixture
def make(tmp_path: Path, catalogs: Catalogs, clock: Clock) -> Iterator[Make]:
    stores: list[SessionStore] = []

    def build(**kwargs: Any) -> SessionRegistry:
        store = SessionStore(tmp_path / "data" / FILENAME)
        stores.append(store)
        return SessionRegistry(store, catalogs, clock=clock, **kwargs)

    yield build
    for store in stores:
        store.close()


def removed(plan: Plan) -> list[tuple[str, str, bool]]:
    return [(t.capability, t.server, t.kill) for t in plan.teardown]


def started(plan: Plan) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(s.capability, str(s.server["name"]), s.tools) for s in plan.start]


# -- plan shape --------------------------------------------------------------------------------------------

def test_plan_has_exactly_the_design_shape(make: Make, clock: Clock) -> None:
    registry = make(max_active=1)
    first = registry.activate("s1", "github").as_dict()
    assert set(first) == {"start", "teardown", "active"}
    assert first["teardown"] == [] and first["active"] == ["github"]
    [item] = first["start"]
    assert set(item) == {"capability", "server", "tools"}
    assert item["capability"] == "github" and item["tools"] == ["create_issue", "list_issues"]
    server = item["server"]
    assert {"name", "type", "command", "args", "url", "timeout_seconds"} <= set(server)
    assert server["name"] == "github" and server["type"] == "http" and server["url"] == "https://api.example.com/mcp/"
    assert server["env"] == {"GITHUB_TOKEN": "{{ENV:GITHUB_TOKEN}}"}  # placeholders never resolved

    clock.tick()
    second = registry.activate("s1", "fs-read").as_dict()
    assert [set(t) for t in second["teardown"]] == [{"capability", "server", "kill", "tools"}]
    assert second["teardown"] == [{"capability": "github", "server": "github", "kill": True,
                                   "tools": ["create_issue", "list_issues"]}]
    assert second["start"][0]["server"]["args"][-1] == "{{ENV:HOME}}"
    assert second["start"][0]["server"]["timeout_seconds"] == 30
    assert json.loads(json.dumps(second)) == second


def test_plan_dicts_are_copies(make: Make) -> None:
    registry = make()
    plan = registry.activate("s1", "fs-read")
    plan.as_dict()["start"][0]["server"]["args"].append("mutated")
    assert "mutated" not in plan.as_dict()["start"][0]["server"]["args"]
    assert "mutated" not in registry.get("s1").active[0].servers[0].spec["args"]


# -- LRU ---------------------------------------------------------------------------------------------------

def test_exactly_one_lru_eviction_per_activation(make: Make, clock: Clock) -> None:
    registry = make(max_active=2)
    registry.activate("s1", "git")
    clock.tick()
    registry.activate("s1", "docker")
    clock.tick()
    plan = registry.activate("s1", "github")
    assert removed(plan) == [("git", "git", True)]
    assert plan.removed == ("git",) and plan.activated == ("github",)
    assert plan.active == ("docker", "github")
    clock.tick()
    plan = registry.activate("s1", "git")
    assert removed(plan) == [("docker", "docker", True)]
    assert registry.active_names("s1") == ("github", "git")


def test_successful_tool_result_changes_the_victim(make: Make, clock: Clock) -> None:
    registry = make(max_active=2)
    registry.activate("s1", "git")
    clock.tick()
    registry.activate("s1", "docker")
    clock.tick()
    assert registry.tool_result("s1", "git", "git_status", ok=True) == ["git"]
    clock.tick()
    assert removed(registry.activate("s1", "github")) == [("docker", "docker", True)]


def test_failed_tool_result_bumps_nothing(make: Make, clock: Clock) -> None:
    registry = make(max_active=2)
    registry.activate("s1", "git")
    clock.tick()
    registry.activate("s1", "docker")
    before = registry.get("s1").active
    clock.tick()
    assert registry.tool_result("s1", "git", "git_status", ok=False) == []
    assert registry.get("s1").active == before
    clock.tick()
    assert removed(registry.activate("s1", "github")) == [("git", "git", True)]


def test_the_clock_set_back_does_not_make_the_capability_just_used_the_oldest(make: Make, clock: Clock) -> None:
    registry = make(max_active=2)
    registry.activate("s1", "git")
    clock.tick()
    registry.activate("s1", "docker")
    clock.tick(-3600)  # the system clock is set back an hour
    registry.activate("s1", "git")  # used again: now the most recent
    plan = registry.activate("s1", "github")
    assert plan.removed == ("docker",) and registry.active_names("s1") == ("git", "github")


def test_ties_on_last_used_evict_the_earliest_activated(make: Make) -> None:
    registry = make(max_active=3)  # the clock never moves
    for name in ("github", "git", "docker"):
        registry.activate("s1", name)
    assert registry.activate("s1", "web").removed == ("github",)
    assert registry.activate("s1", "rust").removed == ("git",)


def test_reactivation_bumps_last_used(make: Make, clock: Clock) -> None:
    registry = make(max_active=2)
    registry.activate("s1", "git")
    clock.tick()
    registry.activate("s1", "docker")
    clock.tick()
    again = registry.activate("s1", "git")
    assert (again.start, again.teardown, again.changed) == ((), (), False)
    assert again.active == ("git", "docker")  # re-activation never reorders
    clock.tick()
    assert registry.activate("s1", "github").removed == ("docker",)


# -- tool results ------------------------------------------------------------------------------------------

def test_tool_result_bumps_every_capability_granting_the_tool(make: Make, clock: Clock) -> None:
    registry = make(max_active=4)
    for name in ("fs-read", "fs-write", "docker", "git"):
        registry.activate("s1", name)
    clock.tick()
    assert registry.tool_result("s1", "filesystem", "read_file", ok=True) == ["fs-read", "fs-write"]
    assert registry.tool_result("s1", "filesystem", "write_file", ok=True) == ["fs-write"]
    assert registry.tool_result("s1", "filesystem", "delete_file", ok=True) == []
    assert registry.tool_result("s1", "docker", "anything_at_all", ok=True) == ["docker"]  # [] means "*"
    assert registry.tool_result("s1", "git", "git_log", ok=True) == ["git"]  # "git:*"
    assert registry.tool_result("s1", "nowhere", "read_file", ok=True) == []
    used = {a.name: a.last_used for a in registry.get("s1").active}
    assert used == {"fs-read": clock.t, "fs-write": clock.t, "docker": clock.t, "git": clock.t}


def test_tool_result_on_unknown_session(make: Make) -> None:
    with pytest.raises(UnknownSession):
        make().tool_result("nobody", "git", "git_status", ok=True)


# -- pinned ------------------------------------------------------------------------------------------------

def test_pinned_are_active_from_the_start_and_never_evicted(make: Make, clock: Clock) -> None:
    registry = make(max_active=1, pinned=("docker", "ghost"))  # "ghost" is not in the catalog: ignored
    first = registry.activate("s1", "git")
    assert started(first) == [("docker", "docker", ("*",)), ("git", "git", ("*",))]
    assert first.active == ("docker", "git")
    assert {a.name: a.origin for a in registry.get("s1").active} == {"docker": "pinned", "git": "manual"}
    for name in ("github", "web", "rust"):
        clock.tick()
        plan = registry.activate("s1", name)
        assert len(plan.removed) == 1 and "docker" not in plan.removed
    assert registry.active_names("s1") == ("docker", "rust")
    with pytest.raises(PinnedCapability):
        registry.deactivate("s1", "docker")
    with pytest.raises(UnknownCapability):  # not "pinned": the name is ignored until a tap provides it
        registry.deactivate("s1", "ghost")
    assert registry.activate("s1", "docker").changed is False


def test_a_session_not_started_yet_lists_its_pinned_capabilities_active(make: Make) -> None:
    """Pinned capabilities are active from a session's start; a listing for a new id showed them inactive."""
    registry = make(pinned=("docker", "not-in-any-tap"))
    assert registry.active_names("new") == ("docker",)
    with pytest.raises(UnknownSession):
        registry.get("new")  # still no session until a plan starts it


def test_session_is_created_with_pinned_on_any_plan_call(make: Make) -> None:
    registry = make(pinned=("rust",))
    plan = registry.reconcile("fresh")
    assert plan.active == ("rust",) and plan.activated == ("rust",) and plan.start == ()
    assert registry.deactivate("other", "git").active == ("rust",)
    assert registry.sessions() == ("fresh", "other")


# -- teardown refcounts ------------------------------------------------------------------------------------

def test_kill_only_when_no_other_capability_references_the_server(make: Make, clock: Clock) -> None:
    registry = make()
    registry.activate("s1", "fs-read")
    plan = registry.activate("s1", "fs-write")
    # the server already runs for fs-read: the start item adds fs-write's tools to it
    assert started(plan) == [("fs-write", "filesystem", ("write_file", "read_file"))]
    plan = registry.deactivate("s1", "fs-read")
    assert [t.as_dict() for t in plan.teardown] == [
        {"capability": "fs-read", "server": "filesystem", "kill": False, "tools": ["read_file", "list_directory"]}]
    assert removed(registry.deactivate("s1", "fs-write")) == [("fs-write", "filesystem", True)]


def test_eviction_of_a_capability_sharing_the_new_ones_server(make: Make, clock: Clock) -> None:
    registry = make(max_active=1)
    registry.activate("s1", "fs-read")
    clock.tick()
    plan = registry.activate("s1", "fs-write")
    assert removed(plan) == [("fs-read", "filesystem", False)]
    assert started(plan) == [("fs-write", "filesystem", ("write_file", "read_file"))]


def _readme_agent() -> dict[str, Any]:
    """The README's reference agent (*For agent developers*): its ``running``, ``apply`` and ``exposed``."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## For agent developers.*?```python\n(.*?)```", readme, re.S)
    assert block is not None
    code = block.group(1).split("\ndef turn(")[0].replace("from capd.client import CapdClient\n", "")
    namespace: dict[str, Any] = {}
    exec(code, namespace)  # our own README's code, to check that it applies plans right
    return namespace


def test_the_readme_agent_keeps_a_tool_another_capability_still_grants(make: Make, clock: Clock) -> None:
    """fs-read grants read_file and list_directory, fs-write write_file and read_file, on one server.
    The README's agent subtracted each teardown's tools from the server's set, so disabling (or
    evicting) fs-read also hid read_file, which fs-write still grants."""
    for leave in ("disable", "evict"):
        agent, registry = _readme_agent(), make(max_active=2)
        agent["apply"](registry.activate("s1", "fs-read").as_dict())
        clock.tick()
        agent["apply"](registry.activate("s1", "fs-write").as_dict())
        clock.tick()
        assert agent["exposed"]("filesystem") == {"read_file", "list_directory", "write_file"}
        plan = registry.deactivate("s1", "fs-read") if leave == "disable" else registry.activate("s1", "git")
        assert [t.capability for t in plan.teardown] == ["fs-read"]
        agent["apply"](plan.as_dict())
        assert agent["exposed"]("filesystem") == {"write_file", "read_file"}, leave
        agent["apply"](registry.deactivate("s1", "fs-write").as_dict())
        assert "filesystem" not in agent["running"]  # the last grant gone: the server was killed


def test_multi_server_capability(make: Make) -> None:
    registry = make()
    plan = registry.activate("s1", "web")
    assert started(plan) == [("web", "fetch", ("*",)), ("web", "search", ("web_search",))]
    assert removed(registry.deactivate("s1", "web")) == [("web", "fetch", True), ("web", "search", True)]


def test_drop_kills_each_server_once(make: Make) -> None:
    registry = make()
    for name in ("fs-read", "git", "fs-write"):
        registry.activate("s1", name)
    plan = registry.drop("s1")
    assert removed(plan) == [("fs-read", "filesystem", False), ("git", "git", True),
                             ("fs-write", "filesystem", True)]
    assert plan.active == ()
    with pytest.raises(UnknownSession):
        registry.get("s1")
    with pytest.raises(UnknownSession):
        registry.drop("s1")


def test_toolchain_and_routing_only_are_tracked_without_servers(make: Make, clock: Clock) -> None:
    registry = make(max_active=2)
    plan = registry.activate("s1", "rust")
    assert (plan.start, plan.active, plan.activated) == ((), ("rust",), ("rust",))
    clock.tick()
    assert registry.activate("s1", "notes").active == ("rust", "notes")
    assert [a.servers for a in registry.get("s1").active] == [(), ()]
    clock.tick()
    plan = registry.activate("s1", "git")  # they count toward max_active like any other
    assert (plan.removed, plan.teardown, plan.active) == (("rust",), (), ("notes", "git"))


# -- enable / disable --------------------------------------------------------------------------------------

def test_enable_and_disable_are_idempotent(make: Make) -> None:
    registry = make()
    first = registry.activate("s1", "git")
    second = registry.activate("s1", "git")
    assert first.changed and not second.changed
    assert second.as_dict() == {"start": [], "teardown": [], "active": ["git"]}
    assert registry.deactivate("s1", "git").removed == ("git",)
    assert registry.deactivate("s1", "git").as_dict() == {"start": [], "teardown": [], "active": []}
    assert registry.deactivate("s1", "docker").as_dict() == {"start": [], "teardown": [], "active": []}


def test_unknown_capability(make: Make) -> None:
    registry = make()
    with pytest.raises(UnknownCapability):
        registry.activate("s1", "nope")
    assert registry.sessions() == ()  # nothing created by a failed call
    with pytest.raises(UnknownCapability):
        registry.deactivate("s1", "nope")


def test_origin_is_upgraded_to_manual_never_downgraded(make: Make) -> None:
    registry = make()
    registry.activate("s1", "git", "auto")
    registry.activate("s1", "docker", "manual")
    registry.activate("s1", "git", "manual")
    registry.activate("s1", "docker", "auto")
    assert {a.name: a.origin for a in registry.get("s1").active} == {"git": "manual", "docker": "manual"}
    with pytest.raises(ValueError, match="origin"):
        registry.activate("s1", "github", "pinned")  # type: ignore[arg-type]


def test_active_order_is_activation_order(make: Make, clock: Clock) -> None:
    registry = make(max_active=3)
    for name in ("web", "docker", "git"):
        clock.tick()
        registry.activate("s1", name)
    clock.tick()
    registry.tool_result("s1", "fetch", "fetch", ok=True)
    registry.activate("s1", "docker")
    assert registry.active_names("s1") == ("web", "docker", "git")
    clock.tick()
    assert registry.activate("s1", "rust").active == ("web", "docker", "rust")  # git was LRU
    registry.deactivate("s1", "web")
    assert registry.activate("s1", "web").active == ("docker", "rust", "web")  # re-added: goes last
    state = registry.get("s1").as_dict()
    assert [a["name"] for a in state["active"]] == ["docker", "rust", "web"]
    assert set(state["active"][0]) == {"name", "last_used", "origin", "servers"}
    assert state["active"][2]["servers"] == [{"name": "fetch", "tools": ["*"]},
                                            {"name": "search", "tools": ["web_search"]}]


# -- catalog changes ---------------------------------------------------------------------------------------

def test_deleted_capability_is_torn_down_in_the_next_plan(make: Make, catalogs: Catalogs, tap: Path) -> None:
    registry = make()
    for name in ("git", "fs-read", "fs-write"):
        registry.activate("s1", name)
    shutil.rmtree(tap / "capabilities" / "git")
    shutil.rmtree(tap / "capabilities" / "fs-write")
    catalogs.reload()
    assert registry.active_names("s1") == ("git", "fs-read", "fs-write")  # reads do not change state
    plan = registry.activate("s1", "docker")
    assert removed(plan) == [("git", "git", True), ("fs-write", "filesystem", False)]
    assert started(plan) == [("docker", "docker", ("*",))]
    assert plan.active == ("fs-read", "docker")
    assert registry.reconcile("s1").changed is False


def test_deleted_capability_can_still_be_disabled(make: Make, catalogs: Catalogs, tap: Path) -> None:
    registry = make()
    registry.activate("s1", "git")
    shutil.rmtree(tap / "capabilities" / "git")
    catalogs.reload()
    assert removed(registry.deactivate("s1", "git")) == [("git", "git", True)]
    with pytest.raises(UnknownCapability):
        registry.deactivate("s1", "git")


def test_snapshot_survives_edits_to_the_tap(make: Make, catalogs: Catalogs, tap: Path) -> None:
    registry = make()
    registry.activate("s1", "fs-read")
    (tap / "capabilities" / "fs-read" / "default.toml").write_text(
        provider(["filesystem"], ["filesystem:write_file"], FILESYSTEM.replace('"npx"', '"other"')))
    catalogs.reload()
    assert registry.tool_result("s1", "filesystem", "read_file", ok=True) == ["fs-read"]
    plan = registry.deactivate("s1", "fs-read")
    assert plan.teardown[0].tools == ("read_file", "list_directory")
    assert started(registry.activate("s1", "fs-read")) == [("fs-read", "filesystem", ("write_file",))]


def _edit_server(tap: Path, name: str, old: str, new: str) -> None:
    path = tap / "capabilities" / name / "default.toml"
    path.write_text(path.read_text().replace(old, new))


def test_an_edited_server_is_restarted_by_the_next_plan(tmp_path: Path, make: Make, catalogs: Catalogs,
                                                        tap: Path) -> None:
    """A changed spec (a version bump in ``args``) never reached a session that had the capability
    active: its plans said nothing until it was disabled and enabled again."""
    registry = make()
    registry.activate("s1", "git")
    registry.activate("s1", "docker")
    _edit_server(tap, "git", '"mcp-server-git"', '"mcp-server-git==2.0"')
    catalogs.reload()
    assert registry.tool_result("s1", "git", "log", ok=True) == ["git"]  # reads and tool results change nothing
    plan = registry.reconcile("s1")
    assert removed(plan) == [("git", "git", True)] and started(plan) == [("git", "git", ("*",))]
    assert plan.start[0].server["args"] == ["mcp-server-git==2.0"] and plan.active == ("git", "docker")
    assert registry.reconcile("s1") == Plan(active=("git", "docker"))  # once
    again = make()  # a restart: the stored snapshots compare equal to the tap's (no restart for nothing)
    assert again.reconcile("s1") == Plan(active=("git", "docker"))
    assert removed(again.deactivate("s1", "git")) == [("git", "git", True)]


def test_a_changed_tool_grant_strips_and_adds_without_a_kill(make: Make, catalogs: Catalogs, tap: Path) -> None:
    registry = make()
    registry.activate("s1", "github")
    _edit_server(tap, "github", '"github:list_issues"', '"github:list_pulls"')
    catalogs.reload()
    plan = registry.activate("s1", "git")
    assert removed(plan) == [("github", "github", False)] and plan.teardown[0].tools == ("create_issue", "list_issues")
    assert started(plan) == [("git", "git", ("*",)), ("github", "github", ("create_issue", "list_pulls"))]


class _Agent:
    """An agent applying plans to its servers, as the README's ``apply`` does: one process per server
    name (the spec it was started with) and the tools each capability has on it."""

    def __init__(self) -> None:
        self.running: dict[str, tuple[dict[str, Any], dict[str, tuple[str, ...]]]] = {}
        self.kills = 0

    def apply(self, plan: Plan) -> None:
        for item in plan.teardown:
            tools = self.running[item.server][1]
            tools.pop(item.capability, None)
            if item.kill:
                assert not tools, f"killed {item.server} while {sorted(tools)} still use it"
                del self.running[item.server]
                self.kills += 1
        for start in plan.start:
            name = str(start.server["name"])
            self.running.setdefault(name, (start.server, {}))[1][start.capability] = start.tools

    def matches(self, registry: SessionRegistry, session: str) -> None:
        """Every active capability's tools are on the server it names, and nothing else is."""
        want: dict[str, dict[str, tuple[str, ...]]] = {}
        for entry in registry.get(session).active:
            for server in entry.servers:
                want.setdefault(server.name, {})[entry.name] = tuple(server.tools)
        assert {name: tools for name, (_, tools) in self.running.items()} == want


def test_an_edited_server_is_restarted_for_every_capability_on_it(make: Make, catalogs: Catalogs, tap: Path) -> None:
    """Two capabilities on one server, their files edited one at a time (as live reload sees an
    editor save them): the first plan restarted the server for the edited capability alone and left
    the other on the old process, whose kill by the second plan took the first's tools with it.
    Both at once, the server was killed twice."""
    registry = make()
    agent = _Agent()
    agent.apply(registry.activate("s1", "fs-read"))
    agent.apply(registry.activate("s1", "fs-write"))
    agent.matches(registry, "s1")
    for edited in (["fs-write"], ["fs-read"], ["fs-read", "fs-write"]):
        version = "2025.2.0" if len(edited) == 1 else "2025.3.0"
        for name in edited:
            _edit_server(tap, name, "2025.1.1" if version == "2025.2.0" else "2025.2.0", version)
        catalogs.reload()
        kills = agent.kills
        plan = registry.reconcile("s1")
        agent.apply(plan)
        agent.matches(registry, "s1")
        assert agent.kills == kills + 1, edited  # restarted once, for both
        assert plan.start[0].capability == edited[0]  # an edited one first: its spec is started
        assert version in agent.running["filesystem"][0]["args"][1]
        assert registry.reconcile("s1") == Plan(active=("fs-read", "fs-write"))  # once
    agent.apply(registry.deactivate("s1", "fs-read"))
    agent.apply(registry.deactivate("s1", "fs-write"))
    assert agent.running == {}


def test_an_edited_capability_evicted_by_the_same_plan_is_torn_down_as_it_ran(make: Make, catalogs: Catalogs,
                                                                            tap: Path) -> None:
    registry = make(max_active=1)
    registry.activate("s1", "git")
    _edit_server(tap, "git", '"mcp-server-git"', '"mcp-server-git==2.0"')
    catalogs.reload()
    plan = registry.activate("s1", "docker")
    assert removed(plan) == [("git", "git", True)] and started(plan) == [("docker", "docker", ("*",))]


def test_pinned_added_to_the_catalog_later_is_started(make: Make, catalogs: Catalogs, tap: Path) -> None:
    shutil.rmtree(tap / "capabilities" / "docker")
    catalogs.reload()
    registry = make(pinned=("docker",))
    assert registry.activate("s1", "git").active == ("git",)
    write_tap(tap, {"docker": PROVIDERS["docker"]})
    catalogs.reload()
    plan = registry.reconcile("s1")
    assert started(plan) == [("docker", "docker", ("*",))] and plan.active == ("git", "docker")


def test_changed_settings_apply_at_the_next_plan(make: Make, clock: Clock) -> None:
    before = make(max_active=3)
    for name in ("git", "docker", "github"):
        clock.tick()
        before.activate("s1", name)
    before.store.close()
    after = make(max_active=1, pinned=("docker",))
    plan = after.reconcile("s1")  # docker becomes pinned; git and github exceed max_active=1
    assert plan.removed == ("git",) and plan.active == ("docker", "github")
    assert {a.name: a.origin for a in after.get("s1").active} == {"docker": "pinned", "github": "manual"}
    later = make(max_active=1)
    later.reconcile("s1")  # unpinned again: docker is manual, the LRU is trimmed
    assert {a.name: a.origin for a in later.get("s1").active} == {"github": "manual"}


# -- session lifecycle -------------------------------------------------------------------------------------

def test_idle_sessions_expire_after_ttl(make: Make, clock: Clock) -> None:
    registry = make(ttl=100)
    registry.activate("old", "git")
    clock.tick(50)
    registry.activate("young", "git")
    registry.get("old")  # reads do not keep a session alive
    clock.tick(51)
    assert registry.expire() == ["old"]
    assert registry.sessions() == ("young",)
    clock.tick(40)
    registry.tool_result("young", "git", "git_status", ok=False)  # a failed call still shows the agent is there
    clock.tick(99)
    assert registry.expire() == []
    clock.tick(2)
    assert registry.expire() == ["young"]
    assert registry.sessions() == ()


def test_an_infinite_ttl_keeps_sessions_until_they_are_ended(make: Make, clock: Clock) -> None:
    """``CAPD_SESSION_TTL=inf`` is a supported setting (README): nothing expires, ``end`` still ends."""
    registry = make(ttl=float("inf"))
    registry.activate("s1", "git")
    registry.activate("s2", "git")
    clock.tick(10 * 365 * 86400)
    assert registry.expire() == []
    assert registry.active_names("s1") == ("git",)
    registry.drop("s2")
    assert registry.sessions() == ("s1",)


def test_a_session_idle_past_ttl_is_gone_when_next_used(make: Make, clock: Clock) -> None:
    """Not only at the sweep (every 60 s in the daemon, and not yet after a restart): a late call
    neither sees nor revives an expired session, and a plan says what to tear down."""
    registry = make(ttl=100)
    registry.activate("s1", "git")
    registry.activate("s2", "git")
    clock.tick(101)
    assert registry.active_names("s1") == ()
    with pytest.raises(UnknownSession):
        registry.get("s1")
    with pytest.raises(UnknownSession):
        registry.tool_result("s2", "git", "git_status", ok=True)
    plan = registry.activate("s1", "docker")  # afresh, told to tear down what it had
    assert plan.active == ("docker",) and [t.capability for t in plan.teardown] == ["git"]
    assert registry.sessions() == ("s1",)
    clock.tick(101)
    assert [t.capability for t in registry.drop("s1").teardown] == ["docker"]


def test_a_session_ended_by_the_sweep_still_tears_down_when_its_id_comes_back(make: Make, clock: Clock) -> None:
    """The sweep used to delete an idle session, so an agent coming back to the id (still running
    git's server) was told nothing to tear down, unlike just before the sweep. Its record is kept
    for ENDED_KEPT past the ttl; only after that does the id start with nothing to tear down."""
    registry = make(ttl=100, pinned=("docker",))
    ended: list[str] = []
    registry.on_end = ended.append
    for session in ("back", "late", "gone"):
        registry.activate(session, "git")
    clock.tick(101)
    assert registry.expire() == ["back", "gone", "late"] and ended == ["back", "gone", "late"]
    assert registry.expire() == [] and len(ended) == 3  # each ends once
    assert registry.sessions() == () and registry.active_names("back") == ("docker",)  # as a new session
    with pytest.raises(UnknownSession):
        registry.get("back")
    plan = registry.activate("back", "github")
    assert [t.capability for t in plan.teardown] == ["git"] and plan.activated == ("github",)
    assert len(ended) == 3, "the sweep already ended it"
    assert {t.capability for t in registry.drop("gone").teardown} == {"docker", "git"}
    clock.tick(ENDED_KEPT - 2)
    assert registry.expire() == ["back"]  # back's second conversation ended
    assert registry.store.ids() == ("back", "late")  # late's record is still within ENDED_KEPT
    clock.tick(3)
    assert registry.expire() == [] and registry.store.ids() == ("back",)
    fresh = registry.activate("late", "github")
    assert fresh.teardown == () and set(fresh.activated) == {"docker", "github"}


def test_sessions_that_ended_before_a_restart_are_not_ended_again(make: Make, clock: Clock) -> None:
    """The sweep after a restart does not announce (or log) the kept records of sessions that had
    ended already; they still tear down what they had when their id comes back."""
    first = make(ttl=100)
    first.activate("s1", "git")
    clock.tick(101)
    assert first.expire() == ["s1"]
    first.activate("s2", "git")
    clock.tick(101)
    restarted = make(ttl=100)
    ended: list[str] = []
    restarted.on_end = ended.append
    assert restarted.expire() == [] and ended == []
    assert [t.capability for t in restarted.activate("s1", "docker").teardown] == ["git"]
    assert [t.capability for t in restarted.activate("s2", "docker").teardown] == ["git"]


def test_a_session_says_when_it_ends(make: Make, clock: Clock) -> None:
    """``on_end`` (what forgets a session's turns for learning): dropped, swept after ttl, or found
    idle past ttl when next used; not while it lives."""
    registry = make(ttl=100)
    ended: list[str] = []
    registry.on_end = ended.append
    for session in ("dropped", "swept", "resumed"):
        registry.activate(session, "git")
    registry.drop("dropped")
    assert ended == ["dropped"]
    clock.tick(50)
    registry.activate("resumed", "docker")
    assert ended == ["dropped"]
    clock.tick(60)
    assert registry.expire() == ["swept"] and ended == ["dropped", "swept"]
    clock.tick(101)
    registry.activate("resumed", "git")  # before the sweep: a new conversation under the same id
    assert ended == ["dropped", "swept", "resumed"]
    registry.activate("resumed", "docker")
    assert ended == ["dropped", "swept", "resumed"]


def test_unknown_sessions(make: Make) -> None:
    registry = make()
    assert registry.active_names("nobody") == ()
    with pytest.raises(UnknownSession):
        registry.get("nobody")
    with pytest.raises(UnknownSession):
        registry.drop("nobody")
    assert registry.sessions() == ()


@pytest.mark.parametrize("bad", ["", "x" * 129, "has space", "a/b", "é", "line\n", "tab\t", "semi;colon"])
def test_invalid_session_ids(make: Make, bad: str) -> None:
    registry = make()
    calls: list[Callable[[], object]] = [
        lambda: registry.activate(bad, "git"), lambda: registry.deactivate(bad, "git"),
        lambda: registry.reconcile(bad), lambda: registry.tool_result(bad, "git", "x", ok=True),
        lambda: registry.get(bad), lambda: registry.drop(bad), lambda: registry.active_names(bad),
    ]
    for call in calls:
        with pytest.raises(InvalidSessionId):
            call()
    with pytest.raises(ValueError):  # InvalidSessionId is also a ValueError
        registry.get(bad)
    assert registry.sessions() == ()


def test_valid_session_ids(make: Make) -> None:
    registry = make()
    for good in ("x" * 128, "A-z_0.9:x", "agent:1234.turn-5"):
        assert registry.activate(good, "git").active == ("git",)


def test_one_session_is_serialised_others_proceed(make: Make) -> None:
    registry = make()
    done: dict[str, threading.Event] = {"a": threading.Event(), "b": threading.Event()}

    def work(session: str) -> None:
        registry.activate(session, "git")
        done[session].set()

    with registry.locked("a"):
        threads = [threading.Thread(target=work, args=(s,)) for s in ("a", "b")]
        for thread in threads:
            thread.start()
        assert done["b"].wait(5), "another session must not wait for a's lock"
        assert not done["a"].wait(0.2), "a's operation must wait for the lock holder"
        assert registry.active_names("a") == ()
    assert done["a"].wait(5)
    for thread in threads:
        thread.join(5)
    assert registry.active_names("a") == ("git",)


def test_stored_ids_an_older_capd_accepted_are_dropped(tmp_path: Path, catalogs: Catalogs) -> None:
    """"." and ".." were valid ids once. Left in the file, every walk over the store raised
    InvalidSessionId: no idle session was ever swept, and `/metrics` answered 400 on every call."""
    from capd.state import ActiveCapability, SessionRecord

    with SessionStore(tmp_path / FILENAME) as store:
        for session in (".", "..", "agent-1"):
            store.put(SessionRecord(session, 1000.0, 1, (ActiveCapability("git", "auto", 0, 1000.0),)))
    store = SessionStore(tmp_path / FILENAME)
    registry = SessionRegistry(store, catalogs, clock=Clock(1000.0 + 10 * 86400))  # idle for ten days
    try:
        assert registry.store.ids() == ("agent-1",)
        assert registry.sessions() == () and registry.expire() == []  # it ended before this start
    finally:
        store.close()
    with SessionStore(tmp_path / FILENAME) as reopened:  # dropped from the file, not only from memory
        assert reopened.ids() == ("agent-1",)  # ended, its record kept for ENDED_KEPT
