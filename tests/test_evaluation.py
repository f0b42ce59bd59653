"""Metrics on a hand-computed case, calibration limits, `capd test` floors and JUnit, the HTML report."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from capd.calibrate import COSINE_GRID, best_point, fit_gates, score_variants, small_part_warnings, split, sweep
from capd.cli import main
from capd.errors import FixtureError
from capd.evaluation import ScoreTable, apply_gates, breakdown, embed_fixtures, failing_rows, metrics
from capd.fixtures import Fixture, load_fixtures
from capd.floors import junit_xml, load_floors, row_line, rows_against
from capd.service import Service
from capd.settings import Settings, default_taps
from capd.vetoes import abstain_corpus
from tests.conftest import SettingsFactory
from tests.taputil import octomind_tap, write_capability


def _table() -> ScoreTable:
    names = ("a", "b", "c")
    rows = [
        # message, expect, kind, scores
        ("m1", ("a",), "positive", [0.70, 0.20, 0.10]),  # fires a: right
        ("m2", ("b",), "positive", [0.60, 0.55, 0.10]),  # margin 0.05 < 0.1: abstains (top1 wrong anyway)
        ("m3", ("c",), "positive", [0.10, 0.20, 0.35]),  # below threshold 0.4: abstains, top1 right
        ("m4", ("a", "b"), "ambiguous", [0.30, 0.80, 0.10]),  # fires b: right (list)
        ("m5", ("c",), "positive", [0.90, 0.10, 0.20]),  # fires a: wrong
        ("m6", (), "null", [0.50, 0.10, 0.10]),  # fires a on a null
        ("m7", (), "null", [0.30, 0.20, 0.10]),  # abstains
    ]
    fixtures = tuple(Fixture(m, e, k, f"x.jsonl:{i}") for i, (m, e, k, _) in enumerate(rows, 1))
    scores = np.array([r[3] for r in rows], dtype=np.float32)
    expected = np.array([[n in r[1] for n in names] for r in rows])
    return ScoreTable(fixtures, names, scores, np.ones(len(rows), dtype=bool), expected)


def test_failing_rows_say_which_gate_decided_each_row() -> None:
    table = _table()
    rows = {r["message"]: r for r in failing_rows(table, apply_gates(table, 0.4, 0.1), 0.4, 0.1)}
    assert sorted(rows) == ["m2", "m3", "m5", "m6"]  # every row decided wrong, and only those
    assert rows["m2"]["why"] == "margin below 0.100" and rows["m2"]["got"] is None
    assert rows["m3"]["why"] == "score below threshold 0.400"
    assert rows["m5"]["why"] == rows["m6"]["why"] == "activated" and rows["m5"]["got"] == "a"
    # per-capability gates are read at the row's winner (as the router reads its tap's)
    per = failing_rows(table, apply_gates(table, np.array([0.4, 0.4, 0.3]), 0.1), np.array([0.4, 0.4, 0.3]), 0.1)
    assert "m3" not in {r["message"] for r in per}
    # the other gates, in the router's order: too short, then coverage, then a veto
    short = replace(table, routable=np.array([True, True, False, True, True, True, True]))
    assert failing_rows(short, apply_gates(short, 0.4, 0.1), 0.4, 0.1)[1]["why"].startswith("too short")
    covered = replace(table, coverage=np.array([0.2, 1, 1, 1, 1, 1, 1], dtype=np.float32))
    (first, *_) = failing_rows(covered, apply_gates(covered, 0.4, 0.1, 0.5), 0.4, 0.1, 0.5)
    assert first["message"] == "m1" and first["why"] == "coverage 0.200 below 0.500"
    vetoed = replace(table, vetoed=np.array([True, False, False, False, False, False, False]))
    (first, *_) = failing_rows(vetoed, apply_gates(vetoed, 0.4, 0.1), 0.4, 0.1)
    assert first["message"] == "m1" and first["why"].startswith("vetoed")
    assert row_line(rows["m2"]) == ("x.jsonl:2: 'm2' expected ['b'], got None (best a 0.600, margin 0.050; "
                                    "margin below 0.100)")


def test_metrics_hand_computed() -> None:
    table = _table()
    outcome = apply_gates(table, 0.4, 0.1)
    result = metrics(table, outcome)
    assert result == {"n": 7, "positives": 5, "nulls": 2, "top1": 0.6, "fired_right": 0.4, "fired_wrong": 0.2,
                      "null_fpr": 0.5, "skipped": 0}
    details = breakdown(table, outcome)
    assert details["per_kind"]["ambiguous"]["accuracy"] == 1.0
    assert details["per_kind"]["null"]["accuracy"] == 0.5
    assert details["per_capability"]["c"] == {"n": 2, "fired_right": 0, "recall": 0.0}
    assert {"expected": "c", "got": "a", "count": 1, "fired": 1} in details["confusions"]  # m5 fired a
    assert {"expected": "b", "got": "a", "count": 1, "fired": 0} in details["confusions"]  # m2 ranked a, abstained


def test_skipped_rows_abstain() -> None:
    table = _table()
    short = ScoreTable(table.fixtures, table.names, table.scores, np.zeros(7, dtype=bool), table.expected)
    result = metrics(short, apply_gates(short, 0.0, 0.0))
    assert result["fired_right"] == 0.0 and result["null_fpr"] == 0.0 and result["skipped"] == 7
    assert result["top1"] == 0.6  # gates (the length gate included) do not change top1


def test_a_vetoed_winner_abstains_in_metrics_and_in_calibration() -> None:
    """A learned abstain (capd.vetoes.Vetoes) vetoing m6's winner: m6 no longer fires, at any gates."""
    table = _table()
    vetoed = replace(table, vetoed=np.array([False] * 5 + [True, False]))
    assert metrics(table, apply_gates(table, 0.4, 0.1))["null_fpr"] == 0.5
    assert metrics(vetoed, apply_gates(vetoed, 0.4, 0.1))["null_fpr"] == 0.0
    assert metrics(vetoed, apply_gates(vetoed, 0.4, 0.1))["fired_right"] == 0.4  # the positives are untouched
    assert vetoed.subset(np.array([5, 6])).vetoed.tolist() == [True, False]  # type: ignore[union-attr]
    grid = COSINE_GRID
    above_m7 = grid.thresholds > 0.3 + 1e-6  # m7 (a null at 0.30) fires below this
    null_before, null_after = sweep(table, grid)[2], sweep(vetoed, grid)[2]
    assert (null_after[above_m7] == 0).all()
    assert (null_before[above_m7 & (grid.thresholds <= 0.5)] > 0).any()


def test_best_point_respects_limits() -> None:
    table = _table()
    point, curve = best_point({3: table}, max_null_fpr=0.0, max_wrong=0.0)
    assert point is not None
    assert point.null_fpr == 0.0 and point.fired_wrong == 0.0
    # m5 fires the wrong capability at 0.90 with margin 0.70, so only gates that stop m5 qualify.
    outcome = apply_gates(table, point.threshold, point.margin)
    assert metrics(table, outcome)["null_fpr"] == 0.0
    assert all(p.null_fpr == 0.0 and p.fired_wrong == 0.0 for p in curve)


def _random_fused_table(rng: np.random.Generator, rows: int = 300) -> ScoreTable:
    """Random fused-like rows: levels, fused scores with exact ties and a one-column case's inf gap
    stand-in, coverage with NaN (no token vectors), unroutable and vetoed rows, nulls and lists."""
    names = ("a", "b", "c", "d")
    scores = rng.normal(0, 3, (rows, 4)).astype(np.float32)
    scores[::17, 1] = scores[::17, 0]  # exact ties: gap 0
    levels = np.round(rng.uniform(-0.7, 0.5, (rows, 4)), 2).astype(np.float32)  # on grid steps, too
    coverage = np.round(rng.uniform(0.1, 1.0, rows), 3).astype(np.float32)
    coverage[::11] = np.nan
    expect = [() if r % 5 == 0 else ((names[r % 4],) if r % 7 else (names[r % 4], names[(r + 1) % 4]))
              for r in range(rows)]
    fixtures = tuple(Fixture(f"m{r}", e, "null" if not e else "positive", f"x:{r}") for r, e in enumerate(expect))
    expected = np.array([[n in e for n in names] for e in expect])
    return ScoreTable(fixtures, names, scores, rng.uniform(size=rows) > 0.05, expected, levels,
                      rng.uniform(size=rows) < 0.05, coverage)


