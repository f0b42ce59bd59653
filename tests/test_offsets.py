"""Per-capability offsets (``[gates.fused.offsets]`` in a tap's ``capd.toml``): numbers the fused rule
adds to each capability's score, fitted by ``capd calibrate --offsets`` on the fit part's positives
and written with the gates by ``--write``."""

from __future__ import annotations

import dataclasses
import json
import shutil
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from capd.catalog import Catalog
from capd.cli import main
from capd.evaluation import ScoreTable
from capd.fixtures import Fixture
from capd.gates import Gates, build_gatebook
from capd.lint import lint_catalog
from capd.offsets import OFFSET_MIN_ROWS, fit_offsets
from capd.service import Service
from capd.settings import Settings
from capd.tap_config import load_tap_config
from capd.taps import load_catalog
from tests.taputil import EVALSETS, calibrated_evalset, octomind_tap

CORE = Path(__file__).resolve().parent.parent / "taps" / "core"


def test_offsets_load_per_tap_and_move_only_its_own_capabilities(tmp_path: Path) -> None:
    first, second = octomind_tap(tmp_path / "a"), octomind_tap(tmp_path / "b")
    (first / "capd.toml").write_text('model = "m"\n[gates.fused]\nthreshold = 0.1\n'
                                     "[gates.fused.offsets]\nsmalltalk = -1.5\nfilesystem-read = 2\n")
    (second / "capd.toml").write_text("[gates.fused.offsets]\nsmalltalk = 3.0\nno-such-capability = 1.0\n")
    config, problems = load_tap_config(first)
    assert problems == [] and config is not None
    assert dict(config.offsets) == {"smalltalk": -1.5, "filesystem-read": 2.0}
    assert dict(config.fused_gates) == {"threshold": 0.1}  # the offsets are not a gate
    catalog: Catalog = load_catalog([first, second])
    book = build_gatebook(Gates(0.0, 0.0), catalog, {}, model="m", rule="fused")
    # the second tap's smalltalk is shadowed by the first's: its offset is not the capability's
    assert dict(book.offsets) == {"smalltalk": -1.5, "filesystem-read": 2.0}
    assert build_gatebook(Gates(0.0, 0.0), catalog, {}, model="m", rule="capd").offsets == {}
    # calibrated for another model, the first tap's offsets are ignored, and smalltalk is still not the second's
    assert build_gatebook(Gates(0.0, 0.0), catalog, {}, model="other", rule="fused").offsets == {}


def test_lint_warns_of_an_offset_for_a_capability_the_tap_does_not_route(tmp_path: Path) -> None:
    first, second = octomind_tap(tmp_path / "a"), octomind_tap(tmp_path / "b")
    (first / "capd.toml").write_text("[gates.fused.offsets]\nsmalltalk = 1.0\nsmall-talk = 0.5\n")
    (second / "capd.toml").write_text("# mine\n[gates.fused.offsets]\nsmalltalk = 1.0\n")
    stray = [p for p in lint_catalog(load_catalog([first, second])) if p.code == "stray-offset"]
    assert [(p.file, p.line) for p in stray] == [(str(first / "capd.toml"), 3), (str(second / "capd.toml"), 3)]
    assert "'small-talk', which this tap does not route" in stray[0].reason
    assert "comes first" in stray[1].reason and stray[0].severity == "warning"


@pytest.mark.parametrize(("line", "reason"), [
    ('smalltalk = "up"', "must be a number"),
    ("smalltalk = true", "must be a number"),
    ("smalltalk = inf", "between -20 and 20"),
    ("smalltalk = 25", "between -20 and 20"),
])
def test_a_bad_offset_names_its_line(tmp_path: Path, line: str, reason: str) -> None:
    tap = octomind_tap(tmp_path)
    (tap / "capd.toml").write_text(f"[gates.fused]\nmargin = 1.0\n\n[gates.fused.offsets]\nqa = 0.5\n{line}\n")
    config, (problem,) = load_tap_config(tap)
    assert config is None and problem.line == 6 and reason in problem.reason
    assert "gates.fused.offsets.smalltalk" in problem.reason


def _table(scores: np.ndarray, labels: list[int | None], names: tuple[str, ...]) -> ScoreTable:
    fixtures = tuple(Fixture(f"message {i}", () if y is None else (names[y],), "positive" if y is not None else "null",
                             f"t:{i}") for i, y in enumerate(labels))
    expected = np.zeros(scores.shape, dtype=bool)
    for row, y in enumerate(labels):
        if y is not None:
            expected[row, y] = True
    return ScoreTable(fixtures, names, scores.astype(np.float32), np.ones(len(labels), dtype=bool), expected,
                      levels=np.zeros(scores.shape, dtype=np.float32))


