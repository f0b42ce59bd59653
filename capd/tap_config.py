"""A tap's own files beside its capabilities: ``capd.toml`` (the rule, the model, the gates and the
per-capability offsets ``capd calibrate --write`` stores), ``vetoes.jsonl`` (messages none of
the tap's capabilities may take) and ``examples.jsonl`` (messages routed as more triggers of the
capability each expects), checked, with the file and line of each problem.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from capd.catalog import RULES, Example, Problem, TapConfig
from capd.errors import TapFileError
from capd.fixtures import Fixture, read_fixture_file
from capd.tap_files import Checker, parse_toml, read_tap_file
from capd.text import routed_key

TAP_CONFIG = "capd.toml"
TAP_VETOES = "vetoes.jsonl"  # messages none of the tap's capabilities may take (TapConfig.vetoes)
TAP_EXAMPLES = "examples.jsonl"  # messages routed as more triggers of the capability each expects (TapConfig.examples)
GATE_KEYS = ("threshold", "margin", "top_k")
TAP_CONFIG_KEYS = ("model", "gates", "rule")  # what capd reads at the top level of a tap's capd.toml
SWITCH = "abstain_corpus"  # a gate table's on/off key: veto with the shipped abstain corpus (capd/vetoes.py)
MAX_OFFSET = 20.0  # log-odds units: beyond this an offset alone would decide every message


def load_tap_config(tap: Path) -> tuple[TapConfig | None, list[Problem]]:
    """``<tap>/capd.toml``, ``<tap>/vetoes.jsonl`` and ``<tap>/examples.jsonl`` (None when none is
    there, or when capd.toml is broken: the daemon then keeps the last good one). A vetoes or
    examples line that cannot be used is reported on its line and skipped; the other lines stay in force."""
    path = tap / TAP_CONFIG
    vetoes, problems = load_tap_vetoes(tap)
    examples, found = load_tap_examples(tap)
    problems += found
    if not os.path.lexists(path):  # a link to nothing is an error to report, not a missing file
        there = os.path.lexists(tap / TAP_VETOES) or os.path.lexists(tap / TAP_EXAMPLES)
        return (TapConfig(path=path, vetoes=vetoes, examples=examples) if there else None), problems
    try:
        table, text, _ = parse_toml(path, tap)
        return replace(tap_config(path, table, text), vetoes=vetoes, examples=examples), problems
    except TapFileError as exc:
        return None, [Problem("error", str(exc.path), exc.reason, exc.line, code="invalid"), *problems]


def load_tap_vetoes(tap: Path) -> tuple[tuple[str, ...], list[Problem]]:
    """The messages of ``<tap>/vetoes.jsonl`` (fixture rows that expect nothing, as ``capd calibrate
    --write`` writes them from the fixtures' null rows), and a problem per line that cannot be used."""
    rows, problems = _tap_rows(tap, TAP_VETOES, "the tap has no vetoes", "this line vetoes nothing", "invalid-veto")
    first: dict[str, int] = {}  # a routed text -> the line that vetoes it
    for row, line in rows:
        if row.positive:
            problems.append(Problem("error", str(tap / TAP_VETOES), "a veto expects nothing (\"expect\": null), not "
                                    f"{', '.join(row.expect)}; this line vetoes nothing", line, code="invalid-veto"))
            continue
        key = _key_or_problem(tap / TAP_VETOES, row.message, line, "this line vetoes nothing", "invalid-veto", problems)
        if key is None:
            continue
        if key in first:
            problems.append(Problem("warning", str(tap / TAP_VETOES), f"the same message as line {first[key]} once "
                                    "case, spacing and tags are set aside (the model sees one message): it counts as "
                                    "one veto with it, and a veto needs two different messages to agree", line,
                                    code="duplicate-veto"))
        else:
            first[key] = line
    return tuple(r.message for r, _ in rows if not r.positive), problems


def load_tap_examples(tap: Path) -> tuple[tuple[Example, ...], list[Problem]]:
    """The rows of ``<tap>/examples.jsonl``: fixture rows that each expect one capability of the tap,
    routed as more of its triggers (``capd calibrate --write`` appends the fit part's positive
    rows when it keeps them as examples), and a problem per line that cannot be used. Whether the
    capability is the tap's own is checked with the tap's capabilities (:func:`unknown_examples`)."""
    path = tap / TAP_EXAMPLES
    rows, problems = _tap_rows(tap, TAP_EXAMPLES, "the tap has no examples", "this line adds no example",
                               "invalid-example")
    examples: list[Example] = []
    first: dict[tuple[str, str], int] = {}  # (capability, routed text) -> its first line
    for row, line in rows:
        if len(row.expect) != 1:
            wanted = "nothing" if not row.expect else ", ".join(row.expect)
            hint = (" (a message no capability may take belongs in vetoes.jsonl)" if not row.expect else "")
            problems.append(Problem("error", str(path), f"an example expects one capability, not {wanted}{hint}; "
                                    "this line adds no example", line, code="invalid-example"))
            continue
        key = _key_or_problem(path, row.message, line, "this line adds no example", "invalid-example", problems)
        if key is None:
            continue
        if (row.expect[0], key) in first:
            problems.append(Problem("warning", str(path), f"the same example as line {first[row.expect[0], key]} "
                                    "once case, spacing and tags are set aside: it counts once", line,
                                    code="duplicate-example"))
            continue
        first[row.expect[0], key] = line
        examples.append(Example(row.expect[0], row.message, line))
    return tuple(examples), problems


def unknown_examples(config: TapConfig, names: Iterable[str]) -> list[Problem]:
    """A warning per example of ``config``'s tap naming a capability that is not among ``names``,
    the tap's own (an example only ever joins its own tap's capability)."""
    known = set(names)
    return [Problem("warning", str(config.path.parent / TAP_EXAMPLES), f"no capability {e.capability!r} in this "
                    "tap: the line adds no example until it has one", e.line, code="unknown-example")
            for e in config.examples if e.capability not in known]


def _tap_rows(tap: Path, name: str, lost: str, skipped: str, code: str) -> tuple[list[tuple[Fixture, int]],
                                                                                   list[Problem]]:
    """The fixture rows of a tap's own JSON Lines file (``vetoes.jsonl``, ``examples.jsonl``) with
    their lines, read with the guards of every tap file (no link out of the tap, no pipe to block
    on, a size limit), and a problem per line that cannot be read: ``lost`` says what the tap then
    lacks, ``skipped`` what a bad line costs."""
    path = tap / name
    if not os.path.lexists(path):
        return [], []
    try:
        data = read_tap_file(path, tap)
    except TapFileError as exc:
        return [], [Problem("error", str(exc.path), f"{exc.reason}; {lost}", code=code)]
    rows, errors = read_fixture_file(path, data)
    problems = [Problem("error", str(e.path), f"{e.reason}; {skipped}", e.line, code=code)
                for e in errors if rows or e.line is not None]  # a file of comments only is no error
    return [(row, int(row.source.rsplit(":", 1)[1])) for row in rows], problems


def _key_or_problem(path: Path, message: str, line: int, skipped: str, code: str,
                    problems: list[Problem]) -> str | None:
    """The message's :func:`~capd.text.routed_key` (None, with a problem, when nothing is left once
    its tags are removed)."""
    key = routed_key(message)
    if not key:
        problems.append(Problem("error", str(path), "nothing is left of the message once its tags are removed "
                                f"(a message routes without them); {skipped}", line, code=code))
        return None
    return key


def tap_config(path: Path, table: Mapping[str, Any], text: str) -> TapConfig:
    """A parsed ``capd.toml`` checked (``text`` for the lines of errors); raises TapFileError."""
    check = Checker(path, text)
    for key in table:  # other keys are the author's own (notes, owners): kept and not read
        if key in TAP_CONFIG_KEYS:
            continue
        if key in (*GATE_KEYS, "coverage", SWITCH, "fused"):  # a gate above [gates] would be ignored
            raise check.fail(key, "is a gate: it goes in [gates] (rules capd, anchor) or [gates.fused]")
        if near := difflib.get_close_matches(key, TAP_CONFIG_KEYS, n=1, cutoff=0.75):
            raise check.fail(key, f"is not read by capd: did you mean {near[0]}?")
    gates_raw = dict(check.table(table, "gates"))
    fused_raw = dict(check.table(gates_raw, "fused")) if "fused" in gates_raw else {}
    gates_raw.pop("fused", None)
    offsets = _offsets(check, check.table(fused_raw, "offsets", "gates.fused.offsets"))
    fused_raw.pop("offsets", None)
    gates = _gate_values(check, "gates", gates_raw, GATE_KEYS)
    fused_gates = _gate_values(check, "gates.fused", fused_raw, ("threshold", "margin", "coverage"))
    model = check.optional_str(table, "model")
    rule = check.optional_str(table, "rule")
    if rule is not None and rule not in RULES:
        raise check.fail("rule", f"must be one of {', '.join(RULES)} (got {rule!r})")
    return TapConfig(path=path, gates=MappingProxyType(gates), model=model, fused_gates=MappingProxyType(fused_gates),
                     rule=rule, offsets=MappingProxyType(offsets))


def _offsets(check: Checker, raw: Mapping[str, Any]) -> dict[str, float]:
    """``[gates.fused.offsets]``: capability name -> a number added to its fused score (``capd
    calibrate``'s per-capability offsets, :func:`capd.offsets.fit_offsets`). A name the tap does
    not define is kept and changes nothing (the capability may come back)."""
    offsets: dict[str, float] = {}
    for name, value in raw.items():
        label = f"gates.fused.offsets.{name}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise check.fail(label, "must be a number")
        if not (math.isfinite(value) and -MAX_OFFSET <= value <= MAX_OFFSET):
            raise check.fail(label, f"must be a number between -{MAX_OFFSET:g} and {MAX_OFFSET:g} (got {value})")
        offsets[name] = float(value)
    return offsets


def _gate_values(check: Checker, where: str, raw: Mapping[str, Any],
                 known: Sequence[str]) -> dict[str, float | bool]:
    gates: dict[str, float | bool] = {}
    for key, value in raw.items():
        if key not in (*known, SWITCH):
            raise check.fail(f"{where}.{key}", f"is not a gate (known: {', '.join((*known, SWITCH))})")
        if key == SWITCH:
            if not isinstance(value, bool):
                raise check.fail(f"{where}.{key}", "must be true or false")
            gates[key] = value
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise check.fail(f"{where}.{key}", "must be a number")
        elif not math.isfinite(value):
            raise check.fail(f"{where}.{key}", f"must be a finite number (got {value})")
        elif key == "top_k" and not (isinstance(value, int) and value >= 1):  # how many triggers' cosines to average
            raise check.fail(f"{where}.{key}", f"must be a whole number of at least 1 (got {value})")
        elif key == "coverage" and not 0.0 <= value <= 1.0:  # a mean of cosines; above 1 nothing would fire
            raise check.fail(f"{where}.{key}", "must be between 0 and 1 (0 turns the coverage gate off)")
        elif key == "threshold" and not -1.0 <= value <= 1.0:  # as CAPD_THRESHOLD: a cosine or a level
            raise check.fail(f"{where}.{key}", f"must be between -1 and 1 (got {value})")
        elif key == "margin" and not 0.0 <= value <= 100.0:  # as CAPD_MARGIN: a cosine or a log-odds gap
            raise check.fail(f"{where}.{key}", f"must be between 0 and 100 (got {value})")
        else:
            gates[key] = float(value)
    return gates
