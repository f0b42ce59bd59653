"""Commands that route with the model: discover, route, eval, test, calibrate."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from capd.catalog import RULES
from capd.cli.common import (
    EXIT_ERROR,
    EXIT_USAGE,
    TEXT,
    Failed,
    PathParam,
    build_settings,
    check_taps,
    connection_options,
    daemon_only,
    emit_json,
    named_by,
    plan_lines,
    setting_rule,
    settings_options,
    share,
    tap_only,
    tuning_not_done,
    write_file,
)
from capd.cli.daemon_cmds import client_for
from capd.errors import TapFileError
from capd.settings import Settings, for_one_tap
from capd.taps import not_a_tap_directory
from capd.text import clean_message

if TYPE_CHECKING:
    from capd.fixtures import Fixture


def _service(settings: Settings) -> Any:
    """An in-process service on ``settings.taps``; a tap path that is not a tap is an error here
    (:func:`check_taps`), and so is a tuning that was asked for and did not happen (a daemon serves
    untuned meanwhile)."""
    from capd.service import Service

    check_taps(settings.taps)
    service = Service(settings).start()
    tuning = service.tuning
    if tuning.enabled and tuning.status != "ready":
        # routing, scores and gates (`calibrate --write`) would silently be the untuned model's
        service.close()
        raise tuning_not_done(tuning.error or tuning.status)
    return service


ROWS_SHOWN_TEXT = 10  # rows listed under each failing check of `capd test` at a terminal


def _broken(service: Any) -> set[str]:
    """The capabilities whose files failed to load."""
    return {p.capability for p in service.catalog_now().errors if p.capability is not None}


def _fmt(value: object) -> str:
    return "n/a" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)


def route_text(result: dict[str, Any], explain: list[dict[str, Any]] | None = None) -> str:
    lines = [f"{result['decision']}: {result['capability'] or '-'}  score {_fmt(result['score'])}  "
             f"margin {_fmt(result['margin'])}", f"  {result['reason']}"]
    for candidate in result["candidates"]:
        lines.append(f"    {candidate['score']:.3f}  {candidate['name']}")
    for entry in explain or []:
        offset = f"  (ranked with offset {entry['offset']:+.3f})" if "offset" in entry else ""
        lines.append(f"  {entry['name']} {entry['score']:.3f}{offset}")
        lines += [f"      {t['cosine']:.3f}  {t['text']}" for t in entry["triggers"]]
    plan = result.get("plan")
    if plan:
        lines += [f"  {line}" for line in plan_lines(plan)]
    return "\n".join(lines)


@click.command()
@click.argument("intent", type=TEXT)
@settings_options
@connection_options
@click.option("--limit", type=click.IntRange(1, 100), default=5, show_default=True,
              help="How many candidates (1-100).")
@click.option("--rule", type=click.Choice(RULES), default=None, help="Ranking rule (with --tap).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def discover(intent: str, config: Path | None, taps: tuple[Path, ...], data_dir: Path | None, model: str | None,
             backend: str | None, host: str | None, port: int | None, uds: Path | None, limit: int,
             rule: str | None, as_json: bool) -> None:
    """Best capabilities for an intent, no gates (the daemon's, or in-process with --tap).

    Example: capd discover "query a postgres table" --tap taps/core
    """
    if taps:
        daemon_only(host=host, port=port, uds=uds)
        service = _service(build_settings(config, taps=taps, data_dir=data_dir, model=model, backend=backend,
                                          rule=rule))
        candidates = [{"name": n, "score": round(s, 4)} for n, s in service.discover(intent, limit)]
    else:
        tap_only(rule=rule, data_dir=data_dir, model=model, backend=backend)
        with client_for(build_settings(config, host=host, port=port, uds=uds)) as client:
            candidates = client.discover(intent, limit)
    if as_json:
        emit_json({"candidates": candidates})
    elif not candidates:  # say why rather than print nothing (stderr: stdout stays the list, empty)
        empty = not clean_message(intent, 0)[0].strip()  # as Router.discover decides
        click.echo("no candidates: " + ("the intent is empty once tags are removed" if empty
                                        else "no capability is loaded"), err=True)
    else:
        for candidate in candidates:
            click.echo(f"{candidate['score']:.3f}  {candidate['name']}")


@click.command()
@click.argument("message", type=TEXT)
@settings_options
@connection_options
@click.option("--rule", type=click.Choice(RULES), default=None, help="Routing rule (with --tap).")
@click.option("--session", type=TEXT, default=None, help="Session id (daemon only): activations update its plan.")
@click.option("--explain", is_flag=True, help="Show each candidate's best triggers and their cosines.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def route(message: str, config: Path | None, taps: tuple[Path, ...], data_dir: Path | None, model: str | None,
          backend: str | None, host: str | None, port: int | None, uds: Path | None, rule: str | None,
          session: str | None, explain: bool, as_json: bool) -> None:
    """Decide for one message: activate, abstain or skipped, with the reason.

    Asks the running daemon, or routes in-process when given --tap.

    Example: capd route "show me the last five commits" --tap taps/core --explain
    """
    details = None
    if taps:
        daemon_only(session=session, host=host, port=port, uds=uds)
        service = _service(build_settings(config, taps=taps, data_dir=data_dir, model=model, backend=backend,
                                          rule=rule))
        result = service.route(message).as_dict()
        details = service.explain(message) if explain else None
    else:
        if explain:
            raise Failed("--explain runs in-process: give --tap", EXIT_USAGE)
        tap_only(rule=rule, data_dir=data_dir, model=model, backend=backend)
        with client_for(build_settings(config, host=host, port=port, uds=uds)) as client:
            result = client.route(session, message)
    if as_json:
        emit_json({**result, **({"explain": details} if explain else {})})
    else:
        click.echo(route_text(result, details))


def _eval_options(func: Any) -> Any:
    func = click.option("--fixtures", "fixture_files", multiple=True, required=True,
                        type=PathParam(exists=True, dir_okay=False),
                        help="Fixture file (.jsonl); repeat for several.")(func)
    func = click.option("--rule", type=click.Choice(RULES), default=None, help="Routing rule.")(func)
    return settings_options(func)


def _known_text(known: dict[str, int]) -> str:
    """The note on fixture rows the taps hold as examples or vetoes (:func:`capd.evaluation.known_rows`)."""
    from capd.evaluation import KNOWN_NOTE

    return f"{known['examples']} rows are examples and {known['vetoes']} vetoes of the taps; {KNOWN_NOTE}"


@click.command("eval")
@_eval_options
@click.option("--threshold", type=float, default=None, callback=setting_rule("threshold"),
              help="Override every tap's threshold (-1 to 1).")
@click.option("--margin", type=float, default=None, callback=setting_rule("margin"),
              help="Override every tap's margin (0 to 100).")
@click.option("--coverage", type=float, default=None, callback=setting_rule("coverage"),
              help="Override every tap's coverage gate (fused rule; 0 to 1, 0 turns it off).")
@click.option("--html", "html", type=PathParam(dir_okay=False), default=None,
              help="Also write a self-contained HTML report here.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def eval_(config: Path | None, taps: tuple[Path, ...], data_dir: Path | None, model: str | None,
          backend: str | None, fixture_files: tuple[Path, ...], rule: str | None, threshold: float | None,
          margin: float | None, coverage: float | None, html: Path | None, as_json: bool) -> None:
    """Routing metrics of taps on fixtures: top1, fired_right, fired_wrong, null_fpr, per kind.

    Example: capd eval --tap taps/core --fixtures taps/core/fixtures/positives.jsonl --json
    """
    from capd.evaluation import evaluate
    from capd.fixtures import check_names, load_fixtures

    settings = build_settings(config, taps=taps, data_dir=data_dir, model=model, backend=backend, rule=rule)
    if coverage is not None and settings.rule != "fused":  # the other rules have no coverage gate
        raise Failed(f"--coverage applies to the fused rule (this is {settings.rule}: --rule fused)", EXIT_USAGE)
    fixtures = load_fixtures(fixture_files)
    service = _service(settings)
    check_names(fixtures, service.catalog_now().capabilities, _broken(service))
    result, table, outcome = evaluate(service.router, fixtures, threshold, margin, coverage)
    if html is not None:
        from capd.report_html import render

        title = f"capd eval: {', '.join(str(t) for t in settings.taps)}"
        write_file(html, render(result, table, outcome, title))
    if as_json:
        emit_json(result)
        return
    click.echo(f"{result['n']} rows ({result['positives']} positives, {result['nulls']} nulls), "
               f"rule {result['rule']}, threshold {_fmt(result['threshold'])}, margin {_fmt(result['margin'])}"
               + (f", coverage {_fmt(result['coverage'])}" if result["rule"] == "fused" else ""))
    for key in ("top1", "fired_right", "fired_wrong", "null_fpr"):
        click.echo(f"  {key:<12}{_fmt(result[key])}")
    if any(result["known"].values()):
        click.echo(f"  note: {_known_text(result['known'])}")
    click.echo("per kind:")
    for kind, entry in result["per_kind"].items():
        click.echo(f"  {kind:<16}n={entry['n']:<5} decided right {_fmt(entry['accuracy'])}")
    if result["confusions"]:
        click.echo("worst confusions (expected -> ranked first; how many of those it activated):")
        for c in result["confusions"]:
            click.echo(f"  {c['count']:>4}  {c['expected']} -> {c['got']}  (activated {c['fired']})")
    _echo_failing_rows(result["failing_rows"])
    if html is not None:
        click.echo(f"report: {html}")


def _echo_failing_rows(rows: list[dict[str, Any]]) -> None:
    """``capd eval``'s rows decided wrong, nulls that fired first (each one loads tools nobody asked
    for), then positives that fired another capability, then those that abstained."""
    from capd.floors import row_line

    if not rows:
        return
    order = sorted(rows, key=lambda r: (r["expect"] is not None, r["got"] is None))
    click.echo(f"rows decided wrong: {len(rows)}" + (f" (the first {ROWS_SHOWN_TEXT}; --json lists every one)"
                                                     if len(rows) > ROWS_SHOWN_TEXT else ""))
    for row in order[:ROWS_SHOWN_TEXT]:
        click.echo(f"  {row_line(row)}")


@click.command("test")
@click.argument("tap_args", metavar="[TAP]...", nargs=-1, type=PathParam())
@settings_options
@click.option("--rule", type=click.Choice(RULES), default=None,
              help="Routing rule (default: the settings', else the rule each tap names); floors.toml may hold floors "
                   "for each.")
@click.option("--junit", type=PathParam(dir_okay=False), default=None,
              help="Write JUnit XML here (for CI).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def test_(tap_args: tuple[Path, ...], config: Path | None, taps: tuple[Path, ...], data_dir: Path | None,
          model: str | None, backend: str | None, rule: str | None, junit: Path | None, as_json: bool) -> None:
    """Run each tap's fixtures/*.jsonl against its fixtures/floors.toml; exit 1 below a floor.

    Example: capd test taps/core --junit routing.xml
    """
    from capd.floors import junit_xml

    base = build_settings(config, taps=(*tap_args, *taps), data_dir=data_dir, model=model, backend=backend,
                          rule=rule)
    reports = [_test_tap(base, tap) for tap in base.taps]
    if junit is not None:
        write_file(junit, junit_xml(reports))
    if as_json:
        emit_json({"passed": all(r["passed"] for r in reports), "taps": reports})
    else:
        for report in reports:
            _echo_test_report(report)
    if not all(r["passed"] for r in reports):
        raise SystemExit(EXIT_ERROR)


def _test_tap(base: Settings, tap: Path) -> dict[str, Any]:
    """``capd test``'s report on one tap: its fixtures routed as a daemon on it routes them, against
    the floors of the rule it routes with."""
    from capd.evaluation import evaluate
    from capd.fixtures import check_names, load_fixtures, tap_fixture_files
    from capd.floors import Check, check_floors, load_floors

    if (reason := not_a_tap_directory(tap)) is not None:  # a mistyped path is not a tap without fixtures
        raise Failed(f"{tap}: {reason}")
    files = tap_fixture_files(tap)
    if not files:
        raise Failed(f"{tap}: no fixtures/*.jsonl to test")
    settings = for_one_tap(base, tap)
    floors = load_floors(tap, settings.rule)
    fixtures = load_fixtures(files)
    service = _service(settings)
    # A row expecting a capability that failed to load is a row nothing can fire right, and the
    # tap fails tap_errors: stopping here left CI with no report (every capability has rows).
    check_names(fixtures, {*service.catalog_now().capabilities, *_broken(service)})
    result, _, _ = evaluate(service.router, fixtures)
    checks = check_floors(floors, result)
    errors = service.catalog_now().errors  # a capability that does not load is not tested at all
    if errors:
        checks.append(Check("tap_errors", len(errors), 0, False, "<="))
    return {"tap": str(tap), "rule": settings.rule, "rule_from": settings.rule_from,
            "floors": str(floors.path) if floors.path else None,
            "floors_table": None if floors.path is None else
            "floors" if floors.rule is None else f"floors.{floors.rule}",
            "metrics": {k: result[k] for k in ("n", "top1", "fired_right", "fired_wrong", "null_fpr")},
            "known": result["known"],
            "checks": [c.as_dict() for c in checks], "passed": all(c.passed for c in checks),
            "failing_rows": result["failing_rows"],
            "errors": [problem.as_dict() for problem in errors]}


def _echo_test_report(report: dict[str, Any]) -> None:
    """One tap's ``capd test`` report as text: the figures, the floors' source, each check and the
    rows that count against a failed one, and the tap's errors."""
    from capd.floors import row_line, rows_against

    status = "PASS" if report["passed"] else "FAIL"
    click.echo(f"{status} {report['tap']}  " + "  ".join(f"{k} {_fmt(v)}" for k, v in report["metrics"].items()))
    if report["floors"] is None:
        click.echo("  no fixtures/floors.toml: nothing to hold the tap to")
    elif not report["checks"]:
        click.echo(f"  {report['floors']} sets no floors: nothing to hold the tap to")
    else:
        click.echo(f"  rule {report['rule']}{named_by(report['rule_from'])}, floors from [{report['floors_table']}]"
                   + (" over [floors]" if report["floors_table"] != "floors" else ""))
    if any(report["known"].values()):
        click.echo(f"  note: {_known_text(report['known'])}")
    for check in report["checks"]:
        mark = "ok  " if check["passed"] else "FAIL"
        click.echo(f"  {mark} {check['name']} {_fmt(check['value'])} {check['relation']} {check['bound']}")
        if not check["passed"]:  # the rows that count against it
            against = rows_against(check["name"], report["failing_rows"])
            for row in against[:ROWS_SHOWN_TEXT]:
                click.echo(f"    {row_line(row)}")
            if len(against) > ROWS_SHOWN_TEXT:
                click.echo(f"    … and {len(against) - ROWS_SHOWN_TEXT} more (--json lists every row decided wrong)")
    for problem in report["errors"]:  # what `capd lint` says about them, in one line each
        where = problem["file"] + (f": line {problem['line']}" if problem["line"] is not None else "")
        click.echo(f"    {where}: {problem['reason']}")


