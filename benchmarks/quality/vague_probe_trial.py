"""Research harness: vague asks made from a capability's own name, as vetoes of that capability.

Run: ``.venv/bin/python -m benchmarks.quality.vague_probe_trial [--sets a,b]`` (untuned model, fused
rule, 2 min on taps/core, healthcare and snips7). The question: can a vague ask that names a
capability's subject ("Can you help with an infusion issue?", which healthcare labels ambiguous,
so null) be told from a request for it? Each capability gets probes: :data:`FRAMES` (vague asks
written here) filled with its name's words ("infusion therapy"). A winner is vetoed when the
message's nearest probe of it is at least as near as its nearest trigger (sentence cosines), the
rule of capd's other vetoes. Gates are fitted on the fit part with the fit nulls as vetoes and no
fit positives as examples (the ``calibrated`` rows of ``make quality``), without the probes
(``shipped``), with them on every row (``probes``) and with them where the fit part's fired_right
does not fall (``chosen``, the abstain corpus's rule). Printed per set, as one JSON line: held-out
top1 / fired_right / fired_wrong / null_fpr per variant, and how many held-out positives and nulls
the probes veto; written to ``--out``. Results: benchmarks/quality/README.md, *What failed*.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

import numpy as np

from benchmarks.quality.run import LIMITS, Bench, EvalSet, FusedSet, folds_trial, gated
from capd.calibrate import Variants, fit_gates, fitted_router, grid_for, score_variants
from capd.evaluation import ScoreTable

FRAMES = ("I have a question about {}", "can you help me with {}", "there is a problem with {}",
          "I need help with {}", "something is wrong with {}", "{} issue")


def unit(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    unit_rows: np.ndarray = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    return unit_rows


def probe_vetoes(on: FusedSet, table: ScoreTable) -> np.ndarray:
    """bool [rows]: the row's winner has a probe at least as near the message as its nearest trigger."""
    encoder = on.service.router.encoder
    catalog = {c.name: c for c in on.service.catalog_now()}
    winners = table.gate_inputs()[0]
    messages = unit(on.vectors)
    out = np.zeros(len(winners), dtype=bool)
    for column, name in enumerate(table.names):
        rows = np.flatnonzero(winners == column)
        if not len(rows):
            continue
        triggers = unit(encoder.embed(list(catalog[name].triggers)))
        probes = unit(encoder.embed([frame.format(name.replace("-", " ")) for frame in FRAMES]))
        near = messages[rows]
        out[rows] = (near @ probes.T).max(axis=1) >= (near @ triggers.T).max(axis=1)
    return out


def with_probes(variants: Variants, mask: np.ndarray) -> Variants:
    return {on: {k: replace(t, vetoed=mask if t.vetoed is None else t.vetoed | mask) for k, t in tables.items()}
            for on, tables in variants.items()}


def run_set(bench: Bench, evalset: EvalSet, folds: int) -> dict[str, Any]:
    grid = grid_for("fused")
    row: dict[str, Any] = {"set": evalset.name}
    with bench.fused_set(evalset) as on:
        router, _, _ = fitted_router(on.service.router, on.fixtures, on.vectors, on.tokens)
        shipped = score_variants(router, on.fixtures, on.vectors, on.tokens, grid)
        mask = probe_vetoes(on, shipped[False][grid.top_ks[0]])
        positive = np.array([f.positive for f in on.fixtures], dtype=bool)
        held = np.zeros(len(mask), dtype=bool)
        held[on.held_rows] = True
        row["probe_vetoes_held_out"] = {"positives": int((mask & held & positive).sum()),
                                        "nulls": int((mask & held & ~positive).sum())}
        fitted = {name: fit_gates(scored, on.fit_rows, grid, **LIMITS)
                  for name, scored in (("shipped", shipped), ("probes", with_probes(shipped, mask)))}
        plain, probed = fitted["shipped"].point, fitted["probes"].point
        keep = probed is not None and (plain is None or probed.fired_right >= plain.fired_right)
        chosen = "probes" if keep else "shipped"
        row["chosen_is"] = chosen
        for name, fit in (*fitted.items(), ("chosen", fitted[chosen])):
            point = fit.point
            row[name] = None if point is None else {
                k: v for k, v in gated(fit.tables[point.top_k], on.held_rows, point).items()
                if k in ("top1", "fired_right", "fired_wrong", "null_fpr")} | {"fit_fired_right": point.fired_right}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str]) -> dict[str, Any]:
    return folds_trial(argv, __doc__ or "", "vague_probe_trial", run_set)


if __name__ == "__main__":
    main(sys.argv[1:])
