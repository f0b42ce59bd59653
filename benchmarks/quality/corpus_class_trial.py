"""Research harness: the abstain corpus as a class of the fused ranking, left out or changed.

Run: ``.venv/bin/python -m benchmarks.quality.corpus_class_trial --variant off|unbalanced
[--sets …] [--splits 20]`` (``splits_trial``'s options apply; fused rule, untuned model). Compare
with a plain ``splits_trial`` run on the same sets and splits, which routes as shipped. Results:
benchmarks/quality/README.md, *The abstain corpus as a class of the ranking*.

Shipped, wherever the abstain corpus is on, it turns a fused winner away in two ways: when one of
its messages is nearer the message than the winner's nearest example (:class:`capd.vetoes.Vetoes`),
and when it outscores the winner as a class of the ranking (:mod:`capd.corpus_class`). ``off``:
the first way alone (capd before the class). ``unbalanced``: the class keeps the prior its share
of the head's rows gives it (184 corpus messages against about ten examples per capability on
taps/core). Calibration still tries the
corpus off and on and keeps it unless it lowers the fit fired_right, so each variant is measured
as ``capd calibrate`` would use it.

``--cost`` instead times, on taps/core as it ships (fused, its gates, the corpus on), a route of
each fixture message with the class and without it and a bare encode of the message (vector and
token vectors, as a fused route asks), interleaved over three passes in one process, and prints
the p50s and their ratios (a minute).
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import capd.corpus_class
from benchmarks.quality.splits_trial import patched_main
from capd.vetoes import Vetoes

VARIANTS = ("off", "unbalanced")


@contextmanager
def class_variant(variant: str) -> Iterator[None]:
    """Within the block, the corpus class is left out (``off``) or fitted without the balanced
    prior (``unbalanced``)."""
    with_class, balanced = Vetoes.with_corpus_class, capd.corpus_class.BALANCED

    def no_class(self: Vetoes, *args: Any, **kwargs: Any) -> Vetoes:
        return self

    if variant == "off":
        Vetoes.with_corpus_class = no_class  # type: ignore[method-assign]
    else:
        capd.corpus_class.BALANCED = False
    try:
        yield
    finally:
        Vetoes.with_corpus_class = with_class  # type: ignore[method-assign]
        capd.corpus_class.BALANCED = balanced


def cost() -> dict[str, float]:
    """p50 milliseconds of a taps/core route with and without the class and of a bare encode."""
    from benchmarks.quality.run import ROOT
    from capd.fixtures import load_fixtures, tap_fixture_files
    from capd.service import Service
    from capd.settings import Settings, for_one_tap

    tap = ROOT / "taps" / "core"
    with tempfile.TemporaryDirectory() as scratch:
        settings = for_one_tap(Settings(taps=(tap,), data_dir=Path(scratch), rule="fused"), tap)
        with closing(Service(settings).start()) as service:
            router = service.router
            bare = copy.copy(router)
            bare.vetoes = dataclasses.replace(router.vetoes, corpus_class=None)
            messages = [f.message for f in load_fixtures(tap_fixture_files(tap))]
            timed: dict[str, list[float]] = {"with the class": [], "without": [], "bare encode": []}
            for _ in range(3):
                for message in messages:
                    calls: dict[str, Callable[[str], object]] = {
                        "with the class": router.route, "without": bare.route,
                        "bare encode": lambda text: router.encoder.embed_tokens([text])}
                    for name, call in calls.items():
                        start = time.perf_counter()
                        call(message)
                        timed[name].append(time.perf_counter() - start)
    p50 = {name: round(statistics.median(times) * 1000, 3) for name, times in timed.items()}
    encode = p50["bare encode"]
    print(f"p50 ms: {p50}; route / bare encode with the class {p50['with the class'] / encode:.2f}x, "
          f"without {p50['without'] / encode:.2f}x")
    return p50


def main(argv: list[str]) -> dict[str, Any]:
    if argv == ["--cost"]:
        return cost()
    return patched_main(argv, __doc__ or "", "corpus_class_trial", VARIANTS, class_variant)


if __name__ == "__main__":
    main(sys.argv[1:])