@click.command()
@_eval_options
@click.option("--max-null-fpr", default=0.05, show_default=True, callback=share, help="Highest null_fpr allowed.")
@click.option("--max-wrong", default=0.03, show_default=True, callback=share, help="Highest fired_wrong allowed.")
@click.option("--write", is_flag=True, help="Store the recommended gates in <tap>/capd.toml and the fit part's "
              "null rows in <tap>/vetoes.jsonl (each --tap given).")
@click.option("--no-vetoes", is_flag=True, help="Fit the gates without the fit part's null rows as vetoes "
              "(and write no vetoes.jsonl).")
@click.option("--offsets", "with_offsets", is_flag=True, help="fused: also fit per-capability offsets "
              "(--write stores them in [gates.fused.offsets]; without this flag it removes that table's lines).")
@click.option("--examples/--no-examples", "with_examples", default=None, help="Route with the fit part's rows that "
              "expect one capability as more of its triggers, the gates fitted out of fold (--write appends them to "
              "<tap>/examples.jsonl). Rules capd and fused. Default: both are measured, the examples kept when they "
              "add 0.01 or more to the fit part's fired_right (not with --offsets).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def calibrate(config: Path | None, taps: tuple[Path, ...], data_dir: Path | None, model: str | None,
              backend: str | None, fixture_files: tuple[Path, ...], rule: str | None, max_null_fpr: float,
              max_wrong: float, write: bool, no_vetoes: bool, with_offsets: bool, with_examples: bool | None,
              as_json: bool) -> None:
    """Sweep the gates, recommend the point with most fired_right within the limits.

    The tap's examples (examples.jsonl) that are fit rows are scored out of fold: each row by a
    router without its own copy, so the gates are fitted on messages the tap does not know. The
    fit part's positives become more examples when that measures better (--examples / --no-examples
    to choose).

    Example: capd calibrate --tap taps/core --fixtures taps/core/fixtures/positives.jsonl --write
    """
    from capd.calibrate import NO_NULLS
    from capd.calibrate import calibrate as run_calibration
    from capd.fixtures import check_names, load_fixtures

    if write and not taps:  # the configured taps could be the shipped ones, inside capd's own install
        raise Failed("--write needs --tap: name the tap whose capd.toml gets the gates", EXIT_USAGE)
    if with_examples is True and with_offsets:
        raise Failed("--examples and --offsets are not fitted together yet: choose one", EXIT_USAGE)
    settings = build_settings(config, taps=taps, data_dir=data_dir, model=model, backend=backend, rule=rule)
    if with_examples is True and settings.rule == "anchor":
        raise Failed("--examples: the anchor rule routes on triggers alone (use --rule capd or fused)", EXIT_USAGE)
    fixtures = load_fixtures(fixture_files)
    service = _service(settings)
    check_names(fixtures, service.catalog_now().capabilities, _broken(service))
    report = run_calibration(service.router, fixtures, max_null_fpr, max_wrong, auto=service.fit_auto_gates(),
                             vetoes=not no_vetoes, offsets=with_offsets, rebuild=service.router_with_examples,
                             add_examples=with_examples)
    point = report["recommended"]
    refused = write and point is not None and NO_NULLS in report["warnings"]
    write_refused = (_write_calibration(report, service, settings, fixtures, refused, no_vetoes) if write else "")
    if as_json:
        emit_json(report)
    else:
        _echo_calibration(report, max_null_fpr, max_wrong, no_vetoes, with_offsets)
    if refused:  # after the report, so that --json still prints it
        raise Failed(f"nothing written: {NO_NULLS}")
    if write_refused:
        raise Failed(f"nothing written: {write_refused}")
    if point is None:
        raise SystemExit(EXIT_ERROR)


