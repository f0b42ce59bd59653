"""Message cleaning before routing: strip ``<tag …>…</tag>`` blocks, measure what is left.

Agents wrap injected context in XML-ish tags (``<system-reminder>``, ``<context>``);
those blocks say nothing about the user's intent, so whole blocks are removed:

- a block is an opening tag ``<name attr="…">`` and the matching ``</name>``, across lines,
  nested blocks included (the outermost matched block is removed whole);
- a self-closing ``<name/>`` is removed;
- an opening tag that is never closed, a stray closing tag, and comparisons such as
  ``a < b`` stay as text.

Also text that leaves capd: :func:`finite` keeps NaN out of JSON (the CLI's and the API's).
"""

from __future__ import annotations

import itertools
import math
import numbers
import re
import unicodedata
from collections import Counter
from typing import Any

# After the name: nothing, "/", or whitespace and then anything but angle brackets (a final "/"
# makes it self-closing). One way to match each text: an earlier ``(\s+[^<>]*?)?\s*(/?)`` could
# split a run of spaces three ways, and "<a" + 2,000 spaces took 25 s to reject.
_TAG = re.compile(r"<(/?)([A-Za-z][\w.:-]*)(?:\s[^<>]*)?/?>")


def surrogate_at(text: str) -> int | None:
    """Where ``text`` stops being Unicode text (a lone surrogate: JSON's ``\\ud800``, or a byte the
    terminal's encoding could not decode, PEP 383), or None. No encoder, tokenizer or UTF-8 log
    line accepts one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def strip_tags(message: str) -> str:
    """Remove whole ``<tag>…</tag>`` blocks (and self-closing tags); keep everything else."""
    spans: list[tuple[int, int]] = []
    stack: list[tuple[str, int]] = []
    open_names: Counter[str] = Counter()  # names on the stack: a stray closing tag is not searched for
    for match in _TAG.finditer(message):
        closing, name = match.group(1), match.group(2)
        if not closing and match.group(0).endswith("/>"):
            spans.append((match.start(), match.end()))
        elif not closing:
            stack.append((name, match.start()))
            open_names[name] += 1
        elif open_names[name]:
            depth = len(stack) - 1
            while stack[depth][0] != name:
                depth -= 1
            spans.append((stack[depth][1], match.end()))
            open_names.subtract(n for n, _ in stack[depth:])
            del stack[depth:]
    if not spans:
        return message
    spans.sort()
    kept: list[str] = []
    position = 0
    for start, end in spans:
        if start >= position:
            kept.append(message[position:start])
            position = end
        elif end > position:  # overlapping with an earlier removed block: extend it
            position = end
    kept.append(message[position:])
    return "".join(kept).strip()


def _shows(ch: str) -> bool:
    return not ch.isspace() and unicodedata.category(ch) not in ("Cc", "Cf")


def content_chars(text: str) -> int:
    """Characters that show (not whitespace, not a control or format character such as a zero-width
    space or a byte order mark): the measure of the short-input gate."""
    return sum(1 for ch in text if _shows(ch))


def clean_message(message: str, min_chars: int) -> tuple[str, bool]:
    """Return (text to route on, long enough to route); counting stops at ``min_chars``."""
    text = strip_tags(message)
    shown = (ch for ch in text if _shows(ch))
    return text, sum(1 for _ in itertools.islice(shown, min_chars)) >= min_chars


def finite(value: Any) -> Any:
    """``value`` (JSON-shaped) with every float, numpy's included, that is NaN or inf replaced by
    None: JSON has no NaN, and parsers reject the ``NaN`` Python would print."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def printable(text: str) -> str:
    r"""``text`` as valid Unicode: the bytes of a file name that is not UTF-8, which Python keeps as
    lone surrogates, become ``\xNN`` escapes (any other lone surrogate a ``\uNNNN`` one)."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def printable_strings(value: Any) -> Any:
    """``value`` (JSON-shaped) with every string, keys included, made :func:`printable`: a path
    that is not UTF-8 (a tap folder named with a 0xff byte) cannot be written as JSON text."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_strings(k): printable_strings(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable_strings(v) for v in value]
    return value


def recall_key(text: str) -> str:
    """How a message is known again: the cleaned text, case and runs of white space aside (the
    bundled model is uncased, and its tokenizer splits on white space, so these are one input)."""
    return " ".join(text.casefold().split())


def routed_key(message: str) -> str:
    """The text a message routes on (its tags removed), as :func:`recall_key` knows it: messages with
    one key are one input to the model (a fixture and its copy, a veto, an example); "" when only
    tags are left."""
    return recall_key(strip_tags(message))


class DuplicateKey(ValueError):
    """A JSON object gives ``key`` twice (:func:`unique_keys`)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for :func:`json.loads` that refuses a key given twice: Python's parser
    keeps the last value without a word (``{"expect": "git", "expect": null}`` a null row,
    ``{"session": "a", "session": "b"}`` a route in ``b``)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out
