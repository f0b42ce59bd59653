"""Routing-quality report: writes benchmarks/results/quality.json and quality.md (``make quality``).

Run: ``.venv/bin/python -m benchmarks.quality.run [--sets a,b] [--out DIR]`` (under
3 minutes on 2 cores). Sets: the shared eval sets in ``../shared/evalsets`` (skipped, with a line in the
report, when that folder is absent) and the shipped ``taps/core`` with its fixtures.

Per set and rule (``anchor``, ``fused``; ``capd`` scores exactly like ``anchor``), with the
split ``capd calibrate`` uses (``capd.calibrate.split``: 30% held out by a hash of the message):

- the model manifest's default gates for the rule, on the held-out part;
- for ``fused``, the auto gates (``capd/autogates.py``: fitted on the tap's own examples and the
  abstain corpus, no fixture seen), on the held-out and fit parts;
- gates calibrated on the fit part (``fit_gates``: what ``capd calibrate`` does, with its limits), on the
  held-out part (the headline) and on the fit part (tuned on); for ``fused`` also calibrated without the
  coverage gate (the gate's contribution);
- the best gates within the limits chosen on every row (an optimistic ceiling, tuned on).

Then: a simulated feedback loop (route the fit part in sessions, enable the expected
capability by hand after a miss and disable what a null activated, ``apply_learned()``, score
the held-out part again; and gates recalibrated on uncorrected rows after learning from the
others), the fused rule's cost per message, and the research figures quoted (not
recomputed) from ``benchmarks/quality/research_results.md``.

Settings are built directly (no ``CAPD_*`` environment, no user config). Each run uses a fresh
temporary data directory (a service with sessions and learned corrections gets its own), so
nothing depends on the user's data; only the model's ONNX export is kept, in
``benchmarks/.cache/quality``. Takes about 8 minutes here (with the tuned models cached).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from capd import calibrate as calibration
from capd.calibrate import (
    Point,
    fit_gates,
    fit_vetoes,
    fitted_router,
    grid_for,
    score_variants,
    split,
)
from capd.calibrate_examples import examples_pay, out_of_fold, plan_examples
from capd.encoder import Encoder, open_encoder
from capd.evaluation import ScoreTable, gated_metrics, score_table
from capd.fixtures import Fixture, load_fixtures, tap_fixture_files
from capd.gates import Gates
from capd.learned import MAX_PER_CAPABILITY
from capd.models import manifest_for
from capd.service import Service
from capd.settings import DEFAULT_MODEL, Settings
from capd.text import clean_message
from capd.tuned_models import MARKER

ROOT = Path(__file__).resolve().parents[2]
EVALSETS = ROOT.parent / "shared" / "evalsets"
RESULTS = ROOT / "benchmarks" / "results"
CACHE = ROOT / "benchmarks" / ".cache" / "quality"
RESEARCH = ROOT / "benchmarks" / "quality" / "research_results.md"
SHARED_SETS = ("clinc150_intent", "clinc150_domain", "hwu64_scenario_oos", "snips7", "healthcare")
SETS = (*SHARED_SETS, "core")
# taps/core as its author calibrates it: `capd calibrate` on taps/core/calibration, tested on all of
# taps/core/fixtures (a larger held-out part than core's 30%). Only in the report: research harnesses
# split rows by hash (some salt it), which this set replaces.
CORE_CAL = "core-cal"
REPORT_SETS = (*SETS, CORE_CAL)
FEEDBACK_SETS = SETS
RULES = ("anchor", "fused")
TUNED = tuple(f"{rule}+tuned" for rule in RULES)  # the same rules with `tune = true` (capd/tuning.py)


class Limits(TypedDict):
    """The issue's limits, as :func:`capd.calibrate.best_point` takes them."""

    max_null_fpr: float
    max_wrong: float


LIMITS: Limits = {"max_null_fpr": 0.05, "max_wrong": 0.03}
GOAL = {"top1": 0.90, "fired_right": 0.80, "fired_wrong": 0.03, "null_fpr": 0.05}  # >=, >=, <=, <=
METRICS = ("top1", "fired_right", "fired_wrong", "null_fpr")
TIMED_MESSAGES = 200


@contextmanager
def split_hashed(hashed: Callable[[Callable[[str, int], int], str, int], int]) -> Iterator[None]:
    """While open, every hash :func:`capd.calibrate.split` and :func:`capd.calibrate.folds_of` take is
    ``hashed(shipped, key, part)`` (``shipped``: capd's own hash), so a harness deals the rows its way."""
    shipped = calibration._hashed
    calibration._hashed = lambda key, part: hashed(shipped, key, part)
    try:
        yield
    finally:
        calibration._hashed = shipped


