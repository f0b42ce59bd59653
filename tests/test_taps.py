"""Catalog loading: the octomind layout, the shipped tap, and every broken-input case."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capd.catalog import tool_allowed, tools_for_server
from capd.live_taps import LiveTaps
from capd.settings import default_taps
from capd.tap_files import MAX_FILE_BYTES
from capd.taps import load_catalog
from tests.taputil import POSTGRES_PROVIDER, octomind_tap, write_capability


def test_octomind_layout_loads_unchanged(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    before = {p: p.read_bytes() for p in tap.rglob("*.toml") if not p.is_symlink()}
    catalog = load_catalog([tap])
    assert catalog.errors == ()
    assert set(catalog.capabilities) == {"database-postgres", "filesystem-read", "filesystem-write",
                                         "python-toolchain", "smalltalk"}
    pg = catalog.capabilities["database-postgres"]
    assert pg.kind == "mcp"
    assert pg.title == "PostgreSQL Database"
    assert pg.provider is not None and pg.provider.description == "Query and inspect PostgreSQL"
    assert pg.domains == ("developer", "devops")
    assert pg.provider.name == "postgres"  # default.toml is a symlink to postgres.toml
    (server,) = pg.servers
    spec = server.as_dict()
    assert spec["command"] == "npx" and spec["timeout_seconds"] == 60
    assert "{{ENV:POSTGRES_CONNECTION_STRING}}" in spec["args"]  # placeholders stay verbatim
    assert pg.server_tools == (("postgres", ("*",)),)
    # a single provider file with no default.toml is the default
    assert catalog.capabilities["filesystem-read"].server_tools == (("filesystem", ("read_file", "list_directory")),)
    # default.toml as a full provider file
    write = catalog.capabilities["filesystem-write"]
    assert write.provider is not None and write.provider.name == "default"
    assert write.server_tools == (("filesystem", ("write_file", "edit_file")),)
    toolchain = catalog.capabilities["python-toolchain"]
    assert toolchain.kind == "toolchain" and toolchain.servers == ()
    assert catalog.capabilities["smalltalk"].kind == "routing-only"
    after = {p: p.read_bytes() for p in tap.rglob("*.toml") if not p.is_symlink()}
    assert before == after  # nothing written into the tap


def test_allowed_tools_resolution() -> None:
    assert tools_for_server(("playwright:*",), "playwright") == ("*",)
    assert tools_for_server(("a:x", "b:y", "a:z"), "a") == ("x", "z")
    assert tools_for_server(("a:x",), "b") == ()
    assert tools_for_server((), "a") == ("*",)
    assert tools_for_server(("plain",), "a") == ("plain",)
    assert tools_for_server(("agent_*",), "agent") == ("agent_*",)  # octomind's own taps write these


def test_tool_patterns_match_tool_names() -> None:
    assert tool_allowed(("*",), "anything") and tool_allowed(("read_file",), "read_file")
    assert tool_allowed(("agent_*",), "agent_delegate") and tool_allowed(("agent_*",), "agent_")
    assert not tool_allowed(("agent_*",), "my_agent_x") and not tool_allowed(("read_file",), "read_files")
    assert tool_allowed(("*_issue",), "create_issue") and tool_allowed(("gh.*.list",), "gh.repo.list")
    assert not tool_allowed(("a.c",), "abc") and not tool_allowed((), "read_file")  # no regex leaks through


def test_fingerprint_changes_only_with_content(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    first = load_catalog([tap]).capabilities
    again = load_catalog([tap]).capabilities
    assert {n: c.fingerprint for n, c in first.items()} == {n: c.fingerprint for n, c in again.items()}
    config = tap / "capabilities" / "smalltalk" / "config.toml"
    config.write_text(config.read_text().replace("weather today", "weather tomorrow"))
    changed = load_catalog([tap]).capabilities
    assert changed["smalltalk"].fingerprint != first["smalltalk"].fingerprint
    assert changed["database-postgres"].fingerprint == first["database-postgres"].fingerprint


def test_several_taps_first_wins(tmp_path: Path) -> None:
    first = octomind_tap(tmp_path / "a")
    second = tmp_path / "b" / "tap"
    write_capability(second, "smalltalk", ["another definition entirely"])
    write_capability(second, "only-here", ["only in the second tap"])
    catalog = load_catalog([first, second])
    assert catalog.capabilities["smalltalk"].tap == first.absolute()
    assert "only-here" in catalog
    dup = [p for p in catalog.problems if p.code == "duplicate-name"]
    assert len(dup) == 1 and dup[0].severity == "warning"


def _broken(tmp_path: Path) -> Path:
    tap = octomind_tap(tmp_path)
    caps = tap / "capabilities"
    write_capability(tap, "bad-toml", ["fine trigger here"])
    (caps / "bad-toml" / "config.toml").write_text('triggers = [\n  "one",\n  "two"\n  "three"\n]\n')
    write_capability(tap, "bad-schema", None)
    (caps / "bad-schema" / "config.toml").write_text('description = "x"\ntriggers = "not a list"\n')
    write_capability(tap, "dangling", ["a dangling default"], {"real": POSTGRES_PROVIDER})
    os.symlink("missing.toml", caps / "dangling" / "default.toml")
    write_capability(tap, "escape", ["points outside"], {})
    outside = tmp_path / "outside.toml"
    outside.write_text(POSTGRES_PROVIDER)
    os.symlink(outside, caps / "escape" / "default.toml")
    write_capability(tap, "huge", None)
    (caps / "huge" / "config.toml").write_text('triggers = ["x"]\n#' + "a" * MAX_FILE_BYTES + "\n")
    write_capability(tap, "binary", None)
    (caps / "binary" / "config.toml").write_bytes(b"triggers = [\x00\x01]\n")
    write_capability(tap, "latin1", None)
    (caps / "latin1" / "config.toml").write_bytes(b'triggers = ["caf\xe9 au lait please"]\n')
    write_capability(tap, "bad-server", ["server table is wrong"],
                     {"p": '[[mcp.servers]]\nname = "x"\ntimeout_seconds = "soon"\n'})
    return tap


def test_broken_files_are_reported_and_skipped(tmp_path: Path) -> None:
    tap = _broken(tmp_path)
    catalog = load_catalog([tap])
    # everything healthy still loads
    assert {"database-postgres", "filesystem-read", "filesystem-write", "python-toolchain",
            "smalltalk"} <= set(catalog.capabilities)
    by_cap = {p.capability: p for p in catalog.errors}
    assert set(by_cap) == {"bad-toml", "bad-schema", "dangling", "escape", "huge", "binary", "latin1", "bad-server"}
    assert by_cap["bad-toml"].line == 4 and "invalid TOML" in by_cap["bad-toml"].reason
    assert by_cap["bad-toml"].file.endswith("bad-toml/config.toml")
    assert by_cap["bad-schema"].line == 2 and "triggers must be a list of strings" in by_cap["bad-schema"].reason
    assert "does not exist" in by_cap["dangling"].reason and by_cap["dangling"].file.endswith("default.toml")
    assert "outside the tap" in by_cap["escape"].reason
    assert "limited to" in by_cap["huge"].reason
    assert "binary" in by_cap["binary"].reason
    assert "UTF-8" in by_cap["latin1"].reason and by_cap["latin1"].line == 1
    assert "timeout_seconds must be a positive, finite number" in by_cap["bad-server"].reason
    assert by_cap["bad-server"].line == 3


# A tap author's schema mistakes: (file, its text, the reason, the line the reason points at).
SCHEMA_MISTAKES = [
    ("p.toml", 'deps = "postgres"\n', "deps must be a table", 1),
    ("p.toml", "[roles]\nmcp = 3\n", "roles.mcp must be a table", 2),
    ("p.toml", '[roles.mcp]\nserver_refs = "db"\n', "roles.mcp.server_refs must be a list of strings", 2),
    ("p.toml", '[mcp]\nservers = "db"\n', "mcp.servers must be an array of tables ([[mcp.servers]])", 2),
    ("p.toml", "[mcp]\nservers = [3]\n", "mcp.servers entry 0 must be a table", 2),
    ("p.toml", '[[mcp.servers]]\nname = "db"\ncommand = 5\n', "mcp.servers[0].command must be a string", 3),
    ("p.toml", '[[mcp.servers]]\nname = "db"\nenv = { A = 1 }\n', "mcp.servers[0].env must be a table of strings", 3),
    ("p.toml", '[[mcp.servers]]\nname = "db"\ntimeout_seconds = inf\n',
     "mcp.servers[0].timeout_seconds must be a positive, finite number of seconds", 3),
    ("p.toml", '[[mcp.servers]]\nname = "db"\ntimeout_seconds = nan\n',
     "mcp.servers[0].timeout_seconds must be a positive, finite number of seconds", 3),
    ("config.toml", 'description = "deep"\ntriggers = ' + "[" * 3000 + "]" * 3000 + "\n",
     "invalid TOML: arrays or inline tables nested too deeply to read", 2),
    ("config.toml", 'triggers = ["a real trigger", "  "]\n', "triggers must not contain empty strings", 1),
    ("config.toml", 'triggers = ["a real trigger"]\ndescription = 5\n', "description must be a string", 2),
]


@pytest.mark.parametrize(("file", "text", "reason", "line"), SCHEMA_MISTAKES,
                         ids=[reason.split(" must")[0] for _, _, reason, _ in SCHEMA_MISTAKES])
def test_a_schema_mistake_names_its_file_line_and_key_and_skips_only_its_capability(
        tmp_path: Path, file: str, text: str, reason: str, line: int) -> None:
    tap = octomind_tap(tmp_path)
    folder = write_capability(tap, "mistaken", ["a real trigger"], {"p": POSTGRES_PROVIDER}, default="p")
    (folder / file).write_text(text, encoding="utf-8")
    catalog = load_catalog([tap])
    (problem,) = catalog.errors
    assert (problem.capability, problem.reason, problem.line) == ("mistaken", reason, line)
    assert problem.file == str(folder / file)
    assert "mistaken" not in catalog and {"smalltalk", "database-postgres"} <= set(catalog.capabilities)


def test_a_misspelt_gate_names_the_gates_there_are(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    (tap / "capd.toml").write_text("[gates]\nthresold = 0.5\n")
    catalog = load_catalog([tap])
    (problem,) = catalog.errors
    assert problem.line == 2 and problem.reason.startswith("gates.thresold is not a gate (known: threshold, margin")
    assert "smalltalk" in catalog  # the tap serves, with the model's gates


def test_several_providers_without_a_default_warn_and_use_the_first(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    write_capability(tap, "two-ways", ["two providers, no default"], {"zeta": POSTGRES_PROVIDER,
                                                                     "alpha": POSTGRES_PROVIDER})
    catalog = load_catalog([tap])
    (problem,) = catalog.problems
    assert (problem.severity, problem.code, problem.reason) == ("warning", "no-default",
                                                                "no default.toml; using alpha.toml of 2 providers")
    assert catalog.capabilities["two-ways"].provider.name == "alpha"  # type: ignore[union-attr]


def test_a_folder_without_capabilities_is_not_a_tap(tmp_path: Path) -> None:
    (tmp_path / "notes").mkdir()
    (problem,) = load_catalog([tmp_path / "notes"]).errors
    assert (problem.code, problem.reason) == ("missing-tap", "not a tap: no capabilities/ directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    config = tap / "capabilities" / "smalltalk" / "config.toml"
    config.chmod(0)
    catalog = load_catalog([tap])
    assert "smalltalk" not in catalog
    assert any("permission denied" in p.reason for p in catalog.errors)


def test_missing_tap_and_bad_names(tmp_path: Path) -> None:
    catalog = load_catalog([tmp_path / "nope"])
    assert len(catalog) == 0 and catalog.errors[0].code == "missing-tap"
    (tmp_path / "fixtures.jsonl").write_text("{}\n")
    assert load_catalog([tmp_path / "fixtures.jsonl"]).errors[0].reason == "is a file, not a tap directory"
    live = LiveTaps([tmp_path / "nope", tmp_path / "fixtures.jsonl"]).load()  # the daemon's loader
    assert [p.reason for p in live.errors] == [  # it said "serving its last good 0 capabilities"
        "tap directory is missing; nothing from it is served until it is there",
        "not a directory; nothing from it is served until it is there"]
    tap = octomind_tap(tmp_path)
    (tap / "capabilities" / "bad name!").mkdir()
    catalog = load_catalog([tap])
    assert any(p.code == "bad-name" for p in catalog.errors)


def test_tap_gates_file(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    (tap / "capd.toml").write_text("[gates]\nthreshold = 0.5\nmargin = 0.05\n")
    catalog = load_catalog([tap])
    cap = catalog.capabilities["smalltalk"]
    assert dict(catalog.gates_for(cap)) == {"threshold": 0.5, "margin": 0.05}
    (tap / "capd.toml").write_text("[gates]\nthreshold = 'high'\n")
    catalog = load_catalog([tap])
    assert any(p.file.endswith("capd.toml") and p.line == 2 for p in catalog.errors)
    (tap / "capd.toml").write_text("[gates]\nthreshold = 0.5\n[gates.fused]\nabstain_corpus = true\n")
    config = load_catalog([tap]).tap_configs[tap.absolute()]
    assert dict(config.gates_for("fused")) == {"abstain_corpus": True} and "abstain_corpus" not in config.gates
    (tap / "capd.toml").write_text("[gates.fused]\nthreshold = -0.2\ncoverage = 0.41\n")
    config = load_catalog([tap]).tap_configs[tap.absolute()]
    assert dict(config.gates_for("fused")) == {"threshold": -0.2, "coverage": 0.41}
    (tap / "capd.toml").write_text("[gates.fused]\ncoverage = 'most'\n")
    errors = [p for p in load_catalog([tap]).errors if p.file.endswith("capd.toml")]
    assert [(p.line, "gates.fused.coverage" in p.reason, "must be a number" in p.reason) for p in errors] == [
        (2, True, True)]
    (tap / "capd.toml").write_text("[gates.fused]\nthreshold = -0.2\ncoverage = 1.5\n")
    errors = [p for p in load_catalog([tap]).errors if p.file.endswith("capd.toml")]
    assert [(p.line, "between 0 and 1" in p.reason) for p in errors] == [(3, True)]
    (tap / "capd.toml").write_text("[gates]\nthreshold = 0.5\nabstain_corpus = 1\n")
    errors = load_catalog([tap]).errors
    assert [(p.line, "must be true or false" in p.reason) for p in errors if p.file.endswith("capd.toml")] == [
        (3, True)]


@pytest.mark.parametrize(("text", "reason"), [
    ("top_k = 0", "gates.top_k must be a whole number of at least 1 (got 0)"),
    ("top_k = 2.7", "gates.top_k must be a whole number of at least 1 (got 2.7)"),
    ("top_k = -1", "gates.top_k must be a whole number of at least 1 (got -1)"),
    ("top_k = nan", "gates.top_k must be a finite number (got nan)"),
    ("threshold = nan", "gates.threshold must be a finite number (got nan)"),
    ("margin = inf", "gates.margin must be a finite number (got inf)"),
    ("[gates.fused]\nthreshold = -inf", "gates.fused.threshold must be a finite number (got -inf)"),
    # out of range: the tap would never fire (threshold 5) or always pass the margin; as CAPD_* refuses them
    ("threshold = 5", "gates.threshold must be between -1 and 1 (got 5)"),
    ("margin = -2", "gates.margin must be between 0 and 100 (got -2)"),
    ("[gates.fused]\nthreshold = 1e300", "gates.fused.threshold must be between -1 and 1 (got 1e+300)"),
])
def test_gates_that_would_break_routing_are_errors_on_their_line(tmp_path: Path, text: str, reason: str) -> None:
    tap = octomind_tap(tmp_path)
    (tap / "capd.toml").write_text(f"[gates]\nabstain_corpus = true\n{text}\n")
    catalog = load_catalog([tap])
    (problem,) = catalog.errors
    assert (problem.file, problem.line, problem.reason) == (str(tap / "capd.toml"), text.count("\n") + 3, reason)
    assert tap.absolute() not in catalog.tap_configs and "smalltalk" in catalog  # the model's gates serve


@pytest.mark.parametrize(("text", "line", "reason"), [
    ("threshold = 0.9\n[gates]\nmargin = 0.1\n", 1,
     "threshold is a gate: it goes in [gates] (rules capd, anchor) or [gates.fused]"),
    ("[fused]\nthreshold = 0.9\n", 1, "fused is a gate: it goes in [gates] (rules capd, anchor) or [gates.fused]"),
    ("[gate]\nthreshold = 0.9\n", 1, "gate is not read by capd: did you mean gates?"),
    ('owner = "me"\nmodl = "all-minilm-l6-v2"\n', 2, "modl is not read by capd: did you mean model?"),
])
def test_a_gate_capd_would_not_read_is_an_error(tmp_path: Path, text: str, line: int, reason: str) -> None:
    """A gate written above [gates], or a misspelt table, was ignored without a word; a key of the
    author's own (``owner``) is kept and not read."""
    tap = octomind_tap(tmp_path)
    (tap / "capd.toml").write_text(text)
    (problem,) = load_catalog([tap]).errors
    assert (problem.line, problem.reason) == (line, reason)
    (tap / "capd.toml").write_text('owner = "me"\n[meta]\nnote = "calibrated on the May fixtures"\n')
    assert load_catalog([tap]).errors == ()


