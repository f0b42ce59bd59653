"""Routing decisions: score a message against every capability, then gate.

Two rules, selectable by name (``Settings.rule`` / ``--rule``):

``anchor``
    Octomind's rule, reproduced exactly so capd can always be compared with it:
    score = mean of the top-k trigger cosines; only capabilities *not* active in the
    session are candidates (so an active winner lets a runner-up switch on); activate iff
    ``top1 >= threshold`` and ``top1 - top2 >= margin`` (top2 = 0 with one candidate).
``capd``
    Every capability is scored; when the winner is already active nothing changes
    (``already_active``); otherwise the same gates decide.

Gates (threshold, margin, top_k) come from the model manifest, are overridden per tap by
``<tap>/capd.toml`` (written by ``capd calibrate``; the gates of the winner's tap apply),
and are overridden by settings (``--threshold`` / ``CAPD_THRESHOLD`` …) above both.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import numpy as np

from capd.catalog import Catalog
from capd.encoder import Encoder
from capd.index import TriggerIndex
from capd.text import clean_message

log = logging.getLogger(__name__)

DecisionKind = Literal["activate", "abstain", "already_active", "skipped"]
RULE_NAMES = ("capd", "anchor")
DISCOVER_LIMIT = 5


@dataclass(frozen=True)
class Gates:
    threshold: float
    margin: float
    top_k: int = 3

    def as_dict(self) -> dict[str, float | int]:
        return {"threshold": self.threshold, "margin": self.margin, "top_k": self.top_k}


@dataclass(frozen=True)
class GateBook:
    """The gates in force: a default, and per tap where ``capd.toml`` says otherwise."""

    default: Gates
    by_tap: Mapping[Path, Gates] = field(default_factory=lambda: MappingProxyType({}))

    def for_tap(self, tap: Path | None) -> Gates:
        return self.by_tap.get(tap, self.default) if tap is not None else self.default


def build_gatebook(model_gates: Gates, catalog: Catalog, overrides: Mapping[str, float | int | None],
                   model: str | None = None) -> GateBook:
    """Manifest < tap ``capd.toml`` < settings overrides (``threshold``, ``margin``, ``top_k``).

    A tap's gates calibrated for another model are ignored (each model has its own cosine scale).
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    configs = {t: c for t, c in catalog.tap_configs.items() if model is None or c.model in (None, model)}
    for tap, config in catalog.tap_configs.items():
        if tap not in configs:
            log.warning("%s: gates were calibrated for model %s, not %s; using the model's defaults",
                        config.path, config.model, model)

    def apply(base: Gates, values: Mapping[str, float | int]) -> Gates:
        known = {k: values[k] for k in ("threshold", "margin") if k in values}
        top_k = int(values["top_k"]) if "top_k" in values else base.top_k
        return replace(base, **{k: float(v) for k, v in known.items()}, top_k=top_k)

    # One top_k for the whole catalog (scores must be comparable across taps): settings, else the
    # first tap (in precedence order) whose capd.toml sets it, else the manifest.
    tap_top_k = next((int(c.gates["top_k"]) for t in catalog.taps if (c := configs.get(t))
                      and "top_k" in c.gates), None)
    if tap_top_k is not None and "top_k" not in given:
        given["top_k"] = tap_top_k
    default = apply(model_gates, given)
    by_tap = {tap: apply(apply(model_gates, config.gates), given) for tap, config in configs.items()}
    return GateBook(default=default, by_tap=MappingProxyType(by_tap))


@dataclass(frozen=True)
class Decision:
    decision: DecisionKind
    reason: str
    capability: str | None = None
    score: float | None = None
    margin: float | None = None
    candidates: tuple[tuple[str, float], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "capability": self.capability,
            "score": None if self.score is None else round(self.score, 4),
            "margin": None if self.margin is None else round(self.margin, 4),
            "reason": self.reason,
            "candidates": [{"name": n, "score": round(s, 4)} for n, s in self.candidates],
        }


