"""A tap's examples (``<tap>/examples.jsonl``): messages routed as more triggers of the capability each
expects. Read with the tap and linted line by line, reloaded live, used by the ``capd`` and ``fused``
rules (not ``anchor``), scored out of fold by ``capd calibrate`` (``--examples`` adds the fit part's
positive rows) and appended by ``--write``."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from capd.calibrate import FOLDS, calibrate, folds_of, split
from capd.calibrate_examples import examples_pay, plan_examples, pooled
from capd.calibrate_write import examples_edit
from capd.cli import main
from capd.evaluation import score_table
from capd.fixtures import Fixture, load_fixtures
from capd.router import example_catalog
from capd.service import Service
from capd.settings import Settings
from capd.taps import load_catalog
from capd.watcher import TapWatcher
from tests.reliability.harness import wait_until
from tests.taputil import EVALSETS, calibrated_evalset, octomind_tap

CORE = Path(__file__).resolve().parent.parent / "taps" / "core"


def _rows(*pairs: tuple[str, str | None]) -> str:
    return "".join(json.dumps({"message": m, "expect": e}) + "\n" for m, e in pairs)


def test_examples_load_with_the_tap_and_each_bad_line_names_itself(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    path = tap / "examples.jsonl"
    path.write_text("# the author's note\n" + _rows(
        ("show me the tables of the orders database", "database-postgres"),  # line 2: good
        ("nothing to see here", None),  # 3: a null row belongs in vetoes.jsonl
        ('{"expect": ["a", "b"]}', None),  # 4: a null row again (the message is just text)
        ("SHOW me the tables of the  orders database", "database-postgres"),  # 5: line 2 again
        ("<context>only tags</context>", "filesystem-read"),  # 6: nothing routes
        ("play my jazz playlist", "music"),  # 7: no such capability in the tap
        ("show me the tables of the orders database", "filesystem-read"),  # 8: fine, another capability
    ) + '{"message": "two things", "expect": ["filesystem-read", "filesystem-write"]}\n{oops\n')
    catalog = load_catalog([tap])
    config = catalog.tap_configs[tap]
    assert [(e.capability, e.line) for e in config.examples] == [
        ("database-postgres", 2), ("music", 7), ("filesystem-read", 8)]
    found = {(p.line, p.code, p.severity) for p in catalog.problems if p.file == str(path)}
    assert found == {(3, "invalid-example", "error"), (4, "invalid-example", "error"),
                     (5, "duplicate-example", "warning"), (6, "invalid-example", "error"),
                     (7, "unknown-example", "warning"), (9, "invalid-example", "error"),
                     (10, "invalid-example", "error")}
    assert any("belongs in vetoes.jsonl" in p.reason for p in catalog.problems if p.line == 3)
    postgres = catalog.capabilities["database-postgres"]
    assert catalog.examples_of(postgres) == ("show me the tables of the orders database",)
    indexed = example_catalog(catalog, "capd")
    assert "show me the tables of the orders database" in indexed.capabilities["database-postgres"].triggers
    assert indexed.capabilities["database-postgres"].fingerprint != postgres.fingerprint  # the index re-embeds it
    anchor = example_catalog(catalog, "anchor")  # the anchor's rule reads triggers alone
    assert anchor.capabilities["database-postgres"].triggers == postgres.triggers
    assert path.read_text().startswith("# the author's note\n")  # read, never written
    linted = CliRunner().invoke(main, ["lint", str(tap), "--json"])
    assert linted.exit_code == 1 and json.loads(linted.output)["examples"] == 2  # the two in use; errors exit 1


def test_an_example_of_a_tap_another_tap_overrides_is_not_used(tmp_path: Path) -> None:
    first, second = octomind_tap(tmp_path / "a"), octomind_tap(tmp_path / "b")
    (second / "examples.jsonl").write_text(_rows(("open the orders table", "database-postgres")))
    catalog = load_catalog([first, second])
    assert catalog.capabilities["database-postgres"].tap == first
    assert catalog.examples_of(catalog.capabilities["database-postgres"]) == ()
    moved = catalog.with_examples({"database-postgres": ["open the orders table"], "nope": ["x"]})
    assert [e.message for e in moved.tap_configs[first].examples] == ["open the orders table"]
    assert moved.tap_configs[second].examples == ()


def test_an_edit_of_the_taps_examples_alone_reloads_them(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    with closing(Service(Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash")).start()) as service:
        watcher = TapWatcher(service)
        message = "zebra quokka marmalade"  # no word of any trigger: the lexical fake model abstains
        assert service.router.route(message).decision == "abstain"
        examples = tap / "examples.jsonl"
        examples.write_text(_rows((message, "filesystem-read")) + "{oops\n")
        assert watcher.apply_changes([examples]) != {}
        routed = service.router.route(message)
        assert routed.decision == "activate" and routed.capability == "filesystem-read"
        (error,) = service.health()["errors"]
        assert error["file"] == str(examples) and error["line"] == 2 and "adds no example" in error["reason"]
        examples.unlink()
        watcher.apply_changes([examples])
        assert service.router.route(message).decision == "abstain" and service.health()["errors"] == []


@pytest.fixture(scope="module")
def nonsense(tmp_path_factory: pytest.TempPathFactory) -> tuple[Service, list[Fixture]]:
    """A service on the octomind tap with the lexical fake model, and rows made of words no trigger and
    no other row has: a row can only be routed right by finding its own copy among the examples."""
    root = tmp_path_factory.mktemp("examples")
    tap = octomind_tap(root)
    service = Service(Settings(taps=(tap,), data_dir=root / "data", model="hash")).start()
    names = ["database-postgres", "filesystem-read", "filesystem-write", "python-toolchain"]
    draw = random.Random(7)
    rows = [Fixture(" ".join("".join(draw.choices("bcdfghjklmnpqrstvwxz", k=7)) for _ in range(5)),
                    (names[i % len(names)],), "positive", f"r:{i}") for i in range(80)]
    yield service, rows
    service.close()


def test_calibrate_scores_each_row_without_its_own_example(nonsense: tuple[Service, list[Fixture]]) -> None:
    """With --examples every fit row is an example, so a row scored with its own copy among them would
    route right at any gates; out of fold none is, and the nonsense rows route no better than before."""
    service, rows = nonsense
    fit_rows, _ = split(rows)
    plan = plan_examples(service.catalog_now(), rows, add=True)
    assert plan is not None and sorted(plan.rows.tolist()) == fit_rows.tolist() and plan.dropped == 0
    assert set(folds_of(rows)[fit_rows].tolist()) == set(range(FOLDS))
    leaky = score_table(service.router_with_examples(plan.examples(rows, plan.rows)), rows).subset(fit_rows)
    winners = leaky.gate_inputs()[0]
    assert leaky.expected[np.arange(len(fit_rows)), winners].all()  # the test has teeth: an own copy wins each row
    report = calibrate(service.router, rows, max_null_fpr=1.0, max_wrong=1.0, rebuild=service.router_with_examples,
                       add_examples=True)
    plain = calibrate(service.router, rows, max_null_fpr=1.0, max_wrong=1.0)
    assert report["examples"] == {"fit_rows": len(fit_rows), "kept": 0, "dropped": 0, "folds": FOLDS, "added": True}
    assert plain["examples"] is None
    assert report["fit"]["top1"] < 0.5 and report["held_out"]["top1"] < 0.5
    assert report["fit"]["top1"] == pytest.approx(plain["fit"]["top1"], abs=0.15)
    # by default both are measured, and the report is the one of the choice
    chosen = calibrate(service.router, rows, max_null_fpr=1.0, max_wrong=1.0, rebuild=service.router_with_examples)
    without, with_them = plain["recommended"]["fired_right"], report["recommended"]["fired_right"]
    assert chosen["add_examples"] == {"without": without, "with": with_them}
    assert chosen == (report if examples_pay(without, with_them) else plain) | {"add_examples": chosen["add_examples"]}


def test_pooled_takes_each_row_from_the_table_that_scored_it(nonsense: tuple[Service, list[Fixture]]) -> None:
    service, rows = nonsense
    whole = score_table(service.router, rows)
    halves = [np.arange(0, len(rows), 2), np.arange(1, len(rows), 2)]
    parts = [(half, score_table(service.router, [rows[i] for i in half])) for half in halves]
    again = pooled(rows, parts)
    assert again.fixtures == whole.fixtures and np.allclose(again.scores, whole.scores)
    with pytest.raises(ValueError, match="exactly one"):
        pooled(rows, parts[:1])


def test_the_taps_examples_that_are_fit_rows_are_scored_out_of_fold_without_the_flag(
        nonsense: tuple[Service, list[Fixture]]) -> None:
    """After ``--examples --write`` a plain ``capd calibrate`` must not fit on rows scored with their own
    copies: the file's fit rows are scored out of fold, a held-out row's copy is left out (and said)."""
    service, rows = nonsense
    fit_rows, held_rows = split(rows)
    catalog = service.catalog_now()
    mine = {"database-postgres": ["look inside the orders table"]}  # the author's own: in force throughout
    in_file = {name: list(messages) for name, messages in mine.items()}
    for i in [*fit_rows[:10], held_rows[0]]:
        in_file.setdefault(rows[i].expect[0], []).append(rows[i].message)
    plan = plan_examples(catalog.with_examples(in_file), rows, add=False)
    assert plan is not None
    assert sorted(plan.rows.tolist()) == sorted(fit_rows[:10].tolist())
    assert plan.kept == mine and plan.dropped == 1
    assert plan_examples(catalog, rows, add=False) is None  # no file, no flag: scored as the tap routes
    assert plan_examples(catalog.with_examples(mine), rows, add=False) is None  # the author's own only: the same


def test_calibrate_write_appends_the_fit_positives_as_examples(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path / "tap")
    fixtures = tmp_path / "routing.jsonl"
    positives = [(f"run query number {i} on the postgres database", "database-postgres") for i in range(12)]
    positives += [(f"open file number {i} and read it", "filesystem-read") for i in range(12)]
    nulls = [f"my cat number {i} likes to sleep on the sofa" for i in range(12)]
    fixtures.write_text(_rows(*positives, *((n, None) for n in nulls)))
    mine = "# my own\n" + _rows(("peek at the pg tables", "database-postgres"))
    (tap / "examples.jsonl").write_text(mine)
    args = ["calibrate", "--tap", str(tap), "--fixtures", str(fixtures), "--write", "--max-null-fpr", "1",
            "--max-wrong", "1", "--model", "hash", "--data-dir", str(tmp_path / "data"), "--examples"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "fit rows as examples" in result.output and f"wrote {tap / 'examples.jsonl'}" in result.output
    written = (tap / "examples.jsonl").read_text()
    assert written.startswith(mine)
    loaded = load_fixtures([fixtures])
    fit = [loaded[i] for i in split(loaded)[0] if loaded[i].positive]
    assert 0 < len(fit) < len(positives)  # the held-out part stays out
    config = load_catalog([tap]).tap_configs[tap]
    assert [(e.capability, e.message) for e in config.examples] == [
        ("database-postgres", "peek at the pg tables"), *((f.expect[0], f.message) for f in fit)]
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and (tap / "examples.jsonl").read_text() == written  # nothing twice
    assert examples_edit(tap, fit) is None
    plain = CliRunner().invoke(main, [*args[:-1], "--json"])  # the file's fit rows: still out of fold
    assert json.loads(plain.output)["examples"]["fit_rows"] == len(fit)
    for refused in (["--offsets"], ["--rule", "anchor"]):
        result = CliRunner().invoke(main, [*args, *refused])
        assert result.exit_code == 2 and "--examples" in result.output


def test_plain_calibrate_keeps_the_fit_positives_as_examples_only_where_they_measure_better(tmp_path: Path) -> None:
    """Rows in words no trigger uses route at chance on triggers alone, and right out of fold once their
    siblings are examples: plain `capd calibrate --write` keeps and writes them; `--no-examples` does not
    measure them; rows the triggers already route are left alone (a tie keeps the tap as it is)."""
    tap = octomind_tap(tmp_path / "tap")
    fixtures = tmp_path / "routing.jsonl"
    unlike = [(f"zebra quokka {word} banana", "database-postgres") for word in ("red", "blue", "green", "gold")]
    unlike += [(f"mango tundra {word} violet", "filesystem-read") for word in ("red", "blue", "green", "gold")]
    unlike *= 3  # one spelling per row would be one copy: a suffix keeps them apart
    rows = [(f"{message} {i}", name) for i, (message, name) in enumerate(unlike)]
    fixtures.write_text(_rows(*rows, *((f"my cat number {i} likes to sleep on the sofa", None) for i in range(12))))
    args = ["calibrate", "--tap", str(tap), "--fixtures", str(fixtures), "--max-null-fpr", "1", "--max-wrong", "1",
            "--model", "hash", "--data-dir", str(tmp_path / "data")]
    off = json.loads(CliRunner().invoke(main, [*args, "--no-examples", "--json", "--write"]).output)
    assert off["examples"] is None and off["add_examples"]["with"] is None and not (tap / "examples.jsonl").exists()
    result = CliRunner().invoke(main, [*args, "--write"])
    assert result.exit_code == 0, result.output
    assert "fit fired_right without the fit positives as examples" in result.output
    assert f"wrote {tap / 'examples.jsonl'}" in result.output
    report = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)  # again, with the file written
    tried = report["add_examples"]
    assert tried["with"] == tried["without"]  # the file holds every fit positive now: nothing more to add
    assert report["examples"]["fit_rows"] > 0 and not report["examples"]["added"]
    chosen = json.loads(CliRunner().invoke(main, [*args[:2], str(octomind_tap(tmp_path / "fresh")), *args[3:],
                                                  "--json"]).output)
    assert examples_pay(chosen["add_examples"]["without"], chosen["add_examples"]["with"])
    assert chosen["add_examples"]["without"] < 0.8 <= chosen["add_examples"]["with"]
    assert chosen["examples"]["added"]


@pytest.fixture
def core_copy(tmp_path: Path) -> Path:
    tap = tmp_path / "core"
    shutil.copytree(CORE, tap, ignore=shutil.ignore_patterns("fixtures", "calibration"))
    return tap


def test_the_examples_floor_keeps_hwu64s_smallest_gain_that_paid_held_out() -> None:
    """The fit gains measured on five splits of each shared set (benchmarks/quality/README.md): the
    smallest that paid held out, hwu64's 0.7941 -> 0.8081, is kept; a tie, a loss, or a gain of 0.005
    is not."""
    assert examples_pay(0.7941, 0.8081)
    assert not examples_pay(0.8917, 0.8599) and not examples_pay(0.80, 0.80) and not examples_pay(0.80, 0.805)
    assert examples_pay(None, 0.5) and not examples_pay(0.5, None)


def test_an_example_routes_a_message_like_it_on_the_real_model(model_settings: Settings, core_copy: Path) -> None:
    """A request in the user's own words that the shipped triggers do not reach: one example of it makes a
    paraphrase of it activate its capability (fused, the shipped gates), and it abstains again without."""
    settings = dataclasses.replace(model_settings, taps=(core_copy,), rule="fused")
    asked = "jot this down so you still know it next week"
    with closing(Service(settings).start()) as service:
        before = service.router.route(asked)
        examples = core_copy / "examples.jsonl"
        examples.write_text(_rows(("note this down so that you still know it next week", "memory")))
        service.reload(changed=[examples])
        after = service.router.route(asked)
        assert after.decision == "activate" and after.capability == "memory", after
        assert not (before.decision == "activate" and before.capability == "memory"), before
        examples.unlink()
        service.reload(changed=[examples])
        assert service.router.route(asked).as_dict() == before.as_dict()


@pytest.mark.skipif(not (EVALSETS / "hwu64_scenario_oos").is_dir(), reason="../shared/evalsets is not present")
def test_plain_calibrate_adds_the_fit_positives_on_hwu64_and_they_lift_it_held_out(model_settings: Settings) -> None:
    """Measured held out (fused, calibrated on the fit part, vetoes on): fired_right 0.783 -> 0.835,
    null_fpr 0.041 -> 0.020, top1 0.875 -> 0.915. Plain `capd calibrate` measures both and keeps the
    examples (fit fired_right 0.792 -> 0.819 out of fold): the issue's goal is met by default."""
    reports = calibrated_evalset(model_settings, "hwu64_scenario_oos", {"default": {"add_examples": None},
                                                                        "without": {}})
    chosen, without = reports["default"], reports["without"]
    assert chosen["examples"]["fit_rows"] > 500 and chosen["examples"]["added"] and without["examples"] is None
    tried = chosen["add_examples"]
    assert tried["without"] == without["recommended"]["fired_right"] and examples_pay(tried["without"], tried["with"])
    held, before = chosen["held_out"], without["held_out"]
    assert held["fired_right"] >= before["fired_right"] + 0.03 and held["fired_right"] >= 0.80
    assert held["top1"] >= before["top1"] + 0.03 and held["top1"] >= 0.90
    assert held["null_fpr"] <= 0.05 and held["fired_wrong"] <= 0.03


