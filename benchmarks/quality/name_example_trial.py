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

import argparse
import sys
from collections.abc import Callable, Sequence
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


def main(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    args, rest = parser.parse_known_args(argv)  # the rest are splits_trial's options
    if "--sets" not in rest:
        rest += ["--sets", "core,healthcare,snips7"]
    if "--out" not in rest:
        rest += ["--out", f"benchmarks/results/name_example_trial_{args.variant}.json"]
    from benchmarks.quality import splits_trial

    shipped = capd.router.example_texts
    capd.router.example_texts = without_name(shipped, args.variant)
    try:
        return splits_trial.main(rest)
    finally:
        capd.router.example_texts = shipped


if __name__ == "__main__":
    main(sys.argv[1:])