def test_fit_offsets_lifts_an_under_scored_capability_and_cross_fits_the_rows_it_learned_from() -> None:
    """``b``'s messages score 1 below where ``a``'s do: ``b`` gets the larger offset, the ranking
    mends, and each fit row is scored with offsets fitted without its fold."""
    rng = np.random.default_rng(0)
    names = ("a", "b", "c")
    rows, labels = [], []
    for i in range(120):
        y = i % 2
        score = rng.normal(0.0, 0.6, 3)
        score[y] += 0.8 - (1.0 if y == 1 else 0.0)  # b's own score sits 0.2 above a's noise, a's 0.8
        rows.append(score)
        labels.append(y)
    rows += [np.array([0.0, 0.0, 0.5]), np.array([0.1, 0.0, 0.6])]  # c: too few rows for an offset of its own
    rows += [np.array([0.2, 0.1, 0.0])]  # a null: never learned from
    table = _table(np.array(rows), [*labels, 2, 2, None], names)
    labels += [2, 2]
    everything = np.arange(len(rows))
    fit = fit_offsets(table, everything)
    assert set(fit.offsets) == {"a", "b"} and fit.offsets["b"] > fit.offsets["a"]
    assert OFFSET_MIN_ROWS > 2
    mended = (table.scores + fit.by_row).argmax(axis=1)[:122] == np.array(labels)
    assert mended[:120].mean() > (table.scores.argmax(axis=1)[:122] == np.array(labels))[:120].mean() + 0.05
    full = np.array([fit.offsets.get(n, 0.0) for n in names], dtype=np.float32)
    assert not np.allclose(fit.by_row[:122], full)  # out of fold: not the offsets fitted on every row
    assert np.allclose(fit.by_row[122], full)  # a row it never learned from gets what the daemon adds
    only_some = fit_offsets(table, everything[:60])
    assert np.allclose(only_some.by_row[60:], [only_some.offsets.get(n, 0.0) for n in names])  # the held-out part
    nothing = fit_offsets(_table(np.zeros((3, 3)), [None, None, None], names), np.arange(3))
    assert nothing.offsets == {} and not nothing.by_row.any()


@pytest.fixture(scope="module")
def core_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tap = tmp_path_factory.mktemp("offsets") / "core"
    shutil.copytree(CORE, tap, ignore=shutil.ignore_patterns("fixtures", "calibration"))
    return tap


def test_the_router_adds_a_taps_offsets_and_reloads_them(model_settings: Settings, core_copy: Path) -> None:
    settings = dataclasses.replace(model_settings, taps=(core_copy,), rule="fused")
    shipped = (CORE / "capd.toml").read_text()
    message = "show me the open pull requests on our github repo"
    with closing(Service(settings).start()) as service:
        before = service.router.route(message)
        assert before.decision == "activate" and before.capability == "github"
        moved = service.router.with_offsets({"github": -20.0})
        assert moved.route(message).capability != "github"  # the offset decides the winner
        assert service.router.route(message).capability == "github"  # a copy: the service's router is untouched
        config = core_copy / "capd.toml"
        config.write_text(shipped + "\n[gates.fused.offsets]\ngithub = -20.0\n")
        service.reload(changed=[config])
        assert service.router.gates.offsets == {"github": -20.0}
        assert service.router.route(message).capability != "github"
        explained = {entry["name"]: entry for entry in service.router.explain(message, limit=100)}
        assert explained["github"]["offset"] == -20.0  # --explain says why github dropped
        assert all("offset" not in entry for name, entry in explained.items() if name != "github")
        config.write_text(shipped)
        service.reload(changed=[config])
        assert service.router.route(message).capability == "github"


def test_calibrate_with_offsets_writes_them_and_without_removes_them(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path / "tap")
    fixtures = tmp_path / "routing.jsonl"
    messages = {"database-postgres": "run a query on the postgres database", "filesystem-read": "open the file and "
                "read what is inside", "python-toolchain": "create a python virtualenv and run pytest"}
    rows = [{"message": f"{text} number {i}", "expect": name} for name, text in messages.items() for i in range(12)]
    rows += [{"message": f"my cat number {i} likes to sleep on the sofa", "expect": None} for i in range(12)]
    fixtures.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mine = "# my notes\nowner = \"me\"\n"
    (tap / "capd.toml").write_text(mine)
    args = ["calibrate", "--tap", str(tap), "--fixtures", str(fixtures), "--rule", "fused", "--write",
            "--max-null-fpr", "1", "--max-wrong", "1", "--model", "hash", "--data-dir", str(tmp_path / "data"),
            "--no-vetoes", "--json"]
    result = CliRunner().invoke(main, [*args, "--offsets"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["offsets"] and set(report["offsets"]) <= set(messages)
    config = load_tap_config(tap)[0]
    assert config is not None and dict(config.offsets) == report["offsets"]
    text = (tap / "capd.toml").read_text()
    assert text.startswith(mine) and "[gates.fused.offsets]" in text
    result = CliRunner().invoke(main, args)  # without --offsets: the gates fitted without them, and none left
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["offsets"] == {}
    config = load_tap_config(tap)[0]
    assert config is not None and config.offsets == {} and (tap / "capd.toml").read_text().startswith(mine)


@pytest.mark.skipif(not (EVALSETS / "hwu64_scenario_oos").is_dir(), reason="../shared/evalsets is not present")
def test_offsets_lift_hwu64_held_out_top1_and_fired_right(model_settings: Settings) -> None:
    """Measured (`capd calibrate --tap …/hwu64_scenario_oos/tap --fixtures …/dev.jsonl --rule fused`,
    then with `--offsets`): held-out top1 0.875 -> 0.890, fired_right 0.783 -> 0.801."""
    reports = calibrated_evalset(model_settings, "hwu64_scenario_oos", {"plain": {}, "offsets": {"offsets": True}})
    plain, offsets = reports["plain"], reports["offsets"]
    assert plain["offsets"] == {} and len(offsets["offsets"]) == 14
    assert offsets["held_out"]["top1"] >= plain["held_out"]["top1"] + 0.01
    assert offsets["held_out"]["fired_right"] >= plain["held_out"]["fired_right"] + 0.01
    assert offsets["rows"] == plain["rows"]