@pytest.mark.parametrize("target", ["calibration/capd.toml", "capd.toml"], ids=["dangling", "loop"])
def test_a_capd_toml_link_to_nothing_is_an_error_not_a_missing_file(tmp_path: Path, target: str) -> None:
    tap = octomind_tap(tmp_path)
    (tap / "capd.toml").symlink_to(target)
    (problem,) = load_catalog([tap]).errors
    assert problem.file == str(tap / "capd.toml") and ("does not exist" in problem.reason or "loop" in problem.reason)
    live = LiveTaps([tap])  # the daemon keeps the last good gates when the link's target goes
    (tap / "capd.toml").unlink()
    (tap / "calibration").mkdir()
    (tap / "calibration" / "capd.toml").write_text("[gates]\nthreshold = 0.5\n")
    (tap / "capd.toml").symlink_to("calibration/capd.toml")
    assert dict(live.load().tap_configs[tap.absolute()].gates) == {"threshold": 0.5}
    (tap / "calibration" / "capd.toml").unlink()
    catalog = live.load([tap / "calibration" / "capd.toml"])
    assert dict(catalog.tap_configs[tap.absolute()].gates) == {"threshold": 0.5}
    assert [p.file for p in catalog.errors] == [str(tap / "capd.toml")]


def test_shipped_tap_loads_cleanly() -> None:
    taps = default_taps()
    assert taps, "the shipped taps/ directory is found from the installed package"
    catalog = load_catalog(taps)
    assert catalog.errors == ()
    assert len(catalog) >= 25
    for capability in catalog:
        assert 6 <= len(capability.triggers) <= 12, capability.name
        assert capability.provider is not None, capability.name


