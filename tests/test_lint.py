"""`capd lint`: each problem with its file and line, exit 1 on errors, 0 with only warnings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from capd.cli import main
from capd.settings import default_taps
from capd.taps import load_catalog
from tests.taputil import POSTGRES_PROVIDER, octomind_tap, write_capability


def _lint(*args: str) -> tuple[int, dict[str, object]]:
    result = CliRunner().invoke(main, ["lint", "--json", *args])
    return result.exit_code, json.loads(result.stdout)


def test_clean_tap_exits_zero(tmp_path: Path) -> None:
    code, report = _lint(str(octomind_tap(tmp_path)))
    assert code == 0
    counts = report["counts"]
    assert isinstance(counts, dict) and counts["error"] == 0
    problems = report["problems"]
    assert isinstance(problems, list)
    assert [p["code"] for p in problems] == ["routing-only"]


def test_warnings_only_exit_zero(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    write_capability(tap, "dupes", ["same trigger here", "same trigger here", "tiny"])
    write_capability(tap, "manual-only", None, {"p": POSTGRES_PROVIDER})
    code, report = _lint(str(tap))
    assert code == 0
    codes = {p["code"] for p in report["problems"]}  # type: ignore[union-attr]
    assert {"duplicate-trigger", "short-trigger", "no-triggers"} <= codes
    (manual,) = [p for p in report["problems"] if p["code"] == "no-triggers"]  # type: ignore[union-attr,index]
    assert manual["file"] == str(tap / "capabilities" / "manual-only")  # it has no config.toml to name


def test_two_servers_of_one_name_are_an_error_on_the_second(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    second = POSTGRES_PROVIDER.split("[[mcp.servers]]")[1]
    write_capability(tap, "twice", ["query the two postgres databases"],
                     {"p": POSTGRES_PROVIDER + "\n[[mcp.servers]]" + second.replace("server-postgres@0.6.2", "x")},
                     default="p")
    code, report = _lint(str(tap))
    assert code == 1
    (found,) = [p for p in report["problems"] if p["code"] == "duplicate-server"]  # type: ignore[union-attr,index]
    text = (tap / "capabilities" / "twice" / "p.toml").read_text()
    lines = [n for n, line in enumerate(text.splitlines(), start=1) if line == 'name = "postgres"']
    assert len(lines) == 2 and found["line"] == lines[1] and found["severity"] == "error"
    assert "named 'postgres'" in found["reason"]


def test_a_mistyped_key_is_named_and_other_tools_keys_are_not(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    folder = write_capability(tap, "typo", None)
    (folder / "config.toml").write_text('description = "x"\ntrigers = ["run the typo check"]\nowner = "ops"\n')
    code, report = _lint(str(tap))
    assert code == 0
    found = {p["code"]: p for p in report["problems"] if p["capability"] == "typo"}  # type: ignore[union-attr,index]
    assert set(found) == {"unknown-key", "no-triggers", "routing-only"}  # nothing about "owner"
    assert found["unknown-key"]["line"] == 2
    assert found["unknown-key"]["reason"] == "key 'trigers' is not one capd reads; did you mean 'triggers'?"


def test_broken_tap_lists_every_problem_with_file_and_line(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    write_capability(tap, "bad-toml", None)
    (tap / "capabilities" / "bad-toml" / "config.toml").write_text('triggers = ["a",\n"b" "c"]\n')
    write_capability(tap, "bad-ref", ["a capability with a bad ref"],
                     {"p": POSTGRES_PROVIDER.replace('server_refs = ["postgres"]', 'server_refs = ["pg"]')
                      .replace('allowed_tools = ["postgres:*"]', 'allowed_tools = ["other:*"]')})
    write_capability(tap, "shared", ["query a postgres database"])  # same as database-postgres
    (tap / "capabilities" / "dangling").mkdir()
    (tap / "capabilities" / "dangling" / "default.toml").symlink_to("nowhere.toml")
    code, report = _lint(str(tap))
    assert code == 1
    problems = {(p["code"], p["capability"]): p for p in report["problems"]}  # type: ignore[union-attr]
    assert problems[("invalid", "bad-toml")]["line"] == 2
    ref = problems[("unknown-server-ref", "bad-ref")]
    assert ref["severity"] == "error" and ref["line"] == 7 and str(ref["file"]).endswith("bad-ref/p.toml")
    assert problems[("unknown-tool-server", "bad-ref")]["severity"] == "warning"
    shared = problems[("shared-trigger", "shared")]
    assert shared["severity"] == "error" and shared["line"] == 2
    assert "does not exist" in str(problems[("invalid", "dangling")]["reason"])


def test_text_output_and_console_script(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    write_capability(tap, "bad-schema", None)
    (tap / "capabilities" / "bad-schema" / "config.toml").write_text("triggers = 3\n")
    proc = subprocess.run([sys.executable, "-m", "capd", "lint", str(tap)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 1
    assert "bad-schema/config.toml: line 1: error: triggers must be a list of strings" in proc.stderr
    assert "errors" in proc.stdout
    assert proc.stderr.count("triggers must be a list of strings") == 1, proc.stderr  # not logged as well
    assert "tap problem" not in proc.stderr


def test_usage_error_exits_two() -> None:
    result = CliRunner().invoke(main, ["lint", "--no-such-flag"])
    assert result.exit_code == 2


def test_shipped_tap_is_lint_clean() -> None:
    taps = default_taps()
    assert taps
    code, report = _lint(*[str(t) for t in taps])
    assert code == 0, report
    assert isinstance(report["capabilities"], int) and report["capabilities"] >= 25
    counts = report["counts"]
    assert isinstance(counts, dict) and counts["warning"] == 0


def test_one_server_name_two_specs_across_capabilities_is_a_warning(tmp_path: Path) -> None:
    """A session with both runs one process by that name; an edit to one copy of a shared server
    made them differ without a word."""
    tap = octomind_tap(tmp_path)
    write_capability(tap, "postgres-admin", ["administer the postgres server"],
                     {"p": POSTGRES_PROVIDER.replace("server-postgres@0.6.2", "server-postgres@0.7.0")}, default="p")
    write_capability(tap, "postgres-same", ["report on the postgres tables"], {"p": POSTGRES_PROVIDER}, default="p")
    code, report = _lint(str(tap))
    conflicts = [p for p in report["problems"] if p["code"] == "server-conflict"]  # type: ignore[union-attr,index]
    assert code == 0 and [c["capability"] for c in conflicts] == ["postgres-admin"], conflicts
    assert conflicts[0]["severity"] == "warning" and "'postgres' is also defined by 'database-postgres'" in str(
        conflicts[0]["reason"])


def test_a_rule_named_by_a_later_tap_that_another_overrides_is_a_warning(tmp_path: Path) -> None:
    """The first tap naming a rule decides for every tap: a later tap naming another routes with a
    rule its author did not name, and lint says so on the line; the same rule twice is fine."""
    first, second = octomind_tap(tmp_path / "a"), octomind_tap(tmp_path / "b")
    (first / "capd.toml").write_text('rule = "fused"\n')
    (second / "capd.toml").write_text('# ours\n[gates]\nthreshold = 0.5\n\n[notes]\nrule = "x"\n')
    def ignored_rules() -> list[object]:
        return [p for p in _lint(str(first), str(second))[1]["problems"]  # type: ignore[attr-defined]
                if p["code"] == "rule-ignored"]

    assert ignored_rules() == []  # a rule key in a table of the author's own is not capd's
    (second / "capd.toml").write_text('# ours\nrule = "capd"\n[gates]\nthreshold = 0.5\n')
    code, report = _lint(str(first), str(second))
    (ignored,) = [p for p in report["problems"] if p["code"] == "rule-ignored"]  # type: ignore[union-attr,index]
    assert code == 0 and (ignored["file"], ignored["line"], ignored["severity"]) == (
        str(second / "capd.toml"), 2, "warning")
    assert f"rule 'capd' is not used: {first / 'capd.toml'} names 'fused' first" in ignored["reason"]
    (second / "capd.toml").write_text('rule = "fused"\n')
    assert ignored_rules() == []


def test_each_trigger_finding_points_at_the_string_it_is_about(tmp_path: Path) -> None:
    """Lines come from the trigger strings as TOML reads them: not the first line that merely
    contains the text (the description, a comment, a longer trigger), and a repeat is the second one."""
    tap = octomind_tap(tmp_path)
    folder = write_capability(tap, "gitlog", None)
    (folder / "config.toml").write_text(
        'description = "show git log history"\n'      # 1: contains both triggers below
        "triggers = [\n"                               # 2
        '  "show git log history", # "git log"\n'      # 3
        "  'git log',\n"                               # 4: short
        '  """look at the\n'                           # 5: multi-line
        'commit history""",\n'                        # 6
        '  "Show Git Log History",\n'                  # 7: repeat of line 3
        '  "say \\"hi\\" to the log",\n'               # 8: escapes
        "]\n")
    other = write_capability(tap, "other", None)
    (other / "config.toml").write_text('triggers = [\n  "open the dashboard",\n  "SAY \\"HI\\" TO THE LOG",\n]\n')
    _, report = _lint(str(tap))
    found = {(p["capability"], p["code"]): p["line"] for p in report["problems"]}  # type: ignore[union-attr,index]
    assert found[("gitlog", "short-trigger")] == 4
    assert found[("gitlog", "duplicate-trigger")] == 7
    shared = [p for p in report["problems"] if p["code"] == "shared-trigger"]  # type: ignore[union-attr,index]
    assert [(p["capability"], p["line"]) for p in shared] == [("other", 3)]  # type: ignore[index]


