"""A tap's vetoes (``<tap>/vetoes.jsonl``): messages none of its capabilities may take. Read with the
tap, applied by the router when two of them are nearer the message than the winner's nearest example,
fitted with by ``capd calibrate`` (the fit part's null rows) and appended by ``--write``."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from capd.calibrate import calibrate, fit_vetoes, split
from capd.calibrate_write import vetoes_edit
from capd.cli import main
from capd.evaluation import score_table
from capd.fixtures import Fixture, load_fixtures
from capd.service import Service
from capd.settings import Settings
from capd.tap_config import load_tap_config
from tests.taputil import EVALSETS, calibrated_evalset, octomind_tap

CORE = Path(__file__).resolve().parent.parent / "taps" / "core"
SHIPPED_GATES = ('model = "all-minilm-l6-v2"\nrule = "fused"\n'
                 "[gates.fused]\nthreshold = -0.37\nmargin = 1.0\ncoverage = 0.42\n")


def _rows(*messages: str) -> str:
    return "".join(json.dumps({"message": m, "expect": None, "kind": "chitchat"}) + "\n" for m in messages)


def test_vetoes_load_with_the_tap_and_a_bad_line_names_itself(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path / "tap")
    assert load_tap_config(tap) == (None, [])
    (tap / "vetoes.jsonl").write_text("# mine\n" + _rows("tell me a joke") + "{not json\n"
                                      + json.dumps({"message": "query postgres", "expect": "database-postgres"})
                                      + "\n" + _rows("what is your favourite colour"))
    config, problems = load_tap_config(tap)
    assert config is not None and config.vetoes == ("tell me a joke", "what is your favourite colour")
    assert [(p.line, p.code) for p in problems] == [(3, "invalid-veto"), (4, "invalid-veto")]
    assert "invalid JSON" in problems[0].reason and "vetoes nothing" in problems[0].reason
    assert "expects nothing" in problems[1].reason and problems[1].file == str(tap / "vetoes.jsonl")
    (tap / "vetoes.jsonl").write_text("# nothing yet\n")
    assert load_tap_config(tap)[1] == []  # a file of comments is no error
    # A line the model would read as another's message is one veto; one of tags only is none.
    (tap / "vetoes.jsonl").write_text(_rows("Tell me a joke", "<context>x</context>", "tell me  a JOKE",
                                            "<a>b</a> tell me a joke"))
    config, problems = load_tap_config(tap)
    assert [(p.line, p.code, p.severity) for p in problems] == [
        (2, "invalid-veto", "error"), (3, "duplicate-veto", "warning"), (4, "duplicate-veto", "warning")]
    assert "tags are removed" in problems[0].reason and "the same message as line 1" in problems[1].reason
    assert config is not None and len(config.vetoes) == 4  # as written; the router counts them once
    (tap / "capd.toml").write_text("[gates\n")  # a broken capd.toml: the daemon keeps its last good config
    config, problems = load_tap_config(tap)
    assert config is None and problems[0].code == "invalid"


def test_vetoes_through_a_link_out_of_the_tap_or_from_a_pipe_are_refused(tmp_path: Path) -> None:
    """The guards of every tap file: a pipe named vetoes.jsonl would have blocked the loader (and the
    daemon) for good, and a link out of the tap would have read a file the tap does not hold."""
    tap = octomind_tap(tmp_path / "tap")
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text(_rows("tell me a joke"))
    (tap / "vetoes.jsonl").symlink_to(outside)
    config, (problem,) = load_tap_config(tap)
    assert config is not None and config.vetoes == () and "outside the tap" in problem.reason
    (tap / "vetoes.jsonl").unlink()
    os.mkfifo(tap / "vetoes.jsonl")
    config, (problem,) = load_tap_config(tap)
    assert config is not None and config.vetoes == () and "not a regular file" in problem.reason


@pytest.fixture(scope="module")
def vetoed_core(model_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tap = tmp_path_factory.mktemp("vetoes") / "core"
    shutil.copytree(CORE, tap, ignore=shutil.ignore_patterns("fixtures", "calibration"))
    (tap / "capd.toml").write_text(SHIPPED_GATES)
    return tap


# A null the shipped gates let through (taps/core/fixtures: "tell me something interesting about
# yourself" activates memory), and two messages of the same kind a tap author would write as vetoes.
NULL = "tell me something interesting about yourself"
VETOES = ("share a fun fact about yourself", "tell me something interesting about you")


def test_two_near_vetoes_turn_a_winner_away_and_one_does_not(model_settings: Settings, vetoed_core: Path) -> None:
    settings = dataclasses.replace(model_settings, taps=(vetoed_core,), rule="fused")
    task = "show me the open pull requests on our github repo"
    with closing(Service(settings).start()) as service:
        before = service.router.route(NULL)
        assert before.decision == "activate" and before.capability == "memory"
        vetoes = vetoed_core / "vetoes.jsonl"
        vetoes.write_text(_rows(VETOES[0]))
        service.reload(changed=[vetoes])
        assert service.router.route(NULL).decision == "activate"  # one veto alone is not enough
        assert service.router.route(VETOES[0]).decision == "abstain"  # but its own text is turned away
        # Copies in other case, spacing or tags are one message to the model: still one vote, not two.
        copies = (VETOES[0], VETOES[0].upper(), VETOES[0].replace(" ", "  "), f"<context>notes</context> {VETOES[0]}")
        vetoes.write_text(_rows(*copies, "<context>only tags</context>"))
        service.reload(changed=[vetoes])
        assert service.router.route(NULL).decision == "activate"
        assert service.router.vetoes.taps[vetoed_core][0] == (VETOES[0],)  # and one with nothing to route on is none
        vetoes.write_text(_rows(VETOES[0], f"<context>notes</context> {VETOES[1]}"))
        service.reload(changed=[vetoes])
        tagged = service.router.vetoes.taps[vetoed_core][1][1]
        assert np.allclose(tagged, service.encoder.embed([VETOES[1]])[0], atol=1e-6)  # as a message like it routes
        assert service.router.route(NULL).decision == "abstain"
        vetoes.write_text(_rows(*VETOES))
        service.reload(changed=[vetoes])
        after = service.router.route(NULL)
        assert after.decision == "abstain" and after.capability == "memory"
        assert "vetoed" in after.reason and "tap's vetoes" in after.reason
        assert service.router.route(task).decision == "activate"  # a task is not like them
        vetoes.unlink()
        service.reload(changed=[vetoes])
        assert service.router.route(NULL).decision == "activate"


def test_calibrate_fits_with_the_fit_nulls_and_never_on_a_rows_own_copy(fused_core: Service) -> None:
    """Each fit null is scored with the others as vetoes, not itself: were its own copy counted, every
    fit null would be vetoed and the null limit would bind nothing."""
    nulls = [Fixture(NULL, (), "chitchat", "t:1")]
    nulls += [Fixture(f"{NULL} {tail}", (), "chitchat", f"t:{i}") for i, tail in
              enumerate(("please", "now", "today", "quickly", "again", "for me", "right now", "if you can"), 2)]
    positives = [Fixture("show me the open pull requests on our github repo", ("github",), "positive", "p:1"),
                 Fixture("list the running docker containers and their ports", ("docker",), "positive", "p:2"),
                 Fixture("what is the time in tokyo right now", ("time",), "positive", "p:3")]
    rows = nulls + positives
    assert len(fit_vetoes(rows, "fused")) == sum(not rows[i].positive for i in split(rows)[0]) >= 2
    report = calibrate(fused_core.router, rows, max_null_fpr=1.0, max_wrong=1.0)
    without = calibrate(fused_core.router, rows, max_null_fpr=1.0, max_wrong=1.0, vetoes=False)
    assert report["vetoes"] == len(fit_vetoes(rows, "fused")) and without["vetoes"] == 0
    assert fit_vetoes(rows, "anchor") == []
    router = fused_core.router.with_tap_vetoes([f.message for f in nulls])
    table = score_table(router, rows, not_own_veto=True)
    assert table.vetoed is not None
    assert table.vetoed[:len(nulls)].all()  # near copies of each other: two others veto each one
    assert not table.vetoed[len(nulls):].any()  # the tasks are not like them
    # the tap's vetoes alone: the abstain corpus, which the tap turns on, turns NULL away as a class as well
    alone = fused_core.router.with_abstain_corpus(False).with_tap_vetoes([NULL])
    assert score_table(alone, nulls[:1]).vetoed.tolist() == [True]  # type: ignore[union-attr]  # its own copy
    assert score_table(alone, nulls[:1], not_own_veto=True).vetoed.tolist() == [False]  # type: ignore[union-attr]


def test_calibrate_write_appends_the_fit_nulls_and_keeps_what_is_there(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path / "tap")
    fixtures = tmp_path / "routing.jsonl"
    positives = [{"message": "run a query on the postgres database please", "expect": "database-postgres"},
                 {"message": "open the file and read what is inside it", "expect": "filesystem-read"},
                 {"message": "create a python virtualenv and run pytest", "expect": "python-toolchain"},
                 {"message": "write this text into a brand new file on disk", "expect": "filesystem-write"}]
    nulls = [f"my cat number {i} likes to sleep on the sofa" for i in range(12)]
    fixtures.write_text("".join(json.dumps(r) + "\n" for r in positives) + _rows(*nulls))
    mine = "\ufeff# my own, kept as written\r\n" + _rows("never route this one")
    (tap / "vetoes.jsonl").write_bytes(mine.encode())
    args = ["calibrate", "--tap", str(tap), "--fixtures", str(fixtures), "--write", "--max-null-fpr", "1",
            "--max-wrong", "1", "--model", "hash", "--data-dir", str(tmp_path / "data")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    written = (tap / "vetoes.jsonl").read_bytes()
    assert written.startswith(mine.encode()) and f"wrote {tap / 'vetoes.jsonl'}" in result.output
    fit_nulls = [fixture.message for fixture in fit_vetoes(load_fixtures([fixtures]), "capd")]
    assert 0 < len(fit_nulls) < len(nulls)  # the held-out part stays out
    assert load_tap_config(tap)[0].vetoes == ("never route this one", *fit_nulls)  # type: ignore[union-attr]
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and (tap / "vetoes.jsonl").read_bytes() == written  # nothing twice
    (tap / "conf").mkdir()  # a vetoes.jsonl linking to a file in the tap is edited there, the link kept
    (tap / "vetoes.jsonl").rename(tap / "conf" / "vetoes.jsonl")
    (tap / "vetoes.jsonl").symlink_to(Path("conf") / "vetoes.jsonl")
    (tap / "conf" / "vetoes.jsonl").write_bytes(mine.encode())
    assert CliRunner().invoke(main, args).exit_code == 0
    assert (tap / "vetoes.jsonl").is_symlink() and (tap / "conf" / "vetoes.jsonl").read_bytes() == written
    other = octomind_tap(tmp_path / "other")
    result = CliRunner().invoke(main, [*args[:2], str(other), *args[3:], "--no-vetoes"])
    assert result.exit_code == 0 and not (other / "vetoes.jsonl").exists() and (other / "capd.toml").exists()


def test_a_veto_is_one_message_whatever_its_case_spacing_or_tags(tmp_path: Path) -> None:
    """Calibration keeps one fit null per routed text, and ``--write`` does not add a copy of a line
    the file has in another spelling: the model sees one message, and two copies would vote twice."""
    spellings = ["Hello there, how are you", "hello  there, HOW are you",
                 "<context>x</context> hello there, how are you"]
    rows = [Fixture(m, (), "chitchat", f"t:{i}") for i, m in enumerate(spellings)]
    assert len(split(rows)[0]) == 3  # one text, one side of the split: here the fit part
    assert [f.message for f in fit_vetoes(rows, "fused")] == [spellings[0]]
    tap = octomind_tap(tmp_path / "tap")
    (tap / "vetoes.jsonl").write_text(_rows(spellings[1]))
    assert vetoes_edit(tap, rows) is None
    added = vetoes_edit(tap, [*rows, Fixture("what a lovely morning", (), "chitchat", "t:9")])
    assert added is not None and added[1].endswith(_rows("what a lovely morning"))
    assert added[1].count("\n") == 2


@pytest.mark.skipif(not (EVALSETS / "hwu64_scenario_oos").is_dir(), reason="../shared/evalsets is not present")
def test_the_fit_nulls_as_vetoes_lift_hwu64_held_out(model_settings: Settings) -> None:
    """hwu64's nulls are four whole scenarios the tap lacks. Measured held out (fused, calibrated on the
    fit part): fired_right 0.603 -> 0.783 at null_fpr 0.041 both (`capd calibrate … --no-vetoes`)."""
    reports = calibrated_evalset(model_settings, "hwu64_scenario_oos", {"with": {}, "without": {"vetoes": False}})
    with_vetoes, without = reports["with"], reports["without"]
    assert with_vetoes["vetoes"] > 100
    held, before = with_vetoes["held_out"], without["held_out"]
    assert held["fired_right"] >= before["fired_right"] + 0.15
    assert held["null_fpr"] <= 0.05 and before["null_fpr"] <= 0.05
    assert np.isclose(held["top1"], before["top1"])  # the ranking is untouched: only the decision to fire
