"""Gates: when a ranked winner may fire, and which gates are in force for each tap.

A winner fires when its score reaches ``threshold``, its lead over the runner-up reaches
``margin`` and (rule ``fused``) its coverage reaches ``coverage`` (0 = no coverage gate).
The gates come from the model manifest, are overridden per tap by ``<tap>/capd.toml`` (written
by ``capd calibrate``; the gates of the winner's tap apply) and by settings above both
(:func:`build_gatebook`). ``anchor`` and ``capd`` share one cosine scale and one set of gates
(``[gates]``); ``fused`` has its own (``[gates.fused]``) and always uses k = 3.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from capd import fused
from capd.catalog import Catalog, TapConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gates:
    threshold: float
    margin: float
    top_k: int = 3
    abstain_corpus: bool = False  # veto with the shipped abstain corpus too (:class:`Vetoes`); not for anchor
    coverage: float = 0.0  # fused only: the winner's coverage must reach it (0: no coverage gate)

    def as_dict(self) -> dict[str, float | int | bool]:
        return {"threshold": self.threshold, "margin": self.margin, "top_k": self.top_k,
                "abstain_corpus": self.abstain_corpus, "coverage": self.coverage}

    def covers(self, coverage: float) -> bool:
        return bool(passes_coverage(coverage, self.coverage))


def passes_coverage(coverage: npt.ArrayLike, gate: npt.ArrayLike) -> np.ndarray:
    """The coverage gate, on one value or element-wise (the router and ``capd eval`` / ``calibrate``
    share it): off where the gate is 0, and a message without token vectors (NaN) passes."""
    coverage = np.asarray(coverage, dtype=np.float64)  # float32 statistics compared as the router compares
    with np.errstate(invalid="ignore"):
        return np.asarray((np.asarray(gate) <= 0) | np.isnan(coverage) | (coverage >= gate))


@dataclass(frozen=True)
class GateBook:
    """The gates in force: a default, and per tap where ``capd.toml`` says otherwise."""

    default: Gates
    by_tap: Mapping[Path, Gates] = field(default_factory=lambda: MappingProxyType({}))
    # fused only: capability name -> the offset its tap's [gates.fused.offsets] adds to its score
    offsets: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    def for_tap(self, tap: Path | None) -> Gates:
        return self.by_tap.get(tap, self.default) if tap is not None else self.default

    @property
    def abstain_corpus(self) -> bool:
        """Whether any tap's gates veto with the abstain corpus."""
        return any(g.abstain_corpus for g in (self.default, *self.by_tap.values()))

    def with_abstain_corpus(self, on: bool) -> GateBook:
        """The same gates with the abstain corpus on (or off) for every tap."""
        return GateBook(replace(self.default, abstain_corpus=on),
                        MappingProxyType({t: replace(g, abstain_corpus=on) for t, g in self.by_tap.items()}),
                        self.offsets)

    def with_offsets(self, offsets: Mapping[str, float]) -> GateBook:
        """The same gates with these per-capability offsets in place of the taps' (``capd calibrate``)."""
        return replace(self, offsets=MappingProxyType(dict(offsets)))


