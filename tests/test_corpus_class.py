"""The abstain corpus as a class of the fused ranking (capd/corpus_class.py): its fit, its prior,
its cache, and what it turns away on the shipped tap with the real model."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

import capd.corpus_class
from capd.corpus_class import CorpusClass, class_key, fit_corpus_class
from capd.fused import FusedHead, fit_head
from capd.lexicon import Lexicon
from capd.service import Service

DIM = 8


def _unit(rows: np.ndarray) -> np.ndarray:
    return np.asarray(rows / np.linalg.norm(rows, axis=1, keepdims=True), dtype=np.float32)


def _cluster(rng: np.random.Generator, axis: int, count: int) -> np.ndarray:
    """``count`` unit vectors around the ``axis``-th basis vector."""
    rows = rng.normal(0.0, 0.15, (count, DIM))
    rows[:, axis] += 1.0
    return _unit(rows)


def _tap(rng: np.random.Generator) -> tuple[FusedHead, np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """Three capabilities of 5 examples on axes 0-2, and a corpus of 30 messages on axis 3."""
    vectors = np.vstack([_cluster(rng, axis, 5) for axis in range(3)])
    labels = np.repeat(np.arange(3), 5).astype(np.int64)
    weight, bias = fit_head(vectors, labels, 3)
    names = ("a", "b", "c")
    head = FusedHead(names, np.ones(3, np.float32), weight, bias, Lexicon([[n] for n in names]), key="head-1")
    corpus = _cluster(rng, 3, 30)
    return head, vectors, labels, corpus, [f"corpus line {i}" for i in range(30)]


def _scores(klass: CorpusClass, vectors: np.ndarray, labels: np.ndarray, corpus: np.ndarray,
            query: np.ndarray) -> np.ndarray:
    knn = np.array([np.sort(vectors[labels == c] @ query)[-3:].mean() for c in range(3)], dtype=np.float32)
    return klass.scores(query, knn, corpus @ query)


def test_the_corpus_outscores_a_capability_only_for_messages_like_the_corpus() -> None:
    rng = np.random.default_rng(0)
    head, vectors, labels, corpus, texts = _tap(rng)
    klass = fit_corpus_class(head, vectors, labels, texts, corpus)
    assert klass.names == head.names and klass.weight is not None and klass.weight.shape == (DIM, 4)
    like_b = _unit(np.eye(DIM)[1:2] + 0.05)[0]
    like_the_corpus = _unit(np.eye(DIM)[3:4] + 0.05)[0]
    between = _unit(np.eye(DIM)[2:3] * 0.4 + np.eye(DIM)[3:4])[0]  # nearer the corpus than capability c
    assert int(np.argmax(_scores(klass, vectors, labels, corpus, like_b))) == 1
    assert int(np.argmax(_scores(klass, vectors, labels, corpus, like_the_corpus))) == 3
    scores = _scores(klass, vectors, labels, corpus, between)
    assert scores[3] > scores[2]


def test_the_corpus_class_gets_an_average_capabilitys_prior(monkeypatch: pytest.MonkeyPatch) -> None:
    """The head's bias carries each class's share of its rows: 30 corpus messages against 5
    examples a capability would make the corpus a likelier answer for everything. Balanced, its
    bias is lowered by exactly log(30 / 5) against the same fit without."""
    rng = np.random.default_rng(1)
    head, vectors, labels, corpus, texts = _tap(rng)
    balanced = fit_corpus_class(head, vectors, labels, texts, corpus)
    monkeypatch.setattr(capd.corpus_class, "BALANCED", False)
    unbalanced = fit_corpus_class(head, vectors, labels, texts, corpus)
    assert balanced.key != unbalanced.key  # cached apart
    assert balanced.bias is not None and unbalanced.bias is not None
    assert float(unbalanced.bias[3] - balanced.bias[3]) == pytest.approx(np.log(30 / 5), abs=1e-5)
    np.testing.assert_allclose(balanced.bias[:3], unbalanced.bias[:3])


def test_the_corpus_class_is_cached_by_the_head_and_the_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(2)
    head, vectors, labels, corpus, texts = _tap(rng)
    first = fit_corpus_class(head, vectors, labels, texts, corpus, tmp_path)
    stored = tmp_path / f"{first.key}.corpus.npz"
    assert stored.is_file()

    def no_fit(*args: object, **kwargs: object) -> None:
        raise AssertionError("fitted again")

    monkeypatch.setattr(capd.corpus_class, "fit_head", no_fit)
    again = fit_corpus_class(head, vectors, labels, texts, corpus, tmp_path)  # a restart: loaded
    assert again.weight is not None and first.weight is not None
    np.testing.assert_array_equal(again.weight, first.weight)
    assert class_key(head, texts[:-1]) != first.key  # another corpus, another class
    assert class_key(dataclasses.replace(head, key="head-2"), texts) != first.key  # other examples or model
    monkeypatch.undo()

    stored.write_bytes(b"not a zip file")  # damaged: refitted, with a warning, and stored again
    with caplog.at_level(logging.WARNING, logger="capd.corpus_class"):
        refitted = fit_corpus_class(head, vectors, labels, texts, corpus, tmp_path)
    assert "ignoring unreadable corpus class" in caplog.text
    assert refitted.weight is not None
    np.testing.assert_allclose(refitted.weight, first.weight, atol=1e-6)
    assert np.load(stored)["weight"].shape == (DIM, 4)


def test_without_a_head_the_corpus_class_ranks_on_nearest_examples_alone() -> None:
    """A tap over the head's budget has no head: the class compares soft nearest neighbours only."""
    rng = np.random.default_rng(3)
    head, vectors, labels, corpus, texts = _tap(rng)
    klass = fit_corpus_class(dataclasses.replace(head, weight=None, bias=None), vectors, labels, texts, corpus)
    assert klass.weight is None
    like_the_corpus = _unit(np.eye(DIM)[3:4] + 0.05)[0]
    assert int(np.argmax(_scores(klass, vectors, labels, corpus, like_the_corpus))) == 3


def test_the_corpus_class_turns_away_chat_that_no_corpus_message_is_near(fused_core: Service) -> None:
    """Real model, the shipped tap and gates (the corpus on): "today was a good day" clears the gates
    for `time` and "tell me something interesting about yourself" for `memory`, and each is nearer
    the winner's examples than any corpus message, so the nearest-message veto let them through
    (two of the tap's known leaks); as a class the corpus outscores the winner. A request for the
    time still activates it. ("time flies" still leaks: `time` outscores the class there.)"""
    for chat, winner in (("today was a good day", "time"), ("tell me something interesting about yourself", "memory")):
        decision = fused_core.router.route(chat)
        assert decision.decision == "abstain" and decision.capability == winner, decision
        assert "as a class of the ranking" in decision.reason
        without = copy.copy(fused_core.router)
        without.vetoes = dataclasses.replace(fused_core.router.vetoes, corpus_class=None)
        assert without.route(chat).decision == "activate"  # the leak the class closes
    assert fused_core.router.route("what time is it in Tokyo").decision == "activate"


def test_the_served_corpus_class_is_cached_with_the_head(fused_core: Service) -> None:
    """The daemon's class is stored in the data directory's heads/, so a restart on unchanged taps
    loads it (the load itself: the cache test above)."""
    klass = fused_core.router.vetoes.corpus_class
    assert klass is not None and klass.weight is not None
    assert fused_core.router.head is not None and klass.names == fused_core.router.head.names
    assert (fused_core.settings.data_dir / "heads" / f"{klass.key}.corpus.npz").is_file()