def _write_calibration(report: dict[str, Any], service: Any, settings: Settings, fixtures: Sequence[Fixture],
                       refused: bool, no_vetoes: bool) -> str:
    """``--write``: every edit made and checked before any file is written (the gates and offsets in
    each tap's ``capd.toml``, the fit part's null rows in its ``vetoes.jsonl`` and, when calibration
    added them (``report["examples"]["added"]``), its rows expecting one capability in the
    ``examples.jsonl`` of that capability's tap). ``report["written"]`` lists what was written, also
    before a refusal; returns why a tap file cannot take the recommendation ("" when none)."""
    from capd.calibrate import fit_vetoes
    from capd.calibrate_examples import plan_examples
    from capd.calibrate_write import examples_edit, gates_edit, vetoes_edit, write_appended

    point = report["recommended"]
    catalog = service.catalog_now()

    def own(tap: Path, name: str) -> bool:  # each tap stores its own capabilities' offsets and examples
        return (capability := catalog.get(name)) is not None and capability.tap == tap

    def own_offsets(tap: Path) -> dict[str, float]:
        return {name: value for name, value in report["offsets"].items() if own(tap, name)}

    report["written"] = []
    try:
        edits = [] if point is None or refused else [
            gates_edit(Path(t), point, service.gate_model, settings.rule, own_offsets(Path(t)))
            for t in settings.taps]
        rows = fit_vetoes(fixtures, settings.rule) if edits and not no_vetoes else []
        lines = [e for e in (vetoes_edit(Path(t), rows) for t in settings.taps) if e is not None] if rows else []
        added = (report["examples"] or {}).get("added", False)
        plan = plan_examples(catalog, fixtures, True) if edits and added else None
        if plan is not None:
            examples = [fixtures[i] for i in plan.rows]
            for tap in map(Path, settings.taps):
                mine = [f for f in examples if own(tap, f.expect[0])]
                if mine and (appended := examples_edit(tap, mine)) is not None:
                    lines.append(appended)
        for edit in edits:
            report["written"].append(str(edit.write()))
        for line_edit in lines:
            report["written"].append(str(write_appended(line_edit)))
    except TapFileError as exc:  # the sweep's result is still printed: only the write is refused
        return str(exc)
    return ""


