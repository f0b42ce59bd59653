"""Tag stripping and the short-input gate."""

from __future__ import annotations

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
    assert clean_message("yes pls", 8) == ("yes pls", False)  # 6 characters
    assert clean_message("show logs", 8) == ("show logs", True)  # 8 characters
    text, ok = clean_message("<ctx>a long injected context block</ctx> ok", 8)
    assert (text, ok) == ("ok", False)
