"""What a published router is fitted with besides its index: the fused rule's head, its auto
gates, and the gate book that decides which gates are in force for each tap.

The service calls :meth:`RuleFits.refit` for every publish (a start, a tap edit, an applied
learned correction, a switch to a tuned model). Both fits are cached in ``<data>/heads/`` by
the examples they were fitted on, so a restart with unchanged taps fits nothing; the head
reuses the token vectors of the router it replaces, and the auto gates carry over while few
capabilities changed (:mod:`capd.autogates`).

Precedence of gates (:meth:`RuleFits.gatebook`): the model's manifest < the auto gates (rule
``fused`` only) < a tap's ``capd.toml`` < settings.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from threadpoolctl import threadpool_info, threadpool_limits

from capd.autogates import Fit as AutoFit
from capd.autogates import auto_gates, examples_of
from capd.calibrate import Point
from capd.catalog import Catalog
from capd.encoder import Embedded, Encoder, Vectors
from capd.fused import TOP_K, FusedHead, build_head, head_key
from capd.gates import GateBook, Gates, build_gatebook, taps_set_gates
from capd.index import TriggerIndex
from capd.models import ModelManifest
from capd.router import Router
from capd.settings import Settings
from capd.vetoes import abstain_corpus

log = logging.getLogger(__name__)


def fitting_threads(replacing: bool) -> AbstractContextManager[object]:
    """The thread budget for fitting the fused head and its auto gates: every core on a start;
    when ``replacing`` a served snapshot (a tap edit, an applied learned correction, a tuned
    model), one core fewer (at least one thread), which routing keeps for its encode. On a
    2-core machine a two-thread fit beside the routes made them 2x slower at p50 and 20x at p99,
    while the one-thread fit takes ~30% longer when nothing routes (``benchmarks/bench_daemon.py``,
    routing during the edits; benchmarks/README.md)."""
    if not replacing:
        return nullcontext()
    # sched_getaffinity (Linux) counts the cores this process may use; macOS lacks it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    spare = max(1, cores - 1)
    pools = {pool["prefix"]: min(pool["num_threads"], spare) for pool in threadpool_info()}
    limits: AbstractContextManager[object] = threadpool_limits(limits=pools)
    return limits


def heads_dir(settings: Settings) -> Path:
    """Where the fused heads and their auto gates are cached."""
    return settings.data_dir / "heads"


def fingerprints(index: TriggerIndex, names: Sequence[str]) -> dict[str, str]:
    """Each capability's examples fingerprint in the index (what the head's key and the auto
    gates' basis are made of), in ``names`` order."""
    return {name: index.fingerprint_of(name) or "" for name in names}