def test_an_empty_trigger_is_reported_on_its_own_line(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    folder = write_capability(tap, "blank", None)
    (folder / "config.toml").write_text('triggers = [\n  "a real trigger here",\n  "   ",\n]\n')
    _, report = _lint(str(tap))
    (found,) = [p for p in report["problems"] if p["code"] == "invalid"  # type: ignore[union-attr,index]
                and "empty strings" in str(p["reason"])]  # type: ignore[index]
    assert found["line"] == 3  # type: ignore[index]


def test_fixture_files_are_linted_line_by_line(tmp_path: Path) -> None:
    """Every line `capd test` would refuse is listed (not only the first), and rows that cannot
    measure routing are warned about, each with its line."""
    tap = octomind_tap(tmp_path)
    (tap / "fixtures").mkdir()
    rows = [
        {"message": "show me the columns of the users table", "expect": "database-postgres"},  # 1: fine
        "{not json",                                                                           # 2
        {"message": "open the staging dashboard please", "expect": "dashboards"},              # 3: unknown
        {"message": "Show me the columns of the  users table", "expect": "database-postgres"},  # 4: repeat of 1
        {"message": "show me the columns of the users table", "expect": None},                  # 5: conflicts with 1
        {"message": "<ctx>logs</ctx> ls", "expect": "filesystem-read"},                         # 6: too short
        {"message": "Read a file from disk", "expect": "filesystem-read"},                      # 7: a trigger
        {"message": "hi", "expect": None},  # 8: a short null: fine
        {"message": "x", "expect": "smalltalk", "kidn": "typo"},                                # 9: unknown key
    ]
    (tap / "fixtures" / "routing.jsonl").write_text(
        "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    code, report = _lint(str(tap))
    assert code == 1
    found = [(p["code"], p["line"]) for p in report["problems"]  # type: ignore[union-attr,index]
             if str(p["code"]).startswith("fixture")]  # type: ignore[index]
    assert found == [("fixture-invalid", 2), ("fixture-invalid", 3), ("fixture-invalid", 9),
                     ("fixture-duplicate", 4), ("fixture-conflict", 5), ("fixture-short", 6),
                     ("fixture-is-trigger", 7)]
    by_line = {p["line"]: p for p in report["problems"]}  # type: ignore[union-attr,index]
    assert "unknown capability 'dashboards'" in by_line[3]["reason"]  # type: ignore[index,operator]
    assert "line 1" in by_line[5]["reason"]  # type: ignore[index,operator]
    assert str(by_line[2]["file"]).endswith("fixtures/routing.jsonl")  # type: ignore[index]


def test_a_message_repeated_in_another_fixture_file_of_the_tap_is_found(tmp_path: Path) -> None:
    """`capd test` runs a tap's fixture files together: a conflict between two of them passed lint."""
    tap = octomind_tap(tmp_path)
    (tap / "fixtures").mkdir()
    message = "show me the columns of the users table"
    (tap / "fixtures" / "a.jsonl").write_text(json.dumps({"message": message, "expect": "database-postgres"}) + "\n")
    (tap / "fixtures" / "b.jsonl").write_text("\n" + json.dumps({"message": message, "expect": None}) + "\n")
    _, report = _lint(str(tap))
    (found,) = [p for p in report["problems"] if p["code"] == "fixture-conflict"]  # type: ignore[union-attr,index]
    assert str(found["file"]).endswith("b.jsonl") and found["line"] == 2  # type: ignore[index]
    assert "the same message as a.jsonl line 1" in found["reason"]  # type: ignore[index,operator]


@pytest.mark.parametrize(("text", "line", "reason"), [
    ("[floors]\nmin_top1 = 0.5\n[floor.kinds]\nchitchat = 1.0\n", 3, "floor: not part of [floors]"),
    ('[floors]\nmin_top1 = "high"\n', 2, "min_top1"),
    ("[floors.fused]\nmin_top1 = 2\n", 2, "min_top1"),  # another rule's table: `capd test --rule fused` stops
])
def test_a_floors_file_capd_test_refuses_fails_lint(tmp_path: Path, text: str, line: int, reason: str) -> None:
    """lint passed a floors.toml that `capd test` then refused: clean, then a failed run."""
    tap = octomind_tap(tmp_path)
    (tap / "fixtures").mkdir()
    (tap / "fixtures" / "floors.toml").write_text(text)
    code, report = _lint(str(tap))
    (found,) = [p for p in report["problems"] if p["code"] == "floors-invalid"]  # type: ignore[union-attr,index]
    assert code == 1 and found["line"] == line and reason in found["reason"]  # type: ignore[index,operator]
    assert str(found["file"]).endswith("fixtures/floors.toml")  # type: ignore[index]
    (tap / "fixtures" / "floors.toml").write_text("[floors]\nmin_top1 = 0.5\n")
    _, report = _lint(str(tap))
    assert not [p for p in report["problems"] if p["code"] == "floors-invalid"]  # type: ignore[union-attr,index]


def test_a_fixture_expecting_a_capability_that_failed_to_load_says_so(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    folder = write_capability(tap, "broken", None)
    (folder / "config.toml").write_text("triggers = [\n")
    (tap / "fixtures").mkdir()
    (tap / "fixtures" / "f.jsonl").write_text(json.dumps({"message": "run the broken thing", "expect": "broken"}))
    _, report = _lint(str(tap))
    (found,) = [p for p in report["problems"] if p["code"] == "fixture-invalid"]  # type: ignore[union-attr,index]
    assert "'broken', which failed to load" in found["reason"] and found["line"] == 1  # type: ignore[index,operator]


def test_server_entries_octomind_would_skip_are_warned_about(tmp_path: Path) -> None:
    """octomind requires type (builtin, http or stdio), timeout_seconds and tools, command for stdio
    and url for http, and skips an entry without them; capd planned them as written (no type: stdio)."""
    tap = octomind_tap(tmp_path)
    provider = ('[roles.mcp]\nserver_refs = ["a", "b", "c"]\n\n'
                '[[mcp.servers]]\nname = "a"\ncommand = "run-a"\n\n'  # line 5: no type, timeout, tools
                '[[mcp.servers]]\nname = "b"\ntype = "http"\ntimeout_seconds = 5\ntools = []\n\n'  # line 9: no url
                '[[mcp.servers]]\nname = "c"\ntype = "stdin"\ncommand = "c"\ntimeout_seconds = 5\ntools = []\n')
    write_capability(tap, "loose", ["start the loose servers"], {"p": provider}, default="p")
    code, report = _lint(str(tap))
    assert code == 0  # warnings: capd itself can plan them
    found = [(p["code"], p["line"], p["reason"]) for p in report["problems"]  # type: ignore[union-attr,index]
             if p["capability"] == "loose" and str(p["code"]).startswith("server")]  # type: ignore[index]
    assert [(c, line) for c, line, _ in found] == [("server-incomplete", 5), ("server-incomplete", 9),
                                                   ("server-type", 15)]
    assert "'a' has no type, timeout_seconds, tools" in found[0][2] and "has no url" in found[1][2]


def test_servers_no_server_refs_name_are_warned_about(tmp_path: Path) -> None:
    """capd starts every server a provider defines when server_refs names none; octomind, reading the
    same tap, starts none. The finding points at [roles.mcp], or without it at the first server's name."""
    tap = octomind_tap(tmp_path)
    server = '[[mcp.servers]]\nname = "a"\ntype = "stdio"\ncommand = "a"\ntimeout_seconds = 5\ntools = []\n'
    write_capability(tap, "bare", ["start the bare server"], {"p": "# Title: bare\n\n" + server}, default="p")
    write_capability(tap, "empty", ["start the other server"], {"p": "[roles.mcp]\nallowed_tools = []\n\n" + server},
                     default="p")
    code, report = _lint(str(tap))
    found = sorted((p["capability"], p["line"]) for p in report["problems"]  # type: ignore[union-attr,index]
                   if p["code"] == "no-server-refs")  # type: ignore[index]
    assert code == 0 and found == [("bare", 4), ("empty", 1)]  # the server's name line, as for other server findings
    assert not [p for p in report["problems"] if p["code"] == "no-server-refs"  # type: ignore[union-attr,index]
                and p["capability"] == "database-postgres"]  # type: ignore[index]


def test_a_referenced_server_no_pattern_grants_is_not_started_and_lint_says_so(tmp_path: Path) -> None:
    """It was planned with ``tools: []``, a server the agent could call nothing on; octomind drops it."""
    tap = octomind_tap(tmp_path)
    provider = ('[roles.mcp]\nserver_refs = ["a", "b"]\nallowed_tools = ["a:*"]\n\n'
                '[[mcp.servers]]\nname = "a"\ntype = "stdio"\ncommand = "a"\ntimeout_seconds = 5\ntools = []\n\n'
                '[[mcp.servers]]\nname = "b"\ntype = "stdio"\ncommand = "b"\ntimeout_seconds = 5\ntools = []\n')
    write_capability(tap, "pair", ["start the pair of servers"], {"p": provider}, default="p")
    catalog = load_catalog((tap,))
    pair = catalog.get("pair")
    assert pair is not None and [s.name for s in pair.servers] == ["a"] and pair.ungranted == ("b",)
    _, report = _lint(str(tap))
    (found,) = [p for p in report["problems"] if p["code"] == "ungranted-server"]  # type: ignore[union-attr,index]
    assert found["line"] == 3 and "'b' is referenced" in found["reason"]  # type: ignore[index,operator]
