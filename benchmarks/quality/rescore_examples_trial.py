"""Research harness: how many of a capability's examples the fused rule's second stage reads.

Run: ``.venv/bin/python -m benchmarks.quality.rescore_examples_trial --variant 8|16|32|64
[--sets …] [--splits 8]`` (``splits_trial``'s options apply; fused rule, untuned model). The
second stage reads, for each of its candidates with more than ``RESCORE_EXAMPLES`` examples, only
the ones nearest the message by sentence cosine (``capd/fused.py``). No tap has more than 32
examples a capability without ``capd calibrate --examples``, so the number matters where
calibration keeps the fit positives as examples: the four public intent sets. Each variant is
measured as plain ``capd calibrate`` would use it; compare with a plain ``splits_trial`` run on
the same sets and splits (the shipped value). Cost: the *with --examples* column of ``make
quality``'s *Cost of the fused rule*, or ``python -m benchmarks.quality.run --sets … --no-tune``
with the constant patched. Results: benchmarks/quality/README.md, *How many examples the second
stage reads*.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from benchmarks.quality.splits_trial import patched_main
from capd import fused

VARIANTS = ("8", "16", "32", "64")


@contextmanager
def examples_read(variant: str) -> Iterator[None]:
    """Within the block, the second stage reads ``variant`` examples of a candidate at most."""
    shipped = fused.RESCORE_EXAMPLES
    fused.RESCORE_EXAMPLES = int(variant)
    try:
        yield
    finally:
        fused.RESCORE_EXAMPLES = shipped


def main(argv: list[str]) -> dict[str, Any]:
    return patched_main(argv, __doc__ or "", "rescore_examples_trial", VARIANTS, examples_read)


if __name__ == "__main__":
    main(sys.argv[1:])
