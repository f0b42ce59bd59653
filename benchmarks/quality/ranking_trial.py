"""Research harness for the fused rule's ranking inputs: lexical weight, common words, head features.

Run: ``.venv/bin/python -m benchmarks.quality.ranking_trial [--sets a,b] [--lexical 0,0.005,0.01,0.02]
[--common 0,1000,3000] [--layers "6;4,5,6"] [--head-c 20,100] [--augment 2:0.15,4:0.15]
[--hubness other:0.5,corpus:0.5]`` (about 4 minutes for every set with the default variants;
``--head-c``, ``--augment`` and ``--hubness`` add about a minute each).

Per set, the shipped fused rule first, then each variant on its own (the others as shipped):

- ``--lexical W``: BM25's weight ``W_BM`` (``FusedHead.lexical_weight``; shipped 0.02), with each
  weight's out-of-fold top1 on the tap's own examples (the folds of :mod:`capd.autogates`): could a
  tap choose its weight from its examples?
- ``--common R``: the R most frequent whole words of the model's vocabulary (its ``vocab.txt``,
  ordered by frequency after the single characters) added to BM25's stop words, so that only
  rarer words (names, products) count as lexical evidence.
- ``--layers L``: the head fitted on, and applied to, the concatenation of the mean-pooled,
  unit-normalised hidden states of layers L (6 is the last of MiniLM's; the sentence vector),
  scaled to unit length; the nearest-example scores stay on the sentence vectors. Layer
  features come from torch (``transformers``) over the model's directory.
- ``--head-c C``: the head's inverse L2 strength (``fused.HEAD_C``; shipped 10).
- ``--augment N:P``: the head also fitted on N copies of each example of three words or more with
  each word dropped with probability P (seeded; copies equal to the example are left out), an
  "easy data augmentation" for a head that has few examples per capability.
- ``--hubness S:λ``: each example's cosine to the message lowered by λ times its *hubness* before
  the nearest-example term takes its top-3 mean (as CSLS does for cross-lingual retrieval): how
  close the example sits to what it should not attract, the mean of its top-3 cosines to the other
  capabilities' examples (S = ``other``) or to the abstain corpus (S = ``corpus``), centred on the
  tap's mean. Only the ranking changes; the level gate still reads the plain cosines.

Reports top1 on the fit and held-out positives and the held-out metrics at the gates calibrated on
the fit part (as ``make quality`` does), and writes ``benchmarks/results/ranking_trial.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.quality.run import EVALSETS, LIMITS, RESULTS, SETS, find_sets, gated, trial_bench, write_report
from capd import fused, lexicon
from capd.autogates import AUTO_FOLDS, Examples, _head, _score, examples_of, folds
from capd.calibrate import best_point, grid_for, split
from capd.encoder import TokenVectors
from capd.evaluation import ScoreTable, score_table
from capd.fixtures import load_fixtures
from capd.index import segment_topk_mean
from capd.models import manifest_for, resolve
from capd.settings import Settings
from capd.vetoes import abstain_corpus


def model_directory() -> Path:
    return resolve(manifest_for(Settings(taps=()))).directory


def common_words(directory: Path) -> list[str]:
    """Whole words of the model's vocabulary in its order (frequency, for BERT's WordPiece vocabulary)."""
    vocabulary = (directory / "vocab.txt").read_text(encoding="utf-8").split("\n")
    return [w for w in vocabulary[vocabulary.index("the"):] if re.fullmatch(r"[a-z]+", w)]


class LayerFeatures:
    """Mean-pooled, unit-normalised hidden states of every layer, per text (memoised)."""

    def __init__(self, directory: Path) -> None:
        from transformers import AutoModel, AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(directory))
        self._model = AutoModel.from_pretrained(str(directory)).eval()
        self._memo: dict[str, np.ndarray] = {}

    def __call__(self, texts: Sequence[str], layers: Sequence[int]) -> np.ndarray:
        import torch

        missing = [t for t in dict.fromkeys(texts) if t not in self._memo]
        for start in range(0, len(missing), 64):
            chunk = missing[start:start + 64]
            batch = self._tokenizer(chunk, padding=True, truncation=True, max_length=256, return_tensors="pt")
            with torch.no_grad():
                states = self._model(**batch, output_hidden_states=True).hidden_states
            mask = batch["attention_mask"].unsqueeze(-1).float()
            pooled = torch.stack([(h * mask).sum(1) / mask.sum(1) for h in states], 1).numpy()
            pooled /= np.linalg.norm(pooled, axis=-1, keepdims=True)
            self._memo.update(zip(chunk, pooled.astype(np.float32), strict=True))
        rows = np.stack([self._memo[t] for t in texts])
        joined = np.concatenate([rows[:, layer] for layer in layers], axis=1) / np.sqrt(len(layers))
        return np.asarray(joined, dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class LayerHead(fused.FusedHead):
    """A fused head whose logistic regression reads layer features instead of the sentence vector."""

    features: Callable[[Sequence[str]], np.ndarray] | None = None

    def score(self, knn: fused.Floats, vectors: fused.Floats, texts: Sequence[str],
              tokens: TokenVectors | None = None, offsets: fused.Floats | None = None) -> fused.Scores:
        assert self.features is not None
        return super().score(knn, self.features(list(texts)), texts, tokens, offsets)


@dataclasses.dataclass(frozen=True)
class HubnessHead(fused.FusedHead):
    """A fused head whose nearest-example term discounts each example by its hubness ``penalty``."""

    examples: np.ndarray | None = None  # [E, dim] unit rows, grouped by capability
    labels: np.ndarray | None = None  # [E]
    penalty: np.ndarray | None = None  # [E]

    def score(self, knn: fused.Floats, vectors: fused.Floats, texts: Sequence[str],
              tokens: TokenVectors | None = None, offsets: fused.Floats | None = None) -> fused.Scores:
        assert self.examples is not None and self.labels is not None and self.penalty is not None
        discounted = np.asarray(vectors @ self.examples.T, dtype=np.float32) - self.penalty
        scores = super().score(nearest_mean(discounted, self.labels, len(self.names)), vectors, texts, tokens,
                               offsets)
        return dataclasses.replace(scores, level=np.asarray(knn - self.in_class, dtype=np.float32))


def nearest_mean(sims: np.ndarray, labels: np.ndarray, columns: int) -> np.ndarray:
    """Per capability the mean of its top-k values in ``sims [n, E]`` (-1 without examples)."""
    out = np.full((len(sims), columns), -1.0, dtype=np.float32)
    present, starts, counts = np.unique(labels, return_index=True, return_counts=True)
    out[:, present] = segment_topk_mean(sims, starts, counts, fused.TOP_K)
    return out


def hubness(examples: Examples, against: np.ndarray | None) -> np.ndarray:
    """Each example's mean top-3 cosine to ``against`` (None: the other capabilities' examples), centred."""
    if against is None:
        sims = examples.vectors @ examples.vectors.T
        sims[examples.labels[:, None] == examples.labels[None, :]] = -np.inf
    else:
        sims = examples.vectors @ against.T
    top = np.sort(sims, axis=1)[:, -fused.TOP_K:].mean(axis=1)
    return np.asarray(top - top.mean(), dtype=np.float32)


def out_of_fold_top1(examples: Examples, weights: Sequence[float]) -> dict[float, float]:
    """Top1 of every example scored by the fold heads of :mod:`capd.autogates`, per lexical weight."""
    fold_of, right, scored = folds(examples.labels), dict.fromkeys(weights, 0), 0
    matrices = examples.head.tokens.matrices() if examples.head.tokens is not None else {}
    for fold in range(AUTO_FOLDS):
        held = fold_of == fold
        kept = np.bincount(examples.labels[~held], minlength=len(examples.names))
        held &= kept[examples.labels] > 0
        if not held.any():
            continue
        train, rows = np.flatnonzero(~held), np.flatnonzero(held)
        texts = [examples.texts[i] for i in rows]
        head = _head(examples, train)
        tokens = [matrices[t] for t in texts] if matrices else None
        for weight in weights:
            scores = _score(dataclasses.replace(head, lexical_weight=weight), examples, train,
                            examples.vectors[rows], texts, tokens)
            right[weight] += int((scores.winner == examples.labels[rows]).sum())
        scored += len(rows)
    return {w: right[w] / max(scored, 1) for w in weights}


def word_dropped(examples: Examples, copies: int, rate: float, seed: int = 0) -> tuple[list[str], np.ndarray]:
    """``copies`` variants of every example of three words or more, each word dropped with
    probability ``rate`` (never all of them), with the examples' labels."""
    rng, texts, labels = random.Random(seed), [], []
    for text, label in zip(examples.texts, examples.labels, strict=True):
        words = text.split()
        if len(words) < 3:
            continue
        for _ in range(copies):
            variant = " ".join([w for w in words if rng.random() >= rate] or words[:1])
            if variant != text:
                texts.append(variant)
                labels.append(label)
    return texts, np.asarray(labels, dtype=np.int64)


