"""``capd test``: a tap's own fixtures against the floors the tap declares.

``<tap>/fixtures/floors.toml``::

    [floors]
    min_top1 = 0.85
    min_fired_right = 0.60
    max_fired_wrong = 0.05
    max_null_fpr = 0.05

    [floors.kinds]          # minimum share of rows of that kind decided right
    chitchat = 0.95         # (fired an expected capability, or abstained on a null)

    [floors.fused]          # for one rule (capd, anchor or fused): replaces the floors it names
    min_fired_right = 0.80

    [floors.fused.kinds]    # and the kinds it names (the others stay as above)
    chitchat = 0.90

Rules route at different levels, so a tap can hold each to its own: ``capd test --rule fused``
checks ``[floors]`` with ``[floors.fused]`` laid over it, key by key. Every rule's table is
checked whichever rule runs, so a mistake in one fails at once, not when someone switches rule.
A tap with fixtures but no floors file is checked against nothing and reported as such.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from capd.catalog import RULES
from capd.errors import FixtureError, TapFileError
from capd.tap_files import line_in_table, line_of, parse_toml

FLOORS_FILE = "floors.toml"
_MINIMA = {"min_top1": "top1", "min_fired_right": "fired_right"}
_MAXIMA = {"max_fired_wrong": "fired_wrong", "max_null_fpr": "null_fpr"}


@dataclass(frozen=True)
class Floors:
    path: Path | None
    minima: dict[str, float] = field(default_factory=dict)  # metric -> lowest allowed
    maxima: dict[str, float] = field(default_factory=dict)  # metric -> highest allowed
    kinds: dict[str, float] = field(default_factory=dict)  # kind -> lowest accuracy
    rule: str | None = None  # the rule whose own table was laid over [floors], if the file has one


def _key_line(text: str, section: str, key: str) -> int | None:
    """The line of ``key = …`` inside the ``[section]`` table, else of ``[section.key]`` (or of a table
    under it, ``[section.key.kinds]``), else of the section's header (best effort, for error messages)."""
    entry = line_in_table(text, section, key)
    if entry is not None:
        return entry
    header = re.compile(rf"^[ \t]*\[\s*{re.escape(section)}\s*\]", re.M).search(text)
    table = re.compile(rf"^[ \t]*\[\s*{re.escape(section)}\.{re.escape(key)}\s*[.\]]", re.M).search(text)
    if table is not None:
        return text.count("\n", 0, table.start()) + 1
    return None if header is None else text.count("\n", 0, header.start()) + 1


def _top_line(text: str, key: str) -> int | None:
    """The line of a top-level ``key = …``, ``[key]`` or ``[key.sub]`` (best effort)."""
    header = re.compile(rf"^[ \t]*\[\s*{re.escape(key)}\s*[.\]]", re.M).search(text)
    if header is not None:
        return text.count("\n", 0, header.start()) + 1
    return line_of(text, key)


class _Reader:
    """Checks one floors table (``[floors]`` or ``[floors.<rule>]``) and collects its bounds."""

    def __init__(self, path: Path, text: str) -> None:
        self.path, self.text = path, text

    def fail(self, section: str, key: str, reason: str) -> FixtureError:
        return FixtureError(self.path, reason, _key_line(self.text, section, key))

    def fraction(self, section: str, key: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise self.fail(section, key, f"{section}.{key} must be a number between 0 and 1")
        return float(value)

    def table(self, section: str, values: dict[str, Any], rules: bool) -> tuple[Floors, dict[str, Floors]]:
        """The bounds of ``[section]`` and, where ``rules``, of each ``[section.<rule>]`` in it."""
        minima: dict[str, float] = {}
        maxima: dict[str, float] = {}
        kinds: dict[str, float] = {}
        per_rule: dict[str, Floors] = {}
        for key, value in values.items():
            if key == "kinds":
                if not isinstance(value, dict):
                    raise self.fail(section, key, f"[{section}.kinds] must be a table of kind = minimum accuracy")
                kinds = {k: self.fraction(f"{section}.kinds", k, v) for k, v in value.items()}
            elif key in _MINIMA:
                minima[_MINIMA[key]] = self.fraction(section, key, value)
            elif key in _MAXIMA:
                maxima[_MAXIMA[key]] = self.fraction(section, key, value)
            elif rules and key in RULES:
                if not isinstance(value, dict):
                    raise self.fail(section, key, f"[{section}.{key}] must be a table of floors for the {key} rule")
                per_rule[key] = self.table(f"{section}.{key}", value, rules=False)[0]
            else:
                known = ", ".join([*_MINIMA, *_MAXIMA, "kinds"])
                also = f"; or a rule's own table: {', '.join(RULES)}" if rules else ""
                raise self.fail(section, key, f"{section}.{key}: unknown floor (known: {known}{also})")
        return Floors(self.path, minima, maxima, kinds), per_rule


def load_floors(tap: Path, rule: str | None = None) -> Floors:
    """The floors ``capd test`` holds ``tap`` to under ``rule``: ``[floors]``, with ``[floors.<rule>]``
    laid over it when the file has that table. Raises FixtureError (file and line) for a file it
    cannot use, whichever rule's table the mistake is in."""
    path = tap / "fixtures" / FLOORS_FILE
    if not os.path.lexists(path):  # a link to nothing is a mistake to report, not a tap without floors
        return Floors(path=None)
    try:
        table, text, _ = parse_toml(path, tap)
    except TapFileError as exc:  # unreadable, not UTF-8, invalid TOML: with its line
        raise FixtureError(path, exc.reason, exc.line) from None
    for key in table:
        if key != "floors":  # a misspelt [floor.kinds], or a key above [floors]: it would hold nothing to account
            raise FixtureError(path, f"{key}: not part of [floors] (the file holds only [floors] and its tables, "
                                     "e.g. [floors.kinds], [floors.fused])", _top_line(text, key))
    floors = table.get("floors", {})
    if not isinstance(floors, dict):
        raise FixtureError(path, "[floors] must be a table", line_of(text, "floors"))
    base, per_rule = _Reader(path, text).table("floors", floors, rules=True)
    own = per_rule.get(rule) if rule is not None else None
    if own is None:
        return base
    return Floors(path, {**base.minima, **own.minima}, {**base.maxima, **own.maxima},
                  {**base.kinds, **own.kinds}, rule)


@dataclass(frozen=True)
class Check:
    name: str
    value: float | None
    bound: float
    passed: bool
    relation: str  # ">=" or "<="

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "bound": self.bound, "relation": self.relation,
                "passed": self.passed}


