"""What ``capd calibrate --write`` changes in a tap: the gates (and offsets) in ``<tap>/capd.toml``,
the fit part's null rows appended to ``<tap>/vetoes.jsonl`` and, when calibration added them as
examples, its positive rows to ``<tap>/examples.jsonl``.

Every edit is made and checked before any file is written (:func:`gates_edit`, :func:`vetoes_edit`,
:func:`examples_edit`),
so a calibration of several taps writes nothing when one of them cannot be edited; what the tap's
author wrote stays (a file is edited in place, line by line, and read back before it replaces the
old one); capability files are never touched.
"""

from __future__ import annotations

import copy
import json
import os
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capd import atomic, toml_edit
from capd.errors import TapFileError
from capd.fixtures import Fixture, read_fixture_file
from capd.tap_config import GATE_KEYS, SWITCH, TAP_EXAMPLES, TAP_VETOES, tap_config
from capd.tap_files import read_tap_file
from capd.text import routed_key
from capd.toml_edit import KeyPath, render_key


@dataclass(frozen=True)
class GatesEdit:
    """A ``capd.toml`` edit checked and ready (:func:`gates_edit`); :meth:`write` stores it."""

    tap: Path
    path: Path
    text: str

    def write(self) -> Path:
        try:
            atomic.write_text(self.path, self.text)
        except OSError as exc:
            raise TapFileError(self.path, f"cannot write it: {exc.strerror or exc}; nothing was changed") from None
        return self.tap / "capd.toml"


VETOES_HEADER = """\
# Vetoes of this tap: messages none of its capabilities may take. A winner is turned away when
# two of these are nearer the message than the winner's nearest example, or the message is one of
# them. One fixture row per line ("expect": null). `capd calibrate --write` appends the null rows
# it fitted the gates with (the gates assume them: remove a line and more messages like it may
# fire); add your own freely.
"""


EXAMPLES_HEADER = """\
# Examples of this tap's capabilities: each message routes as one more trigger of the capability it
# expects (rules capd and fused; the anchor rule reads triggers alone). One fixture row per line,
# "expect" naming one capability of this tap. `capd calibrate --write` appends the fit rows it
# fitted the gates with when they measured better as examples (the gates assume them); add your own freely.
"""


def vetoes_edit(tap: Path, rows: Sequence[Fixture]) -> tuple[Path, str] | None:
    """``<tap>/vetoes.jsonl`` with the ``rows`` it lacks appended (None: it has them all). What is
    there stays byte for byte: lines are only added, never changed or reordered."""
    return _appended(tap, TAP_VETOES, VETOES_HEADER, "no veto was added", rows,
                     lambda row: (routed_key(row.message),),
                     lambda row: {"message": row.message, "expect": None, "kind": row.kind})


def examples_edit(tap: Path, rows: Sequence[Fixture]) -> tuple[Path, str] | None:
    """``<tap>/examples.jsonl`` with the ``rows`` it lacks appended (each expecting one capability;
    a row is there when the file has its message, case, spacing and tags aside, for that
    capability), as :func:`vetoes_edit` appends."""
    return _appended(tap, TAP_EXAMPLES, EXAMPLES_HEADER, "no example was added", rows,
                     lambda row: (row.expect[0] if row.expect else "", routed_key(row.message)),
                     lambda row: {"message": row.message, "expect": row.expect[0], "kind": row.kind})


def _appended(tap: Path, name: str, header: str, nothing: str, rows: Sequence[Fixture],
              key: Callable[[Fixture], tuple[str, ...]],
              line: Callable[[Fixture], dict[str, Any]]) -> tuple[Path, str] | None:
    """``<tap>/<name>`` (JSON Lines of fixture rows) with the ``rows`` whose ``key`` it lacks
    appended as ``line``; a new file starts with ``header``."""
    path = _writable(tap, name)
    old, have = "", set()
    if os.path.lexists(path):
        try:
            data = read_tap_file(path, tap)
            old = data.decode("utf-8")  # a BOM stays (read_fixture_file skips it)
        except TapFileError as exc:
            raise TapFileError(path, f"{exc.reason}; {nothing}") from None
        except UnicodeDecodeError as exc:
            raise TapFileError(path, f"not UTF-8 text ({exc.reason}); {nothing}") from None
        have = {key(f) for f in read_fixture_file(path, data)[0]}
    new = []
    for row in rows:
        if (known := key(row)) not in have:
            have.add(known)
            new.append(row)
    if not new:
        return None
    lines = [json.dumps(line(row), ensure_ascii=False) for row in new]
    text = (old if old.endswith("\n") or not old else old + "\n") if old else header
    return path, text + "\n".join(lines) + "\n"


def write_appended(edit: tuple[Path, str]) -> Path:
    """Store a :func:`vetoes_edit` or an :func:`examples_edit`."""
    path, text = edit
    try:
        atomic.write_text(path, text)
    except OSError as exc:
        raise TapFileError(path, f"cannot write it: {exc.strerror or exc}; nothing was changed") from None
    return path