@dataclass(frozen=True)
class EvalSet:
    """One eval set: a tap and its fixture files, split by :func:`capd.calibrate.split`; or, with
    ``held_files``, fitted on ``fixture_files`` and held out on ``held_files`` (:meth:`file_split`)."""

    name: str
    tap: Path
    fixture_files: tuple[Path, ...]
    held_files: tuple[Path, ...] = ()
    tuned_as: str = ""  # whose tuned model it shares (the same tap tunes to the same model); "" = its own

    @property
    def tuned_name(self) -> str:
        return self.tuned_as or self.name

    def load(self) -> list[Fixture]:
        """The rows measured: all of ``fixture_files``; with ``held_files``, the part of
        ``fixture_files`` that ``capd calibrate`` fits on (as the tap's author runs it on them), then
        every row of ``held_files``. Not inside :meth:`file_split`, which moves that part (it yields
        these rows)."""
        fixtures = load_fixtures(self.fixture_files)
        if not self.held_files:
            return fixtures
        fit_rows, _ = split(fixtures)
        return [fixtures[i] for i in fit_rows] + load_fixtures(self.held_files)

    @contextmanager
    def file_split(self) -> Iterator[list[Fixture]]:
        """The rows (:meth:`load`); while open, :func:`capd.calibrate.split` holds out the rows of
        ``held_files`` (a set without them: unchanged). Every caller of the split (calibration, the
        examples' folds, the vetoes, the feedback loop) then sees the same two parts; the folds are
        unchanged. As in any split, a row that routes as the same text as another (tags, case and
        spacing aside) takes that text's side: a held-out row whose text a fit row has is fitted on,
        so it is not held out (taps/core: one tag-wrapped "alright")."""
        fixtures = self.load()
        if not self.held_files:
            yield fixtures
            return
        keys = calibration._split_keys(fixtures)  # the keys split() will hash: these rows, in this order
        first_held = len(fixtures) - len(load_fixtures(self.held_files))
        held = set(keys[first_held:]) - set(keys[:first_held])
        with split_hashed(lambda shipped, key, part: (0 if key in held else 999) if part == 0 else shipped(key, part)):
            yield fixtures


def trial_parser(doc: str, name: str, sets: Sequence[str] = SETS) -> argparse.ArgumentParser:
    """A research harness's command line: its docstring's first line, ``--sets`` and ``--out``
    (``benchmarks/results/NAME.json``); the harness adds its own options."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--sets", default=",".join(sets))
    parser.add_argument("--out", type=Path, default=RESULTS / f"{name}.json")
    return parser


def chosen_sets(args: argparse.Namespace) -> tuple[list[EvalSet], list[str]]:
    """:func:`find_sets` for a harness's ``--sets`` (comma-separated) among the shared eval sets."""
    return find_sets([s for s in args.sets.split(",") if s], EVALSETS)


def find_sets(names: Sequence[str], evalsets: Path, report: bool = False) -> tuple[list[EvalSet], list[str]]:
    """The requested sets that exist, and a note for each one skipped; :data:`CORE_CAL` only for the
    ``report``."""
    found, skipped = [], []
    core = ROOT / "taps" / "core"
    for name in names:
        if name == "core":
            found.append(EvalSet(name, core, tuple(tap_fixture_files(core))))
            continue
        if name == CORE_CAL:
            if report:
                found.append(EvalSet(name, core, tuple(sorted((core / "calibration").glob("*.jsonl"))),
                                     held_files=tuple(tap_fixture_files(core)), tuned_as="core"))
            else:
                skipped.append(f"{name}: skipped, it is only in the quality report (its split is by file)")
            continue
        folder = evalsets / name
        files = tuple(folder / f for f in ("dev.jsonl", "train.jsonl", "validation.jsonl") if (folder / f).is_file())
        if not (folder / "tap").is_dir() or not files:
            skipped.append(f"{name}: skipped, {folder} is absent (the shared eval sets are not on this machine)")
            continue
        found.append(EvalSet(name, folder / "tap", files))
    return found, skipped