def test_eval_says_which_rows_the_tap_already_holds(tmp_path: Path) -> None:
    """A row written to examples.jsonl (or vetoes.jsonl) routes by construction: `capd eval` counts them
    (`known`) and says so, so that a figure measured on them is not taken for one on unseen messages."""
    tap = octomind_tap(tmp_path)
    (tap / "examples.jsonl").write_text(_rows(("Peek at the orders table", "database-postgres")))
    (tap / "vetoes.jsonl").write_text(_rows(("tell me a joke", None)))
    fixtures = tmp_path / "rows.jsonl"
    fixtures.write_text(_rows(("peek at the  ORDERS table", "database-postgres"), ("tell me a joke", None),
                              ("read the notes file from disk", "filesystem-read")))
    args = ["eval", "--tap", str(tap), "--fixtures", str(fixtures), "--model", "hash", "--data-dir",
            str(tmp_path / "data")]
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["known"] == {"examples": 1, "vetoes": 1}
    text = CliRunner().invoke(main, args).output
    assert "1 rows are examples and 1 vetoes of the taps" in text and "by construction" in text
    anchor = CliRunner().invoke(main, [*args, "--json", "--rule", "anchor"])  # it reads neither file
    assert json.loads(anchor.output)["known"] == {"examples": 0, "vetoes": 0}
    plain = octomind_tap(tmp_path / "plain")
    clean = CliRunner().invoke(main, ["eval", "--tap", str(plain), *args[3:]])
    assert "note:" not in clean.output


