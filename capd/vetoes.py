"""Vetoes: messages that turn a winning capability away after it cleared the gates.

Three sources, one rule (:class:`Vetoes`): the messages an agent refused a capability for (learned
abstains, :mod:`capd.learned`), a tap's ``vetoes.jsonl`` (``capd calibrate --write`` writes its
fixtures' null rows there), and the shipped abstain corpus (:func:`abstain_corpus`) for taps whose
gates turn it on. A winner is vetoed when the message is nearer one of them than to the winner's
nearest example (a tap's need two: ``TAP_VETO_VOTES``). The router asks :meth:`Vetoes.nearest`
for the evidence and compares it with its index (:meth:`capd.router.Router.refusals`). Under the
fused rule the corpus has a second way in: as a class of the ranking that outscores the winner
(:mod:`capd.corpus_class`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Literal

import numpy as np

from capd.corpus_class import CorpusClass, class_key, fit_corpus_class
from capd.fused import FusedHead, Stop
from capd.text import routed_key, strip_tags

# How much closer to a refused message than to the capability's nearest example a message must be
# to be vetoed. The two cosines come from different arithmetic (the vetoes' matrix, the index's own
# rows): a message equal to both a refused message and a trigger scored 1.0 against 0.99999994, and
# a last-bit difference vetoed it. Float32 cosines are good to about 1e-7.
VETO_TIE = 1e-5
# A tap's vetoes (vetoes.jsonl) turn any of its capabilities away, so one stray line near a busy
# capability would swallow its requests: the *second* nearest of them must be nearer the message
# than the winner's nearest example (a message that is one of them is vetoed outright). Measured
# with `python -m benchmarks.quality.null_veto_trial --ks 1,2,3 --core-cal` (benchmarks/quality/README.md,
# *The tap's vetoes*): with the nearest one alone, taps/core calibrated on its calibration set at its
# floors' limits let 6 of its 91 fixture nulls through instead of 3; with two, 3, and hwu64 gains more.
TAP_VETO_VOTES = 2
# The abstain corpus's vote count, the same rule: its nearest message alone. Two were measured
# (`python -m benchmarks.quality.corpus_trial --corpus-votes 2`; benchmarks/quality/README.md, *A larger
# abstain corpus*): with the shipped corpus taps/core met issue 6's goal on 0 of 20 splits instead of 7.
CORPUS_VETO_VOTES = 1


VetoSource = Literal["learned", "corpus", "corpus class", "tap"]


def veto_text(message: str) -> str:
    """What a tap's veto is embedded as: the text a message equal to it routes on."""
    return strip_tags(message)


def distinct_vetoes(messages: Sequence[str]) -> tuple[str, ...]:
    """``messages`` once per routed text (case and spacing aside, :func:`~capd.text.recall_key`),
    the first spelling kept, without those that leave nothing to route on."""
    seen: dict[str, str] = {}
    for message in messages:
        key = routed_key(message)
        if key and key not in seen:
            seen[key] = message
    return tuple(seen.values())


