"""The CLI and the Python client against the real app, served over HTTP in a thread (hash model).

Each command runs through click's CliRunner, as a user would type it; a daemon, where one is
needed, is ``create_app`` under uvicorn on a free loopback port.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import click
import httpx
import numpy as np
import pytest
import uvicorn
from click.testing import CliRunner, Result

from capd.api import LEARNED_CHECK_INTERVAL, create_app
from capd.cli import main
from capd.client import ApiError, CapdClient
from capd.encoder import Encoder, HashEncoder
from capd.errors import (
    ClientError,
    DaemonUnreachable,
    InvalidSessionId,
    PinnedCapability,
    UnknownCapability,
    UnknownSession,
)
from capd.learned import LearnedStore
from capd.service import Service
from capd.settings import Settings
from capd.vectorcache import VectorCache, text_hash
from capd.vetoes import abstain_corpus
from tests.conftest import GatedEncoder
from tests.taputil import octomind_tap, write_capability

Serve = Callable[..., int]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    """``serve(encoder=None, wait=True, **settings)``: the app on a free port; returns the port."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(encoder: Encoder | None = None, wait: bool = True, **overrides: object) -> int:
        port = _free_port()
        values: dict[str, object] = {"taps": (octomind_tap(tmp_path / f"t{len(servers)}"),), "model": "hash",
                                     "data_dir": tmp_path / f"d{len(servers)}", "port": port}
        settings = Settings(**{**values, **overrides})  # type: ignore[arg-type]
        app = create_app(settings, encoder=encoder, watch=False, warm_in_background=not wait)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return port

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(30)


def _capd(*args: str, port: int | None = None) -> Result:
    env = {"CAPD_PORT": str(port if port is not None else _free_port()), "CAPD_CONFIG": ""}
    return CliRunner().invoke(main, list(args), env=env)


def _clean_usage_error(result: Result) -> None:
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # not an exception escaping as a traceback
    assert "Traceback" not in result.output


# -- item 1: text that is not Unicode ----------------------------------------------------------------------

def test_undecodable_bytes_in_arguments_are_a_usage_error(serve: Serve, tmp_path: Path) -> None:
    # Bytes the terminal's encoding cannot decode reach Python as lone surrogates (PEP 383).
    message = "\udcff\udcfe show me the commits"
    port = serve()
    tap = str(octomind_tap(tmp_path / "in-process"))
    for args in (["route", message], ["route", message, "--tap", tap, "--model", "hash", "--data-dir",
                                      str(tmp_path / "d")], ["discover", message], ["enable", "\udcff", "git"],
                 ["enable", "s1", "\udcff"], ["route", "show me the commits", "--session", "\udcff"]):
        result = _capd(*args, port=port)
        _clean_usage_error(result)
        assert "not text in the terminal's encoding" in result.output


# -- item 3: capd status on a daemon that failed to start ----------------------------------------------------

def test_status_exits_3_with_the_startup_error_and_0_while_loading(serve: Serve, tmp_path: Path) -> None:
    """DESIGN: exit 3 for a daemon unreachable or failed to start (it exited 1)."""
    failed = serve(model=str(tmp_path / "no-such-model"))
    result = _capd("status", port=failed)
    assert result.exit_code == 3, result.output
    assert result.stdout.startswith("error  ready=False")
    assert "capd: the daemon failed to start: model directory" in result.stderr
    assert _capd("status", "--json", port=failed).exit_code == 3
    for args in (["route", "show me the commits"], ["discover", "git"], ["list"], ["enable", "s1", "git"]):
        result = _capd(*args, port=failed)  # exited 1 with "503 warming_up", as if a retry could help
        assert result.exit_code == 3, (args, result.output)
        assert result.stderr.startswith("capd: the daemon failed to start: model directory"), result.stderr
    assert _capd("status", port=serve()).exit_code == 0
    gate = threading.Event()
    try:
        loading = _capd("status", port=serve(encoder=GatedEncoder(gate), wait=False))
        assert loading.exit_code == 0 and loading.stdout.startswith("starting  ready=False"), loading.output
    finally:
        gate.set()


# -- item 4: flags that do not apply in a mode ---------------------------------------------------------------