@dataclass
class Bench:
    """One encoder for the whole run, a fresh data directory per service, message vectors memoised."""

    encoder: Encoder
    scratch: Path
    defaults: dict[str, dict[str, float]]
    memo: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    token_memo: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    services: int = 0
    timed: int = TIMED_MESSAGES
    tuned_root: Path | None = None  # where tuned models persist between runs (None: in scratch)
    model: str | None = None  # another model than the manifest default (--model)
    learn_max: int | None = None  # learned corrections kept per capability and kind (None: the default)

    def service(self, tap: Path, rule: str, sessions: bool = False, gates: Point | None = None,
                tuned_as: str | None = None) -> Service:
        """A started service on one tap. Services without sessions share the run's data directory
        (only the vector cache and fused heads live there); a service with sessions (and learned
        corrections) gets a directory of its own; ``tuned_as`` (a set name) turns on tuning, with
        that set's data directory under :attr:`tuned_root` (so a rerun reuses its tuned model)."""
        self.services += 1
        data_dir = self.scratch / (f"sessions-{self.services}" if sessions else "shared")
        tuned_dir = None if tuned_as is None else (self.tuned_root or self.scratch / "tuned") / tuned_as
        if tuned_dir is not None and not sessions:
            data_dir = tuned_dir
        elif tuned_dir is not None:  # fresh sessions and corrections, the set's tuned model and its export
            for folder in ("tuned", "onnx"):
                (data_dir / folder).parent.mkdir(parents=True, exist_ok=True)
                (tuned_dir / folder).mkdir(parents=True, exist_ok=True)
                (data_dir / folder).symlink_to(tuned_dir / folder, target_is_directory=True)
        elif sessions and (self.scratch / "shared" / "heads").is_dir():  # fitted heads are keyed by content
            shutil.copytree(self.scratch / "shared" / "heads", data_dir / "heads")
        settings = Settings(taps=(tap,), rule=rule, data_dir=data_dir, threshold=gates.threshold if gates else None,
                            model=self.model or DEFAULT_MODEL, learn_max=self.learn_max or MAX_PER_CAPABILITY,
                            margin=gates.margin if gates else None,
                            abstain_corpus=gates.abstain_corpus if gates else None, tune=tuned_as is not None)
        return Service(settings, encoder=self.encoder, sessions=sessions).start()

    def vectors(self, service: Service, fixtures: Sequence[Fixture]) -> np.ndarray:
        """The fixtures' vectors (and, kept for :meth:`tokens`, their token vectors): the vectors
        ``capd calibrate`` scores (:func:`capd.evaluation.embed_fixtures`), from one model call."""
        router = service.router
        model = router.encoder.model_id
        texts = [clean_message(f.message, router.min_chars)[0] for f in fixtures]
        missing = [t for t in dict.fromkeys(texts) if (model, t) not in self.memo]
        if len(missing) == len(set(texts)):  # nothing memoised: the very call (batches) `capd calibrate` makes
            missing = texts
        if missing:
            vectors, tokens = router.encoder.embed_tokens(missing)
            self.memo.update(zip([(model, t) for t in missing], vectors, strict=True))
            self.token_memo.update(zip([(model, t) for t in missing], tokens, strict=True))
        return np.stack([self.memo[model, t] for t in texts])

    def tokens(self, service: Service, fixtures: Sequence[Fixture]) -> list[np.ndarray]:
        """The fixtures' token vectors (computed by :meth:`vectors`)."""
        self.vectors(service, fixtures)
        router = service.router
        model = router.encoder.model_id
        return [self.token_memo[model, clean_message(f.message, router.min_chars)[0]] for f in fixtures]

    @contextmanager
    def fused_set(self, evalset: EvalSet, fixtures: list[Fixture] | None = None) -> Iterator[FusedSet]:
        """A started ``fused`` service on the set's tap, with its fixtures (``fixtures``: those of
        :meth:`EvalSet.file_split`, inside it), their split and their vectors and token vectors;
        closed after."""
        fixtures = evalset.load() if fixtures is None else fixtures
        fit_rows, held_rows = split(fixtures)
        service = self.service(evalset.tap, "fused")
        try:
            yield FusedSet(fixtures, fit_rows, held_rows, service, self.vectors(service, fixtures),
                           self.tokens(service, fixtures))
        finally:
            service.close()


@dataclass(frozen=True)
class FusedSet:
    """One eval set under the ``fused`` rule (:meth:`Bench.fused_set`)."""

    fixtures: list[Fixture]
    fit_rows: np.ndarray
    held_rows: np.ndarray
    service: Service
    vectors: np.ndarray
    tokens: list[np.ndarray]


