"""Reading TOML for every file capd reads (taps, ``capd.toml``, config files, model manifests).

``tomllib`` recurses once per nested array or inline table, so a file nested a few thousand deep
raises RecursionError, which no caller expects from a parser. :func:`loads` turns it into the
``TOMLDecodeError`` every caller handles, with the line where the nesting went too deep.
"""

from __future__ import annotations

import tomllib
from typing import Any

MAX_DEPTH = 100  # far beyond any real file; where the reported line is taken


def loads(text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except RecursionError:
        line = _deepest_line(text)
        where = f" (at line {line}, column 1)" if line is not None else ""
        raise tomllib.TOMLDecodeError(f"arrays or inline tables nested too deeply to read{where}") from None


def _deepest_line(text: str) -> int | None:
    """The line where brackets first nest deeper than :data:`MAX_DEPTH` (comments and strings are
    not told apart: a hint for the author, used only once the parser has given up)."""
    depth, line = 0, 1
    for char in text:
        if char in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return line
        elif char in "]}":
            depth -= 1
        elif char == "\n":
            line += 1
    return None