def gate(ranked: Sequence[tuple[str, float]], gates: Gates) -> tuple[bool, float, str]:
    """Apply threshold and margin to a ranking; returns (fire, margin, reason)."""
    if not ranked:
        return False, 0.0, "no capability to route to"
    name, top1 = ranked[0]
    top2 = ranked[1][1] if len(ranked) > 1 else 0.0
    margin = top1 - top2
    if top1 < gates.threshold:
        return False, margin, f"best {top1:.2f} below threshold {gates.threshold:.2f}"
    if margin < gates.margin:
        runner = ranked[1][0]
        return False, margin, f"margin {margin:.2f} between {name} and {runner} below {gates.margin:.2f}"
    return True, margin, f"{name} {top1:.2f} clears threshold {gates.threshold:.2f} and margin {gates.margin:.2f}"


class Router:
    """Turns a message into a :class:`Decision` for one catalog snapshot."""

    def __init__(self, encoder: Encoder, index: TriggerIndex, catalog: Catalog, gates: GateBook,
                 rule: str = "capd", min_chars: int = 8) -> None:
        if rule not in RULE_NAMES:
            raise ValueError(f"unknown rule {rule!r}; choose one of {', '.join(RULE_NAMES)}")
        self.encoder = encoder
        self.index = index
        self.catalog = catalog
        self.gates = gates
        self.rule = rule
        self.min_chars = min_chars

    @property
    def top_k(self) -> int:
        return self.gates.default.top_k

    def _gates_for(self, name: str) -> Gates:
        capability = self.catalog.get(name)
        return self.gates.for_tap(capability.tap if capability else None)

    def rank(self, vector: np.ndarray, limit: int) -> list[tuple[str, float]]:
        """The best ``limit`` capabilities for one query vector, exact, best first."""
        limit = min(limit, self.index.capability_count)
        if limit <= 0:
            return []
        return self.index.top_capabilities(vector, self.top_k, limit)

    def route(self, message: str, active: Collection[str] = ()) -> Decision:
        text, long_enough = clean_message(message, self.min_chars)
        if not long_enough:
            return Decision("skipped", f"too short: fewer than {self.min_chars} characters after removing tags")
        vector = self.encoder.embed([text])[0]
        return self.decide(vector, active)

    def decide(self, vector: np.ndarray, active: Collection[str] = ()) -> Decision:
        active_set = set(active)
        extra = len(active_set) if self.rule == "anchor" else 0
        ranked = self.rank(vector, max(DISCOVER_LIMIT, 2) + extra)
        candidates = tuple(ranked[:DISCOVER_LIMIT])
        if self.rule == "anchor":
            ranked = [(n, s) for n, s in ranked if n not in active_set]
            if not ranked:
                return Decision("abstain", "every capability is already active", candidates=candidates)
        if not ranked:
            return Decision("abstain", "no capability to route to", candidates=candidates)
        name, score = ranked[0]
        gates = self._gates_for(name)
        fire, margin, reason = gate(ranked, gates)
        if self.rule == "capd" and name in active_set:
            return Decision("already_active", f"{name} is already active", name, score, margin, candidates)
        if not fire:
            return Decision("abstain", reason, name, score, margin, candidates)
        return Decision("activate", reason, name, score, margin, candidates)

    def discover(self, intent: str, limit: int = DISCOVER_LIMIT) -> list[tuple[str, float]]:
        """Top ``limit`` capabilities for an intent, no gates (tags stripped, no length gate)."""
        text, _ = clean_message(intent, 0)
        if not text:
            return []
        return self.rank(self.encoder.embed([text])[0], limit)

    def explain(self, message: str, limit: int = DISCOVER_LIMIT) -> list[dict[str, Any]]:
        """Per capability (best first): its score and the top-k triggers with their cosines."""
        text, _ = clean_message(message, 0)
        if not text:
            return []
        vector = self.encoder.embed([text])[0]
        return [
            {"name": name, "score": round(score, 4),
             "triggers": [{"text": t, "cosine": round(c, 4)} for t, c in self.index.top_triggers(vector, name,
                                                                                                 self.top_k)]}
            for name, score in self.rank(vector, limit)
        ]