def test_sweep_counts_exactly_what_applying_each_grid_point_gives() -> None:
    """The histogram sweep against the definition: apply every (threshold, margin, coverage) of the
    fused grid to every row and count (with NaN coverage passing, and coverage 0 no gate)."""
    from capd.calibrate import FUSED_GRID

    table = _random_fused_table(np.random.default_rng(7))
    right, wrong, null = sweep(table, FUSED_GRID)
    positive = table.positive
    for t in range(0, len(FUSED_GRID.thresholds), 7):
        for m in range(0, len(FUSED_GRID.margins), 9):
            for v in range(0, len(FUSED_GRID.coverages), 5):
                outcome = apply_gates(table, float(FUSED_GRID.thresholds[t]), float(FUSED_GRID.margins[m]),
                                      float(FUSED_GRID.coverages[v]))
                fired_right = (outcome.fired & outcome.correct & positive).sum() / positive.sum()
                fired_wrong = (outcome.fired & ~outcome.correct & positive).sum() / positive.sum()
                null_fpr = (outcome.fired & ~positive).sum() / (~positive).sum()
                assert (right[t, m, v], wrong[t, m, v], null[t, m, v]) == pytest.approx(
                    (fired_right, fired_wrong, null_fpr), abs=1e-12), (t, m, v)


def test_calibration_picks_a_coverage_gate_when_it_is_what_separates_nulls() -> None:
    """Nulls as high-level and wide-gap as the positives but poorly covered: only the coverage gate
    keeps them out, so the recommended point has one; without coverage figures it has none."""
    from capd.calibrate import FUSED_GRID

    rng = np.random.default_rng(3)
    table = _random_fused_table(rng, rows=400)
    positive = table.positive
    coverage = np.where(positive, rng.uniform(0.6, 1.0, len(positive)), rng.uniform(0.2, 0.5, len(positive)))
    levels = np.where(positive[:, None], 0.2, 0.2).astype(np.float32) + np.zeros_like(table.levels)
    gated = replace(table, coverage=coverage.astype(np.float32), levels=levels, vetoed=None,
                    routable=np.ones(len(positive), dtype=bool))
    point, _ = best_point({3: gated}, max_null_fpr=0.0, max_wrong=1.0, grid=FUSED_GRID)
    assert point is not None and 0.5 <= point.coverage <= 0.6 and point.null_fpr == 0.0
    assert point.fired_right == pytest.approx(float((positive & gated.expected[
        np.arange(len(positive)), gated.scores.argmax(axis=1)]).sum() / positive.sum()), abs=1e-4)
    without, _ = best_point({3: replace(gated, coverage=None)}, max_null_fpr=0.0, max_wrong=1.0, grid=FUSED_GRID)
    assert without is not None and without.coverage == 0.0 and without.fired_right < point.fired_right / 10


def test_split_is_deterministic_and_disjoint() -> None:
    fixtures = [Fixture(f"message {i}", ("a",), "positive", f"x:{i}") for i in range(500)]
    fit, held = split(fixtures)
    _, held2 = split(list(reversed(fixtures)))
    assert set(fit).isdisjoint(held) and len(fit) + len(held) == 500
    assert 100 < len(held) < 200
    assert {fixtures[i].message for i in held} == {fixtures[::-1][i].message for i in held2}


def test_fixture_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_text('{"message": "fine", "expect": null}\n\n{"message": 3, "expect": "a"}\n')
    with pytest.raises(FixtureError, match=r"f.jsonl: line 3: 'message' must be a string"):
        load_fixtures([path])
    path.write_text('{"message": "x", "expect": []}\n')
    with pytest.raises(FixtureError, match="line 1"):
        load_fixtures([path])
    path.write_text('{"message": "fine", "expect": null}\n{"message": "show the commits", "expects": "git"}\n')
    with pytest.raises(FixtureError, match=r"line 2: unknown key 'expects' \(the keys are message, expect, kind\)"):
        load_fixtures([path])  # it was read as a row that must abstain
    path.write_text('{"message": "show the commits", "kind": "positive"}\n')
    with pytest.raises(FixtureError, match="line 1: missing 'expect'"):
        load_fixtures([path])
    for end in (b"\n", b"\r\n", b"\r"):  # every line end the reader takes (old Mac ones were counted as none)
        path.write_bytes(end.join([b'{"message": "fine", "expect": null}', b'{"message": "ok", "expect": null}',
                                   b'{"message": "caf\xe9", "expect": null}', b""]))
        with pytest.raises(FixtureError, match=r"line 3: not UTF-8 text \(byte 0xe9\)"):
            load_fixtures([path])


def test_fixture_files_without_a_row_are_an_error(tmp_path: Path) -> None:
    """Also beside a file with rows: an empty file next to real ones used to pass unnoticed."""
    path, full = tmp_path / "f.jsonl", tmp_path / "full.jsonl"
    path.write_text("\n# nothing yet\n")
    full.write_text('{"message": "fine", "expect": null}\n')
    for paths in ([path], [full, path], [path, full]):
        with pytest.raises(FixtureError, match=r"f\.jsonl: no fixture rows"):
            load_fixtures(paths)


def test_a_floor_with_nothing_to_measure_fails(tmp_path: Path, settings_factory: SettingsFactory) -> None:
    """Only positives, and a null_fpr floor: n/a used to pass (a kind floor with no rows failed)."""
    tap = _tap_with_fixtures(tmp_path / "tap", "[floors]\nmin_top1 = 0.0\nmax_null_fpr = 0.05\n")
    routing = tap / "fixtures" / "routing.jsonl"
    rows = [line for line in routing.read_text().splitlines() if '"expect": null' not in line]
    routing.write_text("".join(line + "\n" for line in rows))
    data = ["--model", "hash", "--data-dir", str(settings_factory().data_dir)]
    result = CliRunner().invoke(main, ["test", str(tap), *data])
    assert result.exit_code == 1 and "FAIL null_fpr n/a <= 0.05" in result.output, result.output


def test_fixtures_may_start_with_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"message": "fine", "expect": null}\n')
    assert [f.message for f in load_fixtures([path])] == ["fine"]


def test_fixture_lines_end_only_at_line_breaks(tmp_path: Path) -> None:
    """JSON allows U+2028, U+2029 and U+0085 raw in a string; str.splitlines broke the row there
    ("invalid JSON: Unterminated string") and shifted every later line number."""
    path = tmp_path / "f.jsonl"
    rows = ['{"message": "a\u2028docker\u2029b\u0085c", "expect": "docker"}', '{"message": "x", "expect": null}',
            '{"message": 3, "expect": null}']
    path.write_bytes("\r\n".join(rows).encode("utf-8"))
    with pytest.raises(FixtureError, match="line 3: 'message' must be a string"):
        load_fixtures([path])
    path.write_bytes("\r".join(rows[:2]).encode("utf-8"))  # old Mac line ends still count
    assert [f.message for f in load_fixtures([path])] == ["a\u2028docker\u2029b\u0085c", "x"]


def test_a_fixture_message_with_a_lone_surrogate_names_its_line(tmp_path: Path) -> None:
    """It reached the tokenizer, whose TypeError came out as a traceback without file or line."""
    path = tmp_path / "f.jsonl"
    path.write_text('{"message": "fine", "expect": null}\n{"message": "\\ud83d oops", "expect": null}\n')
    with pytest.raises(FixtureError, match=r"f.jsonl: line 2: 'message' has a lone surrogate at character 0"):
        load_fixtures([path])


def test_a_fixture_key_given_twice_names_its_line(tmp_path: Path) -> None:
    """JSON let the last value win: ``"expect": "git", …, "expect": null`` silently made a null row."""
    path = tmp_path / "f.jsonl"
    path.write_text('{"message": "fine", "expect": null}\n{"message": "x", "expect": "git", "expect": null}\n')
    with pytest.raises(FixtureError, match=r"f.jsonl: line 2: key 'expect' given twice"):
        load_fixtures([path])


