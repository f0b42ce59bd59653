"""Research harness: the second stage and the coverage gate on words instead of word pieces.

Run: ``.venv/bin/python -m benchmarks.quality.word_tokens_trial --variant word|nopunct|both|names
[--sets core,healthcare,snips7] [--splits 5]`` (about 1 min a variant on those three sets; the
``splits_trial`` options apply, fused rule, untuned model, ONNX backend).

The fused rule's token vectors are the model's word pieces: "hnswlib" is four rows (``h ##ns ##wl
##ib``), a path is a row per piece and per ``/`` and ``.``. A rare word or a path then weighs
several times a common word in the coverage gate (the mean over the message's rows of each one's
best cosine to the capability's example rows) and in the late-interaction score. Variants, applied
to every text's token rows (messages and examples alike) by patching
:meth:`capd.encoder.OnnxEncoder._embed`: ``word`` averages a word's pieces into one row, ``nopunct``
drops rows that are punctuation or symbols only, ``both`` does both, ``names`` leaves out the rows of
a word split into ``NAME_PIECES`` (3) pieces or more (a product or library name the model does not
know, which no capability's examples speak of). Each is measured like
``splits_trial`` (plain ``capd calibrate`` on five splits), which it runs after the patch; compare
with a plain ``splits_trial`` run on the same sets. Results: ``benchmarks/quality/README.md``, *What
failed*.
"""

from __future__ import annotations

import sys
import unicodedata
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from capd import encoder as encoders
from capd.encoder import Embedded, TokenVectors

VARIANTS = ("word", "nopunct", "both", "names")
NAME_PIECES = 3  # names: a word split into this many pieces or more is taken for a name


def _symbol(piece: str) -> bool:
    text = piece.removeprefix("##")
    return bool(text) and all(unicodedata.category(ch)[0] in "PS" for ch in text)


def word_rows(states: np.ndarray, encoding: Any, variant: str) -> np.ndarray | None:
    """One text's token rows under ``variant``; None when nothing is left (the shipped rows are kept)."""
    groups: dict[int, list[int]] = {}
    if variant == "names":
        pieces: dict[int, int] = {}
        for word in encoding.word_ids:
            if word is not None:
                pieces[word] = pieces.get(word, 0) + 1
    for j, (word, real) in enumerate(zip(encoding.word_ids, encoding.attention_mask, strict=True)):
        if not real or word is None:
            continue  # padding and [CLS] / [SEP] (no word)
        if variant == "names":
            if pieces[word] < NAME_PIECES:  # a name's pieces are left out; every other piece is a row
                groups[j] = [j]
            continue
        if variant != "word" and _symbol(encoding.tokens[j]):
            continue  # with nopunct / both, symbols
        groups.setdefault(word if variant != "nopunct" else j, []).append(j)
    if not groups:
        return None
    return encoders.l2_normalize(np.stack([np.asarray(states[g], dtype=np.float32).mean(axis=0)
                                           for g in groups.values()]))


def patched_embed(variant: str) -> Any:
    """:meth:`OnnxEncoder._embed` with the token rows of ``variant`` (sentence vectors unchanged): the
    model runs once per batch, as shipped, and the rows are built from its hidden states."""
    def _embed(self: encoders.OnnxEncoder, texts: Sequence[str], tokens: bool) -> Embedded:
        if not tokens:
            return shipped_embed(self, texts, tokens)
        items = [self._prefix + t for t in texts]
        vectors = np.empty((len(items), self._dim), dtype=np.float32)
        rows: TokenVectors = []
        for start in range(0, len(items), self._batch):
            chunk = items[start:start + self._batch]
            hidden, mask = self._run(chunk)
            vectors[start:start + len(chunk)] = encoders.pool(hidden, mask, self._pooling)
            for k, (encoding, shipped) in enumerate(zip(self._tokenizer.encode_batch(chunk),
                                                        encoders.token_rows(hidden, mask), strict=True)):
                words = word_rows(hidden[k], encoding, variant)
                rows.append(shipped if words is None else words)
        return (encoders.l2_normalize(vectors) if self._normalize and len(items) else vectors), rows

    return _embed


shipped_embed = encoders.OnnxEncoder._embed


@contextmanager
def word_rows_in_force(variant: str) -> Iterator[None]:
    """Every text's token rows under ``variant`` within the block."""
    encoders.OnnxEncoder._embed = patched_embed(variant)  # type: ignore[method-assign]
    try:
        yield
    finally:
        encoders.OnnxEncoder._embed = shipped_embed  # type: ignore[method-assign]


def main(argv: list[str]) -> dict[str, Any]:
    from benchmarks.quality import splits_trial

    return splits_trial.patched_main(argv, __doc__ or "", "word_tokens_trial", VARIANTS, word_rows_in_force)


if __name__ == "__main__":
    main(sys.argv[1:])