@dataclass(frozen=True)
class Vetoes:
    """Abstains that veto a winner: per capability, the messages an agent refused it for
    (learned abstains, :mod:`capd.learned`); per tap, the messages of its ``vetoes.jsonl``, which
    none of its capabilities may take (written by ``capd calibrate --write`` from the fixtures'
    null rows, or by hand); and the shipped abstain corpus (:func:`abstain_corpus`) for the
    capabilities whose tap's gates turn it on.

    A winner that cleared the gates is vetoed when the message is closer to one of them than
    to the capability's nearest example (for a tap's vetoes: when two of them are, or the message
    is one of them; ``TAP_VETO_VOTES``): nearest-neighbour evidence that this message is like
    one that must not take it. No constant to tune, and a message equal to one of the
    capability's own triggers is never vetoed.
    """

    texts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    vectors: Mapping[str, np.ndarray] = field(default_factory=dict)  # name -> unit rows [n, dim], as texts
    corpus: tuple[str, ...] = ()
    corpus_vectors: np.ndarray | None = None  # unit rows [len(corpus), dim]
    taps: Mapping[Path, tuple[tuple[str, ...], np.ndarray]] = field(default_factory=dict)  # tap -> (texts, rows)
    corpus_class: CorpusClass | None = None  # the corpus as a class of the fused ranking (capd/corpus_class.py)

    @classmethod
    def build(cls, refused: Mapping[str, Sequence[str]], vectors_of: Callable[[list[str]], np.ndarray]) -> Vetoes:
        """From capability → refused messages; ``vectors_of`` embeds texts (unit rows)."""
        texts = {name: tuple(messages) for name, messages in refused.items() if messages}
        flat = [t for messages in texts.values() for t in messages]
        if not flat:
            return cls()
        matrix, start, vectors = np.asarray(vectors_of(flat), dtype=np.float32), 0, {}
        for name, messages in texts.items():
            vectors[name] = matrix[start:start + len(messages)]
            start += len(messages)
        return cls(MappingProxyType(texts), MappingProxyType(vectors))

    def with_corpus(self, vectors_of: Callable[[list[str]], np.ndarray]) -> Vetoes:
        """These vetoes plus the abstain corpus (embedded once; kept when already there)."""
        if self.corpus_vectors is not None:
            return self
        corpus = abstain_corpus()
        return replace(self, corpus=corpus, corpus_vectors=np.asarray(vectors_of(list(corpus)), dtype=np.float32))

    def with_corpus_class(self, head: FusedHead, examples: tuple[tuple[str, ...], np.ndarray, np.ndarray],
                          cache_dir: Path | None = None, stop: Stop | None = None) -> Vetoes:
        """These vetoes (with the corpus: :meth:`with_corpus`) plus the corpus as a class of ``head``'s
        ranking, whose examples are ``examples`` (:meth:`capd.index.TriggerIndex.examples`); kept when
        already fitted for that head."""
        if self.corpus_vectors is None:
            raise ValueError("the corpus class needs the corpus: with_corpus() first")
        if self.corpus_class is not None and self.corpus_class.key == class_key(head, self.corpus):
            return self
        names, vectors, labels = examples
        if names != head.names:
            raise ValueError("the examples and the head list the capabilities in different orders")
        fitted = fit_corpus_class(head, vectors, labels, self.corpus, self.corpus_vectors, cache_dir, stop)
        return replace(self, corpus_class=fitted)

    def with_taps(self, messages: Mapping[Path, Sequence[str]],
                  vectors_of: Callable[[list[str]], np.ndarray]) -> Vetoes:
        """These vetoes with each tap's own (``vetoes.jsonl``) replaced by ``messages``; one embedding call.

        A veto stands for the text a message like it routes on (:func:`veto_text`: its tags
        removed), and counts once per such text: copies that differ in case, spacing or tags are
        one message to the model, and two of them would be the two votes ``TAP_VETO_VOTES`` asks
        of different messages. One with nothing left to route on is no veto."""
        kept = {tap: distinct for tap, texts in messages.items() if (distinct := distinct_vetoes(texts))}
        flat = list(dict.fromkeys(t for texts in kept.values() for t in texts))
        if not flat:
            return replace(self, taps=MappingProxyType({}))
        row = {text: i for i, text in enumerate(flat)}
        matrix = np.asarray(vectors_of([veto_text(t) for t in flat]), dtype=np.float32)
        return replace(self, taps=MappingProxyType(
            {tap: (texts, matrix[[row[t] for t in texts]]) for tap, texts in kept.items()}))

    def candidates(self, name: str, corpus: bool, tap: Path | None = None) -> list[tuple[tuple[str, ...], np.ndarray,
                                                                                        VetoSource]]:
        """(messages, their vectors, where they come from) that can veto ``name`` (of ``tap``)."""
        out: list[tuple[tuple[str, ...], np.ndarray, VetoSource]] = []
        if name in self.vectors:
            out.append((self.texts[name], self.vectors[name], "learned"))
        if tap is not None and tap in self.taps:
            out.append((*self.taps[tap], "tap"))
        if corpus and self.corpus_vectors is not None:
            out.append((self.corpus, self.corpus_vectors, "corpus"))
        return out

    def nearest(self, name: str, corpus: bool, tap: Path | None, query: np.ndarray,
                own: Callable[[str], bool] | None = None) -> tuple[float, str, VetoSource] | None:
        """The strongest evidence against ``name`` (of ``tap``) for the unit vector ``query``:
        (cosine, message, source) of the nearest vetoing message over every source that can veto it
        (for a tap's vetoes, the ``TAP_VETO_VOTES``-th nearest unless the message is one of them);
        None when nothing can veto it. ``own(text)`` leaves out a tap's veto that is the message itself."""
        evidence = []
        for texts, matrix, source in self.candidates(name, corpus, tap):
            sims = matrix @ query
            if own is not None and source == "tap":
                sims = np.where([own(t) for t in texts], -np.inf, sims)
            best = int(sims.argmax())
            similarity = float(sims[best])
            votes = {"tap": TAP_VETO_VOTES, "corpus": CORPUS_VETO_VOTES}.get(source, 1)
            if votes > 1 and similarity < 1 - VETO_TIE:  # that many of them must agree
                similarity = float(np.partition(sims, -votes)[-votes]) if len(sims) >= votes else -np.inf
            evidence.append((similarity, texts[best], source))
        return max(evidence) if evidence else None

    def __len__(self) -> int:
        return (sum(len(t) for t in self.texts.values()) + len(self.corpus)
                + sum(len(texts) for texts, _ in self.taps.values()))


ABSTAIN_CORPUS = Path(__file__).with_name("abstain_corpus.txt")


def abstain_corpus() -> tuple[str, ...]:
    """The shipped abstain corpus: chitchat, thanks, vague asks, feedback ("still broken"),
    pasted logs and errors, off-topic requests, in our own words; one message per line."""
    return corpus_messages(ABSTAIN_CORPUS)


def corpus_messages(path: Path) -> tuple[str, ...]:
    """A corpus file's messages: one a line, blank lines and ``#`` comment lines skipped."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return tuple(line.strip() for line in lines if line.strip() and not line.startswith("#"))


@dataclass(frozen=True)
class Refusal:
    """Why a winner is vetoed: the nearest vetoing message, its cosine, the winner's nearest
    example's cosine, and where the message comes from (:class:`Vetoes`). For the ``corpus class``
    (:mod:`capd.corpus_class`): the corpus message nearest the message, and the corpus's and the
    winner's scores in that class's ranking (log-odds, not cosines)."""

    message: str
    similarity: float
    example: float
    source: VetoSource