@contextmanager
def trial_bench(name: str, tuned: bool = False) -> Iterator[Bench]:
    """A research harness's bench: the bundled model (its export cached under :data:`CACHE`), a
    scratch data directory removed afterwards, and with ``tuned`` the tuned models ``make quality``
    cached (tuned on first use)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    encoder = open_encoder(Settings(data_dir=CACHE, taps=()))
    with tempfile.TemporaryDirectory(prefix=f"capd-{name}-") as scratch:
        yield Bench(encoder, Path(scratch), manifest_info()["gates"], tuned_root=CACHE / "tuned" if tuned else None)


def folds_trial(argv: Sequence[str], doc: str, name: str,
                per_set: Callable[[Bench, EvalSet, int], dict[str, Any]]) -> dict[str, Any]:
    """A research harness over the chosen sets with ``--folds`` (default 5): ``per_set`` gives each
    set's result row; the report (limits, folds, skipped sets, rows) goes to ``--out``."""
    parser = trial_parser(doc, name)
    parser.add_argument("--folds", type=int, default=5)
    args = parser.parse_args(argv)
    found, skipped = chosen_sets(args)
    report: dict[str, Any] = {"limits": LIMITS, "folds": args.folds, "skipped": skipped, "results": []}
    with trial_bench(name) as bench:
        for evalset in found:
            report["results"].append(per_set(bench, evalset, args.folds))
    return write_report(args.out, report)


def write_report(path: Path, report: dict[str, Any]) -> dict[str, Any]:
    """A research harness's JSON report, written to ``path`` (its folder made if need be); returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def fit_and_held_out(fit_fired_right: float | None, held: dict[str, Any] | None,
                     missing: str = "no feasible point") -> str:
    """One harness line: fit fired_right, then held-out fired_right / fired_wrong / null_fpr."""
    if held is None or fit_fired_right is None:
        return missing
    return (f"fit {fit_fired_right:.3f}  held out {held['fired_right']:.3f} / {held['fired_wrong']:.3f} / "
            f"{held.get('null_fpr')}")


def gated(table: ScoreTable, rows: np.ndarray | None, gates: Point | Gates) -> dict[str, Any]:
    """Metrics of ``rows`` of ``table`` (None: all) at ``gates`` (threshold, margin, coverage)."""
    return gated_metrics(table if rows is None else table.subset(rows), gates)


def manifest_info(model: str | None = None) -> dict[str, Any]:
    """The model manifest's default gates per rule (what a tap without ``capd.toml`` gets), and the
    manifest's own comment on how the fused defaults were chosen."""
    manifest = manifest_for(Settings(taps=(), model=model or DEFAULT_MODEL))
    note: list[str] = []
    if manifest.path is not None and manifest.path.is_file():
        lines = manifest.path.read_text(encoding="utf-8").splitlines()
        end = next((i for i, line in enumerate(lines) if line.strip() == "[gates.fused]"), 0)
        start = end
        while start > 0 and lines[start - 1].startswith("#"):
            start -= 1
        note = [line.lstrip("#").strip() for line in lines[start:end]]
    return {"name": manifest.name, "path": str(manifest.path), "fused_note": " ".join(note),
            "gates": {rule: manifest.gates_for(rule) for rule in RULES}}