def _echo_calibration(report: dict[str, Any], max_null_fpr: float, max_wrong: float, no_vetoes: bool,
                      with_offsets: bool) -> None:
    """``capd calibrate``'s text report: warnings on stderr, then the curve, the recommendation and
    its fit / held-out figures, what the tap gets without calibration, and the files written."""
    from capd.calibrate import corpus_rule
    from capd.calibrate_examples import EXAMPLES_MIN_GAIN

    for warning in report.get("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    point = report["recommended"]
    click.echo(f"fit on {report['rows']['fit']} rows, checked on {report['rows']['held_out']} held-out rows; "
               f"limits null_fpr <= {max_null_fpr}, fired_wrong <= {max_wrong}")
    click.echo("operating curve (best point per threshold):")
    fused = report["rule"] == "fused"  # only it has a coverage gate
    click.echo("  top_k threshold margin" + (" coverage" if fused else "") + " fired_right fired_wrong null_fpr")
    for p in report["curve"][:: max(1, len(report["curve"]) // 15)]:
        coverage = f" {p['coverage']:>8.2f}" if fused else ""
        click.echo(f"  {p['top_k']:>5} {p['threshold']:>9.2f} {p['margin']:>6.3f}{coverage} "
                   f"{p['fired_right']:>11.3f} {p['fired_wrong']:>11.3f} {_fmt(p['null_fpr']):>8}")
    if point is None:
        click.echo(report.get("error") or "no gate setting meets the limits", err=True)
    else:
        coverage = f", coverage {point['coverage']:.2f}" if fused else ""
        click.echo(f"recommended: top_k {point['top_k']}, threshold {point['threshold']:.2f}, "
                   f"margin {point['margin']:.3f}{coverage}, "
                   f"abstain corpus {'on' if point['abstain_corpus'] else 'off'}")
        tried = report["abstain_corpus"]
        if report["rule"] != "anchor":  # the anchor's rule has no vetoes
            click.echo(f"  fit fired_right without the abstain corpus {_fmt(tried['without'])}, "
                       f"with it {_fmt(tried['with'])} ({corpus_rule()})")
            click.echo("  fitted without the tap's vetoes (--no-vetoes)" if no_vetoes else
                       f"  fitted with the fit part's {report['vetoes']} null rows as the tap's vetoes"
                       + (" (--write adds them to vetoes.jsonl)" if report["vetoes"] else ""))
        tried = report["add_examples"]
        if tried["without"] is not None and tried["with"] is not None:
            click.echo(f"  fit fired_right without the fit positives as examples {_fmt(tried['without'])}, with them "
                       f"{_fmt(tried['with'])} out of fold (kept when they add {EXAMPLES_MIN_GAIN} or more; "
                       "--examples / --no-examples to choose)")
        if (examples := report.get("examples")) is not None:
            click.echo(f"  fitted with {examples['fit_rows']} fit rows as examples, each row scored without its own "
                       f"fold's ({examples['folds']} folds)" + (f", and {examples['kept']} other examples of the tap"
                                                                if examples["kept"] else "")
                       + (" (--write appends them to examples.jsonl)" if examples["added"] else ""))
        if fused and with_offsets:
            moved = sorted(report["offsets"].items(), key=lambda item: -abs(item[1]))
            click.echo(f"  per-capability offsets: {len(moved)}" + ("" if not moved else " (largest: " + ", ".join(
                f"{name} {value:+.2f}" for name, value in moved[:3]) + "; --write stores them in capd.toml)"))
        for label in ("fit", "held_out"):
            m = report[label]
            click.echo(f"  {label:<9} fired_right {_fmt(m['fired_right'])}  fired_wrong {_fmt(m['fired_wrong'])}"
                       f"  null_fpr {_fmt(m['null_fpr'])}  top1 {_fmt(m['top1'])}")
        if "auto_gates" in report:  # what the tap gets without these gates (fused: capd/autogates.py)
            auto, m = report["auto_gates"]["gates"], report["auto_gates"]["held_out"]
            click.echo(f"  without calibration (auto gates {auto['threshold']:.2f} / {auto['margin']:.3f} / "
                       f"coverage {auto['coverage']:.2f}), "
                       f"held_out fired_right {_fmt(m['fired_right'])}  fired_wrong {_fmt(m['fired_wrong'])}  "
                       f"null_fpr {_fmt(m['null_fpr'])}")
        for path in report.get("written", []):
            click.echo(f"wrote {path}")
