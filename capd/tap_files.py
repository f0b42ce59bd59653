"""Reading a tap's files with the guards every tap file gets (no link out of the tap, no pipe to
block on, a size limit, text only), and TOML with the line of each error: the parser's own, and
for schema errors the line of the key (:class:`Checker`).
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from capd import toml_read
from capd.errors import TapFileError

MAX_FILE_BYTES = 1 << 20
_TOML_POS = re.compile(r"\s*\(at line (\d+), column (\d+)\)")


def resolve(path: Path) -> Path:
    try:
        return path.resolve()
    except RuntimeError:  # how pathlib before 3.13 reports a symlink loop
        raise TapFileError(path, "symlink loop: the link points (eventually) to itself") from None
    except OSError as exc:
        raise TapFileError(path, f"cannot resolve: {exc.strerror or exc}") from None


class Folder:
    """A capability folder and its tap, each resolved once per load, for the containment checks.

    The real path of a file directly in the folder that is not a symlink, or is a link to a
    sibling that is not one (``default.toml -> postgres.toml``), is the folder's real path plus
    a name: one or two system calls instead of ``Path.resolve``'s ``lstat`` per component of
    the path. Resolving took a fifth of the time of loading a 10,000-capability tap.
    """

    def __init__(self, tap: Path, path: Path, real_tap: Path | None = None) -> None:
        self.real_tap = resolve(tap) if real_tap is None else real_tap
        self.path = path
        self.real_path = resolve(path)

    def real(self, path: Path) -> Path:
        if path.parent == self.path:
            if not path.is_symlink():
                return self.real_path / path.name
            try:
                link = os.readlink(path)
            except OSError:
                link = "/"  # let resolve report it
            if "/" not in link and link not in (".", "..") and not (self.path / link).is_symlink():
                return self.real_path / link
        return resolve(path)

    def read(self, path: Path, target: Path | None = None) -> bytes:
        return _read(path, self.real_tap, self.real(path) if target is None else target)


def read_tap_file(path: Path, root: Path) -> bytes:
    """Read one tap file with the guards every tap file gets; raises :class:`TapFileError`."""
    return _read(path, resolve(root), resolve(path))


def _read(path: Path, real_root: Path, target: Path) -> bytes:
    """:func:`read_tap_file` given the real paths of the tap and of ``path``."""
    if path.is_symlink():
        if not target.exists():
            raise TapFileError(path, f"symlink points to {os.readlink(path)!r}, which does not exist")
        if not target.is_relative_to(real_root):
            raise TapFileError(path, f"symlink points outside the tap ({target})")
    elif not target.is_relative_to(real_root):  # reached through a symlinked folder
        raise TapFileError(path, f"resolves outside the tap ({target}) through a symlinked folder")
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise TapFileError(path, "is a directory, expected a TOML file")
        if not stat.S_ISREG(info.st_mode):  # reading a FIFO would block the loader (and the daemon) forever
            raise TapFileError(path, "is not a regular file (a pipe, socket or device), expected a TOML file")
        size = info.st_size
        if size > MAX_FILE_BYTES:
            raise TapFileError(path, f"file is {size} bytes; tap files are limited to {MAX_FILE_BYTES} bytes")
        data = path.read_bytes()
    except PermissionError:
        raise TapFileError(path, "cannot read: permission denied") from None
    except IsADirectoryError:
        raise TapFileError(path, "is a directory, expected a TOML file") from None
    except OSError as exc:
        raise TapFileError(path, f"cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise TapFileError(path, f"file is over {MAX_FILE_BYTES} bytes")
    if b"\x00" in data:
        raise TapFileError(path, "binary file (contains NUL bytes), expected TOML text")
    return data


def parse_toml(path: Path, root: Path) -> tuple[dict[str, Any], str, bytes]:
    """Parse a tap TOML file; returns (table, text, raw bytes). Errors carry the line."""
    return parse_toml_bytes(path, read_tap_file(path, root))


def parse_toml_bytes(path: Path, data: bytes) -> tuple[dict[str, Any], str, bytes]:
    """``data`` (read from ``path``) parsed as TOML, a leading BOM allowed; (table, text, data).
    Raises TapFileError with the line of a byte that is not UTF-8 or of the TOML error."""
    try:
        text = data.decode("utf-8-sig")  # a leading byte order mark, as octomind's TOML reader accepts
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TapFileError(path, f"not UTF-8 text (byte 0x{data[exc.start]:02x})", line) from None
    try:
        return toml_read.loads(text), text, data
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        match = _TOML_POS.search(message)
        where = int(match.group(1)) if match else None
        if where is None and "end of document" in message:
            where = max(1, text.count("\n") + (0 if text.endswith("\n") else 1))
        reason = _TOML_POS.sub("", message).replace(" (at end of document)", " at the end of the file")
        raise TapFileError(path, f"invalid TOML: {reason}", where) from None


def _key_match(text: str, key: str, start: int = 0, end: int | None = None) -> re.Match[str] | None:
    """The first ``key = …`` or ``[key]`` between offsets ``start`` and ``end``. Only spaces and tabs
    may precede it on its line (any whitespace would let a match start on a blank line above)."""
    pattern = re.compile(rf"^[ \t]*(\[\[?\s*{re.escape(key)}\s*\]\]?|[\"']?{re.escape(key)}[\"']?\s*=)", re.M)
    return pattern.search(text, start, len(text) if end is None else end)


def line_of(text: str, key: str, start: int = 0, end: int | None = None) -> int | None:
    """Best-effort line of ``key = …`` or ``[key]`` (:func:`_key_match`) so schema errors point
    somewhere useful."""
    match = _key_match(text, key, start, end)
    return text.count("\n", 0, match.start()) + 1 if match else None


def _string_tokens(text: str, start: int) -> Iterable[tuple[str, int]]:
    """The TOML string literals of the array that opens at or after offset ``start``, each with its
    offset, up to the array's closing bracket (nested arrays are walked through)."""
    depth, at = 0, start
    while at < len(text):
        char = text[at]
        if char == "#":
            at = text.find("\n", at)
            at = len(text) if at < 0 else at
        elif char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth <= 0:
                return
        elif char in "\"'":
            quote = text[at:at + 3] if text.startswith(char * 3, at) else char
            end = at + len(quote)
            while end < len(text) and not text.startswith(quote, end):
                end += 2 if char == '"' and text[end] == "\\" else 1
            end += len(quote)
            for _ in range(2 if quote != char else 0):  # up to two quotes of the content may end a """…""" string
                end += text.startswith(char, end)
            yield text[at:end], at
            at = end
            continue
        at += 1


