"""Research harness: must a corpus line cover the message to veto it (``CORPUS_VETO_COVERS``)?

Run: ``.venv/bin/python -m benchmarks.quality.corpus_covers_trial --variant on|off [--sets …]
[--splits 20]`` (``splits_trial``'s options apply; fused rule, untuned model; ``on`` is shipped).
Under the fused rule a line of the abstain corpus nearer the message than the winner's nearest
example vetoes the winner only when it also covers as much of the message's words as the winner's
examples do (:meth:`capd.vetoes.Vetoes.covering_line`); ``off`` lets its cosine decide alone, as
before 2026-12-08. Each variant is measured as plain ``capd calibrate`` uses it, the corpus kept
where the fit part says so. Results: benchmarks/quality/README.md, *A corpus line must cover the
message*.

``--fixed`` instead routes every row of taps/core (its fixtures and its calibration set) at fixed
gates, the tap's shipped ones and its auto gates, with the rule on and off, and prints the rows
whose decision changes and the fixtures' figures at each (about 1 min).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from benchmarks.quality.run import ROOT, trial_bench
from benchmarks.quality.splits_trial import patched_main
from capd import vetoes
from capd.evaluation import evaluate
from capd.fixtures import load_fixtures, tap_fixture_files

VARIANTS = ("on", "off")


@contextmanager
def corpus_covers(variant: str) -> Iterator[None]:
    """Within the block, a corpus line must (``on``) or need not (``off``) cover the message."""
    shipped = vetoes.CORPUS_VETO_COVERS
    vetoes.CORPUS_VETO_COVERS = variant == "on"
    try:
        yield
    finally:
        vetoes.CORPUS_VETO_COVERS = shipped


def fixed() -> dict[str, Any]:
    """taps/core at its shipped gates and its auto gates, the rule on and off (:data:`VARIANTS`)."""
    tap = ROOT / "taps" / "core"
    regression = load_fixtures(tap_fixture_files(tap))
    rows = [*regression, *load_fixtures(sorted((tap / "calibration").glob("*.jsonl")))]
    report: dict[str, Any] = {}
    with trial_bench("corpus_covers_trial") as bench:
        service = bench.service(tap, "fused")
        try:
            auto = service.fit_auto_gates()
            assert auto is not None
            at = {"shipped": (None, None, None), "auto": (auto.threshold, auto.margin, auto.coverage)}
            for label, gates in at.items():
                fired = {}
                for variant in VARIANTS:
                    with corpus_covers(variant):
                        _, table, outcome = evaluate(service.router, rows, *gates)
                        figures, _, _ = evaluate(service.router, regression, *gates)
                    fired[variant] = np.where(outcome.fired, outcome.winner, -1)
                    report[f"{label} gates, {variant}: fixtures"] = {
                        k: figures[k] for k in ("fired_right", "fired_wrong", "null_fpr", "top1")}
                for i in np.flatnonzero(fired["on"] != fired["off"]):
                    decided = {v: table.names[fired[v][i]] if fired[v][i] >= 0 else "abstain" for v in VARIANTS}
                    print(f"{label} gates: {'positive' if rows[i].positive else 'null'} {decided['off']} -> "
                          f"{decided['on']} | {rows[i].message}")
        finally:
            service.close()
    for key, figures in report.items():
        print(key, figures)
    return report


def main(argv: list[str]) -> dict[str, Any]:
    if argv == ["--fixed"]:
        return fixed()
    return patched_main(argv, __doc__ or "", "corpus_covers_trial", VARIANTS, corpus_covers)


if __name__ == "__main__":
    main(sys.argv[1:])
