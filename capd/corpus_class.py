"""The abstain corpus as a class of the fused ranking: its second way to turn a winner away.

The corpus's veto (:class:`capd.vetoes.Vetoes`) is nearest-neighbour evidence: a winner is
turned away when one corpus message is nearer the message than the winner's nearest example.
Chat that is like the corpus as a kind, but near none of its lines, passes: "time flies" is
nearer the ``time`` capability's examples than any corpus message. Here the corpus is also one
more class beside the capabilities: the fused rule's head is refitted with it as a last column
(:func:`capd.fused.fit_head`), and its soft-nearest-neighbour score is the mean of its top-3
cosines, as a capability's is. The winner is turned away when the corpus column's
``A·log_softmax(head) + (1−A)·log_softmax(K/τ)`` beats the winner's: a boundary between the
tap's requests and generic chat, learned from both, instead of one neighbour's vote.

The head's bias carries each class's share of its rows, and the corpus has many more rows than a
capability, so the class's prior is set to an average capability's (:data:`BALANCED`). It applies
wherever the corpus does (a tap's gates turn it on, and ``capd calibrate`` keeps it unless it
lowers the fit fired_right), to the fused rule only. On twenty splits of taps/core issue 6's goal
is met on 9 instead of 7 (mean held-out null_fpr 0.065 → 0.049, fired_right 0.850 → 0.867,
fired_wrong 0.010 → 0.017; unbalanced, 8); healthcare, snips7 and the large sets are unchanged
split for split, since calibration leaves the corpus off where it did (``python -m
benchmarks.quality.corpus_class_trial``; benchmarks/quality/README.md, *The abstain corpus as a
class of the ranking*).

The refitted head is cached beside the fused head (``<data>/heads/``) by the fused head's key
and the corpus's text, so a restart fits nothing.
"""

from __future__ import annotations

import hashlib
import logging
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from capd.atomic import write_with
from capd.fused import MIX, TEMPERATURE, TOP_K, FusedHead, Stop, fit_head, log_softmax

log = logging.getLogger(__name__)

Floats = npt.NDArray[np.float32]
VERSION = "corpus-class-1"  # bump when the fit or the scores below change
BALANCED = True  # the class's prior set to an average capability's: its bias lowered by the log of its rows' ratio


@dataclass(frozen=True)
class CorpusClass:
    """The fused head refitted with the abstain corpus as its last column, for ``names``."""

    names: tuple[str, ...]  # the fused head's capabilities, in its column order
    weight: Floats | None  # [dim, C + 1]; None when the fused head has none (over its budget)
    bias: Floats | None  # [C + 1]
    mix: float = MIX
    key: str = ""

    def scores(self, query: Floats, knn: Floats, corpus_sims: Floats) -> Floats:
        """``[C + 1]``: each capability's and then the corpus's ``A·log_softmax(head) +
        (1−A)·log_softmax(K/τ)`` for one unit ``query``, given its mean-top-k example cosines
        ``knn`` (``[C]``, in :attr:`names` order) and its cosines to the corpus messages."""
        k = min(TOP_K, len(corpus_sims))
        corpus_k = float(np.partition(corpus_sims, len(corpus_sims) - k)[len(corpus_sims) - k:].mean())
        near = np.append(np.asarray(knn, dtype=np.float32), np.float32(corpus_k))[None, :] / TEMPERATURE
        if self.weight is None or self.bias is None:
            return np.asarray(log_softmax(near)[0], dtype=np.float32)
        logits = np.asarray(query[None, :] @ self.weight + self.bias, dtype=np.float32)
        return np.asarray((self.mix * log_softmax(logits) + (1 - self.mix) * log_softmax(near))[0], dtype=np.float32)


def class_key(head: FusedHead, corpus: Sequence[str]) -> str:
    """What a corpus class is fitted for: the fused head's key (model and examples) and the corpus."""
    digest = hashlib.sha256(f"{VERSION}\n{BALANCED}\n{head.key}\n".encode())
    for message in corpus:
        digest.update(f"{message}\n".encode())
    return digest.hexdigest()


def fit_corpus_class(head: FusedHead, vectors: Floats, labels: npt.NDArray[np.int64], corpus: Sequence[str],
                     corpus_vectors: Floats, cache_dir: Path | None = None, stop: Stop | None = None) -> CorpusClass:
    """The corpus class for ``head``, whose examples are ``vectors`` with their columns ``labels``
    (:meth:`capd.index.TriggerIndex.examples`), loaded from ``cache_dir`` or fitted (and stored)."""
    key = class_key(head, corpus)
    columns = len(head.names)
    if head.weight is None or head.bias is None or not len(corpus):
        return CorpusClass(head.names, None, None, head.mix, key)
    path = cache_dir / f"{key}.corpus.npz" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            with np.load(path) as stored:
                weight, bias = stored["weight"], stored["bias"]
            if weight.shape != (vectors.shape[1], columns + 1) or bias.shape != (columns + 1,) \
                    or not (np.isfinite(weight).all() and np.isfinite(bias).all()):
                raise ValueError(f"its arrays are {weight.shape} and {bias.shape}, not for {columns} capabilities")
            return CorpusClass(head.names, weight.astype(np.float32), bias.astype(np.float32), head.mix, key)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # corrupt or truncated
            log.warning("ignoring unreadable corpus class %s: %s", path, exc)
    rows = np.vstack([vectors, corpus_vectors]).astype(np.float32)
    classes = np.concatenate([labels, np.full(len(corpus_vectors), columns)]).astype(np.int64)
    weight, bias = fit_head(rows, classes, columns + 1, stop)
    if BALANCED:  # the head's bias carries each class's share of the rows; the corpus has many more than a capability
        present = len(np.unique(labels))
        bias[columns] -= np.float32(np.log(len(corpus_vectors) * present / len(labels)))
    if path is not None:
        _store(path, weight, bias)
    return CorpusClass(head.names, weight, bias, head.mix, key)


def _store(path: Path, weight: Floats, bias: Floats) -> None:
    try:
        write_with(path, lambda handle: np.savez(handle, weight=weight, bias=bias))
    except OSError as exc:  # a read-only data directory only costs a refit next start
        log.warning("cannot cache the corpus class in %s: %s", path.parent, exc)