def write_gates(tap: Path, point: dict[str, Any], model: str, rule: str = "capd",
                offsets: dict[str, float] | None = None) -> Path:
    """:func:`gates_edit`, written."""
    return gates_edit(tap, point, model, rule, offsets).write()


def gates_edit(tap: Path, point: dict[str, Any], model: str, rule: str = "capd",
               offsets: dict[str, float] | None = None) -> GatesEdit:
    """The edit that stores gates for ``rule`` in ``<tap>/capd.toml``, keeping the other rule's
    gates: made and checked here, written by :meth:`GatesEdit.write` (so that a calibration of
    several taps writes none when one of them cannot be edited).

    An existing file is updated in place, line by line: the values of ``threshold``, ``margin``
    and ``top_k`` (``[gates]``: rules capd, anchor) or ``coverage`` (``[gates.fused]``) are
    replaced where they stand, a trailing comment kept; a missing key goes after the last key
    line of its table, a missing table at the end, a missing ``model`` before the first table.
    Every comment, blank line and other key stays. ``abstain_corpus = true`` is written when the
    point chose the corpus, and an ``abstain_corpus`` already there is set to ``false`` when it
    did not. With ``offsets`` (``fused``: this tap's capabilities' :func:`capd.offsets.fit_offsets`)
    ``[gates.fused.offsets]`` is made to hold exactly those, value lines updated in place, new ones
    added, lines of capabilities without an offset now deleted; None leaves it alone. Gates
    recorded for another model are stale (each model has its own scale): the other
    table's gate lines are deleted, its comments kept. A new file starts with a comment that says
    what it is. The result is read back before it replaces the file, which is left alone (error)
    when it does not parse, when the gates are written in a shape capd does not edit (an inline
    table, an array of tables, a value over several lines) or when the read-back is not exactly
    the intended gates with every other key unchanged.
    """
    path = _writable(tap)
    text, old = _NEW_FILE, {}
    if path.exists():
        try:
            text = path.read_bytes().decode("utf-8")  # not read_text: its newline translation would drop \r\n
            old = tomllib.loads(text.removeprefix("\ufeff"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise TapFileError(path, f"cannot update it ({exc}); fix or remove it, then calibrate again") from None
    own: KeyPath
    other: KeyPath
    if rule == "fused":
        own, other = ("gates", "fused"), ("gates",)
        values: dict[str, float | int | bool] = {"threshold": float(point["threshold"]),
                                                 "margin": float(point["margin"]),
                                                 "coverage": float(point.get("coverage", 0.0))}
    else:
        own, other = ("gates",), ("gates", "fused")
        values = {"threshold": float(point["threshold"]), "margin": float(point["margin"]),
                  "top_k": int(point["top_k"])}
    stale = other if old.get("model") not in (None, model) else None
    new, expected = _edit_gates(path, text, old, model, own, values, bool(point.get(SWITCH)), stale,
                                None if rule != "fused" else offsets)
    try:
        reread: dict[str, Any] | None = tomllib.loads(new.removeprefix("\ufeff"))
    except tomllib.TOMLDecodeError:
        reread = None
    if reread is not None:  # a table whose last lines went is gone unless it has a header of its own
        for emptied in ((stale,) if stale is not None else ()) + ((OFFSETS,) if rule == "fused" else ()):
            _drop_emptied(expected, reread, emptied)
    if reread is None or not toml_edit.same(reread, expected):
        raise TapFileError(path, "capd cannot update it in place without changing what else it says; write the "
                                 "gates as [gates] and [gates.fused] tables with one `key = value` line per gate, "
                                 "then calibrate again")
    try:
        tap_config(path, reread, new)
    except TapFileError as exc:  # a mistake elsewhere in the file: written, it would still not load
        raise TapFileError(path, f"with the new gates it would still not load: {exc.reason}; fix that, then calibrate "
                                 "again (nothing was changed)", _line_now(path, old, text, exc.reason)) from None
    return GatesEdit(tap, path, new)


def _line_now(path: Path, table: dict[str, Any], text: str, reason: str) -> int | None:
    """The line of the file as it stands that fails with ``reason`` (the edited text's lines have
    moved), or None when the file as it stands does not fail that way."""
    try:
        tap_config(path, table, text)
    except TapFileError as exc:
        return exc.line if exc.reason == reason else None
    return None


def _writable(tap: Path, name: str = "capd.toml") -> Path:
    """The file ``--write`` edits: ``<tap>/<name>``, or the file it links to inside the tap (a
    rename over the link would replace the link with a plain file and leave its target stale). A link
    out of the tap is refused, as the tap loader refuses to read through one."""
    path = tap / name
    if not path.is_symlink():
        return path
    try:
        target, root = path.resolve(strict=False), tap.resolve()
    except (OSError, RuntimeError) as exc:
        raise TapFileError(path, f"cannot follow the link: {exc}") from None
    if not target.is_relative_to(root):
        raise TapFileError(path, f"links to {target}, outside the tap; capd edits only files in the tap: "
                                 "replace the link with the file, then calibrate again")
    return target


_NEW_FILE = ("# Written by `capd calibrate --write`. Gates for this tap's capabilities: [gates] for the\n"
             "# anchor and capd rules, [gates.fused] for the fused rule. CAPD_THRESHOLD / CAPD_MARGIN /\n"
             "# CAPD_TOP_K and flags still override them.\n")
_GATE_KEYS = (*GATE_KEYS, "coverage", SWITCH)  # what a stale table loses


def _edit_gates(path: Path, text: str, old: dict[str, Any], model: str, own: KeyPath,
                values: dict[str, float | int | bool], switch: bool,
                stale: KeyPath | None, offsets: dict[str, float] | None = None) -> tuple[str, dict[str, Any]]:
    """The edited text, and what it must parse to."""
    bom = "\ufeff" if text.startswith("\ufeff") else ""
    tables = (own, *([OFFSETS] if offsets is not None else []), *([stale] if stale else []))
    edit = _editor(path, text.removeprefix(bom), tables)
    if switch or edit.find((*own, SWITCH)) is not None:  # an abstain_corpus line is never removed
        values = {**values, SWITCH: switch}
    found = edit.find(("model",))
    if found is not None:
        edit.set_value(found, model)
    else:
        edit.add_top_level("model", model)
    _set_keys(path, edit, own, values)
    expected = copy.deepcopy(old)
    expected["model"] = model
    _table(expected, own).update(values)
    if offsets is not None:
        _edit_offsets(path, edit, expected, offsets)
    if stale is not None:  # the other table's gates were fitted for another model: only its gate lines go
        for s in edit.statements:
            if s.value is not None and s.path[:-1] == stale and s.path[-1] in _GATE_KEYS:
                edit.delete(s)
                del _table(expected, stale)[s.path[-1]]
    return bom + edit.result(), expected


def _set_keys(path: Path, edit: toml_edit.Editor, table: KeyPath, values: dict[str, float | int | bool]) -> None:
    """Each of ``values`` set where its line stands in ``table`` (a trailing comment kept), the
    missing ones added after the table's last key line; a value over several lines is refused."""
    missing: dict[str, float | int | bool] = {}
    for key, value in values.items():
        found = edit.find((*table, key))
        if found is None or found.value is None:
            missing[key] = value
        elif "\n" in edit.text[found.value[0]:found.value[1]]:
            raise TapFileError(path, f"{render_key(found.path)} runs over several lines; write its value on one "
                                     f"line ({render_key((key,))} = …), then calibrate again",
                               toml_edit.line_of(edit.text, found.start))
        else:
            edit.set_value(found, value)
    if missing:
        edit.add_keys(table, missing)


OFFSETS: KeyPath = ("gates", "fused", "offsets")


def _edit_offsets(path: Path, edit: toml_edit.Editor, expected: dict[str, Any], offsets: dict[str, float]) -> None:
    """``[gates.fused.offsets]`` made to hold exactly ``offsets`` (see :func:`gates_edit`)."""
    for s in edit.statements:
        if s.value is not None and s.path[:-1] == OFFSETS and s.path[-1] not in offsets:
            edit.delete(s)
    _set_keys(path, edit, OFFSETS, dict(offsets))
    table = _table(expected, OFFSETS)
    table.clear()
    table.update(offsets)


def _editor(path: Path, text: str, tables: tuple[KeyPath, ...]) -> toml_edit.Editor:
    """An editor for ``text``, or why ``tables`` cannot be edited in it line by line."""
    try:
        edit = toml_edit.Editor(text)
    except toml_edit.ScanError as exc:
        raise TapFileError(path, f"capd cannot follow this file to update it in place ({exc}); write the gates as "
                                 "[gates] and [gates.fused] tables, then calibrate again",
                           toml_edit.line_of(text, exc.offset)) from None
    blocking = edit.blocking(tables)
    if blocking is not None:
        reason = (f"[[{render_key(blocking.table)}]] is an array of tables" if blocking.array else
                  f"`{render_key(blocking.path)} = …` holds the gates in one value")
        raise TapFileError(path, f"{reason}, which capd cannot update in place; write the gates as [gates] and "
                                 "[gates.fused] tables with one `key = value` line per gate, then calibrate again",
                           toml_edit.line_of(edit.text, blocking.start))
    return edit


def _drop_emptied(expected: dict[str, Any], reread: dict[str, Any], path: KeyPath) -> None:
    """A stale table written only as dotted keys (``fused.threshold = …`` under ``[gates]``) is gone
    once its gate lines are: expect it gone, not as an empty table (one with a header of its own stays)."""
    parent, found = expected, reread
    for part in path[:-1]:
        parent, found = parent.get(part, {}), found.get(part, {})
    if parent.get(path[-1]) == {} and path[-1] not in found:
        del parent[path[-1]]


def _table(data: dict[str, Any], path: KeyPath) -> dict[str, Any]:
    for part in path:
        data = data.setdefault(part, {})
    return data
