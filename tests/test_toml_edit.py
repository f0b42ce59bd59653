"""``capd calibrate --write`` edits a hand-written capd.toml in place (capd/toml_edit.py): a property
test over files holding every kind of TOML value around the gates.

The example-based cases (shapes people write, files it refuses) are in tests/test_fused.py; here
hypothesis writes the rest of the file: strings with escapes and quotes, multi-line strings,
arrays over several lines with comments in them, inline tables, dates and times, numbers in every
notation, comments everywhere. Whatever surrounds gates written as tables with one ``key = value``
line each, the edit must succeed, mean exactly the new gates with every other value unchanged,
and keep every other line of the file, in order.
"""

from __future__ import annotations

import json
import tempfile
import tomllib
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from capd.calibrate_write import write_gates
from capd.toml_edit import same

MODEL = "all-minilm-l6-v2"
POINTS = {"capd": {"threshold": 0.47, "margin": 0.05, "top_k": 2},
          "fused": {"threshold": -0.3, "margin": 1.8, "coverage": 0.4}}
GATE_WORDS = ("threshold", "margin", "top_k", "coverage", "abstain_corpus", "model")
GATE_VALUES = {"threshold": ["0.5", "-0.2", "1.0"], "margin": ["0.5", "3", "1.0"], "top_k": ["3", "1"],
               "coverage": ["0.5", "1.0", "0"]}  # values capd loads: write_gates refuses a file that would not load

_chars = st.characters(blacklist_categories=("Cs", "Cc"))  # control characters need escapes: basic strings only
_plain = st.text(_chars, max_size=12)


def _multiline(quote: str) -> st.SearchStrategy[str]:
    """A multi-line string: lines of text (no backslash, no run of three quotes), up to two quotes
    right before the closing ones (``\"\"\"a\"\"\"\"`` is ``a"``)."""
    line = st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\\" + quote), max_size=10)
    body = st.lists(line, min_size=1, max_size=3).map("\n".join)
    return st.tuples(st.booleans(), body, st.integers(0, 2)).map(
        lambda t: quote * 3 + ("\n" if t[0] else "") + t[1] + quote * t[2] + quote * 3)


SCALARS = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x7f"), max_size=12).map(
        lambda s: json.dumps(s, ensure_ascii=False)),  # escapes of every kind (JSON's are TOML's)
    _plain.filter(lambda s: "'" not in s).map(lambda s: f"'{s}'"),
    _multiline('"'), _multiline("'"),
    st.sampled_from(["0", "+17", "-3", "1_000", "0x1F", "0o17", "0b101", "3.14", "-0.5", "1e10", "6.02E+23",
                     "inf", "-inf", "nan", "true", "false", "1979-05-27T07:32:00Z", "1979-05-27 07:32:00",
                     "1979-05-27T00:32:00.999+07:00", "1979-05-27", "07:32:00"]),
)
COMMENT = _plain.filter(lambda s: "\n" not in s and "\r" not in s).map(lambda s: f"# {s}")


@st.composite
def values(draw: st.DrawFn, depth: int = 0) -> str:
    """A rendered TOML value: a scalar, an array (possibly over lines, with comments) or an inline table."""
    kind = draw(st.sampled_from(["scalar", "scalar", "array", "table"] if depth < 2 else ["scalar"]))
    if kind == "scalar":
        return draw(SCALARS)
    if kind == "table":
        keys = draw(st.lists(st.sampled_from(["a", "b", "c-d", '"e f"']), unique=True, max_size=3))
        return "{ " + ", ".join(f"{k} = {draw(values(depth + 1))}" for k in keys) + " }"
    items = draw(st.lists(values(depth + 1), max_size=3))
    if not draw(st.booleans()):
        return "[" + ", ".join(items) + "]"
    lines = [f"  {item},{'  ' + draw(COMMENT) if draw(st.booleans()) else ''}" for item in items]
    closing = f"  {draw(COMMENT)}\n]" if draw(st.booleans()) else "]"
    return "[\n" + "".join(line + "\n" for line in lines) + closing


@st.composite
def other_lines(draw: st.DrawFn) -> list[str]:
    """Keys that are not gates (each once), comments and blank lines, in any order."""
    keys = draw(st.lists(st.sampled_from(["owner", "note", "tags", '"quoted key"', "created", "when.day", "limits"]),
                         unique=True, max_size=4))
    lines = [f"{key} = {draw(values())}" + (f"  {draw(COMMENT)}" if draw(st.booleans()) else "") for key in keys]
    lines += draw(st.lists(st.one_of(COMMENT, st.just("")), max_size=3))
    return draw(st.permutations(lines))


@st.composite
def gate_table(draw: st.DrawFn, header: str, keys: tuple[str, ...]) -> list[str]:
    chosen = draw(st.lists(st.sampled_from(keys), unique=True, max_size=len(keys)))
    lines = [f"{key} = {draw(st.sampled_from(GATE_VALUES[key]))}" for key in chosen]
    lines = [line + (f"  {draw(COMMENT)}" if draw(st.booleans()) else "") for line in lines]
    lines += draw(st.lists(COMMENT, max_size=2))
    return [header, *draw(st.permutations(lines))]


@st.composite
def documents(draw: st.DrawFn) -> str:
    top = draw(other_lines())
    if draw(st.booleans()):
        top.insert(draw(st.integers(0, len(top))), f'model = "{draw(st.sampled_from([MODEL, "other-model"]))}"')
    tables = [draw(other_lines()).copy() for _ in range(draw(st.integers(0, 2)))]
    sections = [["[meta]", *lines] if i == 0 else ["[notes.more]", *lines] for i, lines in enumerate(tables)]
    if draw(st.booleans()):
        sections.append(draw(gate_table("[gates]", ("threshold", "margin", "top_k"))))
    if draw(st.booleans()):
        sections.append(draw(gate_table("[gates.fused]", ("threshold", "margin", "coverage"))))
    sections = draw(st.permutations(sections))
    newline = draw(st.sampled_from(["\n", "\r\n"]))
    text = newline.join(top + [line for section in sections for line in section])
    return text + (newline if draw(st.booleans()) else "")


def _kept(line: str) -> bool:
    return not line.lstrip().startswith(GATE_WORDS) and not line.startswith("[gates")


@settings(max_examples=150, deadline=None)
@given(text=documents(), rule=st.sampled_from(["capd", "fused"]))
def test_calibrate_write_changes_the_gates_and_nothing_else(text: str, rule: str) -> None:
    before = tomllib.loads(text)  # the generator writes valid TOML; a file that is not is refused (test_fused)
    with tempfile.TemporaryDirectory() as scratch:
        tap = Path(scratch)
        (tap / "capd.toml").write_bytes(text.encode())
        write_gates(tap, POINTS[rule], MODEL, rule)
        written = (tap / "capd.toml").read_bytes().decode()
    after = tomllib.loads(written)
    table = after["gates"]["fused"] if rule == "fused" else after["gates"]
    assert {key: table[key] for key in POINTS[rule]} == POINTS[rule] and after["model"] == MODEL
    assert same({k: v for k, v in after.items() if k not in ("gates", "model")},
                {k: v for k, v in before.items() if k not in ("gates", "model")})
    kept = iter(written.splitlines())
    for line in filter(_kept, text.splitlines()):  # every other line, verbatim and in order
        assert any(line == candidate for candidate in kept), (line, written)
