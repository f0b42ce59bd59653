"""A line of the abstain corpus as a veto under the fused rule: nearer the message than the
winner's nearest example, and covering as much of the message's words as the winner's examples do
(capd/vetoes.py, ``Vetoes.covering_line``); the rule itself, and what it changes on the shipped tap
with the real model."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

import capd.vetoes
from capd.encoder import Embedded
from capd.service import Service
from capd.vetoes import Vetoes


def _unit(rows: Sequence[Sequence[float]]) -> np.ndarray:
    array = np.asarray(rows, dtype=np.float32)
    return np.asarray(array / np.linalg.norm(array, axis=1, keepdims=True), dtype=np.float32)


class LineTokens:
    """The corpus lines' token vectors, by line, counting the lines embedded."""

    def __init__(self, tokens: dict[str, np.ndarray]) -> None:
        self.tokens = tokens
        self.embedded: list[str] = []

    def __call__(self, texts: Sequence[str]) -> Embedded:
        self.embedded += texts
        return _unit([[1.0, 0.0, 0.0]] * len(texts)), [self.tokens[t] for t in texts]


def _vetoes() -> tuple[Vetoes, LineTokens]:
    """Three lines: "near" and "also near" both nearer the query than 0.5, "far" not. "near" shares
    no word with the message, "also near" all of them."""
    words = _unit([[1, 0, 0, 0], [0, 1, 0, 0]])
    other = _unit([[0, 0, 1, 0], [0, 0, 0, 1]])
    tokens = LineTokens({"near": other, "also near": words, "far": words})
    vectors = _unit([[0.9, 0.1, 0, 0], [0.7, 0.3, 0, 0], [0.1, 0.9, 0, 0]])
    corpus = Vetoes(corpus=("near", "also near", "far"), corpus_vectors=vectors, corpus_tokens_of=tokens)
    return corpus, tokens


def test_a_line_vetoes_only_a_message_it_covers_as_much_of_as_the_winners_examples() -> None:
    """The nearest line that covers the message as much as the winner's examples vetoes it; a
    line that is near but speaks of other words does not; a line farther than the winner's
    nearest example is neither considered nor embedded, and a line is embedded once."""
    vetoes, tokens = _vetoes()
    query = _unit([[1, 0, 0, 0]])[0]
    message = _unit([[1, 0, 0, 0], [0, 1, 0, 0]])  # its two words, as token vectors
    found = vetoes.covering_line(query, message, above=0.5, coverage=0.6)
    assert found is not None
    similarity, line, covered = found
    assert line == "also near" and covered == pytest.approx(1.0) and similarity == pytest.approx(0.919, abs=1e-3)
    assert sorted(tokens.embedded) == ["also near", "near"]  # "far" (0.11) is not nearer than 0.5
    assert vetoes.covering_line(query, message, above=0.5, coverage=1.01) is None  # none covers that much
    assert sorted(tokens.embedded) == ["also near", "near"]  # embedded once
    assert vetoes.covering_line(query, message, above=0.999, coverage=0.0) is None  # no line is nearer


def test_the_rule_applies_where_the_corpus_has_token_vectors_and_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the fused rule gives the corpus its lines' token vectors (``with_corpus(…, embed_tokens)``);
    ``CORPUS_VETO_COVERS`` off (the research harness's ``off``) leaves the cosine to decide alone."""
    vetoes, _ = _vetoes()
    assert vetoes.covers()
    assert not Vetoes(corpus=vetoes.corpus, corpus_vectors=vetoes.corpus_vectors).covers()
    monkeypatch.setattr(capd.vetoes, "CORPUS_VETO_COVERS", False)
    assert not vetoes.covers()


def test_requests_naming_a_file_or_a_test_are_not_turned_away_by_a_pasted_log(fused_core: Service,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Real model, the shipped tap and gates: each request came nearer a pasted log of the corpus
    (a traceback naming main.py; "FAILED tests/test_api.py::test_login") than to its capability's
    examples, and was vetoed; the log covers little of what it asks, so now it activates. A pasted
    log is still turned away, and so is feedback that a corpus line covers."""
    requests = (("what's in src/capd/router.py", "filesystem-read"),
                ("create an issue for the flaky login test", "issue-tracking"))
    for message, capability in requests:
        decision = fused_core.router.route(message)
        assert decision.decision == "activate" and decision.capability == capability, decision
    pasted = fused_core.router.route('Traceback (most recent call last): File "app.py", line 3, in <module> '
                                     "KeyError: 'x'")
    assert pasted.decision == "abstain" and "abstain corpus" in pasted.reason, pasted
    feedback = fused_core.router.route("still getting the exact same error")
    assert feedback.decision == "abstain" and "covers as much of its words" in feedback.reason, feedback
    monkeypatch.setattr(capd.vetoes, "CORPUS_VETO_COVERS", False)  # the veto as it was
    for message, capability in requests:
        decision = fused_core.router.route(message)
        assert decision.decision == "abstain" and decision.capability == capability, decision
        assert "a message of capd's abstain corpus" in decision.reason
