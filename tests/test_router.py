"""The anchor's rule and capd's decisions, with the real bundled model on the shipped tap."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from capd.encoder import HashEncoder, Vectors
from capd.gates import GateBook, Gates, build_gatebook, gate
from capd.router import Decision, Router
from capd.service import Service
from capd.settings import Settings
from capd.taps import load_catalog
from tests.conftest import SettingsFactory
from tests.taputil import docker_and_postgres, octomind_tap, write_capability


def test_gate_reasons() -> None:
    gates = Gates(threshold=0.45, margin=0.08)
    assert gate([("docker", 0.41), ("kubernetes", 0.30)], gates) == (False, pytest.approx(0.11),
                                                                      "best 0.41 below threshold 0.45")
    fire, margin, reason = gate([("docker", 0.60), ("kubernetes", 0.58)], gates)
    assert not fire and margin == pytest.approx(0.02)
    assert reason == "margin 0.02 between docker and kubernetes below 0.08"
    close = gate([("git", 0.60), ("gitlab", 0.5212)], gates)[2]  # 0.0788: not "0.08 below 0.08"
    assert close == "margin 0.079 between git and gitlab below 0.080"
    assert gate([("docker", 0.50)], gates)[0]  # a single candidate: top2 = 0
    assert gate([], gates)[0] is False


def test_activate_and_reasons(core_service: Service) -> None:
    decision = core_service.router.route("show me the last five commits on this branch")
    assert decision.decision == "activate" and decision.capability == "git"
    assert decision.score is not None and decision.margin is not None
    assert decision.candidates[0][0] == "git" and len(decision.candidates) == 5
    abstain = core_service.router.route("hello there, how is your week going?")
    assert abstain.decision == "abstain"
    assert abstain.reason.startswith(("best ", "margin "))


def test_short_and_tagged_messages_are_skipped(core_service: Service) -> None:
    router = core_service.router
    assert router.route("ls -la").decision == "skipped"
    tagged = "<system-reminder>\nquery the postgres database for all users\n</system-reminder>\nok go"
    decision = router.route(tagged)
    assert decision.decision == "skipped" and decision.reason.startswith("too short")
    assert router.route("<context>ignore</context> query the users table in postgres").capability == "postgres"


def test_already_active_versus_anchor(core_service: Service) -> None:
    capd = core_service.router
    message = "list the running docker containers and their ports"
    first = capd.route(message)
    assert first.decision == "activate"
    winner = first.capability
    assert winner is not None
    again = capd.route(message, active={winner})
    assert again.decision == "already_active" and again.capability == winner
    anchor = Router(capd.encoder, capd.index, capd.catalog, GateBook(Gates(0.0, 0.0, 3)),
                    rule="anchor", min_chars=8)
    switched = anchor.route(message, active={winner})
    # The anchor only scores inactive capabilities, so a runner-up is activated instead.
    assert switched.decision == "activate" and switched.capability != winner
    every = set(capd.index.names)
    assert anchor.route(message, active=every).decision == "abstain"


@pytest.mark.parametrize("rule", ["capd", "fused"])
def test_an_active_winner_below_the_threshold_abstains(core_service: Service, fused_core: Service,
                                                       rule: str) -> None:
    """A message unlike anything (chitchat) whose best, far below the threshold, was active came back
    ``already_active`` and kept that capability in use; it abstains as it would were none active."""
    router = (core_service if rule == "capd" else fused_core).router
    chitchat = router.route("hello there, how is your week going?")
    assert chitchat.decision == "abstain" and chitchat.capability is not None
    again = router.route("hello there, how is your week going?", active={chitchat.capability})
    assert (again.decision, again.reason) == ("abstain", chitchat.reason)
    clear = router.route("list the running docker containers and their ports")
    assert clear.decision == "activate"
    assert router.route("list the running docker containers and their ports",
                        active={clear.capability}).decision == "already_active"


def test_discover_and_explain(core_service: Service) -> None:
    found = core_service.discover("send a message to the team channel", limit=3)
    assert found[0][0] == "slack" and len(found) == 3
    assert [s for _, s in found] == sorted((s for _, s in found), reverse=True)
    explained = core_service.explain("restart the api container", limit=2)
    assert len(explained) == 2
    top = explained[0]
    cosines = [t["cosine"] for t in top["triggers"]]
    assert len(cosines) == 3 and cosines == sorted(cosines, reverse=True)
    assert top["score"] == pytest.approx(float(np.mean(cosines)), abs=2e-4)  # mean of the top-3


def test_gate_precedence(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tap = octomind_tap(tmp_path)
    (tap / "capd.toml").write_text('model = "all-minilm-l6-v2"\n[gates]\nthreshold = 0.6\ntop_k = 2\n')
    catalog = load_catalog([tap])
    model = Gates(0.45, 0.08, 3)
    book = build_gatebook(model, catalog, {}, model="all-minilm-l6-v2")
    assert book.for_tap(tap.absolute()) == Gates(0.6, 0.08, 2)
    assert book.default == Gates(0.45, 0.08, 2)  # top_k is one for the catalog
    overridden = build_gatebook(model, catalog, {"threshold": 0.3, "margin": None}, model="all-minilm-l6-v2")
    assert overridden.for_tap(tap.absolute()) == Gates(0.3, 0.08, 2)
    warned: set[tuple[Path, str | None]] = set()
    with caplog.at_level(logging.WARNING, logger="capd.router"):
        for _ in range(3):  # a daemon builds one on every reload: the warning is said once
            other = build_gatebook(model, catalog, {}, model="bge-small-en-v1.5", warned=warned)
    assert other.for_tap(tap.absolute()) == model  # calibrated for another model: ignored
    assert caplog.text.count("calibrated for model all-minilm-l6-v2, not bge-small-en-v1.5") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="capd.router"):  # the file has no [gates.fused]: nothing ignored
        build_gatebook(model, catalog, {}, model="bge-small-en-v1.5", rule="fused")
    assert "calibrated for model" not in caplog.text


def test_coverage_gate_precedence_and_only_for_fused(tmp_path: Path) -> None:
    tap = octomind_tap(tmp_path)
    (tap / "capd.toml").write_text('model = "all-minilm-l6-v2"\n[gates]\nthreshold = 0.6\n'
                                   '[gates.fused]\nthreshold = -0.2\nmargin = 1.0\ncoverage = 0.41\n')
    catalog = load_catalog([tap])
    fused = build_gatebook(Gates(0.01, 0.0, 3, coverage=0.3), catalog, {}, model="all-minilm-l6-v2", rule="fused")
    assert fused.for_tap(tap.absolute()) == Gates(-0.2, 1.0, 3, coverage=0.41)  # the tap over the auto gates
    assert fused.default.coverage == 0.3
    settings = build_gatebook(Gates(0.01, 0.0, 3), catalog, {"coverage": 0.0}, model="all-minilm-l6-v2",
                              rule="fused")
    assert settings.for_tap(tap.absolute()).coverage == 0.0  # CAPD_COVERAGE=0 turns it off everywhere
    cosine = build_gatebook(Gates(0.45, 0.08, 3), catalog, {"coverage": 0.5}, model="all-minilm-l6-v2")
    assert cosine.for_tap(tap.absolute()).coverage == 0.0 and cosine.default.coverage == 0.0  # no such gate
    assert Gates(0, 0, coverage=0.4).covers(float("nan")) and not Gates(0, 0, coverage=0.4).covers(0.39)
    assert Gates(0, 0).covers(0.0)


def test_calibrated_tap_gates_change_routing(tmp_path: Path, model_settings: Settings) -> None:
    tap = octomind_tap(tmp_path)
    message = "run some sql against the postgres database"
    settings = replace(model_settings, taps=(tap,))
    before = Service(settings).start().router.route(message)
    assert before.decision == "activate"
    (tap / "capd.toml").write_text(f"[gates]\nthreshold = {min((before.score or 0) + 0.05, 0.99)}\n")
    after = Service(settings).start().router.route(message)
    assert after.decision == "abstain" and "below threshold" in after.reason


class PoisonEncoder(HashEncoder):
    """The hash fake, giving NaN for every text that says "poison": a damaged model that still runs."""

    def embed(self, texts: Sequence[str]) -> Vectors:
        vectors = super().embed(texts)
        vectors[["poison" in text for text in texts]] = np.nan
        return vectors


def test_nan_clears_no_gate() -> None:
    """``top1 < threshold`` and ``margin < margin`` are False for NaN: the comparisons are now
    ``not value >= gate``, and the reason says why rather than claiming it cleared."""
    gates = Gates(threshold=0.45, margin=0.08)
    nan = float("nan")
    for ranked in ([("alpha", nan), ("beta", nan)], [("alpha", nan), ("beta", 0.1)], [("alpha", 0.9), ("beta", nan)],
                   [("alpha", nan)], [("alpha", float("inf")), ("beta", 0.1)]):
        fire, _, reason = gate(ranked, gates)
        assert not fire and "clears" not in reason and "not a number" in reason, ranked
    permissive = Gates(threshold=float("-inf"), margin=float("-inf"))
    assert not gate([("alpha", nan), ("beta", nan)], permissive)[0]
    decision = Decision("abstain", "x", "alpha", nan, nan, (("alpha", nan), ("beta", 0.25)))
    assert decision.as_dict()["score"] is None and decision.as_dict()["margin"] is None
    assert decision.as_dict()["candidates"] == [{"name": "beta", "score": 0.25}]


@pytest.mark.parametrize("rule", ["capd", "anchor", "fused"])
def test_a_message_the_model_gives_nan_for_never_activates(rule: str, settings_factory: SettingsFactory,
                                                           tmp_path: Path) -> None:
    tap = tmp_path / "tap"
    docker_and_postgres(tap)
    settings = settings_factory(taps=(tap,), rule=rule, threshold=-5.0, margin=-5.0, auto_gates=False)
    with closing(Service(settings, encoder=PoisonEncoder()).start()) as service:
        assert service.router.route("restart a container").decision == "activate"  # the gates let anything through
        poisoned = service.router.route("poison: restart a container")
    assert poisoned.decision == "abstain" and "clears" not in poisoned.reason
    assert "not a number" in poisoned.reason


@pytest.mark.parametrize("rule", ["capd", "anchor", "fused"])
def test_a_tap_without_capabilities_abstains_with_the_reason(settings_factory: SettingsFactory, tmp_path: Path,
                                                             rule: str) -> None:
    """A new tap starts empty. The anchor's rule said "every capability is already active" there."""
    (tmp_path / "empty" / "capabilities").mkdir(parents=True)
    with closing(Service(settings_factory(taps=(tmp_path / "empty",), rule=rule), sessions=True).start()) as service:
        decision = service.route("show me the last five commits", "s1").decision
        assert (decision.decision, decision.reason, decision.candidates) == ("abstain", "no capability to route to", ())
        assert service.discover("commits") == [] and service.explain("show me the last five commits") == []


