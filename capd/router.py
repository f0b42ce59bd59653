"""Routing decisions: score a message against every capability, then gate.

Three rules, selectable by name (``Settings.rule`` / ``--rule``):

``anchor``
    Octomind's rule, reproduced exactly so capd can always be compared with it:
    score = mean of the top-k trigger cosines; only capabilities *not* active in the
    session are candidates (so an active winner lets a runner-up switch on); activate iff
    ``top1 >= threshold`` and ``top1 - top2 >= margin`` (top2 = 0 with one candidate).
``capd``
    Every capability is scored; when the winner is already active and clears the threshold,
    nothing changes (``already_active``: no margin is asked of it, so a near runner-up does not
    switch on beside it); otherwise the same gates decide (a message unlike the active winner's
    triggers abstains rather than keep it in use). Learned corrections
    (:mod:`capd.learned`) count as extra triggers, and learned abstains veto (:class:`Vetoes`).
``fused``
    :mod:`capd.fused`: ranks on a light head + soft nearest examples + BM25 over the
    triggers, description, name and learned corrections; ``score`` is the winner's
    mean-top-3 cosine minus its capabilities' in-class similarity (``level``), ``margin``
    the log-odds gap to the runner-up, and ``coverage`` how much of the message the winner's
    examples speak of (a third gate, 0 = off). Sessions and learned corrections behave as with ``capd``
    (an active winner must clear the threshold and the coverage gate to be ``already_active``).

Gates (threshold, margin, coverage) and which are in force for each tap: :mod:`capd.gates`.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal

import numpy as np

from capd import fused
from capd.batching import aembed, aembed_tokens
from capd.catalog import Capability, Catalog
from capd.encoder import Encoder, TokenVectors
from capd.errors import UnknownCapability
from capd.gates import GateBook, Gates, gate, not_a_number, shown
from capd.index import TriggerIndex
from capd.text import clean_message, recall_key, routed_key
from capd.vetoes import VETO_TIE, Refusal, Vetoes

log = logging.getLogger(__name__)

DecisionKind = Literal["activate", "abstain", "already_active", "skipped"]
RULE_NAMES = ("capd", "anchor", "fused")
DISCOVER_LIMIT = 5


@dataclass(frozen=True)
class Decision:
    decision: DecisionKind
    reason: str
    capability: str | None = None
    score: float | None = None
    margin: float | None = None
    candidates: tuple[tuple[str, float], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: a score or margin that is not a finite number (a damaged model) reads as
        null, and a candidate without a finite score is left out."""
        return {
            "decision": self.decision,
            "capability": self.capability,
            "score": _rounded(self.score),
            "margin": _rounded(self.margin),
            "reason": self.reason,
            "candidates": [{"name": n, "score": round(s, 4)} for n, s in self.candidates if math.isfinite(s)],
        }


def _rounded(value: float | None) -> float | None:
    return round(value, 4) if value is not None and math.isfinite(value) else None


def example_texts(capability: Capability, rule: str, learned: Sequence[str] = (),
                  tap_examples: Sequence[str] = ()) -> tuple[str, ...]:
    """What a capability is routed on under ``rule``: its triggers, and (not for ``anchor``)
    its tap's examples (``examples.jsonl``) and learned corrections; ``fused`` adds its description
    and its name. No triggers: nothing (a capability without triggers is never auto-routed)."""
    if not capability.triggers:
        return ()
    texts = list(capability.triggers)
    if rule == "fused":
        description = capability.description or (capability.provider.description if capability.provider else None)
        texts += [description or "", capability.name.replace("-", " ").replace("_", " ")]
    if rule != "anchor":
        texts += [*tap_examples, *learned]
    return tuple(dict.fromkeys(t.strip() for t in texts if t.strip()))


def example_catalog(catalog: Catalog, rule: str, learned: Mapping[str, Sequence[str]] | None = None) -> Catalog:
    """The catalog the index is built from: each capability's triggers replaced by its examples."""
    capabilities: dict[str, Capability] = {}
    for capability in catalog:
        texts = example_texts(capability, rule, (learned or {}).get(capability.name, ()),
                              catalog.examples_of(capability))
        if texts == capability.triggers:
            capabilities[capability.name] = capability
            continue
        digest = hashlib.sha256(capability.fingerprint.encode())
        for text in texts:
            digest.update(b"\0" + text.encode())
        capabilities[capability.name] = replace(capability, triggers=texts, fingerprint=digest.hexdigest())
    return replace(catalog, capabilities=MappingProxyType(capabilities))