def test_a_real_observer_puts_an_examples_file_in_force_and_takes_it_out(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    with closing(Service(Settings(taps=(tap,), data_dir=tmp_path / "data", model="hash")).start()) as service:
        watcher = TapWatcher(service, debounce=0.1)
        watcher.start()
        try:
            message = "zebra quokka marmalade"

            def routed() -> str | None:
                decision = service.router.route(message)
                return decision.capability if decision.decision == "activate" else None

            assert routed() is None
            (tap / "examples.jsonl").write_text(_rows((message, "filesystem-read")))
            assert wait_until(lambda: routed() == "filesystem-read", 15)
            (tap / "examples.jsonl").unlink()
            assert wait_until(lambda: routed() is None, 15)
        finally:
            watcher.stop()



def test_learned_triggers_export_as_the_taps_examples(tmp_path: Path) -> None:
    """`capd learned export --format examples --tap DIR` prints the corrections learned for that tap as
    examples.jsonl lines: appended there, the tap routes those messages without the data directory."""
    from capd.learned import LearnedStore

    tap = octomind_tap(tmp_path / "tap")
    message = "zebra quokka marmalade"
    store = LearnedStore.open(tmp_path / "data")
    store.record(tap, "filesystem-read", message, "abstain", "s1")
    store.record(tap, "filesystem-write", "never again this one", "filesystem-write", "s1", kind="abstain")
    store.close()
    base = ["learned", "export", "--data-dir", str(tmp_path / "data"), "--format", "examples"]
    refused = CliRunner().invoke(main, base)
    assert refused.exit_code == 2 and "exactly one --tap" in refused.output
    exported = CliRunner().invoke(main, [*base, "--tap", str(tap)])
    assert exported.exit_code == 0, exported.output
    assert [json.loads(line) for line in exported.stdout.splitlines()] == [
        {"message": message, "expect": "filesystem-read", "kind": "learned"}]  # the abstain is no example
    (tap / "examples.jsonl").write_text(exported.stdout)
    with closing(Service(Settings(taps=(tap,), data_dir=tmp_path / "fresh", model="hash")).start()) as service:
        routed = service.router.route(message)
        assert routed.decision == "activate" and routed.capability == "filesystem-read"