def test_the_anchors_rule_with_every_capability_active_says_so(settings_factory: SettingsFactory,
                                                               tmp_path: Path) -> None:
    tap = docker_and_postgres(tmp_path / "tap")
    with closing(Service(settings_factory(taps=(tap,), rule="anchor"), sessions=True).start()) as service:
        for name in ("docker", "postgres"):
            service.registry.activate("s1", name)  # type: ignore[union-attr]
        decision = service.route("list the running containers", "s1").decision
        assert (decision.decision, decision.reason) == ("abstain", "every capability is already active")


def test_a_lone_candidate_short_of_the_margin_abstains() -> None:
    """With one candidate the runner-up scores 0, so margin = top1; a top1 that clears a low
    threshold but not a higher margin (calibration picks threshold 0.00 / margin 0.11) raised
    IndexError looking for the runner-up's name."""
    fire, margin, reason = gate([("docker", 0.3)], Gates(threshold=0.0, margin=0.5))
    assert (fire, margin) == (False, pytest.approx(0.3))
    assert reason == "margin 0.30 between docker and no runner-up below 0.50"


@pytest.mark.parametrize(("rule", "active"), [("capd", ()), ("anchor", ()), ("anchor", ("postgres",))])
def test_one_candidate_below_the_margin_abstains_in_a_route(rule: str, active: tuple[str, ...],
                                                            settings_factory: SettingsFactory, tmp_path: Path) -> None:
    """One capability, or (the anchor's rule) every other one active: the lone candidate's margin is its score."""
    tap = tmp_path / "tap"
    write_capability(tap, "docker", ["list running containers", "restart a container"])
    if active:
        write_capability(tap, "postgres", ["run a sql query", "show database tables"])
    settings = settings_factory(taps=(tap,), rule=rule, threshold=0.0, margin=0.9)
    with closing(Service(settings, sessions=True).start()) as service:
        for name in active:
            service.registry.activate("s1", name)  # type: ignore[union-attr]
        decision = service.route("list the running containers please", "s1").decision
    assert (decision.decision, decision.capability) == ("abstain", "docker")
    assert decision.reason.startswith("margin ") and decision.reason.endswith("and no runner-up below 0.90")