class RuleFits:
    """The fitted state a service publishes its routers with, kept from one publish to the next."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.auto_gates: Point | None = None  # the fused rule's gates fitted on the examples (capd/autogates.py)
        self._auto_fit: AutoFit | None = None  # and the examples they were fitted on
        self._corpus: tuple[str, Embedded] | None = None  # (model id, the abstain corpus embedded)
        self._warned: set[tuple[Path, str | None]] = set()  # capd.toml files for another model, logged once
        self.stopping = threading.Event()  # set by Service.close(): a fit under way ends (Stopping)

    @property
    def auto_allowed(self) -> bool:
        """Auto gates are on, and the settings do not give both threshold and margin."""
        return self.settings.auto_gates and (self.settings.threshold is None or self.settings.margin is None)

    def refit(self, catalog: Catalog, index: TriggerIndex, encoder: Encoder, previous: Router | None,
              fresh: Mapping[str, Vectors], gate_model: str) -> FusedHead | None:
        """The head for ``index`` as it now stands (rule ``fused``; None otherwise), and the auto
        gates on its examples where they would gate anything; ``fresh``: token vectors the index's
        embedding just produced."""
        if self.settings.rule != "fused":
            self.auto_gates = None
            return None
        head = self.head(index, encoder, previous, fresh)
        self.auto_gates = self._auto_gates(head, index, encoder) if self._gated_by_auto(catalog, gate_model) else None
        return head

    def head(self, index: TriggerIndex, encoder: Encoder, previous: Router | None,
             fresh: Mapping[str, Vectors] | None = None, cache: bool = True) -> FusedHead:
        """The fused rule's head for ``index`` (cached in the data directory unless not ``cache``)."""
        names, vectors, labels = index.examples()
        key = head_key(encoder.model_id, names, list(fingerprints(index, names).values()))
        documents = [index.triggers(n) for n in names]
        tokens = (previous.head.tokens if previous is not None and previous.head is not None
                  and previous.encoder.model_id == encoder.model_id else None)  # not across a model swap
        return build_head(names, documents, vectors, labels, key, heads_dir(self.settings) if cache else None,
                          encoder.embed_tokens, tokens, fresh, self.stopping.is_set)

    def _gated_by_auto(self, catalog: Catalog, gate_model: str) -> bool:
        """Whether auto gates would gate anything: not when they are off, when the settings give
        threshold and margin (a coverage gate alone is not fitted; it comes from the settings, a
        tap's capd.toml or the manifest), or when every tap sets its own fused gates (taps/core
        does: fitting them anyway cost 4-6 s of its first fused start). A tap added later without
        gates gets them at that reload."""
        return self.auto_allowed and not taps_set_gates(catalog, "fused", gate_model)

    def fit_auto_gates(self, router: Router) -> Point | None:
        """The auto gates of ``router``'s examples, fitted now (and cached) if the publish skipped
        them because every tap sets its own: what the taps would get without their ``capd.toml``,
        which ``capd calibrate`` and ``make quality`` compare against. None when auto gates are off
        or the rule is not ``fused``."""
        if self.auto_gates is not None or router.head is None or not self.auto_allowed:
            return self.auto_gates
        return self._auto_gates(router.head, router.index, router.encoder, install=False)

    def _auto_gates(self, head: FusedHead, index: TriggerIndex, encoder: Encoder,
                    install: bool = True) -> Point | None:
        """The fused gates fitted on the examples (cached by the head's key), logged when fitted."""
        examples = examples_of(index, head, encoder.embed_tokens, self.stopping.is_set)
        if examples is None:
            return None

        def embed_corpus(corpus: Sequence[str]) -> Embedded:  # once per model, not per publish
            if self._corpus is None or self._corpus[0] != encoder.model_id:
                self._corpus = encoder.model_id, encoder.embed_tokens(corpus)
            return self._corpus[1]

        fit = auto_gates(examples, abstain_corpus(), embed_corpus, head.key, heads_dir(self.settings),
                         encoder.model_id, fingerprints(index, examples.names), self._auto_fit)
        point = fit.point
        if not install:
            return point
        self._auto_fit = fit
        if point is not None and point != self.auto_gates:
            log.info("fused auto gates: threshold %.2f, margin %.2f, coverage %.2f (examples out of fold: "
                     "fired_right %.2f, fired_wrong %.2f; abstain corpus fired %.2f)", point.threshold, point.margin,
                     point.coverage, point.fired_right, point.fired_wrong, point.null_fpr)
        return point

    def gatebook(self, catalog: Catalog, manifest: ModelManifest, gate_model: str) -> GateBook:
        """The gates in force: ``manifest`` < auto gates (``fused``) < a tap's ``capd.toml`` < settings."""
        settings = self.settings
        gates = manifest.gates_for(settings.rule)
        model_gates = Gates(gates["threshold"], gates["margin"], int(gates["top_k"]),
                            coverage=gates.get("coverage", 0.0))
        if self.auto_gates is not None:  # threshold and margin; they fit no coverage gate (0), so the manifest's stays
            auto = self.auto_gates
            model_gates = Gates(auto.threshold, auto.margin, TOP_K, coverage=auto.coverage or model_gates.coverage)
        overrides = {"threshold": settings.threshold, "margin": settings.margin, "top_k": settings.top_k,
                     "abstain_corpus": settings.abstain_corpus, "coverage": settings.coverage}
        return build_gatebook(model_gates, catalog, overrides, model=gate_model, rule=settings.rule,
                              warned=self._warned)