def check_floors(floors: Floors, result: dict[str, Any]) -> list[Check]:
    """A floor whose metric has no rows to measure fails (``n/a``), like a floor on a kind with
    none: an empty or truncated fixture file must not pass a tap's CI."""
    checks: list[Check] = []
    for metric, bound in floors.minima.items():
        value = result.get(metric)
        checks.append(Check(metric, value, bound, value is not None and value >= bound - 1e-9, ">="))
    for metric, bound in floors.maxima.items():
        value = result.get(metric)
        checks.append(Check(metric, value, bound, value is not None and value <= bound + 1e-9, "<="))
    per_kind = result.get("per_kind", {})
    for kind, bound in floors.kinds.items():
        if kind not in per_kind:
            checks.append(Check(f"kind:{kind}", None, bound, False, ">="))
            continue
        value = per_kind[kind]["accuracy"]
        checks.append(Check(f"kind:{kind}", value, bound, value is not None and value >= bound - 1e-9, ">="))
    return checks


ROWS_SHOWN = 50  # failing rows listed per failing check (JUnit; the CLI's text shows fewer)


def rows_against(check: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Which of the rows decided wrong (:func:`capd.evaluation.failing_rows`) count against
    ``check``: the positives ranked wrong for ``top1``, the positives not fired right for
    ``fired_right``, those that fired another capability for ``fired_wrong``, the nulls that fired
    for ``null_fpr``, the kind's rows for ``kind:NAME``. A check failed by one kind of mistake used
    to list the first rows of every kind, in file order, often none of its own."""
    if check == "top1":
        return [r for r in rows if r["expect"] and r["best"] not in r["expect"]]
    if check == "fired_right":
        return [r for r in rows if r["expect"]]
    if check == "fired_wrong":
        return [r for r in rows if r["expect"] and r["got"] is not None]
    if check == "null_fpr":
        return [r for r in rows if not r["expect"]]
    if check.startswith("kind:"):
        return [r for r in rows if r["kind"] == check.removeprefix("kind:")]
    return [] if check == "tap_errors" else rows


ROW_MESSAGE_SHOWN = 60  # characters of a row's message in its line


def row_line(row: dict[str, Any]) -> str:
    """One row decided wrong (:func:`capd.evaluation.failing_rows`): where it is, what it says, what
    happened and why."""
    message = " ".join(str(row["message"]).split())
    if len(message) > ROW_MESSAGE_SHOWN:
        message = message[:ROW_MESSAGE_SHOWN - 1] + "…"
    why = f"; {row['why']}" if row.get("why") else ""
    return (f"{row['source']}: {message!r} expected {row['expect']}, got {row['got']} "
            f"(best {row['best']} {row['score']:.3f}, margin {row['margin']:.3f}{why})")


def junit_xml(reports: list[dict[str, Any]]) -> str:
    """One <testsuite> per tap, one <testcase> per floor; failing rows go to system-out."""
    suites = ET.Element("testsuites")
    for report in reports:
        checks = report["checks"]
        suite = ET.SubElement(suites, "testsuite", name=f"capd:{report['tap']}", tests=str(len(checks)),
                              failures=str(sum(not c["passed"] for c in checks)))
        properties = ET.SubElement(suite, "properties")  # which rule, held to which floors
        for key in ("rule", "floors_table"):
            if report.get(key) is not None:
                ET.SubElement(properties, "property", name=key, value=str(report[key]))
        for check in checks:
            case = ET.SubElement(suite, "testcase", classname=f"capd.{Path(report['tap']).name}", name=check["name"])
            if not check["passed"]:
                failure = ET.SubElement(case, "failure", message=(f"{check['name']} = {check['value']} "
                                                                  f"not {check['relation']} {check['bound']}"))
                against = rows_against(check["name"], report["failing_rows"])
                lines = [row_line(r) for r in against[:ROWS_SHOWN]]
                if len(against) > ROWS_SHOWN:
                    lines.append(f"… and {len(against) - ROWS_SHOWN} more")
                failure.text = "\n".join(lines)
        out = ET.SubElement(suite, "system-out")
        out.text = f"{len(report['failing_rows'])} fixture rows decided wrong"
    # Characters XML 1.0 cannot hold (control characters in a kind or message, a file name's
    # undecodable bytes as lone surrogates) are written as escapes: a CI parser rejects the file otherwise.
    return _NOT_XML.sub(lambda m: ascii(m.group())[1:-1], ET.tostring(suites, encoding="unicode",
                                                                       xml_declaration=True))


_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
