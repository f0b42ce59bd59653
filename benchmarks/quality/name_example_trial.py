"""Research harness: the fused rule without a capability's name among its examples.

Run: ``.venv/bin/python -m benchmarks.quality.name_example_trial --variant none|words
[--sets core,healthcare,snips7] [--splits 5]`` (the ``splits_trial`` options apply; fused rule,
untuned model).

The fused rule routes on a capability's triggers, its description and its name with ``-`` as a
space (:func:`capd.router.example_texts`). On taps/core several names are one everyday word
(``time``, ``memory``, ``maps``, ``shell``, ``email``), and a one-word example sits near any
message that says the word: "time flies" and "today was a good day" activate ``time``. Variants,
applied by patching :func:`capd.router.example_texts` for the services ``splits_trial`` builds:
``none`` leaves every name out, ``words`` leaves out the names that are one word (the description
and the triggers stay). Compare with a plain ``splits_trial`` run on the same sets and splits.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import capd.router
from capd.catalog import Capability

VARIANTS = ("none", "words")
ExampleTexts = Callable[..., tuple[str, ...]]


def without_name(shipped: ExampleTexts, variant: str) -> ExampleTexts:
    """:func:`capd.router.example_texts` without the capability's name under ``variant``."""
    def texts(capability: Capability, rule: str, learned: Sequence[str] = (),
              tap_examples: Sequence[str] = ()) -> tuple[str, ...]:
        base = shipped(capability, rule, learned, tap_examples)
        name = capability.name.replace("-", " ").replace("_", " ").strip()
        if rule != "fused" or (variant == "words" and len(name.split()) > 1) or name in capability.triggers:
            return base
        return tuple(t for t in base if t != name)

    return texts


@contextmanager
def names_left_out(variant: str) -> Iterator[None]:
    """The fused examples without the names ``variant`` leaves out, within the block."""
    shipped = capd.router.example_texts
    capd.router.example_texts = without_name(shipped, variant)
    try:
        yield
    finally:
        capd.router.example_texts = shipped


def main(argv: list[str]) -> dict[str, Any]:
    from benchmarks.quality import splits_trial

    return splits_trial.patched_main(argv, __doc__ or "", "name_example_trial", VARIANTS, names_left_out)


if __name__ == "__main__":
    main(sys.argv[1:])
