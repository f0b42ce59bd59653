"""Lexical evidence for the ``fused`` rule: BM25 over each capability's words.

Embeddings blur names and products ("postgres" and "mysql" sit close); words keep them. One
document per capability (its triggers, description, name and learned corrections), scored with
BM25 (k1 = 1.2, b = 0.75) over :func:`words`: lower-case content words of any script, without
stop words and one-character words, with a light suffix strip.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

BM25_K1, BM25_B = 1.2, 0.75

# Words: letters and digits of any script (ASCII: [a-z0-9] after lower()). A command-line flag
# (`-la`, `--force`: dashes starting a word, then a letter) is one word with its dashes, so
# that "la la la" does not match `ls -la` (nor a message with "force" a trigger with `--force`).
_WORD = re.compile(r"(?<![^\s(\[{'\"`])-{1,2}[^\W\d_][^\W_]*|[^\W_]+")
_STOP_WORDS = """
a an the to of and or in on at for with by from is are was were be been am i me my we our you your it its this
that these those do does did can could would will should please pls hey hi what whats how when where which who why
there here just some any so if then than as about up out into over under not no yes get got have has had let lets
want need like tell show give make go know
"""
_STOP = frozenset(_STOP_WORDS.split())


def words(text: str) -> list[str]:
    """Lower-case content words with a light suffix strip (``running`` and ``runs`` → ``runn``/``run``);
    a command-line flag keeps its dashes (``-la``)."""
    out = []
    for word in _WORD.findall(text.lower()):
        if len(word) < 2 or word in _STOP:
            continue
        for suffix in ("ing", "ed", "es", "s"):
            if len(word) > len(suffix) + 2 and word.endswith(suffix):
                word = word[: -len(suffix)]
                break
        out.append(word)
    return out


class Lexicon:
    """BM25 with one document per capability, stored as word → (capabilities, weights)."""

    def __init__(self, documents: Sequence[Sequence[str]]) -> None:
        self.size = len(documents)
        tokenised = [[w for text in doc for w in words(text)] for doc in documents]
        average = max(float(np.mean([len(t) for t in tokenised])) if tokenised else 1.0, 1.0)
        frequency: Counter[str] = Counter(w for t in tokenised for w in set(t))
        postings: dict[str, tuple[list[int], list[float]]] = {}
        for column, tokens in enumerate(tokenised):
            norm = BM25_K1 * (1 - BM25_B + BM25_B * len(tokens) / average)
            for word, count in Counter(tokens).items():
                df = frequency[word]
                idf = math.log(1 + (self.size - df + 0.5) / (df + 0.5))
                entry = postings.setdefault(word, ([], []))
                entry[0].append(column)
                entry[1].append(idf * count * (BM25_K1 + 1) / (count + norm))
        self._postings = {w: (np.array(c, dtype=np.int64), np.array(v, dtype=np.float32))
                          for w, (c, v) in postings.items()}

    def scores(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        out = np.zeros((len(texts), self.size), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in set(words(text)):
                hit = self._postings.get(word)
                if hit is not None:
                    out[row, hit[0]] += hit[1]
        return out

    def matches(self, text: str, column: int) -> list[str]:
        """The message's words that count for one capability (for explanations)."""
        return sorted({w for w in words(text) if (hit := self._postings.get(w)) is not None and column in hit[0]})
