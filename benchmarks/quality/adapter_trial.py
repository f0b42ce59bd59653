"""Research harness: a linear adapter on the frozen model, trained on the tap's examples.

Run: ``.venv/bin/python -m benchmarks.quality.adapter_trial [--sets a,b] [--variants 1:3e-4:0.1,1:3e-4:0.3]
[--seeds 0,1,2]`` (about 2.5 minutes with these).

Tuning the model (``tune = true``, :mod:`capd.tuning`) is the largest measured gain on hwu64
(fused held-out fired_right 0.60 → 0.74) but costs minutes of CPU per tap, so it is opt-in. This
screens a cheap stand-in: a ``dim × dim`` matrix ``M`` (from the identity) applied to every vector
the model gives (sentence and token vectors, renormalised), trained with the tuning recipe's loss
(symmetric multiple-negatives ranking over pairs of examples of one capability, no capability twice
in a batch, cosines × 20) on the frozen example vectors, plus ``λ·‖M − I‖²``. A variant
``epochs:learning-rate:λ`` trains that many passes over the pairs with Adam. The whole rule (nearest
examples, μ_in, head, BM25, second stage) then runs in the adapted space: the service is built with
an encoder that applies ``M``.

Per set and variant: top1 on the fit and held-out positives, the held-out metrics at gates
calibrated on the fit part (as ``make quality``; also the fit part's own metrics there), and at the
auto gates (no fixture seen), next to the unadapted rule; the adapter's training time. Screened and
not kept: ``benchmarks/quality/README.md``, "A linear adapter instead of tuning". Writes
``benchmarks/results/adapter_trial.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.quality.ranking_trial import measure
from benchmarks.quality.run import EVALSETS, LIMITS, RESULTS, SETS, Bench, find_sets, gated, trial_bench, write_report
from capd import fused
from capd.autogates import examples_of
from capd.calibrate import best_point, grid_for, split
from capd.encoder import Embedded, Encoder, Vectors, l2_normalize
from capd.evaluation import score_table
from capd.fixtures import Fixture, load_fixtures
from capd.service import Service
from capd.tuning import batches

PAIRS_PER_EXAMPLE = 10  # the tuning recipe's
BATCH = 32
SCALE = 20.0


class Adapted:
    """An encoder whose every vector is ``M`` applied to the base model's, renormalised. The base
    model's outputs are memoised in ``memo`` (shared between variants)."""

    def __init__(self, base: Encoder, matrix: np.ndarray, memo: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self._base, self._matrix, self._memo = base, matrix.astype(np.float32), memo
        digest = hashlib.sha256(self._matrix.tobytes()).hexdigest()[:12]
        self._model_id = f"{base.model_id}+adapter-{digest}"

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def dim(self) -> int:
        return self._base.dim

    def embed(self, texts: Sequence[str]) -> Vectors:
        return self.embed_tokens(texts)[0]

    def embed_tokens(self, texts: Sequence[str]) -> Embedded:
        missing = [t for t in dict.fromkeys(texts) if t not in self._memo]
        if missing:
            vectors, tokens = self._base.embed_tokens(missing)
            self._memo.update(zip(missing, zip(vectors, tokens, strict=True), strict=True))
        rows = [self._memo[t] for t in texts]
        if not rows:
            return np.zeros((0, self.dim), dtype=np.float32), []
        vectors = l2_normalize(np.stack([v for v, _ in rows]) @ self._matrix)
        return vectors, [l2_normalize(t @ self._matrix) for _, t in rows]


def fit_adapter(vectors: np.ndarray, labels: np.ndarray, epochs: int, rate: float, pull: float,
                seed: int = 0) -> tuple[np.ndarray, int]:
    """``M`` and the number of steps: the tuning recipe's loss on frozen vectors (see the module)."""
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    members: dict[int, list[int]] = {}
    for row, label in enumerate(labels.tolist()):
        members.setdefault(label, []).append(row)
    pairs = [(label, a, p) for label, rows in members.items() if len(rows) > 1 for a in rows
             for p in rng.sample([r for r in rows if r != a], min(PAIRS_PER_EXAMPLE, len(rows) - 1))]
    x = torch.tensor(vectors, dtype=torch.float32)
    identity = torch.eye(x.shape[1])
    matrix = identity.clone().requires_grad_(True)
    optimiser = torch.optim.Adam([matrix], lr=rate)
    steps = 0
    for batch in [b for _ in range(epochs) for b in batches(pairs, BATCH, rng)]:
        if len(batch) < 2:
            continue
        anchors = torch.nn.functional.normalize(x[[a for _, a, _ in batch]] @ matrix, dim=1)
        positives = torch.nn.functional.normalize(x[[p for _, _, p in batch]] @ matrix, dim=1)
        logits = SCALE * anchors @ positives.T
        target = torch.arange(len(batch))
        loss = (torch.nn.functional.cross_entropy(logits, target)
                + torch.nn.functional.cross_entropy(logits.T, target)) / 2
        loss = loss + pull * ((matrix - identity) ** 2).sum()
        optimiser.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimiser.step()
        steps += 1
    return matrix.detach().numpy(), steps


def evaluate(bench: Bench, service: Service, fixtures: Sequence[Fixture]) -> dict[str, Any]:
    """Top1, fit and held-out metrics at gates calibrated on the fit part, held-out at the auto gates."""
    fit_rows, held_rows = split(fixtures)
    table = score_table(service.router, fixtures, vectors=bench.vectors(service, fixtures),
                        tokens=bench.tokens(service, fixtures))
    point, _ = best_point({fused.TOP_K: table.subset(fit_rows)}, grid=grid_for("fused"), **LIMITS)
    auto = service.fit_auto_gates()
    return {**measure(table, fit_rows, held_rows), "fit": None if point is None else gated(table, fit_rows, point),
            "auto": None if auto is None else gated(table, held_rows, auto)}


def line(entry: dict[str, Any]) -> str:
    def three(metrics: dict[str, Any] | None) -> str:
        if metrics is None:
            return "no feasible point"
        return " / ".join("—" if metrics[k] is None else f"{metrics[k]:.3f}"
                          for k in ("fired_right", "fired_wrong", "null_fpr"))

    extra = {k: entry[k] for k in ("steps", "seconds", "drift") if k in entry}
    return (f"{entry['set']:20s} {entry['variant']:22s} top1 fit {entry['top1_fit']:.3f} held {entry['top1_held']:.3f}"
            f" | fit {three(entry['fit'])} | calibrated {three(entry['held_out'])} | auto {three(entry['auto'])}"
            + (f" | {extra}" if extra else ""))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--variants", default="1:3e-4:0.1,1:3e-4:0.3",
                        help="epochs:learning-rate:pull (λ) triples")
    parser.add_argument("--seeds", default="0", help="adapter seeds (batch order)")
    parser.add_argument("--out", type=Path, default=RESULTS / "adapter_trial.json")
    args = parser.parse_args(argv)
    variants = [(int(e), float(r), float(p)) for e, r, p in (v.split(":") for v in args.variants.split(",") if v)]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    found, skipped = find_sets([s for s in args.sets.split(",") if s], EVALSETS)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "skipped": skipped, "results": []}

    def record(entry: dict[str, Any]) -> None:
        report["results"].append(entry)
        print(line(entry), flush=True)

    with trial_bench("adapter") as bench:
        memo: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for evalset in found:
            fixtures = load_fixtures(evalset.fixture_files)
            service = bench.service(evalset.tap, "fused")
            assert service.router.head is not None
            examples = examples_of(service.router.index, service.router.head, service.router.encoder.embed_tokens)
            assert examples is not None
            record({"set": evalset.name, "variant": "shipped", **evaluate(bench, service, fixtures)})
            for (epochs, rate, pull), seed in itertools.product(variants, seeds):
                started = time.perf_counter()
                matrix, steps = fit_adapter(examples.vectors, examples.labels, epochs, rate, pull, seed)
                seconds = round(time.perf_counter() - started, 2)
                adapted = dataclasses.replace(bench, encoder=Adapted(bench.encoder, matrix, memo))
                record({"set": evalset.name, "variant": f"adapter {epochs}:{rate:g}:{pull:g} s{seed}", "steps": steps,
                        "seconds": seconds, "drift": round(float(np.linalg.norm(matrix - np.eye(len(matrix)))), 3),
                        **evaluate(adapted, adapted.service(evalset.tap, "fused"), fixtures)})
    write_report(args.out, report)


if __name__ == "__main__":
    main(sys.argv[1:])