class Router:
    """Turns a message into a :class:`Decision` for one catalog snapshot.

    ``index`` holds the rule's examples (:func:`example_catalog`); ``head`` is required
    for the ``fused`` rule and built from that index (:meth:`capd.service.Service.reload`);
    ``vetoes`` are learned abstains and the abstain corpus (ignored by ``anchor``).
    """

    def __init__(self, encoder: Encoder, index: TriggerIndex, catalog: Catalog, gates: GateBook,
                 rule: str = "capd", min_chars: int = 8, head: fused.FusedHead | None = None,
                 vetoes: Vetoes | None = None, recalled: Mapping[str, str] | None = None) -> None:
        if rule not in RULE_NAMES:
            raise ValueError(f"unknown rule {rule!r}; choose one of {', '.join(RULE_NAMES)}")
        if rule == "fused" and head is None:
            raise ValueError("the fused rule needs a fused head")
        self.encoder = encoder
        self.index = index
        self.catalog = catalog
        self.gates = gates
        self.rule = rule
        self.min_chars = min_chars
        self.head = head
        self.vetoes = vetoes if vetoes is not None and rule != "anchor" else Vetoes()
        # A message an agent corrected, seen again: the capability it enabled (LearnedStore.recalls)
        self.recalled: Mapping[str, str] = recalled if recalled is not None and rule != "anchor" else {}
        # (gates.offsets, head.names, their vector): built once per router, not per route
        self._offset_vector: tuple[Mapping[str, float], tuple[str, ...], np.ndarray | None] | None = None

    @property
    def top_k(self) -> int:
        return self.gates.default.top_k

    def _gates_for(self, name: str) -> Gates:
        capability = self.catalog.get(name)
        return self.gates.for_tap(capability.tap if capability else None)

    def fused_scores(self, vectors: np.ndarray, texts: Sequence[str],
                     tokens: TokenVectors | None = None) -> tuple[tuple[str, ...], fused.Scores]:
        """The fused rule's scores for many messages; columns follow the returned names.
        ``tokens`` (the messages' token vectors) turn on the second stage."""
        assert self.head is not None
        names, knn = self.index.named_scores(vectors, fused.TOP_K)
        if names != self.head.names:  # the index moved on under a router about to be replaced
            position = {n: i for i, n in enumerate(names)}
            aligned = np.full((knn.shape[0], len(self.head.names)), -1.0, dtype=np.float32)
            for column, name in enumerate(self.head.names):
                if name in position:
                    aligned[:, column] = knn[:, position[name]]
            knn = aligned
        vectors = np.asarray(vectors, dtype=np.float32).reshape(-1, self.index.dim)
        return self.head.names, self.head.score(knn, vectors, texts, tokens, self._offsets())

    def _offsets(self) -> np.ndarray | None:
        """The taps' per-capability offsets ([gates.fused.offsets]) in the head's column order, or
        None; rebuilt only when the gates or the head change (a copy by :meth:`with_offsets`)."""
        assert self.head is not None
        offsets, names, cached = self.gates.offsets, self.head.names, self._offset_vector
        if cached is None or cached[0] is not offsets or cached[1] is not names:
            vector = np.array([offsets.get(n, 0.0) for n in names], dtype=np.float32) if offsets else None
            cached = self._offset_vector = (offsets, names, vector)
        return cached[2]

    def refusals(self, vectors: np.ndarray, winners: Sequence[str],
                 own: Sequence[str] | None = None, knn: np.ndarray | None = None) -> list[Refusal | None]:
        """Per message: the :class:`Refusal` that vetoes its winner (:class:`Vetoes`), else None.
        ``own`` (the messages' texts) leaves out a tap's veto equal to the message itself: ``capd
        calibrate`` scores the fixtures' null rows that become the tap's vetoes, and a row must not
        be turned away by its own copy (learned abstains and the corpus are not fixtures: they stay).
        ``knn``: the messages' mean-top-k example cosines in the head's column order when the caller
        has them (:class:`capd.fused.Scores`), so that the corpus class does not score them again."""
        out: list[Refusal | None] = [None] * len(winners)
        queries = np.asarray(vectors, dtype=np.float32).reshape(-1, self.index.dim)
        # copies that differ in tags, case or spacing count as one message (as in capd.calibrate.split)
        own_keys = None if own is None else [routed_key(m) for m in own]
        key_of: dict[str, str] = {}  # veto text -> its key, computed once per call

        def key(text: str) -> str:
            if text not in key_of:
                key_of[text] = routed_key(text)
            return key_of[text]

        for row, name in enumerate(winners):
            capability = self.catalog.get(name)
            tap = capability.tap if capability is not None else None
            own_row = None if own_keys is None else (lambda text, mine=own_keys[row]: key(text) == mine)
            corpus = self._gates_for(name).abstain_corpus
            nearest = self.vetoes.nearest(name, corpus, tap, queries[row], own_row)
            if nearest is not None:
                similarity, message, source = nearest
                try:  # only the winner's own examples are compared, not the whole index
                    example = next((c for _, c in self.index.top_triggers(queries[row], name, 1)), -1.0)
                except UnknownCapability:  # the index moved on under a router about to be replaced
                    example = -1.0
                if similarity > example + VETO_TIE:
                    out[row] = Refusal(message, similarity, example, source)
            if out[row] is None and corpus:
                out[row] = self._outscored_by_corpus(queries[row], name, None if knn is None else knn[row])
        return out

    def _outscored_by_corpus(self, query: np.ndarray, name: str, knn: np.ndarray | None = None) -> Refusal | None:
        """The refusal when the abstain corpus, as a class of the fused ranking, outscores ``name``
        (:mod:`capd.corpus_class`); None without that class or when ``name`` stays ahead. ``knn``:
        the query's mean-top-k example cosines in the class's column order, if already scored."""
        klass, corpus = self.vetoes.corpus_class, self.vetoes.corpus_vectors
        if klass is None or corpus is None or name not in klass.names:
            return None
        if knn is None:
            names, scored = self.index.named_scores(query[None, :], fused.TOP_K)
            knn = scored[0]
        else:
            names = self.index.names
        if names != klass.names:  # the index moved on under a router about to be replaced
            return None
        sims = corpus @ query
        scores = klass.scores(query, knn, sims)
        mine = float(scores[names.index(name)])
        if not float(scores[-1]) > mine:
            return None
        return Refusal(self.vetoes.corpus[int(sims.argmax())], float(scores[-1]), mine, "corpus class")

    def with_abstain_corpus(self, on: bool) -> Router:
        """This router with the abstain corpus on (or off) for every tap (``capd calibrate``
        tries both); the corpus is embedded here if no tap used it yet, and for ``fused`` fitted as a
        class of the ranking (:mod:`capd.corpus_class`; not cached: calibration's routers are its own)."""
        router = copy.copy(self)
        router.gates = self.gates.with_abstain_corpus(on and self.rule != "anchor")
        if on and self.rule != "anchor":
            router.vetoes = self.vetoes.with_corpus(self.encoder.embed)
            examples = self.index.examples()
            if self.head is not None and examples[0] == self.head.names:  # (not when the index moved on under it)
                router.vetoes = router.vetoes.with_corpus_class(self.head, examples)
        return router

    def with_offsets(self, offsets: Mapping[str, float]) -> Router:
        """This router with ``offsets`` (capability name -> added to its fused score) in place of
        the taps' (``capd calibrate`` scores without them to fit new ones)."""
        router = copy.copy(self)
        router.gates = self.gates.with_offsets(offsets)
        return router

    def with_tap_vetoes(self, messages: Sequence[str]) -> Router:
        """This router with ``messages`` added to every tap's vetoes (``capd calibrate`` fits the
        gates with the fixtures' null rows in force, as ``--write`` will leave them)."""
        router = copy.copy(self)
        if self.rule != "anchor" and messages:
            own = {tap: texts for tap, (texts, _) in self.vetoes.taps.items()}  # vetoes.jsonl's, kept
            every = {tap: (*own.get(tap, ()), *messages) for tap in self.catalog.taps}
            router.vetoes = self.vetoes.with_taps(every, self.encoder.embed)  # de-duplicates, as for the files
        return router

    def _vetoed(self, vector: np.ndarray, name: str, score: float, margin: float,
                candidates: tuple[tuple[str, float], ...], knn: np.ndarray | None = None) -> Decision | None:
        """The abstain a veto turns an activation of ``name`` into, if any (``knn``: :meth:`refusals`)."""
        refusal = self.refusals(vector[None, :], [name], knn=knn)[0]
        if refusal is None:
            return None
        if refusal.source == "corpus class":
            return Decision("abstain", f"{name} vetoed: capd's abstain corpus, as a class of the ranking, outscores "
                            f"it ({refusal.similarity:.2f} against {refusal.example:.2f}; its nearest message "
                            f"{refusal.message[:60]!r})", name, score, margin, candidates)
        who = {"learned": "which an agent refused it for", "corpus": "a message of capd's abstain corpus",
               "tap": "one of its tap's vetoes (vetoes.jsonl; unless it is one of them, the cosine shown is the "
                      "second nearest veto's: two must be closer)"}[refusal.source]
        return Decision("abstain", f"{name} vetoed: the message is closer to {refusal.message[:60]!r} "
                        f"({refusal.similarity:.2f}), {who}, than to its nearest example ({refusal.example:.2f})",
                        name, score, margin, candidates)

    def embed(self, text: str) -> tuple[np.ndarray, TokenVectors | None]:
        """One cleaned message's vector and, for ``fused``, its token vectors (one model call)."""
        if self.rule != "fused":
            return self.encoder.embed([text])[0], None
        vectors, tokens = self.encoder.embed_tokens([text])
        return vectors[0], tokens

    async def aembed(self, text: str) -> tuple[np.ndarray, TokenVectors | None]:
        """:meth:`embed` from an event loop (awaits the micro-batcher)."""
        if self.rule != "fused":
            return (await aembed(self.encoder, [text]))[0], None
        vectors, tokens = await aembed_tokens(self.encoder, [text])
        return vectors[0], tokens

    def rank(self, vector: np.ndarray, limit: int, text: str = "",
             tokens: TokenVectors | None = None) -> list[tuple[str, float]]:
        """The best ``limit`` capabilities for one query vector, best first (exact).

        Scores are mean-of-top-k cosines, or for ``fused`` each capability's level, in the
        fused ranking's order.
        """
        limit = min(limit, self.index.capability_count)
        if limit <= 0:
            return []
        if self.rule == "fused":
            names, scores = self.fused_scores(vector[None, :], [text], tokens)
            order = np.argsort(-scores.fused[0], kind="stable")[:limit]
            return [(names[i], float(scores.level[0, i])) for i in order.tolist()]
        return self.index.top_capabilities(vector, self.top_k, limit)

    def route(self, message: str, active: Collection[str] = ()) -> Decision:
        text, long_enough = clean_message(message, self.min_chars)
        if not long_enough:
            return Decision("skipped", f"too short: fewer than {self.min_chars} characters after removing tags")
        vector, tokens = self.embed(text)
        return self.decide(vector, active, text, tokens)

    def decide(self, vector: np.ndarray, active: Collection[str] = (), text: str = "",
               tokens: TokenVectors | None = None) -> Decision:
        """The decision for one message's vector; ``text`` (the cleaned message) feeds ``fused``'s
        BM25 and ``tokens`` (its token vectors, ``[message]``) its second stage."""
        if self.rule == "fused":
            return self._decide_fused(vector, set(active), text, tokens)
        active_set = set(active)
        extra = len(active_set) if self.rule == "anchor" else 0
        ranked = self.rank(vector, max(DISCOVER_LIMIT, 2) + extra)
        candidates = tuple(ranked[:DISCOVER_LIMIT])
        if not ranked:
            return Decision("abstain", "no capability to route to", candidates=candidates)
        if self.rule == "anchor":
            ranked = [(n, s) for n, s in ranked if n not in active_set]
            if not ranked:
                return Decision("abstain", "every capability is already active", candidates=candidates)
        recalled = self._recall(text, active_set, candidates)
        if recalled is not None:
            return recalled
        name, score = ranked[0]
        gates = self._gates_for(name)
        fire, margin, reason = gate(ranked, gates)
        if self.rule == "capd" and name in active_set and score >= gates.threshold:  # margin aside: see the docstring
            return Decision("already_active", f"{name} is already active", name, score, margin, candidates)
        if not fire:
            return Decision("abstain", reason, name, score, margin, candidates)
        return self._vetoed(vector, name, score, margin, candidates) or Decision(
            "activate", reason, name, score, margin, candidates)

    def _recall(self, text: str, active: Collection[str],
                candidates: tuple[tuple[str, float], ...]) -> Decision | None:
        """The capability an agent enabled for this very message when routing got it wrong
        (:meth:`capd.learned.LearnedStore.recalls`), whatever the scores say: a learned trigger is
        one example among the capability's others, and a message corrected once could still lose
        to them (5 corrected messages of taps/core repeated word for word: 3 routed elsewhere
        under ``capd``, 2 under ``fused``). Its score is the rule's, None when the capability ranks
        below the candidates."""
        name = self.recalled.get(recall_key(text)) if self.recalled and text else None
        if name is None or name not in self.catalog:
            return None
        score = dict(candidates).get(name)
        if name in active:
            return Decision("already_active", f"{name} is already active", name, score, None, candidates)
        return Decision("activate", f"{name}: an agent enabled it for this very message before (learned)",
                        name, score, None, candidates)

    def _decide_fused(self, vector: np.ndarray, active: set[str], text: str,
                      tokens: TokenVectors | None) -> Decision:
        if self.index.capability_count == 0:
            return Decision("abstain", "no capability to route to")
        names, scores = self.fused_scores(vector[None, :], [text], tokens)
        order = np.argsort(-scores.fused[0], kind="stable")[:DISCOVER_LIMIT]
        candidates = tuple((names[i], float(scores.level[0, i])) for i in order.tolist())
        recalled = self._recall(text, active, candidates)
        if recalled is not None:
            return recalled
        name = names[int(scores.winner[0])]
        level, gap = float(scores.winner_level[0]), float(scores.gap[0])
        coverage = float(scores.winner_coverage[0])
        gates = self._gates_for(name)
        if name in active and level >= gates.threshold and gates.covers(coverage):  # margin aside, as with capd
            return Decision("already_active", f"{name} is already active", name, level, gap, candidates)
        alone = len(names) == 1 and gap == math.inf  # no runner-up: the gap is infinite, and clears any margin
        if not (math.isfinite(level) and (math.isfinite(gap) or alone)):  # NaN clears nothing ("not >=" below)
            return Decision("abstain", not_a_number(name, level, gap), name, level, gap, candidates)
        if not level >= gates.threshold:
            value, limit = shown(level, gates.threshold)
            return Decision("abstain", f"{name} level {value} below threshold {limit}", name, level, gap, candidates)
        if not gap >= gates.margin:
            runner = candidates[1][0] if len(candidates) > 1 else "-"
            value, limit = shown(gap, gates.margin)
            return Decision("abstain", f"margin {value} between {name} and {runner} below {limit}",
                            name, level, gap, candidates)
        if not gates.covers(coverage):
            value, limit = shown(coverage, gates.coverage)
            return Decision("abstain", f"{name}'s examples cover the message's words {value}, below coverage "
                            f"{limit}: much of what it says is unlike anything they say", name, level, gap, candidates)
        covered = f", coverage {coverage:.2f} clears {gates.coverage:.2f}" if gates.coverage > 0 else ""
        return self._vetoed(vector, name, level, gap, candidates, scores.knn) or Decision(
            "activate", f"{name} level {level:.2f} clears threshold {gates.threshold:.2f} and margin "
            f"{gates.margin:.2f} (margin {gap:.2f}){covered}", name, level, gap, candidates)

    def discover(self, intent: str, limit: int = DISCOVER_LIMIT) -> list[tuple[str, float]]:
        """Top ``limit`` capabilities for an intent, no gates (tags stripped, no length gate; an
        intent of only whitespace is empty)."""
        text, _ = clean_message(intent, 0)
        if not text.strip():
            return []
        vector, tokens = self.embed(text)
        return self.rank(vector, limit, text, tokens)

    def explain(self, message: str, limit: int = DISCOVER_LIMIT) -> list[dict[str, Any]]:
        """Per capability (best first): its score, the top-k examples with their cosines, and (fused) the
        words BM25 matched and the offset its tap adds to the score it is ranked by, if any."""
        text, _ = clean_message(message, 0)
        if not text.strip():
            return []
        vector, tokens = self.embed(text)
        out = []
        for name, score in self.rank(vector, limit, text, tokens):
            entry: dict[str, Any] = {"name": name, "score": round(score, 4), "triggers": [
                {"text": t, "cosine": round(c, 4)} for t, c in self.index.top_triggers(vector, name, self.top_k)]}
            if self.head is not None and name in self.head.names:
                entry["words"] = self.head.lexicon.matches(text, self.head.names.index(name))
            if name in self.gates.offsets:  # fused: its tap's [gates.fused.offsets], part of the score
                entry["offset"] = self.gates.offsets[name]
            out.append(entry)
        return out