@pytest.mark.parametrize(("args", "flag"), [
    (["route", "show me the commits", "--rule", "fused"], "--rule applies with --tap"),
    (["route", "show me the commits", "--model", "hash"], "--model applies with --tap"),
    (["route", "show me the commits", "--backend", "onnx"], "--backend applies with --tap"),
    (["route", "show me the commits", "--data-dir", "DATA"], "--data-dir applies with --tap"),
    (["discover", "show me the commits", "--model", "hash"], "--model applies with --tap"),
    (["discover", "show me the commits", "--rule", "fused"], "--rule applies with --tap"),
    (["route", "show me the commits", "--tap", "TAP", "--model", "hash", "--data-dir", "DATA", "--session", "s1"],
     "--session applies to a running daemon"),
    (["list", "--tap", "TAP", "--session", "s1"], "--session applies to a running daemon"),
    (["discover", "show me the commits", "--tap", "TAP", "--model", "hash", "--data-dir", "DATA", "--port", "1"],
     "--port applies to a running daemon"),
])
def test_flags_that_do_not_apply_are_usage_errors(tmp_path: Path, args: list[str], flag: str) -> None:
    where = {"TAP": str(octomind_tap(tmp_path)), "DATA": str(tmp_path / "data")}
    result = _capd(*[where.get(a, a) for a in args])
    _clean_usage_error(result)
    assert f"capd: {flag}" in result.stderr


def test_route_discover_and_forget_reach_the_daemon_given_by_flags(serve: Serve, tmp_path: Path) -> None:
    port = str(serve())
    routed = _capd("route", "please run a query on the postgres database", "--port", port, "--json")
    assert routed.exit_code == 0, routed.output
    assert json.loads(routed.stdout)["decision"] in ("activate", "abstain")
    found = _capd("discover", "look at the postgres schema", "--port", port, "--json")
    assert found.exit_code == 0, found.output
    assert json.loads(found.stdout)["candidates"][0]["name"] == "database-postgres"
    data = tmp_path / "learned"
    store = LearnedStore.open(data)
    store.record(str(tmp_path / "tap"), "smalltalk", "how warm is it outside", "abstain", "s")
    store.close()
    forgot = _capd("learned", "forget", "smalltalk", "--data-dir", str(data), "--port", port, "--json")
    assert forgot.exit_code == 0, forgot.output
    assert json.loads(forgot.stdout) == {"forgotten": 1, "daemon_reloaded": True}


def test_route_prints_the_decision_its_reason_the_candidates_and_the_sessions_plan(serve: Serve) -> None:
    """What a person at a terminal reads (``capd route`` without --json), line by line, against
    the JSON of the same route in a session in the same state."""
    port = str(serve(threshold=0.0, margin=0.0, max_active=1))
    message = "please run a query on the postgres database"
    winner = json.loads(_capd("route", message, "--port", port, "--json").stdout)["capability"]
    evicted = "filesystem-write" if winner == "filesystem-read" else "filesystem-read"  # it has a server to stop
    for session in ("a", "b"):
        assert _capd("enable", session, evicted, "--port", port).exit_code == 0
    data = json.loads(_capd("route", message, "--port", port, "--session", "a", "--json").stdout)
    result = _capd("route", message, "--port", port, "--session", "b")
    assert result.exit_code == 0, result.output
    plan = data["plan"]
    assert data["decision"] == "activate" and plan["teardown"], data
    assert result.stdout.splitlines() == [
        f"activate: {winner}  score {data['score']:.3f}  margin {data['margin']:.3f}",
        f"  {data['reason']}",
        *[f"    {c['score']:.3f}  {c['name']}" for c in data["candidates"]],
        *[f"  start {s['server']['name']} for {s['capability']} ({', '.join(s['tools'])})" for s in plan["start"]],
        *[f"  {'kill' if t['kill'] else 'strip'} {t['server']} for {t['capability']}" for t in plan["teardown"]],
        f"  active: {winner}"]
    assert f"kill filesystem for {evicted}" in result.stdout


def test_list_enable_and_disable_print_the_catalog_and_the_plans(serve: Serve, tmp_path: Path) -> None:
    port = str(serve(max_active=1))
    enabled = _capd("enable", "a", "filesystem-read", "--port", port)
    assert enabled.exit_code == 0, enabled.output
    assert enabled.stdout.splitlines() == ["start filesystem for filesystem-read (read_file, list_directory)",
                                           "active: filesystem-read"]
    swapped = _capd("enable", "a", "filesystem-write", "--port", port)  # max_active 1: read is evicted
    assert swapped.stdout.splitlines() == [  # the server is shared: read's tools are stripped, it keeps running
        "start filesystem for filesystem-write (write_file, edit_file)",
        "strip filesystem for filesystem-read", "active: filesystem-write"]
    listed = _capd("list", "--session", "a", "--port", port)
    rows = {line[2:].split()[0]: line for line in listed.stdout.splitlines()}
    assert set(rows) == {"database-postgres", "filesystem-read", "filesystem-write", "python-toolchain", "smalltalk"}
    assert rows["filesystem-write"].startswith("* filesystem-write ") and rows["smalltalk"].startswith("  smalltalk ")
    disabled = _capd("disable", "a", "filesystem-write", "--port", port)
    assert disabled.stdout == "kill filesystem for filesystem-write\nactive: -\n"
    in_process = _capd("list", "--tap", str(octomind_tap(tmp_path / "other")))
    assert in_process.exit_code == 0 and in_process.stdout.splitlines() == [
        line.replace("*", " ") for line in listed.stdout.splitlines()]


