"""Editing a TOML file in place, so that what a person wrote in it stays.

``tomllib`` only reads, and re-rendering what it read drops every comment, blank line and the
layout. :func:`scan` finds the table headers and ``key = value`` statements of a text that
``tomllib`` has accepted, with their offsets (a value may run over several lines: arrays,
multi-line strings); an :class:`Editor` replaces values, deletes statements and inserts lines at
those offsets and leaves every other character as it was. A caller re-parses the result and
compares it with what it meant (:func:`same`): a shape the scanner misreads must fail, never
write a file that means something else.
"""

from __future__ import annotations

import itertools
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KeyPath = tuple[str, ...]
Scalar = bool | int | float | str

_BARE = re.compile(r"[A-Za-z0-9_-]+")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_SCALAR = re.compile(r"[^ \t\r\n#]+")  # a number, boolean or date: up to blanks or a comment


class ScanError(ValueError):
    """The scanner cannot follow the text at ``offset``."""

    def __init__(self, offset: int, reason: str) -> None:
        self.offset = offset
        super().__init__(reason)


@dataclass(frozen=True)
class Statement:
    """A table header (``value`` None) or a ``key = value`` statement.

    ``start`` is the offset where its first line starts, ``end`` the offset just past the newline
    of its last line (a trailing comment included); ``value`` holds the value's own offsets."""

    table: KeyPath  # a header's own path; for a key, the table it sits in
    key: KeyPath  # the dotted key as written (empty for a header)
    start: int
    end: int
    value: tuple[int, int] | None = None
    array: bool = False  # [[header]]

    @property
    def path(self) -> KeyPath:
        return self.table + self.key


