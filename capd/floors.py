"""``capd test``: a tap's own fixtures against the floors the tap declares.

``<tap>/fixtures/floors.toml``::

    [floors]
    min_top1 = 0.85
    min_fired_right = 0.60
    max_fired_wrong = 0.05
    max_null_fpr = 0.05

    [floors.kinds]          # minimum share of rows of that kind decided right
    chitchat = 0.95         # (fired an expected capability, or abstained on a null)

A tap with fixtures but no floors file is checked against nothing and reported as such.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from capd.errors import FixtureError, TapFileError
from capd.taps import _line_of, parse_toml

FLOORS_FILE = "floors.toml"
_MINIMA = {"min_top1": "top1", "min_fired_right": "fired_right"}
_MAXIMA = {"max_fired_wrong": "fired_wrong", "max_null_fpr": "null_fpr"}


@dataclass(frozen=True)
class Floors:
    path: Path | None
    minima: dict[str, float] = field(default_factory=dict)  # metric -> lowest allowed
    maxima: dict[str, float] = field(default_factory=dict)  # metric -> highest allowed
    kinds: dict[str, float] = field(default_factory=dict)  # kind -> lowest accuracy


def load_floors(tap: Path) -> Floors:
    path = tap / "fixtures" / FLOORS_FILE
    if not path.exists():
        return Floors(path=None)
    try:
        table, text, _ = parse_toml(path, tap)
    except TapFileError as exc:  # unreadable, not UTF-8, invalid TOML: with its line
        raise FixtureError(path, exc.reason, exc.line) from None
    floors = table.get("floors", {})
    if not isinstance(floors, dict):
        raise FixtureError(path, "[floors] must be a table", _line_of(text, "floors"))
    minima: dict[str, float] = {}
    maxima: dict[str, float] = {}
    kinds: dict[str, float] = {}

    def line(key: str) -> int | None:  # `key = …` under [floors], or its own [floors.key] table
        return _line_of(text, f"floors.{key}") or _line_of(text, key)

    def fraction(key: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise FixtureError(path, f"{key} must be a number between 0 and 1", _line_of(text, key.split(".")[-1]))
        return float(value)

    for key, value in floors.items():
        if key == "kinds":
            if not isinstance(value, dict):
                raise FixtureError(path, "[floors.kinds] must be a table of kind = minimum accuracy", line("kinds"))
            kinds = {k: fraction(f"floors.kinds.{k}", v) for k, v in value.items()}
        elif key in _MINIMA:
            minima[_MINIMA[key]] = fraction(f"floors.{key}", value)
        elif key in _MAXIMA:
            maxima[_MAXIMA[key]] = fraction(f"floors.{key}", value)
        else:
            known = ", ".join([*_MINIMA, *_MAXIMA, "kinds"])
            raise FixtureError(path, f"floors.{key}: unknown floor (known: {known})", line(key))
    return Floors(path=path, minima=minima, maxima=maxima, kinds=kinds)


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


def junit_xml(reports: list[dict[str, Any]]) -> str:
    """One <testsuite> per tap, one <testcase> per floor; failing rows go to system-out."""
    suites = ET.Element("testsuites")
    for report in reports:
        checks = report["checks"]
        suite = ET.SubElement(suites, "testsuite", name=f"capd:{report['tap']}", tests=str(len(checks)),
                              failures=str(sum(not c["passed"] for c in checks)))
        for check in checks:
            case = ET.SubElement(suite, "testcase", classname=f"capd.{Path(report['tap']).name}", name=check["name"])
            if not check["passed"]:
                failure = ET.SubElement(case, "failure", message=(f"{check['name']} = {check['value']} "
                                                                  f"not {check['relation']} {check['bound']}"))
                failure.text = "\n".join(f"{r['source']}: expected {r['expect']}, got {r['got']} "
                                         f"(best {r['best']} {r['score']})" for r in report["failing_rows"][:50])
        out = ET.SubElement(suite, "system-out")
        out.text = f"{len(report['failing_rows'])} fixture rows decided wrong"
    return ET.tostring(suites, encoding="unicode", xml_declaration=True)