def test_a_forget_reaches_every_daemon_on_the_data_directory_within_seconds(serve: Serve, tmp_path: Path) -> None:
    """`capd learned forget` reloads the daemon at the address it is given. Another daemon sharing the
    data directory (another port) used to route with the forgotten correction until it restarted."""
    tap, data, message = octomind_tap(tmp_path / "tap"), tmp_path / "shared", "something the tap cannot place at all"
    with closing(LearnedStore.open(data)) as store:
        store.record(str(tap), "filesystem-read", message, "abstain", "s")
    told, other = (serve(taps=(tap,), data_dir=data, rule="capd") for _ in range(2))

    def decision(port: int) -> str:
        routed: str = httpx.post(f"http://127.0.0.1:{port}/v1/route", json={"message": message}).json()["decision"]
        return routed

    assert decision(told) == decision(other) == "activate"
    forgot = _capd("learned", "forget", "filesystem-read", "--data-dir", str(data), "--port", str(told), "--json")
    started = time.monotonic()
    assert json.loads(forgot.stdout) == {"forgotten": 1, "daemon_reloaded": True}, forgot.output
    assert decision(told) == "abstain"  # at once
    while decision(other) != "abstain":  # by its own check of the file, at most LEARNED_CHECK_INTERVAL later
        assert time.monotonic() - started < LEARNED_CHECK_INTERVAL + 1.0, "the other daemon still routes with it"
        time.sleep(0.05)


@pytest.mark.parametrize("limit", ["0", "-3", "1000"])
def test_discover_limit_is_1_to_100_in_process_too(tmp_path: Path, limit: str) -> None:
    result = _capd("discover", "look at the postgres schema", "--tap", str(octomind_tap(tmp_path)),
                   "--model", "hash", "--data-dir", str(tmp_path / "d"), "--limit", limit)
    _clean_usage_error(result)


# -- item 6: NAME and --all ----------------------------------------------------------------------------------

def test_forget_takes_a_name_or_all_not_both(tmp_path: Path) -> None:
    store = LearnedStore.open(tmp_path)
    store.record("/taps/core", "docker", "the thing with the boxes is slow", "abstain", "s")
    store.record("/taps/core", "git", "undo my last save point", "abstain", "s")
    store.close()
    result = _capd("learned", "forget", "docker", "--all", "--data-dir", str(tmp_path))
    _clean_usage_error(result)
    assert "not both" in result.stderr
    assert len(LearnedStore.open(tmp_path).entries()) == 2


# -- item 7: messages said once, no "line None", whitespace-only intents ------------------------------------