def evaluate_rule(service: Service, fixtures: Sequence[Fixture], vectors: np.ndarray,
                  default: dict[str, float], tokens: list[np.ndarray] | None = None,
                  examples: bool = False) -> dict[str, Any]:
    """Default, calibrated (fit → held-out) and all-rows gates for the service's rule; with
    ``examples``, also ``capd calibrate --examples`` (:func:`calibrated_examples`) and what plain
    ``capd calibrate`` keeps of the two (:func:`default_calibration`)."""
    router = service.router
    grid = grid_for(router.rule)
    plain = score_variants(router, fixtures, vectors, tokens, grid)  # as the tap routes before calibration
    tables = plain[False]  # as a tap without capd.toml routes (the default and auto gates' rows): no corpus
    fit_rows, held_rows = split(fixtures)
    # what `capd calibrate` fits with: the fit part's null rows as the tap's vetoes (none for anchor)
    veto_rows = [f.message for f in fit_vetoes(fixtures, router.rule)]
    vetoed = router.with_tap_vetoes(veto_rows)
    variants = score_variants(vetoed, fixtures, vectors, tokens, grid) if veto_rows else plain
    out: dict[str, Any] = {
        "capabilities": len(router.catalog), "examples": router.index.trigger_count,
        "default": {"gates": default, "held_out": gated(tables[int(default["top_k"])], held_rows, Gates(
            default["threshold"], default["margin"], coverage=default.get("coverage", 0.0)))},
    }
    if (auto := service.fit_auto_gates()) is not None:  # fused: fitted on the tap's examples, no fixture seen
        table = tables[auto.top_k]
        out["auto"] = {"gates": auto.as_dict(), "held_out": gated(table, held_rows, auto),
                       "fit": gated(table, fit_rows, auto)}
    tap = service.settings.taps[0]
    config = router.catalog.tap_configs.get(tap)
    # the tap's own gates, calibrated apart from these rows (taps/core), when in force for this rule and model
    if config is not None and config.gates_for(router.rule) and tap in router.gates.by_tap:
        shipped = router.gates.for_tap(tap)
        table = plain[shipped.abstain_corpus][shipped.top_k]  # with the corpus when the tap turns it on
        out["tap_gates"] = {"gates": {"threshold": shipped.threshold, "margin": shipped.margin,
                                      "top_k": shipped.top_k, "coverage": shipped.coverage,
                                      "abstain_corpus": shipped.abstain_corpus},
                            "held_out": gated(table, held_rows, shipped), "all": gated(table, None, shipped)}
    fitted = fit_gates(variants, fit_rows, grid=grid, **LIMITS)  # what `capd calibrate` does
    out["abstain_corpus"] = fitted.corpus
    if (calibrated := fitted.point) is not None:
        table = fitted.tables[calibrated.top_k]
        out["calibrated"] = {"gates": calibrated.as_dict(),
                             "held_out": gated(table, held_rows, calibrated),
                             "fit": gated(table, fit_rows, calibrated)}
    out["vetoes"] = len(veto_rows)
    if veto_rows:  # the vetoes' contribution: the same calibration without them
        alone = fit_gates(plain, fit_rows, grid=grid, **LIMITS)
        if (point := alone.point) is not None:
            table = alone.tables[point.top_k]
            out["calibrated_no_vetoes"] = {"gates": point.as_dict(), "held_out": gated(table, held_rows, point),
                                           "fit": gated(table, fit_rows, point)}
    if router.rule == "fused":  # `capd calibrate --offsets`: the same calibration with per-capability offsets
        moved, _, offsets = fitted_router(vetoed, fixtures, vectors, tokens, vetoes=False, offsets=True)
        with_offsets = fit_gates(score_variants(moved, fixtures, vectors, tokens, grid, offsets), fit_rows, grid=grid,
                                 **LIMITS)
        if (point := with_offsets.point) is not None:
            table = with_offsets.tables[point.top_k]
            out["calibrated_offsets"] = {"gates": point.as_dict(), "held_out": gated(table, held_rows, point),
                                         "fit": gated(table, fit_rows, point),
                                         "offsets": 0 if offsets is None else len(offsets.offsets)}
    if router.rule == "fused":  # the coverage gate's contribution: the same calibration without its axis
        no_axis = fit_gates(variants, fit_rows, grid=dataclasses.replace(grid, coverages=np.zeros(1)), **LIMITS)
        if (point := no_axis.point) is not None:
            table = no_axis.tables[point.top_k]
            out["calibrated_no_coverage"] = {"gates": point.as_dict(),
                                             "held_out": gated(table, held_rows, point),
                                             "fit": gated(table, fit_rows, point)}
    if examples:
        out["calibrated_examples"] = calibrated_examples(service, fixtures, vectors, tokens)
        out["calibrated_default"] = default_calibration(out)
    everything = fit_gates(plain, np.arange(len(fixtures)), grid=grid, **LIMITS)  # the ceiling, as before
    if (ceiling := everything.point) is not None:
        out["all_rows"] = {"gates": ceiling.as_dict(),
                           "all": gated(everything.tables[ceiling.top_k], None, ceiling)}
    return out


def calibrated_examples(service: Service, fixtures: Sequence[Fixture], vectors: np.ndarray,
                        tokens: list[np.ndarray] | None) -> dict[str, Any] | None:
    """``capd calibrate --examples``: the fit part's rows that expect one capability as more of its
    triggers, each fit row scored out of fold and the held-out part by a router with them all
    (:func:`capd.calibrate.out_of_fold`, the fit nulls as vetoes); None when no point meets the limits."""
    router = service.router
    grid = grid_for(router.rule)
    plan = plan_examples(router.catalog, fixtures, add=True)
    if plan is None:
        return None
    fit_rows, held_rows = split(fixtures)
    variants, _ = out_of_fold(service.router_with_examples, plan, fixtures, vectors, tokens, grid, vetoes=True)
    fitted = fit_gates(variants, fit_rows, grid=grid, **LIMITS)
    if (point := fitted.point) is None:
        return None
    table = fitted.tables[point.top_k]
    return {"gates": point.as_dict(), "held_out": gated(table, held_rows, point), "fit": gated(table, fit_rows, point),
            "examples": len(plan.rows)}


