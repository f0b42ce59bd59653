"""Research harness: the coverage gate measured against each capability's own coverage.

Run: ``.venv/bin/python -m benchmarks.quality.coverage_trial --variant relative
[--sets core,healthcare,snips7] [--splits 5]`` (the ``splits_trial`` options apply; fused rule,
untuned model).

The coverage gate (:mod:`capd.fused`) asks how much of the message the winner's examples speak of,
with one cut for every capability. Some capabilities' requests carry a free payload their examples
cannot name (a web search's topic, a translation's text: "search the web for benchmarks comparing
faiss and hnswlib" has coverage 0.36 on taps/core), while others' examples share one small
vocabulary (``time``), so that a message naming one of its words ("time flies") covers half of
itself. The threshold gate already measures a message against the winner's own spread (``level =
K_w − μ_in[w]``). ``relative`` does the same for coverage: each capability's own coverage, the
mean over its examples of each one's coverage by its other examples, is subtracted from the
message's coverage of it and the mean of that over the capabilities added back (so the statistic
keeps the gate grid's scale); a capability with one example keeps its coverage as it is. Applied
by patching :meth:`capd.fused.ExampleTokens.late_interaction` for the services ``splits_trial``
builds, so calibration sweeps the gate on the new statistic. Compare with a plain ``splits_trial``
run on the same sets and splits.

``--chosen SHIPPED.json VARIANT.json`` reads such a pair of runs and prints, per set, what
calibration would give if it chose between the two statistics on each split by the fit part (the
variant only where its fit fired_right is higher; a tie keeps the shipped one), as it chooses the
abstain corpus: splits on which the goal is met, mean held-out fired_right and null_fpr.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from capd.fused import ExampleTokens

VARIANTS = ("relative",)


def own_coverage(tokens: ExampleTokens) -> np.ndarray:
    """Per capability: the mean over its examples of each one's coverage by its other examples
    (NaN with fewer than two examples)."""
    out = np.full(len(tokens.first) - 1, np.nan, dtype=np.float32)
    for column in range(len(out)):
        a, b = int(tokens.first[column]), int(tokens.first[column + 1])
        if b - a < 2:
            continue
        low = tokens.starts[a]
        rows = tokens.rows[low:tokens.starts[b]]
        owner = np.repeat(np.arange(b - a), np.diff(tokens.starts[a:b + 1]))
        sims = rows @ rows.T
        sims[owner[:, None] == owner[None, :]] = -np.inf  # an example does not cover itself
        out[column] = float(np.mean([sims[owner == e].max(axis=1).mean() for e in range(b - a)]))
    return out


def relative(shipped: Any) -> Any:
    """:meth:`ExampleTokens.late_interaction` with coverage measured against each column's own."""
    def late_interaction(self: ExampleTokens, message: Any, columns: Any, *args: Any, **kwargs: Any) -> Any:
        match, coverage = shipped(self, message, columns, *args, **kwargs)
        own = self.__dict__.get("_own_coverage")
        if own is None:
            own = own_coverage(self)
            object.__setattr__(self, "_own_coverage", own)  # frozen dataclass: cached on the instance
        if np.isnan(own).all():
            return match, coverage
        shift = own[np.asarray(columns, dtype=np.int64)] - float(np.nanmean(own))
        return match, np.where(np.isnan(shift), coverage, coverage - shift).astype(np.float32)

    return late_interaction


@contextmanager
def coverage_variant(variant: str) -> Iterator[None]:
    shipped = ExampleTokens.late_interaction
    ExampleTokens.late_interaction = relative(shipped)  # type: ignore[method-assign]
    try:
        yield
    finally:
        ExampleTokens.late_interaction = shipped  # type: ignore[method-assign]


def chosen(shipped: dict[str, Any], variant: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per set of two ``splits_trial`` reports on the same splits: the held-out figures when each
    split takes the variant only where its fit fired_right is higher."""
    out = {}
    for result in shipped["results"]:
        other = next(r for r in variant["results"] if r["set"] == result["set"])
        picked = [b if b["recommended"]["fired_right"] > a["recommended"]["fired_right"] + 1e-9 else a
                  for a, b in zip(result["splits"], other["splits"], strict=True)]
        nulls = [s["held_out"]["null_fpr"] for s in picked if s["held_out"].get("null_fpr") is not None]
        out[result["set"]] = {
            "splits": len(picked), "met": sum(bool(s["met"]) for s in picked),
            "variant_chosen": sum(s is b for s, b in zip(picked, other["splits"], strict=True)),
            "fired_right_mean": round(statistics.mean(s["held_out"]["fired_right"] for s in picked), 3),
            "null_fpr_mean": round(statistics.mean(nulls), 3) if nulls else None}
    return out


def main(argv: list[str]) -> dict[str, Any]:
    from benchmarks.quality import splits_trial

    if argv[:1] == ["--chosen"]:
        if len(argv) != 3:
            raise SystemExit("usage: coverage_trial --chosen SHIPPED.json VARIANT.json")
        reports = [json.loads(Path(path).read_text(encoding="utf-8")) for path in argv[1:]]
        result = chosen(*reports)
        for name, row in result.items():
            print(f"{name:20s} fit-chosen: goal met on {row['met']} of {row['splits']} splits, variant chosen "
                  f"on {row['variant_chosen']}; held-out fired_right {row['fired_right_mean']}, "
                  f"null_fpr {row['null_fpr_mean']}")
        return result
    return splits_trial.patched_main(argv, __doc__ or "", "coverage_trial", VARIANTS, coverage_variant)


if __name__ == "__main__":
    main(sys.argv[1:])