def test_links_between_siblings_are_still_checked(tmp_path: Path) -> None:
    """The loader places a file linked to a sibling without resolving the whole path; a sibling
    that is itself a link, a loop, or a folder linked from elsewhere in the tap is still followed."""
    tap = octomind_tap(tmp_path)
    caps = tap / "capabilities"
    outside = tmp_path / "outside.toml"
    outside.write_text(POSTGRES_PROVIDER)
    chain = write_capability(tap, "chain", ["a default that links to a link"], {})
    os.symlink(outside, chain / "inner.link")  # not *.toml: only reached through default.toml
    os.symlink("inner.link", chain / "default.toml")
    loop = write_capability(tap, "loop", ["a default that links to itself"], {})
    os.symlink("default.toml", loop / "default.toml")
    os.symlink("database-postgres", caps / "postgres-again")  # a folder linked within the tap: fine
    catalog = load_catalog([tap])
    by_cap = {p.capability: p for p in catalog.errors}
    assert set(by_cap) == {"chain", "loop"}
    assert "outside the tap" in by_cap["chain"].reason and by_cap["chain"].file.endswith("default.toml")
    assert "symlink loop" in by_cap["loop"].reason
    again = catalog.capabilities["postgres-again"]
    assert again.provider is not None and again.provider.name == "postgres"
    assert again.servers == catalog.capabilities["database-postgres"].servers