def default_calibration(out: dict[str, Any]) -> dict[str, Any] | None:
    """What plain ``capd calibrate`` keeps: the calibration with the fit positives as examples when
    they add ``EXAMPLES_MIN_GAIN`` to the fit fired_right (:func:`capd.calibrate.examples_pay`), else
    the one without; ``examples_added`` says which."""
    without, with_them = out.get("calibrated"), out.get("calibrated_examples")
    added = examples_pay(without and without["gates"]["fired_right"], with_them and with_them["gates"]["fired_right"])
    chosen = with_them if added else without
    return None if chosen is None else {**chosen, "examples_added": added}


def timing(bench: Bench, service: Service, fixtures: Sequence[Fixture], vectors: np.ndarray) -> dict[str, float]:
    """p50 per message, one at a time: scoring an already-embedded vector (the rule's cost, with
    ``fused``'s second stage) and, for ``fused``, encoding the message (the bare encoder's vector,
    and the service's micro-batcher with token vectors, as a route does), and scoring with the fit
    part's rows as examples too (``score_examples_ms``: the tap after ``capd calibrate --examples
    --write``), interleaved so that load from other work on the machine hits all of them alike."""
    router, encoder = service.router, service.encoder
    assert encoder is not None
    rows = np.linspace(0, len(fixtures) - 1, min(bench.timed, len(fixtures))).astype(int)
    texts = [clean_message(fixtures[i].message, router.min_chars)[0] for i in rows]
    calls: dict[str, Callable[[int], object]] = {
        "score_ms": lambda i: router.index.named_scores(vectors[rows[i]][None, :], router.top_k)}
    if router.rule == "fused":
        tokens = bench.tokens(service, [fixtures[i] for i in rows])
        calls["score_ms"] = lambda i: router.fused_scores(vectors[rows[i]][None, :], [texts[i]], [tokens[i]])
        if (plan := plan_examples(router.catalog, fixtures, add=True)) is not None:
            examples = service.router_with_examples(plan.examples(fixtures, plan.rows))
            calls["score_examples_ms"] = lambda i: examples.fused_scores(vectors[rows[i]][None, :], [texts[i]],
                                                                         [tokens[i]])
        calls["encode_ms"] = lambda i: bench.encoder.embed([texts[i]])
        calls["service_encode_ms"] = lambda i: encoder.embed_tokens([texts[i]])
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for warm in (True, False):
        for i in range(min(20, len(rows)) if warm else len(rows)):
            for name, call in calls.items():
                started = time.perf_counter()
                call(i)
                if not warm:
                    samples[name].append((time.perf_counter() - started) * 1000)
    return {name: round(statistics.median(values), 4) for name, values in samples.items()}


def correct(service: Service, fixtures: Sequence[Fixture], rows: np.ndarray) -> dict[str, Any]:
    """Route ``rows`` in sessions of their own and correct the mistakes as an agent would: a positive
    that did not activate an expected capability gets the expected one enabled (a learned trigger); a
    null that activated something gets it disabled (a learned abstain). Then ``apply_learned()``."""
    assert service.registry is not None
    # Route every message first, then correct: each session holds one routed turn, so this is the
    # same as correcting right after each mistake, except that no correction is applied (capd applies
    # them about a second after they arrive) while others are still being routed, which keeps the
    # result independent of timing.
    started = time.perf_counter()
    misses, refused = [], []
    for i in rows.tolist():
        decision = service.route(fixtures[i].message, f"sim-{i}").decision
        fired = decision.decision == "activate"
        if fixtures[i].positive and not (fired and decision.capability in fixtures[i].expect):
            misses.append(i)
        elif not fixtures[i].positive and fired and decision.capability is not None:
            refused.append((i, decision.capability))
    for i in misses:
        service.registry.activate(f"sim-{i}", fixtures[i].expect[0], "manual")
    for i, name in refused:
        service.registry.deactivate(f"sim-{i}", name)
    learned = service.apply_learned()
    return {"routed": len(rows), "corrected": len(misses), "refused": len(refused), "learned": learned,
            "seconds": round(time.perf_counter() - started, 1)}