def build_gatebook(model_gates: Gates, catalog: Catalog, overrides: Mapping[str, float | int | bool | None],
                   model: str | None = None, rule: str = "capd",
                   warned: set[tuple[Path, str | None]] | None = None) -> GateBook:
    """Manifest < tap ``capd.toml`` < settings overrides (``threshold``, ``margin``, ``top_k``,
    ``abstain_corpus``, ``coverage``; the last only for ``fused``, the others have no coverage gate).
    Under ``fused`` a tap's ``[gates.fused.offsets]`` apply to its own capabilities (no setting
    overrides them).

    ``model_gates`` are the manifest's gates for ``rule``; a tap contributes its gates for
    that rule (``abstain_corpus`` too, which ``anchor`` ignores). A tap's gates calibrated for
    another model are ignored (each model has its own cosine scale), with a warning; ``warned``
    (the caller's, across reloads) holds the (file, model) pairs already warned about.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    configs = {t: c for t, c in catalog.tap_configs.items() if _calibrated_for(c, model)}
    for tap, config in catalog.tap_configs.items():
        if not config.gates_for(rule):
            continue  # nothing for this rule in the file: nothing ignored, nothing to warn about
        if tap not in configs and (warned is None or (config.path, config.model) not in warned):
            log.warning("%s: gates were calibrated for model %s, not %s; using the model's defaults",
                        config.path, config.model, model)
            if warned is not None:
                warned.add((config.path, config.model))

    def apply(base: Gates, values: Mapping[str, float | int | bool]) -> Gates:
        known = {k: values[k] for k in ("threshold", "margin", "coverage") if k in values}
        if rule != "fused":
            known.pop("coverage", None)
        top_k = int(values["top_k"]) if "top_k" in values else base.top_k
        corpus = bool(values.get("abstain_corpus", base.abstain_corpus)) and rule != "anchor"
        return replace(base, **{k: float(v) for k, v in known.items()}, top_k=top_k, abstain_corpus=corpus)

    # One top_k for the whole catalog (scores must be comparable across taps): settings, else the
    # first tap (in precedence order) whose capd.toml sets it, else the manifest.
    tap_top_k = next((int(c.gates_for(rule)["top_k"]) for t in catalog.taps if (c := configs.get(t))
                      and "top_k" in c.gates_for(rule)), None)
    if tap_top_k is not None and "top_k" not in given:
        given["top_k"] = tap_top_k
    if rule == "fused":
        given["top_k"] = fused.TOP_K
    default = apply(model_gates, given)
    by_tap = {tap: apply(apply(model_gates, config.gates_for(rule)), given) for tap, config in configs.items()}
    # a tap's offsets move its own capabilities only (a name it shares with a tap before it is not its)
    offsets = {name: value for tap, config in configs.items() if rule == "fused"
               for name, value in config.offsets.items()
               if (capability := catalog.capabilities.get(name)) is not None and capability.tap == tap}
    return GateBook(default=default, by_tap=MappingProxyType(by_tap), offsets=MappingProxyType(offsets))


def _calibrated_for(config: TapConfig, model: str | None) -> bool:
    """A tap's gates apply to ``model`` (None: any) unless they were calibrated for another one."""
    return model is None or config.model in (None, model)


def taps_set_gates(catalog: Catalog, rule: str, model: str | None = None) -> bool:
    """Whether every tap that provides a capability sets its own threshold and margin for ``rule``
    in a ``capd.toml`` calibrated for ``model`` (then the model's gates, auto gates included, gate
    nothing)."""
    for tap in {capability.tap for capability in catalog}:
        config = catalog.tap_configs.get(tap)
        if config is None or not _calibrated_for(config, model):
            return False
        if not {"threshold", "margin"} <= config.gates_for(rule).keys():
            return False
    return True


def shown(value: float, gate: float) -> tuple[str, str]:
    """``value`` and the ``gate`` it missed, with as many decimals as it takes for them to differ
    in a reason (a 0.0788 margin under 0.08 reads "0.079 below 0.080", not "0.08 below 0.08")."""
    for digits in (2, 3, 4):
        pair = f"{value:.{digits}f}", f"{gate:.{digits}f}"
        if pair[0] != pair[1]:
            break
    return pair


def gate(ranked: Sequence[tuple[str, float]], gates: Gates) -> tuple[bool, float, str]:
    """Apply threshold and margin to a ranking; returns (fire, margin, reason).

    Written as ``not value >= gate`` so that a NaN score (a damaged model) fails every gate."""
    if not ranked:
        return False, 0.0, "no capability to route to"
    name, top1 = ranked[0]
    top2 = ranked[1][1] if len(ranked) > 1 else 0.0
    margin = top1 - top2
    if not (math.isfinite(top1) and math.isfinite(margin)):
        return False, margin, not_a_number(name, top1, margin)
    if not top1 >= gates.threshold:
        value, limit = shown(top1, gates.threshold)
        return False, margin, f"best {value} below threshold {limit}"
    if not margin >= gates.margin:  # a lone candidate too, when the margin gate is above the threshold
        runner = ranked[1][0] if len(ranked) > 1 else "no runner-up"
        value, limit = shown(margin, gates.margin)
        return False, margin, f"margin {value} between {name} and {runner} below {limit}"
    return True, margin, f"{name} {top1:.2f} clears threshold {gates.threshold:.2f} and margin {gates.margin:.2f}"


def not_a_number(name: str, score: float, margin: float) -> str:
    """The reason of an abstain on a score or margin that is NaN or inf (never one that clears)."""
    return f"{name}'s score ({score}) or margin ({margin}) is not a number: no gate lets it through (a damaged model?)"