def test_an_unreadable_folder_skips_its_capability_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A capability folder (or capabilities/ itself) that cannot be listed crashed the load: a
    traceback in lint, a failed start, a reload that kept failing. The filesystem refuses through a
    patched ``os.listdir`` (root reads whatever the mode, and the suite may run as root)."""
    tap = octomind_tap(tmp_path)
    refused: set[Path] = {tap / "capabilities" / "smalltalk"}
    listdir = os.listdir

    def guarded(path: str | os.PathLike[str]) -> list[str]:
        if Path(path) in refused:
            raise PermissionError(13, "Permission denied", str(path))
        return listdir(path)

    monkeypatch.setattr("capd.taps.os.listdir", guarded)
    catalog = load_catalog([tap])
    assert "smalltalk" not in catalog and "database-postgres" in catalog
    (problem,) = catalog.errors
    assert problem.capability == "smalltalk"
    assert "cannot list the capability folder: Permission denied" in problem.reason
    refused.add(tap / "capabilities")
    (problem,) = load_catalog([tap]).errors
    assert problem.file.endswith("capabilities") and "cannot list: Permission denied" in problem.reason


def test_hidden_files_are_not_tap_files(tmp_path: Path) -> None:
    """Emacs keeps ``.#<file>`` as a dangling link while a buffer is unsaved: it dropped the capability."""
    tap = octomind_tap(tmp_path)
    os.symlink("root@host.1234:1700000000", tap / "capabilities" / "database-postgres" / ".#postgres.toml")
    catalog = load_catalog([tap])
    assert "database-postgres" in catalog and not catalog.errors