def feedback(bench: Bench, evalset: EvalSet, fixtures: Sequence[Fixture], vectors: np.ndarray | None,
             gates: Point, tuned: bool = False) -> dict[str, Any]:
    """The fit part is the traffic: route it, :func:`correct` its mistakes, re-score held-out at the
    same gates (with and without the learned abstains). Then, for gates recalibrated after learning
    without memorised rows: a fresh run corrects only alternate fit rows and recalibrates on the
    others. ``tuned``: with the set's tuned model (``vectors`` None: embedded with it)."""
    fit_rows, held_rows = split(fixtures)
    grid = grid_for("fused")
    out: dict[str, Any] = {"gates": gates.as_dict()}
    with loop_service(bench, evalset, gates, tuned) as service:
        if tuned and service.tuning.status != "ready":
            return {"error": f"the tuned model is not available: {service.tuning.error or service.tuning.status}"}
        vectors = bench.vectors(service, fixtures) if vectors is None else vectors
        tokens = bench.tokens(service, fixtures)
        out["before"] = gated(score_table(service.router, fixtures, vectors=vectors, tokens=tokens),
                              held_rows, gates)
        out.update(correct(service, fixtures, fit_rows))
        triggers_only = copy.copy(service.router)
        triggers_only.vetoes = dataclasses.replace(service.router.vetoes, texts={}, vectors={})  # corpus kept
        for key, router in (("after_triggers_only", triggers_only), ("after_same_gates", service.router)):
            table = score_table(router, fixtures, vectors=vectors, tokens=tokens)
            out[key] = gated(table, held_rows, gates)
    with loop_service(bench, evalset, gates, tuned) as service:
        out["refit_traffic"] = correct(service, fixtures, fit_rows[0::2])
        refit = fit_gates(score_variants(service.router, fixtures, vectors, bench.tokens(service, fixtures), grid),
                          fit_rows[1::2], grid=grid, **LIMITS)
        if (point := refit.point) is not None:
            out["refit_gates"] = point.as_dict()
            out["after_refit"] = gated(refit.tables[point.top_k], held_rows, point)
    return out


@contextmanager
def loop_service(bench: Bench, evalset: EvalSet, gates: Point, tuned: bool) -> Iterator[Service]:
    """A fused service with sessions and learning at ``gates``, closed afterwards."""
    service = bench.service(evalset.tap, "fused", sessions=True, gates=gates,
                            tuned_as=evalset.tuned_name if tuned else None)
    try:
        yield service
    finally:
        service.close()


def run_set(bench: Bench, evalset: EvalSet, fixtures: list[Fixture], with_feedback: bool,
            tune: bool = True) -> dict[str, Any]:
    result: dict[str, Any] = {"tap": str(evalset.tap), "fixtures": [str(p) for p in evalset.fixture_files],
                              "rows": len(fixtures), "rules": {}, "timing": {}}
    if evalset.held_files:
        result["held_files"] = [str(p) for p in evalset.held_files]
    vectors = None
    for rule in RULES:
        service = bench.service(evalset.tap, rule)
        try:
            vectors = bench.vectors(service, fixtures) if vectors is None else vectors
            tokens = bench.tokens(service, fixtures) if rule == "fused" else None
            result["rules"][rule] = evaluate_rule(service, fixtures, vectors, bench.defaults[rule], tokens,
                                                  examples=rule == "fused")
            result["timing"][rule] = timing(bench, service, fixtures, vectors)
        finally:
            service.close()
    # the loop learns its own vetoes from traffic, so it starts from gates fitted without the fixtures' ones
    calibrated = result["rules"]["fused"].get("calibrated_no_vetoes") or result["rules"]["fused"].get("calibrated")
    if with_feedback and vectors is not None and calibrated is not None:
        print(f"   feedback loop on {evalset.name}", flush=True)
        result["feedback"] = feedback(bench, evalset, fixtures, vectors, Point(**calibrated["gates"]))
    for rule in RULES if tune else ():
        print(f"   {rule} with the tuned model", flush=True)
        service = bench.service(evalset.tap, rule, tuned_as=evalset.tuned_name)
        try:
            if service.tuning.status != "ready":
                result["tuning"] = service.tuning.as_dict()
                continue
            tuned = bench.vectors(service, fixtures)
            tokens = bench.tokens(service, fixtures) if rule == "fused" else None
            result["rules"][f"{rule}+tuned"] = evaluate_rule(service, fixtures, tuned, bench.defaults[rule], tokens)
            result["tuning"] = {**service.tuning.as_dict(), "trained": tuning_summary(service)}
        finally:
            service.close()
    tuned_rule = result["rules"].get("fused+tuned", {})
    calibrated = tuned_rule.get("calibrated_no_vetoes") or tuned_rule.get("calibrated")
    if with_feedback and calibrated is not None:
        print(f"   feedback loop on {evalset.name} with the tuned model", flush=True)
        result["feedback_tuned"] = feedback(bench, evalset, fixtures, None, Point(**calibrated["gates"]), tuned=True)
    return result


