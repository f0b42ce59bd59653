"""Research harness: the tap's null rows as a class of the fused ranking, beside their veto.

Run: ``.venv/bin/python -m benchmarks.quality.null_class_trial --variant class [--sets …]
[--splits 20]`` (``splits_trial``'s options apply; fused rule, untuned model). Compare with a plain
``splits_trial`` run on the same sets and splits. Results: benchmarks/quality/README.md, *The tap's
null rows as a class of the ranking*.

The abstain corpus turns a winner away as a class of the ranking too (:mod:`capd.corpus_class`);
this asks the same of the fixtures' null rows that ``capd calibrate`` makes the tap's vetoes
(two of which must be nearer the message than the winner's nearest example). The head is refitted
with them as one more class (prior balanced as the corpus's), their kNN column is the mean of their
top-3 cosines, and a winner no veto turned away is turned away when that column beats it. A fit
null row is scored by a class fitted without its fold of the nulls (5 folds by a hash of its
routed text), as the veto leaves out its own copy; held-out rows see the class of every fit null.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from benchmarks.quality.splits_trial import patched_main
from capd.corpus_class import CorpusClass, fit_corpus_class
from capd.fused import TOP_K
from capd.router import Router
from capd.text import routed_key
from capd.vetoes import Refusal

VARIANTS = ("class",)
FOLDS = 5
_classes: dict[tuple[str, int, int], tuple[CorpusClass, np.ndarray]] = {}
_keys: dict[int, set[str]] = {}  # hash of a tap's null rows -> their routed texts


def fold(key: str) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % FOLDS


def null_class(router: Router, texts: Sequence[str], rows: np.ndarray, dropped: int) -> tuple[CorpusClass, np.ndarray]:
    """The class of the tap's null rows (without fold ``dropped``; -1 keeps them all) and its members' rows."""
    assert router.head is not None
    key = (router.head.key, hash(tuple(texts)), dropped)
    if key not in _classes:
        keep = [i for i, t in enumerate(texts) if dropped < 0 or fold(routed_key(t)) != dropped]
        members = [texts[i] for i in keep]
        _, vectors, labels = router.index.examples()
        fitted = fit_corpus_class(router.head, vectors, labels, members, rows[keep])
        _classes[key] = fitted, rows[keep]
    return _classes[key]


@contextmanager
def with_null_class(variant: str) -> Iterator[None]:
    shipped = Router.refusals

    def refusals(self: Router, vectors: np.ndarray, winners: Sequence[str],
                 own: Sequence[str] | None = None, knn: np.ndarray | None = None) -> list[Refusal | None]:
        out = shipped(self, vectors, winners, own, knn)
        if self.rule != "fused" or self.head is None:
            return out
        queries = np.asarray(vectors, dtype=np.float32).reshape(-1, self.index.dim)
        for row, name in enumerate(winners):
            capability = self.catalog.get(name)
            if out[row] is not None or capability is None or capability.tap not in self.vetoes.taps:
                continue
            texts, rows = self.vetoes.taps[capability.tap]
            mine = routed_key(own[row]) if own is not None else ""
            keys = _keys.setdefault(hash(tuple(texts)), {routed_key(t) for t in texts})
            dropped = fold(mine) if mine and mine in keys else -1
            klass, members = null_class(self, texts, rows, dropped)
            names, knn = self.index.named_scores(queries[row][None, :], TOP_K)
            if names != klass.names or not len(members):
                continue
            scores = klass.scores(queries[row], knn[0], members @ queries[row])
            if scores[-1] > scores[names.index(name)]:
                out[row] = Refusal("(the tap's nulls as a class)", float(scores[-1]), 0.0, "tap")
        return out

    Router.refusals = refusals  # type: ignore[method-assign]
    try:
        yield
    finally:
        Router.refusals = shipped  # type: ignore[method-assign]
        _classes.clear()
        _keys.clear()


def main(argv: list[str]) -> dict[str, Any]:
    return patched_main(argv, __doc__ or "", "null_class_trial", VARIANTS, with_null_class)


if __name__ == "__main__":
    main(sys.argv[1:])