def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    config = tap / "capabilities" / "smalltalk" / "config.toml"
    config.write_bytes(b"\xef\xbb\xbf" + config.read_bytes())
    catalog = load_catalog([tap])
    assert not catalog.errors and catalog.capabilities["smalltalk"].triggers[0] == "tell me about the weather today"


def test_dangling_and_looping_folder_links_are_reported(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    caps = tap / "capabilities"
    os.symlink("no-such-folder", caps / "ghost")
    os.symlink("loop-b", caps / "loop-a")
    os.symlink("loop-a", caps / "loop-b")
    (caps / "README.md").write_text("not a capability, and not an error")
    by_cap = {p.capability: p.reason for p in load_catalog([tap]).errors}
    assert set(by_cap) == {"ghost", "loop-a", "loop-b"}
    assert "'no-such-folder', which does not exist" in by_cap["ghost"] and "symlink loop" in by_cap["loop-a"]


def test_a_server_entrys_error_points_at_that_entry(tmp_path: Path) -> None:
    """The line used to be the first ``name =`` of the file (or none), whichever server was wrong."""
    tap = octomind_tap(tmp_path)
    provider = POSTGRES_PROVIDER + '\n[[mcp.servers]]\nname = 7\ncommand = "x"\n'
    write_capability(tap, "two", ["two servers here"], {"p": provider}, default="p")
    (problem,) = load_catalog([tap]).errors
    assert problem.reason == "mcp.servers[1].name must be a non-empty string"
    assert problem.line == provider.splitlines().index("name = 7") + 1


def test_a_change_naming_most_folders_rescans_the_tap_and_a_few_only_those(tmp_path: Path) -> None:
    """A checkout of the whole tap names most of its folders: the reload rescans the tap, which
    loads about what a partial reload would, without resolving every path. It then matches a
    fresh load, an edited folder the change did not name included. A change naming a few folders
    reloads those alone."""
    tap = octomind_tap(tmp_path)
    live = LiveTaps([tap])
    live.load()
    folders = sorted((tap / "capabilities").iterdir())
    for folder in folders:
        config = folder / "config.toml"
        added = 'triggers = [\n    "a trigger the checkout added",'
        config.write_text(config.read_text().replace("triggers = [", added))
    few = live.load([folders[0] / "config.toml"])
    assert "a trigger the checkout added" in few.capabilities[folders[0].name].triggers
    assert "a trigger the checkout added" not in few.capabilities[folders[-1].name].triggers
    most = live.load([folder / "config.toml" for folder in folders[:-2]])  # 3 of 5 named
    assert all("a trigger the checkout added" in capability.triggers for capability in most)
    assert most.capabilities == LiveTaps([tap]).load().capabilities