def tuning_summary(service: Service) -> dict[str, Any]:
    """What the tuning child recorded (steps, seconds, loss) for the tuned model in use."""
    path = Path(service.tuning.model or "") / MARKER
    summary: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return summary


def measure(names: Sequence[str], evalsets: Path, feedback_sets: Sequence[str], encoder: Encoder | None = None,
            scratch: Path | None = None, timed: int = TIMED_MESSAGES, tune: bool = True,
            model: str | None = None) -> dict[str, Any]:
    """Everything the report shows, as a JSON-ready dict. Tests pass an ``encoder`` to reuse, a
    ``scratch`` directory to keep (else a temporary one is removed), fewer ``timed`` messages,
    and ``tune=False`` to leave out the tuned model (minutes of training per set). ``model``: a
    manifest name or a sentence-transformers directory instead of the default model (its own
    data directory under the cache, so vectors and exports never mix)."""
    began = time.perf_counter()
    found, skipped = find_sets(names, evalsets, report=True)
    learning = hasattr(Service, "apply_learned")
    result: dict[str, Any] = {
        "command": ".venv/bin/python -m benchmarks.quality.run" + (f" --model {model}" if model else ""),
        "generated": datetime.now(UTC).isoformat(
            timespec="seconds"), "machine": f"{os.cpu_count()} CPUs",
        "load_before": [round(x, 2) for x in os.getloadavg()], "limits": LIMITS, "goal": GOAL,
        "evalsets": str(evalsets), "skipped": skipped, "learning_available": learning, "sets": {},
    }
    cache = CACHE if model is None else CACHE / "models" / Path(model).name
    if encoder is None:
        cache.mkdir(parents=True, exist_ok=True)
        encoder = open_encoder(Settings(data_dir=cache, taps=(), model=model or DEFAULT_MODEL))
    result["model"] = encoder.model_id
    result["manifest"] = manifest_info(model)
    with tempfile.TemporaryDirectory(prefix="capd-quality-") as temporary:
        bench = Bench(encoder, scratch or Path(temporary), result["manifest"]["gates"], timed=timed,
                      tuned_root=None if scratch else cache / "tuned", model=model)
        for evalset in found:
            print(f"== {evalset.name}", flush=True)
            started = time.perf_counter()
            with evalset.file_split() as fixtures:
                result["sets"][evalset.name] = run_set(bench, evalset, fixtures,
                                                       learning and evalset.name in feedback_sets, tune)
            result["sets"][evalset.name]["seconds"] = round(time.perf_counter() - started, 1)
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    result["seconds"] = round(time.perf_counter() - began, 1)
    return result


# -- report --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="capd routing-quality report")
    parser.add_argument("--sets", default=",".join(REPORT_SETS), help=f"comma-separated, from {', '.join(REPORT_SETS)}")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where quality.json and quality.md go")
    parser.add_argument("--evalsets", type=Path, default=EVALSETS, help="the shared eval sets folder")
    parser.add_argument("--feedback-sets", default=",".join(FEEDBACK_SETS), help="sets to run the feedback loop on")
    parser.add_argument("--no-tune", action="store_true",
                        help="leave out the tuned model (tuning takes 0.2-4 minutes per set, once: it is cached "
                             "in benchmarks/.cache/quality/tuned)")
    parser.add_argument("--model", default=None,
                        help="another model: a manifest name or a sentence-transformers directory (a comparison; "
                             "the headline is the bundled model)")
    args = parser.parse_args(argv if argv is not None else [])
    names = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [n for n in names if n not in REPORT_SETS]
    if unknown:
        parser.error(f"unknown set(s) {', '.join(unknown)}; choose from {', '.join(REPORT_SETS)}")
    result = measure(names, args.evalsets, [s.strip() for s in args.feedback_sets.split(",") if s.strip()],
                     tune=not args.no_tune, model=args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    from benchmarks.quality.report import render  # the report module reads this one's constants

    (args.out / "quality.md").write_text(render(result, args.out) + "\n", encoding="utf-8")
    print(f"wrote {args.out / 'quality.md'} in {result['seconds']} s", flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