@dataclass(frozen=True)
class Scanned:
    """What :func:`scan` found."""

    statements: list[Statement]
    comment_lines: frozenset[int]  # start offsets of the lines that hold only a comment


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def at(self, s: str) -> bool:
        return self.text.startswith(s, self.pos)

    def fail(self, reason: str) -> ScanError:
        return ScanError(self.pos, reason)

    def blank(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    def skip_comment(self) -> None:
        newline = self.text.find("\n", self.pos)
        self.pos = len(self.text) if newline < 0 else newline

    def line_end(self) -> None:
        """Blanks, an optional comment, then the newline (or the end of the text)."""
        self.blank()
        if self.at("#"):
            self.skip_comment()
        for newline in ("\r\n", "\n"):
            if self.at(newline):
                self.pos += len(newline)
                return
        if self.pos < len(self.text):
            raise self.fail("expected the end of the line")

    def key(self) -> KeyPath:
        parts: list[str] = []
        while True:
            self.blank()
            if self.at('"') or self.at("'"):
                start = self.pos
                self.string()
                parts.append(tomllib.loads("k = " + self.text[start:self.pos])["k"])
            else:
                match = _BARE.match(self.text, self.pos)
                if match is None:
                    raise self.fail("expected a key")
                parts.append(match.group())
                self.pos = match.end()
            self.blank()
            if not self.at("."):
                return tuple(parts)
            self.pos += 1

    def string(self) -> None:
        quote = next(q for q in ('"""', "'''", '"', "'") if self.at(q))
        self.pos += len(quote)
        multiline = len(quote) == 3
        while self.pos < len(self.text) and (multiline or self.text[self.pos] != "\n"):
            if quote[0] == '"' and self.text[self.pos] == "\\":
                self.pos += 2
            elif self.at(quote):
                self.pos += len(quote)
                for _ in range(2 if multiline else 0):  # """a"""" is 'a"': up to two more quotes close it
                    if self.at(quote[0]):
                        self.pos += 1
                return
            else:
                self.pos += 1
        raise self.fail("unterminated string")

    def value(self) -> None:
        if self.at('"') or self.at("'"):
            self.string()
        elif self.at("[") or self.at("{"):
            self.nested()
        else:
            match = _SCALAR.match(self.text, self.pos)
            if match is None:
                raise self.fail("expected a value")
            self.pos = match.end()
            rest = self.text[self.pos:self.pos + 2]
            if _DATE.fullmatch(match.group()) and rest[:1] == " " and rest[1:].isdigit():  # 1979-05-27 07:32:00
                self.pos += 1
                self.value()

    def nested(self) -> None:
        """An array or inline table, over as many lines as it takes."""
        depth = 0
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char in "\"'":
                self.string()
                continue
            if char == "#":
                self.skip_comment()
                continue
            if char in "[{":
                depth += 1
            elif char in "]}":
                depth -= 1
                if depth == 0:
                    self.pos += 1
                    return
            self.pos += 1
        raise self.fail("unterminated array or inline table")

    def statement(self, table: KeyPath) -> Statement:
        start = self.pos
        self.blank()
        if self.at("["):
            array = self.at("[[")
            self.pos += 2 if array else 1
            path = self.key()
            close = "]]" if array else "]"
            if not self.at(close):
                raise self.fail(f"expected {close}")
            self.pos += len(close)
            self.line_end()
            return Statement(path, (), start, self.pos, array=array)
        key = self.key()
        if not self.at("="):
            raise self.fail("expected =")
        self.pos += 1
        self.blank()
        begin = self.pos
        self.value()
        value = (begin, self.pos)
        self.line_end()
        return Statement(table, key, start, self.pos, value)


def scan(text: str) -> Scanned:
    """Every header and key/value statement of ``text`` (TOML that ``tomllib`` accepts), in order.
    Raises ScanError where it cannot follow the text."""
    scanner = _Scanner(text)
    statements: list[Statement] = []
    comments: set[int] = set()
    table: KeyPath = ()
    while scanner.pos < len(text):
        start = scanner.pos
        scanner.blank()
        if scanner.pos == len(text) or text[scanner.pos] in "#\r\n":
            if scanner.at("#"):
                comments.add(start)
            scanner.line_end()
            continue
        scanner.pos = start
        statement = scanner.statement(table)
        if statement.value is None:
            table = statement.table
        statements.append(statement)
    return Scanned(statements, frozenset(comments))


class Editor:
    """A TOML text (one ``tomllib`` accepts) and changes at offsets of it, applied all at once by
    :meth:`result`; insertions at one offset keep the order they were made in. New lines use the
    text's own line ending. Raises ScanError when the text cannot be followed."""

    def __init__(self, text: str) -> None:
        self.newline = "\r\n" if "\r\n" in text else "\n"
        self.text = text if not text or text.endswith("\n") else text + self.newline  # so lines can follow it
        scanned = scan(self.text)
        self.statements, self.comment_lines = scanned.statements, scanned.comment_lines
        self._edits: list[tuple[int, int, int, str]] = []

    def find(self, path: KeyPath) -> Statement | None:
        """The ``key = value`` statement for the full key ``path``, wherever and however it is written."""
        return next((s for s in self.statements if s.value is not None and s.path == path), None)

    def blocking(self, tables: Sequence[KeyPath]) -> Statement | None:
        """A statement that keeps ``tables`` from being edited line by line: one value holding
        one of them (an inline table), or an array of tables on their path."""
        for s in self.statements:
            if any(t[:len(s.path)] == s.path for t in tables) and (s.value is not None or s.array):
                return s
        return None

    def replace(self, start: int, end: int, new: str) -> None:
        self._edits.append((start, end, len(self._edits), new))

    def set_value(self, statement: Statement, value: Scalar) -> None:
        """Replace the value where it stands; what follows it on the line (a comment) stays."""
        if statement.value is None:
            raise ValueError(f"[{render_key(statement.table)}] is a table header, not a value")
        self.replace(*statement.value, render_value(value))

    def delete(self, statement: Statement) -> None:
        self.replace(statement.start, statement.end, "")

    def add_top_level(self, key: str, value: Scalar) -> None:
        """A new top-level key, before the first table and the comment lines just above it (they
        describe that table), or at the end of a text without tables."""
        line = f"{render_key((key,))} = {render_value(value)}{self.newline}"
        headers = [s.start for s in self.statements if s.value is None]
        if not headers:
            self.replace(len(self.text), len(self.text), line)
            return
        at = headers[0]
        while at > 0 and (above := self.text.rfind("\n", 0, at - 1) + 1) in self.comment_lines:
            at = above
        self.replace(at, at, line + self.newline)

    def add_keys(self, table: KeyPath, values: Mapping[str, Scalar]) -> None:
        """New keys for ``table``: after the last key line under its header (in a table without
        keys, after the comment lines just under its header), or after its last dotted key
        (``fused.threshold = …`` under ``[gates]``); a table that is nowhere is added at the end."""
        lines = "".join(f"{render_key((key,))} = {render_value(value)}{self.newline}" for key, value in values.items())
        for i, s in enumerate(self.statements):
            if s.value is None and s.table == table:
                body = list(itertools.takewhile(lambda b: b.value is not None, self.statements[i + 1:]))
                at = (body[-1] if body else s).end
                while not body and at in self.comment_lines:  # a keyless table: after the comments under its header
                    at = self.text.index("\n", at) + 1
                self.replace(at, at, lines)
                return
        dotted = [s for s in self.statements
                  if s.value is not None and len(s.table) < len(table) < len(s.path) and s.path[:len(table)] == table]
        if dotted:
            last = dotted[-1]
            prefix = render_key(last.key[:len(table) - len(last.table)]) + "."
            self.replace(last.end, last.end, "".join(prefix + line for line in lines.splitlines(keepends=True)))
            return
        so_far = self.result()
        lead = self.newline if so_far.strip() and not so_far.endswith(self.newline * 2) else ""
        self.replace(len(self.text), len(self.text), f"{lead}[{render_key(table)}]{self.newline}{lines}")

    def result(self) -> str:
        parts, pos = [], 0
        for start, end, _, new in sorted(self._edits):
            if start < pos:
                raise ValueError("overlapping edits")
            parts += [self.text[pos:start], new]
            pos = end
        return "".join([*parts, self.text[pos:]])


def render_key(key: KeyPath) -> str:
    return ".".join(part if _BARE.fullmatch(part) else render_value(part) for part in key)


def render_value(value: Scalar) -> str:
    """TOML for a boolean, number or string (floats as the shortest text that reads back equal)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    return '"' + "".join(_escape(char) for char in value) + '"'


def _escape(char: str) -> str:
    if char in '"\\':
        return "\\" + char
    if (char < " " and char != "\t") or char == "\x7f":
        return f"\\u{ord(char):04x}"
    return char


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def same(a: Any, b: Any) -> bool:
    """Parsed TOML equal in value and type (``1`` is not ``1.0`` nor ``true``; NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)