def test_a_fixture_row_nested_too_deeply_names_its_line(tmp_path: Path) -> None:
    """json's RecursionError came out of eval / test / calibrate as a traceback."""
    path = tmp_path / "f.jsonl"
    path.write_text('{"message": "fine", "expect": null}\n{"message": "x", "expect": ' + "[" * 5000 + "]" * 5000
                    + "}\n")
    with pytest.raises(FixtureError, match=r"f.jsonl: line 2: invalid JSON: arrays or objects nested too deeply"):
        load_fixtures([path])


def test_calibrate_without_a_positive_to_fit_on_recommends_and_writes_nothing(
        tmp_path: Path, settings_factory: SettingsFactory) -> None:
    """Every point tied at fired_right 0 and the tie went to the gates that fire least: --write stored
    threshold 1.0, which switched the tap's routing off, and the command exited 0."""
    tap = _tap_with_fixtures(tmp_path / "tap", "[floors]\nmin_top1 = 0.0\n")
    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text("".join(json.dumps({"message": f"my cat sleeps on the sofa, day {i}", "expect": None}) + "\n"
                             for i in range(8)))
    data = ["--model", "hash", "--data-dir", str(settings_factory().data_dir)]
    result = CliRunner().invoke(main, ["calibrate", "--tap", str(tap), "--fixtures", str(nulls), "--write", *data])
    assert result.exit_code == 1, result.output
    assert "no positive row to fit on (0 positive rows in all" in result.stderr
    assert not (tap / "capd.toml").exists()
    result = CliRunner().invoke(main, ["calibrate", "--tap", str(tap), "--fixtures", str(nulls), "--json", *data])
    assert result.exit_code == 1 and json.loads(result.output)["recommended"] is None