def test_unknown_names_are_said_once_by_the_client_and_the_cli(serve: Serve) -> None:
    port = serve()
    with CapdClient(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(UnknownSession) as session:
            client.session("my-agent-1")
        assert str(session.value) == "unknown session 'my-agent-1'" and session.value.session == "my-agent-1"
        with pytest.raises(UnknownCapability) as capability:
            client.enable("s1", "nosuchcap")
        assert str(capability.value) == "unknown capability 'nosuchcap'" and capability.value.name == "nosuchcap"
        with pytest.raises(UnknownSession):
            client.resume_plan("my-agent-1")
        started = client.enable("s2", "database-postgres")
        assert client.resume_plan("s2") == {**started, "teardown": []} and started["start"]
    result = _capd("enable", "s1", "nosuchcap", port=port)
    assert result.exit_code == 1 and result.stderr == "capd: unknown capability 'nosuchcap'\n"


def test_the_client_refuses_a_bad_session_id_before_sending_it(serve: Serve) -> None:
    """Sent as it is, ``victim/../other`` reached session ``other`` (HTTP clients collapse ``..``):
    enabled there, or dropped it."""
    port = serve()
    with CapdClient(f"http://127.0.0.1:{port}") as client:
        client.enable("other", "smalltalk")
        for call in (lambda: client.drop("victim/../other"),
                     lambda: client.enable("victim/../other", "filesystem-read"),
                     lambda: client.session("x/../../health"),
                     lambda: client.tool_result("a?b", "fs", "read", True)):
            with pytest.raises(InvalidSessionId):
                call()
        assert [a["name"] for a in client.session("other")["active"]] == ["smalltalk"]
    result = _capd("disable", "victim/../other", "smalltalk", port=port)
    assert result.exit_code == 1 and "invalid session id 'victim/../other'" in result.stderr


def test_the_client_raises_what_the_session_calls_raise(serve: Serve) -> None:
    """A pinned capability's disable raised a bare ApiError(409) where PinnedCapability is the
    error's type, and a bad session id given to route() went to the daemon (its 422 as an ApiError)
    where every session call raises InvalidSessionId before sending."""
    port = serve(pinned=("smalltalk",))
    with CapdClient(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(PinnedCapability) as pinned:
            client.disable("s1", "smalltalk")
        assert pinned.value.name == "smalltalk"
        with pytest.raises(InvalidSessionId):
            client.route("victim/../other", "read a file from disk")


def test_the_client_tells_another_server_from_capd_on_every_call(foreign_port: int) -> None:
    """reload(), capability_tool() and capability_call() took any JSON object as capd's answer."""
    with CapdClient(f"http://127.0.0.1:{foreign_port}") as client:
        for call in (client.reload, client.capability_tool, lambda: client.capability_call("s1", "list")):
            with pytest.raises(DaemonUnreachable, match="does not look like a capd daemon"):
                call()


def test_a_trailing_slash_is_a_404_with_a_reason_not_a_redirect(serve: Serve) -> None:
    response = httpx.get(f"http://127.0.0.1:{serve()}/v1/sessions/s1/", follow_redirects=False)
    assert response.status_code == 404 and response.json()["error"] == "not_found", response.text


def test_a_tap_path_that_is_not_a_tap_is_an_error_in_process(tmp_path: Path) -> None:
    """It routed against nothing and exited 0: a mistyped path looked like a real abstain."""
    for args in (["route", "list my running containers"], ["discover", "containers"]):
        result = _capd(*args, "--tap", str(tmp_path / "nope"), "--model", "hash", "--data-dir", str(tmp_path / "d"))
        assert result.exit_code == 1 and result.stderr == f"capd: {tmp_path / 'nope'}: not a tap (no such directory)\n"


def test_the_client_says_a_lone_surrogate_is_not_text(serve: Serve) -> None:
    with CapdClient(f"http://127.0.0.1:{serve()}") as client, pytest.raises(ClientError, match="lone surrogate"):
        client.route("s1", "deploy \ud800 now")


def test_status_omits_line_none(serve: Serve, tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path / "broken")
    (tap / "capabilities" / "smalltalk" / "config.toml").write_bytes(b"triggers = []\x00\n")
    result = _capd("status", port=serve(taps=(tap,)))
    assert result.exit_code == 0, result.output
    assert "smalltalk/config.toml: binary file" in result.stderr and "line None" not in result.stderr
    assert "  rule=capd  " in result.stdout  # the default: no tap names one


def test_whitespace_only_intent_finds_nothing_in_process(tmp_path: Path) -> None:
    result = _capd("discover", "   ", "--tap", str(octomind_tap(tmp_path)), "--model", "hash",
                   "--data-dir", str(tmp_path / "d"), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"candidates": []}


def test_discover_says_why_it_found_nothing(tmp_path: Path) -> None:
    """At a terminal an empty list used to print nothing at all."""
    empty_tap = tmp_path / "empty"
    (empty_tap / "capabilities").mkdir(parents=True)
    tap = str(octomind_tap(tmp_path))
    cases = [(tap, "<system>only a tag</system>  ", "the intent is empty once tags are removed"),
             (tap, "   ", "the intent is empty once tags are removed"),
             (str(empty_tap), "query a postgres table", "no capability is loaded")]
    for tap, intent, reason in cases:
        result = _capd("discover", intent, "--tap", tap, "--model", "hash", "--data-dir", str(tmp_path / "d"))
        assert result.exit_code == 0, result.output
        assert result.stdout == "" and result.stderr == f"no candidates: {reason}\n"


def test_discover_in_process_ranks_with_the_rule_given(tmp_path: Path) -> None:
    """The README lists --rule among the in-process flags; discover had none (route has)."""
    tap = str(octomind_tap(tmp_path))
    ranked: dict[str, list[dict[str, Any]]] = {}
    for rule in ("capd", "fused"):
        result = _capd("discover", "run a query on the postgres database", "--tap", tap, "--model", "hash",
                       "--data-dir", str(tmp_path / "d"), "--rule", rule, "--json")
        assert result.exit_code == 0, result.output
        ranked[rule] = json.loads(result.stdout)["candidates"]
    assert ranked["capd"][0]["name"] == ranked["fused"][0]["name"] == "database-postgres"
    assert ranked["capd"] != ranked["fused"]  # scored by each rule: the fused scores are another scale


def test_list_of_a_path_that_is_not_a_tap_fails(tmp_path: Path) -> None:
    """It said so on stderr and exited 0 with an empty list, as if the tap were empty."""
    for args in (["list", "--tap", str(tmp_path / "missing")], ["list", "--tap", str(tmp_path), "--json"]):
        result = _capd(*args)
        assert result.exit_code == 1 and result.stdout == "", result.output
        assert "not a tap" in result.stderr


def test_lint_and_test_take_the_taps_given_both_ways(tmp_path: Path) -> None:
    """``capd lint A --tap B`` linted A alone, so CI passed a broken B; one tap named twice is one tap
    (each of its capabilities was a duplicate of itself)."""
    good, broken = octomind_tap(tmp_path / "a"), octomind_tap(tmp_path / "b")
    (broken / "capabilities" / "smalltalk" / "config.toml").write_text("triggers = [\n")
    result = _capd("lint", str(good), "--tap", str(broken), "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["taps"] == [str(good), str(broken)] and report["counts"]["error"] >= 1
    twice = json.loads(_capd("lint", str(good), "--tap", str(good) + "/", "--json").stdout)
    assert twice["taps"] == [str(good)] and twice["counts"]["warning"] == 0, twice


def test_capd_test_skips_hidden_fixture_files(tmp_path: Path) -> None:
    """An editor's lock (``.#routing.jsonl``, a dangling link) or half-written ``.routing.jsonl`` made
    ``capd test`` fail; hidden files are not tap files."""
    tap = octomind_tap(tmp_path / "tap")
    fixtures = tap / "fixtures"
    fixtures.mkdir()
    (fixtures / "routing.jsonl").write_text(json.dumps({"message": "tell me a joke about cats", "expect": None}) + "\n")
    (fixtures / ".#routing.jsonl").symlink_to("user@host.1234:1700000000")
    (fixtures / ".routing.jsonl").write_text('{"message": "half wri')
    result = _capd("test", str(tap), "--model", "hash", "--data-dir", str(tmp_path / "d"), "--json")
    assert result.exit_code in (0, 1) and "cannot read" not in result.stderr, result.output
    assert json.loads(result.stdout)["taps"][0]["metrics"]["n"] == 1


# -- capd index with a data directory that cannot be written ------------------------------------------------

def test_index_that_stored_nothing_says_so_first_and_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It used to print "N vectors stored" (from the in-memory cache), warn afterwards that nothing
    was kept, and exit 0. A file where the data directory should be refuses writes even to root;
    the start's check that refuses such a path is skipped, so that the stores meet what a read-only
    disk gives them (that check lets a directory it cannot create through, to the stores)."""
    monkeypatch.setattr("capd.settings.own_data_dir", lambda path: None)
    blocker = tmp_path / "a-file"
    blocker.write_text("the data directory cannot be created under a file")
    args = ["index", "--tap", str(octomind_tap(tmp_path / "tap")), "--model", "hash", "--data-dir", str(blocker / "d")]
    result = _capd(*args)
    assert result.exit_code == 1, result.output
    assert "nothing was stored" in result.stderr and "make the data directory writable" in result.stderr
    assert result.output.index("nothing was stored") < result.output.index("capabilities")  # said first
    assert result.stdout.startswith("nothing stored:") and "vectors stored" not in result.stdout
    as_json = _capd(*args, "--json")
    assert as_json.exit_code == 1, as_json.output
    report = json.loads(as_json.stdout)
    assert (report["persistent"], report["stored"], report["unstored"]) == (False, 0, report["triggers"])
    assert report["triggers"] > 0 and report["embedded"] == report["triggers"]


def test_index_that_could_not_write_some_vectors_fails(tmp_path: Path) -> None:
    """A cache file that cannot be written (here immutable: chmod does not stop root) in a directory
    that can: the vectors a new capability needs are embedded, not stored, and said so."""
    tap, data = octomind_tap(tmp_path / "tap"), tmp_path / "data"
    args = ["index", "--tap", str(tap), "--model", "hash", "--data-dir", str(data)]
    first = _capd(*args)
    assert first.exit_code == 0 and "vectors stored" in first.stdout and not first.stderr, first.output
    write_capability(tap, "weather", ["what is the weather like tomorrow", "will it rain in Oslo today"])
    cache = data / "vectors.sqlite3"
    frozen = subprocess.run(["chattr", "+i", str(cache)], capture_output=True, check=False).returncode == 0
    try:
        if not frozen:
            pytest.skip("cannot make the cache file immutable here (no chattr, or not allowed)")
        result = _capd(*args, "--json")
    finally:
        subprocess.run(["chattr", "-i", str(cache)], capture_output=True, check=False)
    assert result.exit_code == 1, result.output
    assert "2 of the" in result.stderr and "could not be written" in result.stderr
    report = json.loads(result.stdout)
    assert (report["persistent"], report["embedded"], report["unstored"]) == (True, 2, 2)
    assert report["stored"] == report["triggers"] - 2


def _cached_hashes(data: Path) -> set[str]:
    with closing(sqlite3.connect(data / "vectors.sqlite3")) as conn:
        return {row[0] for row in conn.execute("SELECT text_hash FROM vectors")}


def _deploy_and_database(tap: Path) -> Path:
    """A tap of two capabilities, one with a description."""
    write_capability(tap, "deploy", ["deploy the service", "ship it to production"],
                     extra_config='description = "Deploy services to the cluster"\n')
    write_capability(tap, "database-admin", ["query the database", "run sql"])
    return tap


def test_index_prune_keeps_every_vector_a_daemon_on_the_taps_uses(tmp_path: Path) -> None:
    """--prune kept only the taps' triggers: a daemon's other texts (the fused rule's descriptions and
    names, learned corrections, the taps' vetoes, the abstain corpus) were deleted and embedded again at its next start.
    The daemon here routes with ``fused``, ``capd index`` runs with the default rule (--rule can differ)."""
    tap, data = _deploy_and_database(tmp_path / "tap"), tmp_path / "data"
    with closing(LearnedStore.open(data)) as learned:
        learned.record(tap, "deploy", "push the build live")
        learned.record(tap, "database-admin", "thanks, that is all", kind="abstain")
    (tap / "vetoes.jsonl").write_text('{"message": "what a lovely afternoon", "expect": null}\n')
    settings = Settings(taps=(tap,), model="hash", data_dir=data, rule="fused", abstain_corpus=True)

    def start() -> int:
        service = Service(settings, learn=True).start()
        service.close()
        return service.counters.embedded

    assert start() == 8  # 4 triggers, a description, 2 names, a learned trigger (the index's count)
    used = _cached_hashes(data)
    assert {text_hash(t) for t in ("database admin", "push the build live", "thanks, that is all",
                                   "what a lovely afternoon", abstain_corpus()[0])} <= used
    encoder = HashEncoder()
    with closing(VectorCache.open(data)) as cache:
        cache.put_many(encoder.model_id, [(text_hash("a trigger since removed"), np.ones(encoder.dim))])
    result = _capd("index", "--tap", str(tap), "--model", "hash", "--data-dir", str(data), "--prune", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pruned"] == 1  # only the stale one
    assert _cached_hashes(data) == used
    assert start() == 0 and _cached_hashes(data) == used  # nothing embedded again, the corpus included
    fresh = tmp_path / "fresh"
    assert _capd("index", "--tap", str(tap), "--model", "hash", "--data-dir", str(fresh), "--prune").exit_code == 0
    assert not (fresh / "learned.sqlite3").exists()  # read when there, never created


def test_index_under_fused_leaves_a_daemon_nothing_to_embed_or_fit(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``capd index`` embedded the triggers only: a fused daemon's first start still embedded the
    descriptions, names and abstain corpus, computed every example's token vectors and fitted the
    head and the auto gates (35 s on 1,000 capabilities). Under ``--rule fused`` it now does all
    of that, with the corrections learned in the data directory, so the daemon fits nothing."""
    from capd import autogates, fused

    tap, data = _deploy_and_database(tmp_path / "tap"), tmp_path / "data"
    with closing(LearnedStore.open(data)) as learned:
        learned.record(tap, "deploy", "push the build live")
    result = _capd("index", "--tap", str(tap), "--model", "hash", "--data-dir", str(data), "--rule", "fused", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["rule"] == "fused" and report["fits"]["stored"] is True
    assert list((data / "heads").glob("*.auto.json"))  # no capd.toml: auto gates gate this tap

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the daemon fitted or embedded what capd index should have prepared")

    monkeypatch.setattr(fused, "fit_head", refuse)
    monkeypatch.setattr(fused, "_example_tokens", refuse)
    monkeypatch.setattr(autogates, "choose", refuse)
    service = Service(Settings(taps=(tap,), model="hash", data_dir=data, rule="fused"), sessions=True).start()
    try:
        assert service.counters.embedded == 0
        assert "push the build live" in service.router.index.triggers("deploy")  # the head includes the correction
        assert service.route("push the build live").decision.capability == "deploy"
    finally:
        service.close()
    monkeypatch.undo()
    text = _capd("index", "--tap", str(tap), "--model", "hash", "--data-dir", str(tmp_path / "fresh"),
                 "--rule", "fused")
    assert text.exit_code == 0, text.output
    assert "fused rule: head, token vectors and gates fitted and stored" in text.stdout
    assert not (tmp_path / "fresh" / "learned.sqlite3").exists()  # none is created
    default = _capd("index", "--tap", str(tap), "--model", "hash", "--data-dir", str(tmp_path / "other"), "--json")
    assert json.loads(default.stdout)["fits"] is None and not (tmp_path / "other" / "heads").exists()
    (tmp_path / "other" / "heads").write_text("a file where the heads folder goes")  # vectors writable, heads not
    unstored = _capd("index", "--tap", str(tap), "--model", "hash", "--data-dir", str(tmp_path / "other"),
                     "--rule", "fused")
    assert unstored.exit_code == 1, unstored.output
    assert "the fused rule's head could not be stored" in unstored.stderr
    assert "gates fitted, not stored" in unstored.stdout


def test_json_output_never_holds_nan(capsys: pytest.CaptureFixture[str]) -> None:
    """``NaN`` is not JSON: a score a damaged model made NaN prints as null."""
    import numpy as np

    from capd.cli.common import emit_json

    emit_json({"score": float("nan"), "margin": float("-inf"), "candidates": [{"score": np.float32("nan")}],
               "fine": 0.5, "count": 3})
    out = capsys.readouterr().out
    assert "NaN" not in out and "Infinity" not in out
    assert json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) == {
        "score": None, "margin": None, "candidates": [{"score": None}], "fine": 0.5, "count": 3}


# -- connection flags: precedence, ranges, case, something that is not capd -------------------------------

def test_uds_with_host_or_port_flags_is_a_usage_error(tmp_path: Path) -> None:
    sock = str(tmp_path / "capd.sock")
    for args in (["status", "--uds", sock, "--port", "7171"], ["serve", "--uds", sock, "--host", "127.0.0.1"],
                 ["list", "--uds", sock, "--host", "127.0.0.1", "--port", "7171"]):
        result = _capd(*args)
        _clean_usage_error(result)
        assert "name two addresses" in result.stderr


def test_a_port_flag_beats_capd_uds_from_the_environment(serve: Serve, tmp_path: Path) -> None:
    port = serve()
    env = {"CAPD_UDS": str(tmp_path / "nobody.sock"), "CAPD_CONFIG": ""}
    result = CliRunner().invoke(main, ["status", "--port", str(port)], env=env)
    assert result.exit_code == 0, result.output
    gone = CliRunner().invoke(main, ["status"], env={**env, "CAPD_PORT": str(port)})  # env against env: the socket
    assert gone.exit_code == 3 and "nobody.sock" in gone.stderr


@pytest.mark.parametrize("args", [["status", "--port", "70000"], ["serve", "--port", "-1"],
                                  ["list", "--port", "65536"]])
def test_a_port_out_of_range_is_a_usage_error(args: list[str]) -> None:
    result = _capd(*args)
    _clean_usage_error(result)
    assert "must be between 0 and 65535" in result.stderr


def test_choice_flags_take_any_case(tmp_path: Path) -> None:
    """The environment took CAPD_LOG_LEVEL=DEBUG, the flag --log-level DEBUG was a usage error."""
    parsed = main.commands["serve"].make_context(
        "serve", ["--log-level", "DEBUG", "--backend", "ONNX", "--rule", "Fused"]).params
    assert (parsed["log_level"], parsed["backend"], parsed["rule"]) == ("debug", "onnx", "fused")
    routed = _capd("route", "please run a query on the postgres database", "--tap", str(octomind_tap(tmp_path)),
                   "--model", "hash", "--data-dir", str(tmp_path / "d"), "--rule", "ANCHOR", "--backend", "Auto",
                   "--json")
    assert routed.exit_code == 0, routed.output

    def choices(command: click.Command) -> Iterator[tuple[str, click.Choice[Any]]]:
        for param in command.params:
            if isinstance(param.type, click.Choice):
                yield f"{command.name} {param.name}", param.type
        for sub in getattr(command, "commands", {}).values():
            yield from choices(sub)

    found = dict(choices(main))
    assert "export fmt" in found  # `capd learned export --format`: the sub-groups are walked too
    assert [name for name, choice in found.items() if choice.case_sensitive] == []


class _Foreign(BaseHTTPRequestHandler):
    """An HTTP server that is not capd: HTML errors, or JSON of another shape."""

    json_body: bytes | None = None

    def _answer(self) -> None:
        if self.json_body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.json_body)))
        self.end_headers()
        self.wfile.write(self.json_body)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(params=[None, b'{"ok": 1}'], ids=["html-404", "other-json"])
def foreign_port(request: pytest.FixtureRequest) -> Iterator[int]:
    handler = type("Handler", (_Foreign,), {"json_body": request.param})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["list"], ["route", "show me the commits"],
                                  ["discover", "postgres"], ["enable", "s1", "git"]])