def trigger_lines(text: str) -> list[tuple[str, int]]:
    """Each trigger of a ``config.toml`` in file order with the line its string starts on, decoded
    as TOML decodes it (escapes, literal and multi-line strings); empty when the file does not read."""
    key = _key_match(text, "triggers")
    if key is None:
        return []
    found = []
    for token, offset in _string_tokens(text, key.end()):
        try:
            value = tomllib.loads(f"v = {token}")["v"]
        except tomllib.TOMLDecodeError:
            return []
        found.append((value, text.count("\n", 0, offset) + 1))
    return found


def line_in_table(text: str, table: str, key: str) -> int | None:
    """The line of ``key = …`` among the ``[table]`` header's own lines; None without that header
    or that key under it (``threshold`` in [gates] and in [gates.fused] are two lines)."""
    header = re.compile(rf"^[ \t]*\[\s*{re.escape(table)}\s*\]", re.M).search(text)
    if header is None:
        return None
    following = re.compile(r"^[ \t]*\[", re.M).search(text, header.end())
    return line_of(text, key, header.end(), following.start() if following else None)


def entry_line(text: str, array: str, index: int, key: str) -> int | None:
    """The line of ``key`` in the ``index``-th ``[[array]]`` table (its header line without the key)."""
    headers = list(re.finditer(rf"^[ \t]*\[\[\s*{re.escape(array)}\s*\]\]", text, re.M))
    if index >= len(headers):
        return line_of(text, key)
    start = headers[index].start()
    following = re.compile(r"^[ \t]*\[", re.M).search(text, headers[index].end())
    return line_of(text, key, start, following.start() if following else None) or text.count("\n", 0, start) + 1


class Checker:
    """Schema checks for one parsed file; each failure raises a TapFileError with a line."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self.text = text

    def fail(self, key: str, reason: str) -> TapFileError:
        return TapFileError(self.path, f"{key} {reason}", self._line(key))

    def _line(self, key: str) -> int | None:
        """The line of a dotted ``key``: within its table's lines when the table has a header, else
        its first mention."""
        table, _, name = key.rpartition(".")
        return (line_in_table(self.text, table, name) if table else None) or line_of(self.text, name)

    def table(self, parent: Mapping[str, Any], key: str, label: str | None = None) -> Mapping[str, Any]:
        value = parent.get(key, {})
        if not isinstance(value, dict):
            raise self.fail(label or key, "must be a table")
        return value

    def strings(self, parent: Mapping[str, Any], key: str, label: str | None = None) -> tuple[str, ...]:
        value = parent.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(label or key, "must be a list of strings")
        return tuple(value)

    def optional_str(self, parent: Mapping[str, Any], key: str, label: str | None = None) -> str | None:
        value = parent.get(key)
        if value is not None and not isinstance(value, str):
            raise self.fail(label or key, "must be a string")
        return value