def measure(table: ScoreTable, fit_rows: np.ndarray, held_rows: np.ndarray) -> dict[str, Any]:
    winner, _, _ = table.gate_inputs()
    right = table.expected[np.arange(len(winner)), winner] & table.positive
    fit_pos, held_pos = fit_rows[table.positive[fit_rows]], held_rows[table.positive[held_rows]]
    point, _ = best_point({fused.TOP_K: table.subset(fit_rows)}, grid=grid_for("fused"), **LIMITS)
    return {"top1_fit": round(float(right[fit_pos].mean()), 4), "top1_held": round(float(right[held_pos].mean()), 4),
            "held_out": None if point is None else gated(table, held_rows, point)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--lexical", default="0,0.005,0.01,0.02", help="BM25 weights (shipped 0.02)")
    parser.add_argument("--common", default="1000,3000", help="how many common words become stop words")
    parser.add_argument("--layers", default="4,5,6;3,4,5,6", help="';'-separated layer lists for the head")
    parser.add_argument("--head-c", default="", help="the head's C values (shipped 10)")
    parser.add_argument("--augment", default="", help="copies:drop-rate pairs, e.g. 2:0.15,4:0.15")
    parser.add_argument("--hubness", default="", help="source:lambda pairs, source other or corpus, e.g. other:0.5")
    parser.add_argument("--out", type=Path, default=RESULTS / "ranking_trial.json")
    args = parser.parse_args(argv)
    lexical = [float(w) for w in args.lexical.split(",") if w]
    commons = [int(r) for r in args.common.split(",") if r]
    layer_sets = [tuple(int(x) for x in group.split(",")) for group in args.layers.split(";") if group]
    head_cs = [float(c) for c in args.head_c.split(",") if c]
    augments = [(int(n), float(p)) for n, p in (pair.split(":") for pair in args.augment.split(",") if pair)]
    hubs = [(source, float(lam)) for source, lam in (pair.split(":") for pair in args.hubness.split(",") if pair)]
    if any(source not in ("other", "corpus") for source, _ in hubs):
        parser.error("--hubness sources are other and corpus")
    directory = model_directory()
    vocabulary = common_words(directory)
    layer_features = LayerFeatures(directory) if layer_sets else None
    found, skipped = find_sets([s for s in args.sets.split(",") if s], EVALSETS)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "skipped": skipped, "results": []}
    stop_words = lexicon._STOP
    with trial_bench("ranking") as bench:
        for evalset in found:
            fixtures = load_fixtures(evalset.fixture_files)
            fit_rows, held_rows = split(fixtures)
            service = bench.service(evalset.tap, "fused")
            router, head = service.router, service.router.head
            assert head is not None
            vectors, tokens = bench.vectors(service, fixtures), bench.tokens(service, fixtures)
            examples = examples_of(router.index, head, router.encoder.embed_tokens)
            assert examples is not None
            documents = [[examples.texts[i] for i in np.flatnonzero(examples.labels == c)]
                         for c in range(len(examples.names))]
            oof = out_of_fold_top1(examples, lexical)
            variants: list[tuple[str, fused.FusedHead, float | None]] = [("shipped", head, None)]
            variants += [(f"lexical {w:g}", dataclasses.replace(head, lexical_weight=w), oof[w]) for w in lexical]
            for count in commons:
                lexicon._STOP = stop_words | frozenset(vocabulary[:count])
                common = dataclasses.replace(head, lexicon=lexicon.Lexicon(documents))
                variants.append((f"common {count}", common, None))
                lexicon._STOP = stop_words
            for layers in layer_sets:
                assert layer_features is not None

                def features(texts: Sequence[str], layers: tuple[int, ...] = layers) -> np.ndarray:
                    assert layer_features is not None
                    return layer_features(texts, layers)

                weight, bias = fused.fit_head(features(examples.texts), examples.labels, len(examples.names))
                fields = {f.name: getattr(head, f.name) for f in dataclasses.fields(fused.FusedHead)}
                variants.append((f"layers {','.join(map(str, layers))}",
                                 LayerHead(**{**fields, "weight": weight, "bias": bias}, features=features), None))
            shipped_c = fused.HEAD_C
            for c in head_cs:
                fused.HEAD_C = c
                weight, bias = fused.fit_head(examples.vectors, examples.labels, len(examples.names))
                variants.append((f"head C {c:g}", dataclasses.replace(head, weight=weight, bias=bias), None))
            fused.HEAD_C = shipped_c
            for copies, rate in augments:
                texts, labels = word_dropped(examples, copies, rate)
                weight, bias = fused.fit_head(np.vstack([examples.vectors, router.encoder.embed(texts)]),
                                              np.concatenate([examples.labels, labels]), len(examples.names))
                variants.append((f"augment {copies}x{rate:g}", dataclasses.replace(head, weight=weight, bias=bias),
                                 None))
            corpus = router.encoder.embed(list(abstain_corpus())) if hubs else None
            for source, lam in hubs:
                fields = {f.name: getattr(head, f.name) for f in dataclasses.fields(fused.FusedHead)}
                penalty = lam * hubness(examples, None if source == "other" else corpus)
                variants.append((f"hubness {source} {lam:g}", HubnessHead(
                    **fields, examples=examples.vectors, labels=examples.labels, penalty=penalty), None))
            for label, variant, oof_top1 in variants:
                router.head = variant
                entry = {"set": evalset.name, "variant": label, "oof_top1": oof_top1,
                         **measure(score_table(router, fixtures, vectors=vectors, tokens=tokens), fit_rows, held_rows)}
                report["results"].append(entry)
                held = entry["held_out"]
                print(f"{evalset.name:20s} {label:16s} top1 fit {entry['top1_fit']:.3f} held {entry['top1_held']:.3f}"
                      + ("" if oof_top1 is None else f" oof {oof_top1:.3f}") + " | held out: "
                      + ("no feasible point" if held is None else " ".join(
                          f"{k} {'—' if held[k] is None else round(held[k], 3)}"
                          for k in ("fired_right", "fired_wrong", "null_fpr"))), flush=True)
            router.head = head
    write_report(args.out, report)


if __name__ == "__main__":
    main(sys.argv[1:])