def test_something_that_is_not_capd_is_said_in_one_line(foreign_port: int, args: list[str]) -> None:
    """It printed the server's raw HTML (exit 1), or a TypeError traceback for JSON of another shape."""
    result = _capd(*args, port=foreign_port)
    assert result.exit_code == 3, result.output
    assert isinstance(result.exception, SystemExit)
    assert result.stderr.count("\n") == 1 and "<" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"capd: http://127.0.0.1:{foreign_port} does not look like a capd daemon")


def test_help_says_when_exit_code_3_happens() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert ("3 daemon unreachable or failed to start (any command that asks it), or `capd serve` could not start "
            "(address in use, cannot bind, a data directory it must not use)") in " ".join(result.output.split())


@pytest.mark.parametrize("args", [["list", "--tap", ""], ["index", "--data-dir", ""], ["status", "--uds", " "],
                                  ["lint", ""], ["route", "hello there", "--tap", "taps/core", "--config", ""]])
def test_an_empty_path_flag_is_a_usage_error(args: list[str]) -> None:
    """``Path("")`` is the working directory: ``--data-dir "$UNSET"`` wrote capd's files there."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "empty; give a path" in result.output


def test_an_empty_session_is_refused_by_list_as_by_route(serve: Serve) -> None:
    """``capd list --session "$SESSION"`` with the variable unset listed the catalog with nothing
    marked active, as if the session had nothing on; ``route --session ""`` is refused."""
    port = serve()
    listed = _capd("list", "--session", "", port=port)
    assert listed.exit_code == 1 and listed.stdout == "" and "422 invalid_session_id: query.session" in listed.stderr
    # the rule in words, not the regular expression behind it
    for args in (["list", "--session", "bad/id"], ["route", "hello there friend", "--session", "é"]):
        refused = _capd(*args, port=port)
        assert refused.exit_code == 1, refused.output
        assert "invalid session id" in refused.stderr and "use 1 to 128 characters" in refused.stderr
        assert "pattern" not in refused.stderr
    with CapdClient(f"http://127.0.0.1:{port}") as client, pytest.raises(ApiError) as caught:
        client.capabilities(session="")
    assert caught.value.status == 422


@pytest.mark.parametrize("args", [["status", "--host", ""], ["serve", "--host", " "], ["list", "--host", ""],
                                  ["route", "hello there", "--tap", "taps/core", "--model", ""],
                                  ["serve", "--model", " "], ["index", "--model", ""]])
def test_an_empty_host_or_model_flag_is_a_usage_error(args: list[str]) -> None:
    """``--host "$UNSET"`` exited 1, as an error, where ``--port 99999`` and an empty path flag exit 2."""
    result = CliRunner().invoke(main, args, env={"CAPD_CONFIG": ""})
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--" in result.output


@pytest.mark.parametrize("host", ["127.0.0.1:7171", "http://127.0.0.1", "bad host", "[::1"])
def test_a_host_that_is_no_host_is_said_not_a_traceback(host: str) -> None:
    """``--host 127.0.0.1:7171`` (the port with the host), a URL, a space: every client command died
    with a traceback (ValueError from urlsplit, InvalidURL from http.client), serve said "cannot listen"."""
    for command in (["status"], ["list"], ["route", "hello there friend"], ["serve"]):
        flag = CliRunner().invoke(main, [*command, "--host", host], env={"CAPD_CONFIG": ""})
        assert flag.exit_code == 2 and "Invalid value for '--host'" in flag.output, (command, flag.output)
        assert flag.exception is None or isinstance(flag.exception, SystemExit), (command, flag.exception)
    env = CliRunner().invoke(main, ["status"], env={"CAPD_CONFIG": "", "CAPD_HOST": host})
    assert env.exit_code == 1 and "CAPD_HOST" in env.stderr and isinstance(env.exception, SystemExit), env.output


def test_ctrl_c_stops_any_command_quietly_with_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """click printed "Aborted!" and exited 1 (an error) for a command stopped by Ctrl-C, such as a
    long `capd index` or `capd tune`; `capd serve` already exited 130 (tests/test_daemon.py)."""
    import capd.taps

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(capd.taps, "load_catalog", interrupted)
    result = _capd("index", "--tap", str(octomind_tap(tmp_path / "tap")), "--model", "hash", "--data-dir",
                   str(tmp_path / "data"))
    assert result.exit_code == 130 and "Aborted" not in result.output, result.output


def test_every_option_of_every_command_says_what_it_does() -> None:
    """`capd serve --help` listed --data-dir, --backend and --log-level with no description."""
    def commands(group: click.Group, prefix: str) -> Iterator[tuple[str, click.Command]]:
        for name, command in group.commands.items():
            yield f"{prefix} {name}", command
            if isinstance(command, click.Group):
                yield from commands(command, f"{prefix} {name}")

    bare = [f"{path} {'/'.join(p.opts)}" for path, command in commands(main, "capd") for p in command.params
            if isinstance(p, click.Option) and not p.help and "--help" not in p.opts]
    assert bare == []
