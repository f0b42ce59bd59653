"""Tag stripping and the short-input gate."""

from __future__ import annotations

import time

import pytest

from capd.text import clean_message, content_chars, strip_tags


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("query the users table", "query the users table"),
        ("<context>lots of stuff</context> query the users table", "query the users table"),
        ("before <a>x</a> middle <b>y</b> after", "before  middle  after"),
        ('<system-reminder kind="x" id=\'3\'>\nline one\nline two\n</system-reminder>\nopen a PR', "open a PR"),
        ("<outer>one <inner>two</inner> three</outer>show commits", "show commits"),
        ("<a>one <a>nested same</a> still a</a>tail", "tail"),
        ("<unclosed> keep this text", "<unclosed> keep this text"),
        ("is a < b and c > d here", "is a < b and c > d here"),
        ("stray </close> tag stays", "stray </close> tag stays"),
        ("line break <br/> removed", "line break  removed"),
        ("<open>never closed <b>bold</b> rest", "<open>never closed  rest"),
    ],
)
def test_strip_tags(message: str, expected: str) -> None:
    assert strip_tags(message) == expected


def test_short_input_gate_counts_non_whitespace() -> None:
    assert content_chars(" a b\tc\n") == 3
    assert content_chars("\u200b" * 9 + "\x00\ufeffok\u2060") == 2  # zero-width, NUL, BOM, word joiner
    assert clean_message("\u200b" * 20 + "yes", 8) == ("\u200b" * 20 + "yes", False)
    assert clean_message("yes pls", 8) == ("yes pls", False)  # 6 characters
    assert clean_message("show logs", 8) == ("show logs", True)  # 8 characters
    text, ok = clean_message("<ctx>a long injected context block</ctx> ok", 8)
    assert (text, ok) == ("ok", False)


@pytest.mark.parametrize("message", [
    "<a" + " " * 3000,  # an opening tag's start and a long run of spaces: the tag pattern backtracked cubically
    "<a>" * 12000 + "</b>" * 12000,  # stray closing tags each searched the whole stack of open ones
])
def test_strip_tags_takes_linear_time_on_hostile_messages(message: str) -> None:
    """Route and discover strip tags on the event loop: a 64 KiB message must not hold it for
    seconds (``"<a" + 2,000 spaces`` took 25 s, 4,000 took 200 s)."""
    started = time.perf_counter()
    assert strip_tags(message) == message
    # 0.05 s here; 0.52 s once with two suites sharing 2 cores. The regressions took 25-200 s, so a
    # bound far above a loaded machine's time still catches them without failing on load.
    assert time.perf_counter() - started < 5.0


@pytest.mark.parametrize(("message", "expected"), [
    ("<a />x", "x"), ("<a x=/>y", "y"), ('<a x="/">keep', '<a x="/">keep'), ("<a\n>b</a>c", "c"),
    ("<ab>x</a>", "<ab>x</a>"), ("</a/> text", "</a/> text"), ("<a>x</a >y", "y"),
])
def test_strip_tags_reads_tags_as_before(message: str, expected: str) -> None:
    assert strip_tags(message) == expected