def test_calibrate_write_needs_the_tap_named(tmp_path: Path, settings_factory: SettingsFactory,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --tap, --write stored the gates in the taps of the settings: with none configured,
    the shipped taps inside capd's own install. A write names its target."""
    tap = _tap_with_fixtures(tmp_path / "tap", "[floors]\nmin_top1 = 0.0\n")
    data = ["--model", "hash", "--data-dir", str(settings_factory().data_dir)]
    monkeypatch.setenv("CAPD_TAPS", str(tap))
    fixtures = str(tap / "fixtures" / "routing.jsonl")
    result = CliRunner().invoke(main, ["calibrate", "--fixtures", fixtures, "--write", *data])
    assert result.exit_code == 2 and "--write needs --tap" in result.stderr, result.output
    assert not (tap / "capd.toml").exists()
    result = CliRunner().invoke(main, ["calibrate", "--fixtures", fixtures, *data])  # no write: taps as configured
    assert result.exit_code in (0, 1) and "fit on" in result.stdout, result.output


def _tap_with_fixtures(tmp_path: Path, floors: str) -> Path:
    tap = octomind_tap(tmp_path)
    fixtures = tap / "fixtures"
    fixtures.mkdir()
    rows = [
        {"message": "run a query on the postgres database please", "expect": "database-postgres"},
        {"message": "open the file and read what is inside it", "expect": "filesystem-read"},
        {"message": "create a python virtualenv and run pytest", "expect": "python-toolchain"},
        {"message": "write this text into a brand new file on disk", "expect": "filesystem-write"},
        {"message": "my cat likes to sleep on the sofa all afternoon", "expect": None, "kind": "off-topic"},
    ]
    (fixtures / "routing.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (fixtures / "floors.toml").write_text(floors)
    return tap


def test_capd_test_holds_each_tap_to_the_rule_it_names(tmp_path: Path) -> None:
    """Two taps, one naming anchor in its capd.toml and one naming none: each is tested with its own
    rule and that rule's floors, and the text says which rule and why; --rule names one for both."""
    named = _tap_with_fixtures(tmp_path / "a", "[floors]\nmin_top1 = 0\n[floors.anchor]\nmin_top1 = 0.1\n")
    (named / "capd.toml").write_text('rule = "anchor"\n')
    plain = _tap_with_fixtures(tmp_path / "b", "[floors]\nmin_top1 = 0\n")
    args = ["test", str(named), str(plain), "--model", "hash", "--data-dir", str(tmp_path / "data")]
    report = json.loads(CliRunner().invoke(main, [*args, "--json"]).stdout)
    assert [(r["rule"], r["rule_from"], r["floors_table"]) for r in report["taps"]] == [
        ("anchor", str(named / "capd.toml"), "floors.anchor"), ("capd", "default", "floors")]
    text = CliRunner().invoke(main, args).output
    assert f"  rule anchor (named by {named / 'capd.toml'}), floors from [floors.anchor] over [floors]" in text
    assert "  rule capd, floors from [floors]" in text
    report = json.loads(CliRunner().invoke(main, [*args, "--rule", "fused", "--json"]).stdout)
    assert [(r["rule"], r["rule_from"]) for r in report["taps"]] == [("fused", "settings")] * 2


def test_capd_test_pass_fail_and_junit(tmp_path: Path, model_settings: Settings) -> None:
    data = ["--data-dir", str(model_settings.data_dir)]
    good = _tap_with_fixtures(tmp_path / "good", "[floors]\nmin_top1 = 0.75\nmax_null_fpr = 0.0\n")
    result = CliRunner().invoke(main, ["test", str(good), *data, "--junit", str(tmp_path / "good.xml")])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output
    bad = _tap_with_fixtures(tmp_path / "bad", "[floors]\nmin_fired_right = 1.0\n[floors.kinds]\noff-topic = 1.0\n"
                             "missing-kind = 0.5\n")
    junit = tmp_path / "bad.xml"
    result = CliRunner().invoke(main, ["test", str(bad), *data, "--junit", str(junit)])
    assert result.exit_code == 1
    assert "FAIL" in result.output and "kind:missing-kind" in result.output
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and int(suite.get("failures", "0")) >= 1
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert "kind:missing-kind" in failed
    assert {p.get("name"): p.get("value") for p in suite.iter("property")} == {"rule": "capd",
                                                                               "floors_table": "floors"}
    broken = _tap_with_fixtures(tmp_path / "broken", "[floors]\nmin_recall = 0.5\n")
    result = CliRunner().invoke(main, ["test", str(broken), *data])
    assert result.exit_code == 1 and "unknown floor" in result.output
    table = _tap_with_fixtures(tmp_path / "table", "[floors]\nmin_top1 = 0.5\n\n[floors.capabilities]\ngit = 0.9\n")
    result = CliRunner().invoke(main, ["test", str(table), *data])  # a table of its own: its header's line
    assert result.exit_code == 1 and "floors.toml: line 4: floors.capabilities: unknown floor" in result.output


def test_reports_that_cannot_be_written_are_clean_errors(tmp_path: Path, settings_factory: SettingsFactory) -> None:
    tap = _tap_with_fixtures(tmp_path / "tap", "[floors]\nmin_top1 = 0.0\n")
    data = ["--model", "hash", "--data-dir", str(settings_factory().data_dir)]
    fixtures = ["--fixtures", str(tap / "fixtures" / "routing.jsonl")]
    for args, target in [(["eval", "--tap", str(tap), *fixtures, "--html"], "r.html"),
                         (["test", str(tap), "--junit"], "r.xml")]:
        path = tmp_path / "no-such-dir" / target
        result = CliRunner().invoke(main, [*args, str(path), *data])
        assert result.exit_code == 1, result.output
        assert isinstance(result.exception, SystemExit)  # no traceback
        assert result.stderr == f"capd: cannot write {path}: No such file or directory\n"


@pytest.mark.parametrize(("flag", "value"), [("--coverage", "2"), ("--coverage", "-0.1"), ("--threshold", "1.5"),
                                             ("--margin", "-1")])
def test_eval_gate_flags_follow_the_settings_rules(tmp_path: Path, flag: str, value: str) -> None:
    tap = _tap_with_fixtures(tmp_path / "tap", "")
    result = CliRunner().invoke(main, ["eval", "--tap", str(tap), "--fixtures", str(tap / "fixtures" / "routing.jsonl"),
                                       "--model", "hash", "--data-dir", str(tmp_path / "d"), "--rule", "fused",
                                       flag, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}': must be between" in result.output


def test_eval_coverage_under_another_rule_is_a_usage_error(tmp_path: Path) -> None:
    """It was ignored: the other rules have no coverage gate, and the figures said nothing of it."""
    tap = _tap_with_fixtures(tmp_path / "tap", "")
    args = ["eval", "--tap", str(tap), "--fixtures", str(tap / "fixtures" / "routing.jsonl"), "--model", "hash",
            "--data-dir", str(tmp_path / "d"), "--coverage", "0.3"]
    for rule in ("capd", "anchor"):
        result = CliRunner().invoke(main, [*args, "--rule", rule])
        assert result.exit_code == 2 and "--coverage applies to the fused rule" in result.stderr, result.output
    assert CliRunner().invoke(main, [*args, "--rule", "fused"]).exit_code == 0


@pytest.mark.parametrize(("flag", "value"), [("--max-null-fpr", "-1"), ("--max-wrong", "nan"),
                                             ("--max-wrong", "1.5")])
def test_calibrate_limits_are_shares(tmp_path: Path, flag: str, value: str) -> None:
    """They were taken as given and ended in "no gate setting meets the limits"."""
    tap = _tap_with_fixtures(tmp_path / "tap", "")
    result = CliRunner().invoke(main, ["calibrate", "--tap", str(tap), "--fixtures",
                                       str(tap / "fixtures" / "routing.jsonl"), "--model", "hash", "--data-dir",
                                       str(tmp_path / "d"), flag, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}': must be between 0 and 1" in result.output


def test_shipped_tap_meets_its_floors(model_settings: Settings) -> None:
    taps = default_taps()
    result = CliRunner().invoke(main, ["test", *map(str, taps), "--data-dir", str(model_settings.data_dir),
                                       "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 0, json.dumps([r["checks"] for r in report["taps"]], indent=1)
    # the shipped tap names the fused rule in its capd.toml, and is held to that rule's floors
    assert [(r["rule"], Path(r["rule_from"]).parts[-2:], r["floors_table"]) for r in report["taps"]] == [
        ("fused", ("core", "capd.toml"), "floors.fused")]
    result = CliRunner().invoke(main, ["test", *map(str, taps), "--data-dir", str(model_settings.data_dir),
                                       "--rule", "capd", "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 0, json.dumps([r["checks"] for r in report["taps"]], indent=1)
    assert all(r["floors"] and r["floors_table"] == "floors" and r["rule"] == "capd" and r["rule_from"] == "settings"
               for r in report["taps"])


def test_eval_json_and_html_report(tmp_path: Path, model_settings: Settings) -> None:
    core = default_taps()[0]
    html = tmp_path / "report.html"
    args = ["eval", "--tap", str(core), "--data-dir", str(model_settings.data_dir), "--json", "--html", str(html)]
    for name in ("positives", "abstain", "ambiguous"):
        args += ["--fixtures", str(core / "fixtures" / f"{name}.jsonl")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for key in ("n", "positives", "nulls", "top1", "fired_right", "fired_wrong", "null_fpr", "per_kind",
                "threshold", "margin"):
        assert key in report
    assert report["positives"] + report["nulls"] == report["n"]
    wrong = report["failing_rows"]  # every row decided wrong, each with what decided it
    assert wrong and all(r["why"] for r in wrong)
    assert sum(r["expect"] is None for r in wrong) == round(report["null_fpr"] * report["nulls"])
    assert sum(r["expect"] is not None for r in wrong) == round((1 - report["fired_right"]) * report["positives"])
    text = CliRunner().invoke(main, [a for a in args if a not in ("--json", "--html", str(html))]).stdout
    listed = text.split("rows decided wrong: ")[1].splitlines()
    assert listed[0].startswith(str(len(wrong))) and "expected None" in listed[1]  # the nulls that fired first
    page = html.read_text()
    assert "<svg" in page and "threshold" in page and "http://" not in page.replace("http://www.w3.org", "")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed: the page was checked for content only")
    shot = tmp_path / "report.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,1400",
                    f"--screenshot={shot}", html.as_uri()], check=True, capture_output=True, timeout=60)
    assert shot.stat().st_size > 20_000  # a rendered page with charts, not a blank frame


def test_cautious_calibration_trial_modes_accept_a_subset_of_the_shipped_points() -> None:
    from benchmarks.quality.calibration_trial import choose, feasible

    table = _table()
    _, plain = feasible(table, COSINE_GRID, "plain")
    best, _ = best_point({1: table}, 0.05, 0.03, COSINE_GRID)
    chosen = choose({1: table}, COSINE_GRID, "plain")
    assert best is not None and chosen is not None and chosen[3] == best.fired_right
    for mode in ("spare", "wilson", "erode"):
        _, ok = feasible(table, COSINE_GRID, mode)
        assert not (ok & ~plain).any()
        assert ok.sum() < plain.sum()


def test_splits_trial_split_zero_is_the_shipped_split_and_others_move_rows_keeping_copies_together() -> None:
    from benchmarks.quality.splits_trial import salted
    from capd import calibrate as calibration

    fixtures = [Fixture(f"message number {i}", ("a",), "positive", f"t:{i}") for i in range(200)]
    fixtures += [Fixture("Message  number 7", ("a",), "positive", "t:copy")]  # routes as row 7's text
    shipped = split(fixtures)
    with salted(0):
        assert all((a == b).all() for a, b in zip(split(fixtures), shipped, strict=True))
    with salted(1):
        held = split(fixtures)[1]
        folds = calibration.folds_of(fixtures)
    assert split(fixtures)[1].tolist() == shipped[1].tolist()  # the shipped hash is back
    assert held.tolist() != shipped[1].tolist() and 0.2 < len(held) / len(fixtures) < 0.4
    assert (7 in held) == (200 in held) and folds[7] == folds[200]


def test_splits_trial_forces_the_abstain_corpus_each_way_and_puts_the_rule_back() -> None:
    from benchmarks.quality.splits_trial import choosing
    from capd import calibrate as calibration

    shipped = calibration.CORPUS_MIN_GAIN
    # fit fired_right is within [0, 1]: a floor of -1 lets any feasible corpus point win, 2 none
    for corpus, floor in (("on", -1.0), ("off", 2.0), ("shipped", shipped)):
        with choosing("shipped", "plain", corpus):
            during = calibration.CORPUS_MIN_GAIN
        after = calibration.CORPUS_MIN_GAIN
        assert (during, after) == (floor, shipped)


def test_calibration_keeps_the_abstain_corpus_unless_it_fires_right_less_often(
        settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """Deterministic encoder: a null that is a corpus message and outscores a positive binds the gates
    without the corpus; with it, the null is vetoed and the positive can fire. Where it only costs (it
    vetoes a positive phrased like a corpus message) it stays off; where it changes nothing it is kept
    (``CORPUS_MIN_GAIN`` 0: it guards against nulls the fit part lacks)."""
    null, phrased_like_corpus = "help me write a birthday message for my mum", "thanks, appreciate the help"
    assert {null, phrased_like_corpus} <= set(abstain_corpus())
    tap = tmp_path / "tap"
    write_capability(tap, "greetings", ["write a birthday message for a friend", "send birthday wishes"])
    write_capability(tap, "helpdesk", ["open a helpdesk ticket", "thanks the helpdesk will help"])
    with closing(Service(settings_factory(taps=(tap,), rule="capd")).start()) as service:
        router = service.router
        positives = [Fixture("birthday greetings for my friend please", ("greetings",), "positive", "t:1"),
                     Fixture("open a ticket with the helpdesk", ("helpdesk",), "positive", "t:2")]
        cases = {"a null outscoring a positive": [*positives, Fixture(null, (), "null", "t:3")],
                 "a positive phrased like the corpus": [*positives, Fixture(phrased_like_corpus, ("helpdesk",),
                                                                            "positive", "t:3")],
                 "nothing the corpus touches": positives}
        chosen = {}
        for label, fixtures in cases.items():
            vectors, tokens = embed_fixtures(router, fixtures)
            variants = score_variants(router, fixtures, vectors, tokens)
            fitted = fit_gates(variants, np.arange(len(fixtures)), COSINE_GRID)
            assert fitted.point is not None and fitted.corpus["without"] is not None
            assert {c.abstain_corpus for c in fitted.curve} == {fitted.point.abstain_corpus}  # the curve it won on
            chosen[label] = (fitted.point.abstain_corpus, fitted.corpus)
    on, tried = chosen["a null outscoring a positive"]
    assert on and tried["with"] == 1.0 and tried["without"] < 1.0
    on, tried = chosen["a positive phrased like the corpus"]
    assert not on and tried["without"] == 1.0 and tried["with"] < 1.0
    on, tried = chosen["nothing the corpus touches"]
    assert on and tried["without"] == tried["with"] == 1.0


def test_floors_errors_name_their_line(tmp_path: Path) -> None:
    (tmp_path / "fixtures").mkdir()
    floors = tmp_path / "fixtures" / "floors.toml"
    for text, line, reason in [("[floors]\nmin_top1 = 0.8\nmax_null_fpr = 2\n", 3, "floors.max_null_fpr must be"),
                               ("[floors]\n\n[floors.kinds]\nchitchat = 'all'\n", 4, "floors.kinds.chitchat must be"),
                               ("[floors\n", 1, "invalid TOML"),
                               # a rule's own table: checked whichever rule runs, the line inside that table
                               ("[floors.kinds]\nchitchat = 1.0\n\n[floors.fused.kinds]\nchitchat = 'x'\n", 5,
                                "floors.fused.kinds.chitchat must be"),
                               ("[floors]\nmin_top1 = 0.8\n[floors.fused]\nmin_top1 = 1.5\n", 4,
                                "floors.fused.min_top1 must be"),
                               ("[floors]\nfused = 0.9\n", 2, "[floors.fused] must be a table of floors for"),
                               ("[floors.fsued]\nmin_top1 = 0.9\n", 1,
                                "floors.fsued: unknown floor (known: min_top1, min_fired_right, max_fired_wrong, "
                                "max_null_fpr, kinds; or a rule's own table: capd, anchor, fused)"),
                               ("[floors.fused.anchor]\nmin_top1 = 0.9\n", 1, "floors.fused.anchor: unknown floor"),
                               # a misspelt rule's kinds, below [floors]: its own line, not [floors]'s
                               ("[floors]\nmin_top1 = 0.8\n\n[floors.fussed.kinds]\nchitchat = 1.0\n", 4,
                                "floors.fussed: unknown floor")]:
        floors.write_text(text)
        for rule in (None, "capd", "fused"):
            with pytest.raises(FixtureError, match=rf"floors.toml: line {line}: {re.escape(reason)}"):
                load_floors(tmp_path, rule)


@pytest.mark.parametrize("target", ["nowhere.toml", "floors.toml"])
def test_a_floors_link_to_nothing_is_an_error_not_a_tap_without_floors(tmp_path: Path, target: str) -> None:
    """A dangling (or looping) ``floors.toml`` link passed as "no floors: nothing to hold the tap
    to", so a tap's CI went green with nothing checked."""
    (tmp_path / "fixtures").mkdir()
    (tmp_path / "fixtures" / "floors.toml").symlink_to(target)
    with pytest.raises(FixtureError, match=r"floors.toml: "):
        load_floors(tmp_path)


def test_a_rules_own_floors_replace_the_ones_they_name(tmp_path: Path) -> None:
    (tmp_path / "fixtures").mkdir()
    (tmp_path / "fixtures" / "floors.toml").write_text(
        "[floors]\nmin_top1 = 0.85\nmin_fired_right = 0.45\nmax_null_fpr = 0.03\n"
        "[floors.kinds]\nchitchat = 1.0\nvague = 1.0\n"
        "[floors.fused]\nmin_fired_right = 0.8\nmax_null_fpr = 0.05\n[floors.fused.kinds]\nvague = 0.9\n"
        "[floors.anchor]\nmin_top1 = 0.5\n")
    base = load_floors(tmp_path, "capd")  # no table of its own
    assert (base.minima, base.maxima, base.kinds, base.rule) == (
        {"top1": 0.85, "fired_right": 0.45}, {"null_fpr": 0.03}, {"chitchat": 1.0, "vague": 1.0}, None)
    assert load_floors(tmp_path) == base
    fused = load_floors(tmp_path, "fused")
    assert (fused.minima, fused.maxima, fused.kinds, fused.rule) == (
        {"top1": 0.85, "fired_right": 0.8}, {"null_fpr": 0.05}, {"chitchat": 1.0, "vague": 0.9}, "fused")
    anchor = load_floors(tmp_path, "anchor")
    assert (anchor.minima, anchor.kinds, anchor.rule) == ({"top1": 0.5, "fired_right": 0.45}, base.kinds, "anchor")


def test_a_tap_author_at_a_terminal_reads_what_the_json_says(model_settings: Settings) -> None:
    """``capd route --explain``, ``capd eval`` and ``capd calibrate`` without --json, on the shipped
    tap and the real model: each text line says what the same command's JSON says."""
    core = str(default_taps()[0])
    where = ["--tap", core, "--data-dir", str(model_settings.data_dir)]
    fixtures = [arg for name in ("positives", "abstain") for arg in ("--fixtures", f"{core}/fixtures/{name}.jsonl")]

    def run(*args: str) -> str:
        result = CliRunner().invoke(main, [*args, *where])
        assert result.exit_code == 0, result.output
        return result.stdout

    message = "show me the last five commits on main"
    routed = json.loads(run("route", message, "--explain", "--json"))
    lines = run("route", message, "--explain").splitlines()
    assert lines[0].startswith("activate: git  score ") and lines[1] == f"  {routed['reason']}"
    first = routed["explain"][0]
    at = lines.index(f"  {first['name']} {first['score']:.3f}")
    assert lines[at + 1:at + 1 + len(first["triggers"])] == [f"      {t['cosine']:.3f}  {t['text']}"
                                                             for t in first["triggers"]]

    report = json.loads(run("eval", *fixtures, "--rule", "capd", "--json"))
    lines = run("eval", *fixtures, "--rule", "capd").splitlines()
    assert lines[0] == (f"{report['n']} rows ({report['positives']} positives, {report['nulls']} nulls), rule capd, "
                        f"threshold {report['threshold']:.3f}, margin {report['margin']:.3f}")
    assert lines[1:5] == [f"  {key:<12}{report[key]:.3f}" for key in ("top1", "fired_right", "fired_wrong", "null_fpr")]
    assert lines[5] == "per kind:" and len(lines) > 6
    report = json.loads(run("eval", *fixtures, "--json"))  # the rule the tap names, with its own gates
    assert report["rule"] == "fused"
    assert run("eval", *fixtures).splitlines()[0] == (
        f"{report['n']} rows ({report['positives']} positives, {report['nulls']} nulls), rule fused, threshold "
        f"{report['threshold']:.3f}, margin {report['margin']:.3f}, coverage {report['coverage']:.3f}")

    calibrated = json.loads(run("calibrate", *fixtures, "--rule", "capd", "--json"))
    point = calibrated["recommended"]
    lines = run("calibrate", *fixtures, "--rule", "capd").splitlines()
    assert lines[0] == (f"fit on {calibrated['rows']['fit']} rows, checked on {calibrated['rows']['held_out']} "
                        "held-out rows; limits null_fpr <= 0.05, fired_wrong <= 0.03")
    assert (f"recommended: top_k {point['top_k']}, threshold {point['threshold']:.2f}, margin {point['margin']:.3f}, "
            f"abstain corpus {'on' if point['abstain_corpus'] else 'off'}") in lines
    held_out = calibrated["held_out"]
    assert any(line.startswith(f"  held_out  fired_right {held_out['fired_right']:.3f}") for line in lines)


def test_the_readmes_calibrate_example_is_what_the_command_prints(model_settings: Settings) -> None:
    """The README's `capd calibrate --rule capd` session on taps/core went stale when its vetoes
    changed (three curve rows): it is now checked line for line."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    start = readme.index("$ capd calibrate --tap taps/core --rule capd --fixtures")
    shown = readme[start:readme.index("```", start)].splitlines()[2:]  # the command takes two lines
    core = str(default_taps()[0])
    fixtures = [arg for name in ("positives", "abstain", "ambiguous")
                for arg in ("--fixtures", f"{core}/fixtures/{name}.jsonl")]
    result = CliRunner().invoke(main, ["calibrate", "--tap", core, "--rule", "capd", *fixtures,
                                       "--data-dir", str(model_settings.data_dir)])
    assert result.exit_code == 0, result.output
    warned = [line for line in shown if line.startswith("warning: ")]  # stderr, printed first
    assert result.stdout.splitlines() == shown[len(warned):]
    assert result.stderr.splitlines() == warned


# -- what tap authors run into on taps under construction (found by review, 2026-11-26) -------------------

def _hash(tmp_path: Path) -> list[str]:
    return ["--model", "hash", "--data-dir", str(tmp_path / "data")]


def test_a_row_expecting_a_capability_without_triggers_is_a_positive(tmp_path: Path) -> None:
    """It has no score column, so it was counted as a null: a wrong activation passed as null_fpr
    (and as a pass of max_fired_wrong = 0)."""
    tap = _tap_with_fixtures(tmp_path / "tap", "[floors]\nmax_fired_wrong = 0.0\n")
    write_capability(tap, "not-yet", [])
    rows = [{"message": "run a query on the postgres database please", "expect": "not-yet"},
            {"message": "create a python virtualenv and run pytest", "expect": "python-toolchain"},
            {"message": "my cat likes to sleep on the sofa all afternoon", "expect": None}]
    (tap / "fixtures" / "routing.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for rule in ("capd", "fused"):
        result = CliRunner().invoke(main, ["eval", "--tap", str(tap), "--fixtures",
                                           str(tap / "fixtures" / "routing.jsonl"), "--rule", rule, "--json",
                                           "--threshold", "0", "--margin", "0", *_hash(tmp_path)])
        report = json.loads(result.stdout)
        assert (report["positives"], report["nulls"], report["top1"]) == (2, 1, 0.5), rule
        assert report["fired_wrong"] == 0.5, rule  # the postgres row fired, on another capability
    result = CliRunner().invoke(main, ["test", str(tap), *_hash(tmp_path)])
    assert result.exit_code == 1 and "FAIL fired_wrong 0.500 <= 0.0" in result.output


def test_fused_routes_on_a_tap_of_one_capability(tmp_path: Path) -> None:
    """With no runner-up the gap is infinite: the router called it 'not a number' and abstained on
    every message, while eval and calibrate counted the same rows as fired."""
    tap = tmp_path / "tap"
    write_capability(tap, "docker", ["list running containers", "build a docker image", "stop the container"])
    result = CliRunner().invoke(main, ["route", "list running containers", "--tap", str(tap), "--rule", "fused",
                                       "--json", *_hash(tmp_path)])
    routed = json.loads(result.stdout)
    assert routed["decision"] == "activate" and routed["capability"] == "docker", routed
    assert routed["margin"] is None and "not a number" not in routed["reason"]


def test_calibrate_recommends_nothing_when_no_fit_positive_can_fire(tmp_path: Path) -> None:
    """Positives too short to route: every point tied at fired_right 0 and --write stored threshold 1.0,
    which switched the tap off, with exit 0."""
    tap = _tap_with_fixtures(tmp_path / "tap", "[floors]\nmin_top1 = 0.0\n")
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"message": f"py {i}", "expect": "python-toolchain"}) + "\n" for i in range(8))
                     + "".join(json.dumps({"message": f"my cat sleeps on the sofa, day {i}", "expect": None}) + "\n"
                               for i in range(2)))
    result = CliRunner().invoke(main, ["calibrate", "--tap", str(tap), "--fixtures", str(short), "--write",
                                       *_hash(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "no gates within the limits fire any of the" in result.output
    assert not (tap / "capd.toml").exists()


def test_measuring_a_tap_with_nothing_to_route_to_is_a_clear_error(tmp_path: Path) -> None:
    """A tap under construction whose capabilities have no triggers yet: tracebacks (argmax of an
    empty sequence; fused, a zero-size reduction)."""
    tap = tmp_path / "tap"
    write_capability(tap, "mytool", [])
    (tap / "fixtures").mkdir()
    rows = tap / "fixtures" / "routing.jsonl"
    rows.write_text("".join(json.dumps({"message": f"use my tool on file {i} please", "expect": "mytool"}) + "\n"
                            for i in range(10)))
    for args in (["test", str(tap)], ["eval", "--tap", str(tap), "--fixtures", str(rows), "--rule", "fused"],
                 ["calibrate", "--tap", str(tap), "--fixtures", str(rows)]):
        result = CliRunner().invoke(main, [*args, *_hash(tmp_path)])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (args, result.output)
        assert "nothing to measure: no capability of the taps has triggers" in result.stderr, (args, result.output)


def test_floors_outside_the_floors_table_are_errors(tmp_path: Path) -> None:
    """A key above [floors], or a misspelt [floor.kinds], was ignored: the tap passed with no floor checked."""
    (tmp_path / "fixtures").mkdir()
    floors = tmp_path / "fixtures" / "floors.toml"
    for text, line, key in [("min_fired_right = 0.99\n[floors]\nmin_top1 = 0.5\n", 1, "min_fired_right"),
                            ("[floors]\nmin_top1 = 0.5\n\n[floor.kinds]\noff-topic = 1.0\n", 4, "floor")]:
        floors.write_text(text)
        with pytest.raises(FixtureError, match=rf"floors.toml: line {line}: {key}: not part of \[floors\]"):
            load_floors(tmp_path)


def test_junit_holds_only_characters_xml_allows(tmp_path: Path) -> None:
    """A control character in a kind (or a file name's undecodable bytes) made XML a CI parser rejects."""
    tap = _tap_with_fixtures(tmp_path / "tap", '[floors]\n[floors.kinds]\n"bell\\u0007kind" = 1.0\n')
    rows = tap / "fixtures" / "routing.jsonl"
    rows.write_text(rows.read_text() + json.dumps({"message": "my cat likes the sofa", "expect": None,
                                                   "kind": "bell\u0007kind"}) + "\n")
    junit = tmp_path / "r.xml"
    CliRunner().invoke(main, ["test", str(tap), "--junit", str(junit), *_hash(tmp_path)])
    names = [c.get("name") for c in ET.parse(junit).getroot().iter("testcase")]
    assert "kind:bell\\x07kind" in names


def test_calibrate_write_follows_a_link_in_the_tap_and_refuses_one_out(tmp_path: Path) -> None:
    """The rename replaced a linked capd.toml with a plain file and left the link's target stale."""
    tap = _tap_with_fixtures(tmp_path / "tap", "[floors]\nmin_top1 = 0.0\n")
    (tap / "conf").mkdir()
    (tap / "conf" / "capd.toml").write_text("# shared settings\n")
    (tap / "capd.toml").symlink_to(Path("conf") / "capd.toml")
    args = ["calibrate", "--tap", str(tap), "--fixtures", str(tap / "fixtures" / "routing.jsonl"), "--write",
            "--max-null-fpr", "1", "--max-wrong", "1", *_hash(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert (tap / "capd.toml").is_symlink() and "[gates]" in (tap / "conf" / "capd.toml").read_text()
    outside = tmp_path / "elsewhere.toml"
    outside.write_text("# not the tap's\n")
    (tap / "capd.toml").unlink()
    (tap / "capd.toml").symlink_to(outside)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "outside the tap" in result.output
    assert outside.read_text() == "# not the tap's\n" and (tap / "capd.toml").is_symlink()


def test_calibrate_write_that_cannot_write_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OSError from the rename (a read-only or immutable tap) came out as a traceback."""
    import capd.calibrate_write

    def refuse(path: Path, text: str) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(capd.calibrate_write.atomic, "write_text", refuse)
    tap = _tap_with_fixtures(tmp_path / "tap", "[floors]\nmin_top1 = 0.0\n")
    result = CliRunner().invoke(main, ["calibrate", "--tap", str(tap), "--fixtures",
                                       str(tap / "fixtures" / "routing.jsonl"), "--write", "--max-null-fpr", "1",
                                       "--max-wrong", "1", *_hash(tmp_path)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "capd.toml: cannot write it: Operation not permitted; nothing was changed" in result.output


def test_split_keeps_a_message_and_its_tagged_copies_on_one_side() -> None:
    """The split hashed the raw message, so `<context>…</context> open the file` could be held out
    while `open the file`, the same text to the router, was fitted on."""
    import hashlib

    def held(text: str) -> bool:
        return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 1000 < 300

    plain = "open the file and read what is inside it"
    copies = (f"<context>note {i}</context> {plain}" for i in range(100))
    tagged = next(c for c in copies if held(c) != held(plain))  # a copy the old split put on the other side
    other = "my cat likes to sleep on the sofa all afternoon"
    rows = [Fixture(plain, ("filesystem-read",), "positive", "f:1"),
            Fixture(tagged, ("filesystem-read",), "tagged", "f:2"), Fixture(other, (), "null", "f:3")]
    _, held_out = split(rows)
    sides = {i: i in set(held_out.tolist()) for i in range(3)}
    assert sides[0] == sides[1]
    assert sides[2] == held(other)  # a row with no tagged copy keeps the side of its own message
    # nor do case and spacing part copies (the model is uncased; a corrected message is recalled across them)
    variants = (f"{plain[:i].upper()}{plain[i:]}" for i in range(1, len(plain)))
    shouted = next(v for v in variants if held(v) != held(plain))
    _, held_out = split([rows[0], Fixture(shouted, ("filesystem-read",), "positive", "f:4"),
                         Fixture(f"  {plain}  ", ("filesystem-read",), "positive", "f:5")])
    assert len(held_out) in (0, 3)


@pytest.mark.parametrize("text", ["", "# floors to come\n", "[floors]\n"])
def test_a_floors_file_that_sets_nothing_says_so(tmp_path: Path, text: str) -> None:
    """It printed "floors from [floors]" and no check, as if the tap had been held to something."""
    tap = _tap_with_fixtures(tmp_path / "tap", text)
    result = CliRunner().invoke(main, ["test", str(tap), *_hash(tmp_path)])
    assert result.exit_code == 0, result.output
    assert f"{tap / 'fixtures' / 'floors.toml'} sets no floors: nothing to hold the tap to" in result.output


def test_calibrate_write_refuses_gates_no_null_row_checked(tmp_path: Path) -> None:
    """Fitted on positives alone, the gates were written and null_fpr went unchecked ("n/a"): on a
    copy of taps/core without its capd.toml, `capd test` then measured null_fpr 0.055 against 0.022."""
    tap = _tap_with_fixtures(tmp_path / "tap", "[floors]\nmin_top1 = 0.0\n")
    positives = tap / "fixtures" / "positives.jsonl"
    positives.write_text("".join(line for line in (tap / "fixtures" / "routing.jsonl").read_text().splitlines(True)
                                 if '"expect": null' not in line))
    args = ["calibrate", "--tap", str(tap), "--fixtures", str(positives), "--max-null-fpr", "1", "--max-wrong", "1",
            *_hash(tmp_path)]
    written = CliRunner().invoke(main, [*args, "--write"])
    assert written.exit_code == 1 and "nothing written: no null row in the fit part" in written.stderr, written.output
    assert not (tap / "capd.toml").exists()
    shown = CliRunner().invoke(main, [*args, "--json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)["rows"]["fit_nulls"] == 0
    report = json.loads(shown.stdout)  # never measured, so null as in "fit" (the sweep counted 0.0)
    assert report["recommended"]["null_fpr"] is None and {p["null_fpr"] for p in report["curve"]} == {None}
    assert report["fit"]["null_fpr"] is None
    text = CliRunner().invoke(main, args).stdout
    assert re.search(r"^ +\d+ +[-0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +n/a$", text, re.M), text
    (warning,) = json.loads(shown.stdout)["warnings"]
    assert "null_fpr limit was never checked" in warning
    assert '"expect": null' in warning  # the advice was "expect": [], which the fixture reader refuses
    refused = CliRunner().invoke(main, [*args, "--write", "--json"])  # it printed nothing on stdout
    assert refused.exit_code == 1 and "nothing written" in refused.stderr
    assert json.loads(refused.stdout)["written"] == [] and json.loads(refused.stdout)["recommended"] is not None


def test_calibrate_warns_when_the_fit_part_is_too_small_for_a_limit(tmp_path: Path) -> None:
    """With fewer fit nulls than one per limit's worth (20 at 0.05), calibration must keep every one
    of them out and fits the gates to whichever happen to be there: healthcare's 11 fit nulls gave
    held-out fired_right 0.737 where its auto gates gave 0.947. The author was told only afterwards,
    by the held-out figures, that "more fixture rows would make the gates surer"."""
    tap = _tap_with_fixtures(tmp_path / "tap", "[floors]\nmin_top1 = 0.0\n")
    fixtures = tap / "fixtures" / "routing.jsonl"
    result = CliRunner().invoke(main, ["calibrate", "--tap", str(tap), "--fixtures", str(fixtures), "--json",
                                       *_hash(tmp_path)])
    report = json.loads(result.stdout)
    fit, nulls = report["rows"]["fit"], report["rows"]["fit_nulls"]
    assert 0 < nulls < 20 and 0 < fit - nulls < 34
    null_warning, wrong_warning = (w for w in report["warnings"] if "happen to be there" in w)
    assert null_warning.startswith(f"the fit part has {nulls} null rows: one is {1 / nulls:.3f} of null_fpr")
    assert "must let none of them through" in null_warning and "with 20 null rows in the fit part (about 29 in all)" \
        in null_warning
    assert f"has {fit - nulls} positive rows" in wrong_warning and "with 34 positive rows" in wrong_warning
    assert small_part_warnings(34, 20, 0.05, 0.03) == [] and len(small_part_warnings(33, 19, 0.05, 0.03)) == 2
    assert small_part_warnings(1, 1, 0.0, 1.0) == []  # a limit of 0 or 1 asks nothing that rows could allow


def test_calibrate_json_has_its_keys_without_a_fit_positive(tmp_path: Path) -> None:
    """With no positive row to fit on, `warnings` and `rows.fit_nulls` were missing."""
    tap = _tap_with_fixtures(tmp_path / "tap", "[floors]\nmin_top1 = 0.0\n")
    nulls = tap / "fixtures" / "nulls.jsonl"
    nulls.write_text("".join(line for line in (tap / "fixtures" / "routing.jsonl").read_text().splitlines(True)
                             if '"expect": null' in line))
    result = CliRunner().invoke(main, ["calibrate", "--tap", str(tap), "--fixtures", str(nulls), "--json",
                                       *_hash(tmp_path)])
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["recommended"] is None and "no positive row" in report["error"]
    assert report["warnings"] == [] and report["rows"]["fit_nulls"] == report["rows"]["fit"] > 0


def test_calibrate_write_of_several_taps_writes_none_when_one_cannot_be_edited(tmp_path: Path) -> None:
    """The first tap's capd.toml was written, the second refused, and the author saw only the refusal."""
    first = _tap_with_fixtures(tmp_path / "a", "[floors]\nmin_top1 = 0.0\n")
    second = tmp_path / "b" / "tap"
    second.mkdir(parents=True)
    (second / "capabilities").mkdir()
    (second / "capd.toml").write_text("gates = { threshold = 0.4 }\n")  # an inline table: capd does not edit it
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"message": m, "expect": None}) + "\n" for m in
                            ("my cat likes to sleep on the sofa", "the weather is lovely", "thanks, that is all",
                             "what a nice afternoon it is", "good morning to you")) +
                    (first / "fixtures" / "routing.jsonl").read_text())
    result = CliRunner().invoke(main, ["calibrate", "--tap", str(first), "--tap", str(second), "--fixtures", str(rows),
                                       "--write", "--max-null-fpr", "1", "--max-wrong", "1", *_hash(tmp_path)])
    assert result.exit_code == 1 and "cannot update in place" in result.output, result.output
    assert not (first / "capd.toml").exists()
    assert (second / "capd.toml").read_text() == "gates = { threshold = 0.4 }\n"


def test_capd_test_fails_a_tap_with_a_capability_that_does_not_load(tmp_path: Path) -> None:
    """It said PASS (exit 0): the broken capability was simply not there, and only a log line on
    stderr told of it; a fixture expecting it said "unknown capability"."""
    tap = _tap_with_fixtures(tmp_path / "tap", "[floors]\nmin_top1 = 0.0\n")
    (tap / "capabilities" / "smalltalk" / "config.toml").write_text('triggers = ["unclosed\n')
    result = CliRunner().invoke(main, ["test", str(tap), "--json", *_hash(tmp_path)])
    assert result.exit_code == 1, result.output
    (report,) = json.loads(result.stdout)["taps"]
    assert not report["passed"] and [e["capability"] for e in report["errors"]] == ["smalltalk"]
    assert {"name": "tap_errors", "value": 1, "bound": 0, "relation": "<=", "passed": False} in report["checks"]
    text = CliRunner().invoke(main, ["test", str(tap), *_hash(tmp_path)])
    assert "FAIL tap_errors 1 <= 0" in text.stdout and "smalltalk/config.toml: line 1:" in text.stdout, text.output
    rows = tap / "fixtures" / "routing.jsonl"
    weather = {"message": "what is the weather today", "expect": "smalltalk"}
    rows.write_text(rows.read_text() + json.dumps(weather) + "\n")
    # A row expecting it stopped the run with no report and no JUnit file (every capability of
    # taps/core has rows): it is now a row nothing can fire right, and the tap fails tap_errors.
    junit = tmp_path / "routing.xml"
    result = CliRunner().invoke(main, ["test", str(tap), "--json", "--junit", str(junit), *_hash(tmp_path)])
    assert result.exit_code == 1, result.output
    (report,) = json.loads(result.stdout)["taps"]
    assert {"name": "tap_errors", "value": 1, "bound": 0, "relation": "<=", "passed": False} in report["checks"]
    assert [r for r in report["failing_rows"] if r["expect"] == ["smalltalk"]]
    assert "tap_errors" in junit.read_text()
    eval_ = CliRunner().invoke(main, ["eval", "--tap", str(tap), "--fixtures", str(rows), *_hash(tmp_path)])
    assert eval_.exit_code == 1 and "expects 'smalltalk', which failed to load" in eval_.stderr, eval_.output


def test_each_failing_check_lists_the_rows_that_count_against_it() -> None:
    """Every failing check listed the same first rows decided wrong, in file order: a fired_wrong
    failure on a copy of taps/core showed 25 rows that had abstained and none that fired wrong."""
    def row(source: str, expect: list[str] | None, got: str | None, best: str,
            kind: str | None = None) -> dict[str, object]:
        return {"source": source, "message": "m", "kind": kind, "expect": expect, "got": got, "best": best,
                "score": 0.5, "margin": 0.01}

    abstained = [row(f"p.jsonl:{i}", ["a"], None, "a") for i in range(30)]
    ranked_wrong = row("p.jsonl:40", ["a"], None, "b")
    fired_wrong = row("p.jsonl:41", ["a"], "c", "c")
    null_fired = row("n.jsonl:1", None, "a", "a", kind="chitchat")
    rows = [*abstained, ranked_wrong, fired_wrong, null_fired]
    assert rows_against("fired_wrong", rows) == [fired_wrong]
    assert rows_against("null_fpr", rows) == rows_against("kind:chitchat", rows) == [null_fired]
    assert rows_against("top1", rows) == [ranked_wrong, fired_wrong]
    assert rows_against("fired_right", rows) == [*abstained, ranked_wrong, fired_wrong]
    report = {"tap": "t", "checks": [{"name": "fired_wrong", "value": 0.1, "bound": 0.0, "relation": "<=",
                                      "passed": False}], "failing_rows": rows}
    (failure,) = ET.fromstring(junit_xml([report]).split("?>", 1)[1]).iter("failure")
    assert failure.text is not None and failure.text.splitlines() == [
        "p.jsonl:41: 'm' expected ['a'], got c (best c 0.500, margin 0.010)"]


def test_calibrate_write_refused_still_prints_what_it_measured(tmp_path: Path) -> None:
    """A capd.toml --write cannot edit used to end the run with the error alone: the sweep's
    recommendation was lost, even with --json."""
    tap = _tap_with_fixtures(tmp_path / "tap", "[floors]\nmin_top1 = 0.0\n")
    (tap / "capd.toml").write_text("gates = { threshold = 0.5 }\n")
    args = ["calibrate", "--tap", str(tap), "--fixtures", str(tap / "fixtures" / "routing.jsonl"), "--write",
            "--max-null-fpr", "1", "--max-wrong", "1", *_hash(tmp_path)]
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["recommended"] is not None and report["written"] == []
    assert "nothing written" in result.stderr and "`gates = …` holds the gates in one value" in result.stderr
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "recommended:" in result.stdout
    assert (tap / "capd.toml").read_text() == "gates = { threshold = 0.5 }\n"


def test_capd_test_names_a_tap_path_that_is_not_there(tmp_path: Path) -> None:
    """A mistyped tap path was reported as a tap without fixtures."""
    a_file = tmp_path / "afile"
    a_file.write_text("x\n")
    for path, reason in ((tmp_path / "nope", "tap directory does not exist"),
                         (a_file, "is a file, not a tap directory")):
        result = CliRunner().invoke(main, ["test", str(path), *_hash(tmp_path)])
        assert result.exit_code == 1 and f"{path}: {reason}" in result.output, result.output


def test_corpus_trial_adds_messages_and_votes_and_puts_the_corpus_back() -> None:
    """``corpus_trial`` measures a larger corpus and a corpus veto that takes its second-nearest
    message (benchmarks/quality/README.md); outside its block the shipped corpus and one vote hold."""
    import capd.vetoes
    from benchmarks.quality.corpus_trial import corpus_in_force
    from capd.vetoes import Vetoes

    shipped = abstain_corpus()
    rows = np.eye(3, dtype=np.float32)
    vetoes = Vetoes(corpus=("a", "b", "c"), corpus_vectors=rows)
    query = np.array([0.8, 0.6, 0.0], dtype=np.float32)  # nearest "a" (0.8), then "b" (0.6)
    assert vetoes.nearest("cap", True, None, query) == (pytest.approx(0.8), "a", "corpus")
    with corpus_in_force(["well, that was a long meeting"], 2):
        assert abstain_corpus() == (*shipped, "well, that was a long meeting")
        assert vetoes.nearest("cap", True, None, query) == (pytest.approx(0.6), "a", "corpus")
        assert vetoes.nearest("cap", False, None, query) is None  # the tap's gates keep the corpus off
    assert abstain_corpus() == shipped and capd.vetoes.CORPUS_VETO_VOTES == 1
    assert vetoes.nearest("cap", True, None, query)[0] == pytest.approx(0.8)


def test_coverage_trial_measures_each_capability_by_its_own_examples() -> None:
    """``coverage_trial``'s own coverage: an example covered by a copy of itself covers 1.0, by an
    orthogonal one 0, one alone has nothing to be covered by; the relative statistic moves each
    column by its own coverage less the mean of them."""
    from benchmarks.quality.coverage_trial import own_coverage, relative
    from capd.fused import ExampleTokens

    unit = np.eye(4, dtype=np.float32)
    a, b, c = unit[:1], unit[1:2], unit[2:3]
    tokens = ExampleTokens.build(["a", "a again", "b", "c", "d"], np.array([0, 0, 1, 1, 2]), [a, a, b, c, unit[3:]], 3)
    own = own_coverage(tokens)
    assert own[:2].tolist() == pytest.approx([1.0, 0.0]) and np.isnan(own[2])
    message = np.concatenate([a, b])
    shipped = ExampleTokens.late_interaction(tokens, message, [0, 1, 2])[1]
    moved = relative(ExampleTokens.late_interaction)(tokens, message, [0, 1, 2])[1]
    assert shipped.tolist() == pytest.approx([0.5, 0.5, 0.0])
    assert moved.tolist() == pytest.approx([0.0, 1.0, 0.0])  # shifted by 1.0 - 0.5 and 0.0 - 0.5; the lone one kept


def test_coverage_trial_chooses_the_variant_only_where_the_fit_part_gains() -> None:
    from benchmarks.quality.coverage_trial import chosen

    def split(fit: float, held: float, met: bool) -> dict[str, object]:
        return {"recommended": {"fired_right": fit}, "held_out": {"fired_right": held, "null_fpr": 0.0}, "met": met}

    shipped = {"results": [{"set": "s", "splits": [split(0.8, 0.7, False), split(0.9, 0.9, True),
                                                   split(0.7, 0.8, True)]}]}
    variant = {"results": [{"set": "s", "splits": [split(0.85, 0.9, True), split(0.9, 0.5, False),
                                                   split(0.6, 0.1, False)]}]}
    assert chosen(shipped, variant)["s"] == {"splits": 3, "met": 3, "variant_chosen": 1,  # a tie keeps the shipped
                                             "fired_right_mean": 0.867, "null_fpr_mean": 0.0}
