"""Commands about the embedding engine: ``capd index`` and ``capd models``."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from capd.catalog import RULES
from capd.cli.common import (
    EXIT_ERROR,
    Failed,
    build_settings,
    emit_json,
    settings_options,
    stderr,
    tuning_not_done,
)
from capd.errors import CapdError, ModelError
from capd.models import ModelManifest, availability, load_manifests, manifest_for, resolve

if TYPE_CHECKING:
    from capd.catalog import Catalog
    from capd.settings import Settings
    from capd.vectorcache import VectorCache


class _Bar:
    """A click progress bar on stderr, shown only on a terminal and only when there is work."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.bar: Any = None
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None and total > 0 and sys.stderr.isatty():
            self.bar = click.progressbar(length=total, label=self.label, file=sys.stderr)
            self.bar.__enter__()
        if self.bar is not None:
            self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


@click.command()
@settings_options
@click.option("--rule", type=click.Choice(RULES), default=None,
              help="The rule to prepare for (default: the settings', else the taps'); fused also gets its fits.")
@click.option("--prune", is_flag=True, help="Also drop this model's cached vectors that nothing on these taps needs "
              "(what is kept: see above).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def index(config: Path | None, taps: tuple[Path, ...], data_dir: Path | None, model: str | None,
          backend: str | None, rule: str | None, prune: bool, as_json: bool) -> None:
    """Embed the triggers the configured taps need (only what the cache lacks) and print counts.

    Under the fused rule (--rule fused, CAPD_RULE or the config file) it also does the rest of a
    daemon's first start, so that the daemon starts as fast as a restart: it embeds the
    descriptions, names, learned corrections and abstain corpus, computes the examples' token
    vectors and fits the rule's head and auto gates, all cached in the data directory.

    Storing is this command's only job, so it exits 1 when any trigger vector is not in the vector
    cache afterwards (a data directory that cannot be written keeps nothing; a full disk some), or
    the fused head was not stored, saying so first, as it does when a tap has errors. With
    `tune = true` (CAPD_TUNE) the vectors are the tuned model's (tuned now unless cached), which the
    daemon routes with.

    --prune also deletes this model's cached vectors that nothing on these taps needs. It keeps
    those of the triggers and of every other text capd embeds for them under any rule (a command's
    --rule may differ from the daemon's): the capabilities' descriptions and names (`fused`), the
    corrections learned in this data directory, and the abstain corpus. Other models' vectors stay.

    Example: capd index --tap taps/core --rule fused --prune
    """
    from capd.embedder import CachedEmbedder
    from capd.encoder import open_encoder
    from capd.index import TriggerIndex
    from capd.settings import own_data_dir
    from capd.taps import load_catalog
    from capd.vectorcache import VectorCache, text_hash

    settings = build_settings(config, taps=taps, data_dir=data_dir, model=model, backend=backend, rule=rule)
    started = time.perf_counter()
    own_data_dir(settings.data_dir)
    catalog = load_catalog(settings.taps)
    tuned = _tuned_model(settings, catalog)
    encoder = open_encoder(dataclasses.replace(settings, model=str(tuned)) if tuned else settings)
    cache = VectorCache.open(settings.data_dir)
    bar = _Bar("embedding triggers")
    try:
        report = TriggerIndex(encoder.dim).sync(catalog, CachedEmbedder(encoder, cache), progress=bar)
        bar.close()
        wanted = {text_hash(t) for capability in catalog for t in capability.triggers}
        pruned = cache.prune(encoder.model_id, wanted | _in_use(settings, catalog)) if prune else 0
        unstored = _unstored(cache, encoder.model_id, wanted)
        stored = cache.counts().get(encoder.model_id, 0) if cache.persistent else 0  # not what memory holds
    finally:
        bar.close()
        cache.close()
    seconds = round(time.perf_counter() - started, 3)
    fits = _fit_rule(settings) if settings.rule == "fused" and cache.persistent and not unstored else None
    result = {
        "model": settings.model, "tuned": str(tuned) if tuned else None, "model_id": encoder.model_id,
        "taps": [str(t) for t in catalog.taps],
        "capabilities": len(catalog), "triggers": catalog.trigger_count, "embedded": report.embedded,
        "cached": report.cached, "pruned": pruned, "stored": stored, "unstored": unstored,
        "cache": str(cache.path) if cache.path else None, "persistent": cache.persistent,
        "seconds": seconds, "errors": [p.as_dict() for p in catalog.errors], "rule": settings.rule, "fits": fits,
    }
    _say_index_errors(result, len(wanted), settings.data_dir)
    if as_json:
        emit_json(result)
    else:
        for problem in catalog.errors:
            stderr(str(problem))
        _echo_index(result)
    if catalog.errors or unstored or not cache.persistent or (fits is not None and not fits["stored"]):
        raise SystemExit(EXIT_ERROR)


def _say_index_errors(result: dict[str, Any], wanted: int, data_dir: Path) -> None:
    """On stderr, what ``capd index`` could not store (``result`` is its JSON report)."""
    fits = result["fits"]
    if not result["persistent"]:
        stderr(f"capd: error: nothing was stored: the vector cache in {data_dir} cannot be written "
               f"(the {result['embedded']} vectors embedded were kept in memory for this run only); make the data "
               "directory writable and run capd index again")
    elif result["unstored"]:
        stderr(f"capd: error: {result['unstored']} of the {wanted} trigger vectors the taps need could not be "
               f"written to {result['cache']}; they will be embedded again until capd index stores them")
    if fits is not None and not fits["stored"]:
        stderr(f"capd: error: the fused rule's head could not be stored in {fits['path']}; a daemon will fit it "
               "again at every start until capd index stores it")


def _echo_index(result: dict[str, Any]) -> None:
    """``capd index``'s text report (``result`` is its JSON report)."""
    sizes = f"{result['capabilities']} capabilities, {result['triggers']} triggers"
    if not result["persistent"]:
        click.echo(f"nothing stored: {sizes}, embedded {result['embedded']} in memory only for "
                   f"{result['model_id']} ({result['seconds']:.1f} s)")
    else:
        missing = f", {result['unstored']} needed not stored" if result["unstored"] else ""
        click.echo(f"embedded {result['embedded']}, cached {result['cached']}, pruned {result['pruned']}: {sizes}, "
                   f"{result['stored']} vectors stored for {result['model_id']}{missing} ({result['seconds']:.1f} s)")
    fits = result["fits"]
    if fits is not None:
        done = "fitted and stored" if fits["stored"] else "fitted, not stored"
        click.echo(f"fused rule: head, token vectors and gates {done} ({fits['seconds']:.1f} s)")


def _fit_rule(settings: Settings) -> dict[str, Any]:
    """What a fused daemon's first start does after embedding the triggers, done now by starting
    the service as the daemon would and stopping it: everything it fits is cached in the data
    directory by content, so the daemon finds it. Corrections are routed with (as the daemon
    does) when the data directory has a learned file; none is created here."""
    from capd.fits import heads_dir
    from capd.fused import head_file
    from capd.learned import FILE_NAME
    from capd.service import Service

    started = time.perf_counter()
    service = Service(settings, learn=settings.learn and (settings.data_dir / FILE_NAME).is_file()).start()
    try:
        head = service.router.head
    finally:
        service.close()
    folder = heads_dir(settings)
    return {"stored": head is not None and head_file(folder, head.key).is_file(), "path": str(folder),
            "seconds": round(time.perf_counter() - started, 3)}


def _tuned_model(settings: Settings, catalog: Catalog) -> Path | None:
    """With ``tune = true``, the tuned model the daemon will route with (tuned now if it is not
    cached), so that its vectors are the ones stored; None when tuning is off."""
    from capd.models import HASH_MODEL
    from capd.tuner import tuned_model

    if not settings.tune or settings.model == HASH_MODEL:
        return None
    try:
        return tuned_model(settings, catalog)
    except (CapdError, OSError) as exc:
        raise tuning_not_done(str(exc)) from None


def _in_use(settings: Settings, catalog: Catalog) -> set[str]:
    """The hashes of every text a service on ``catalog`` embeds through the vector cache, under any
    rule, with the corrections learned in the data directory (the store is read, never created)."""
    from capd.learned import FILE_NAME, LearnedStore
    from capd.service import cached_texts
    from capd.vectorcache import text_hash

    path = settings.data_dir / FILE_NAME
    # all the file holds, not only the latest learn_max: a daemon with a larger learn_max routes with more
    store = LearnedStore(path, limit=sys.maxsize) if path.is_file() else None
    try:
        texts = set().union(*(cached_texts(catalog, rule, store) for rule in RULES))
    finally:
        if store is not None:
            store.close()
    return {text_hash(t) for t in texts}


def _unstored(cache: VectorCache, model_id: str, hashes: set[str]) -> int:
    """How many of these text hashes the cache file lacks (all of them in memory). CachedEmbedder
    logs a failed write and carries on, which suits a daemon (its next start pays for it), not a
    command whose job is storing them; so ``capd index`` reads back what it stored."""
    from capd.vectorcache import LOOKUP_SLICE

    if not cache.persistent:
        return len(hashes)
    ordered = sorted(hashes)
    found = sum(len(cache.get_many(model_id, ordered[start:start + LOOKUP_SLICE]))
                for start in range(0, len(ordered), LOOKUP_SLICE))
    return len(ordered) - found


def _model_row(manifest: ModelManifest, current: str, backend: str, verify: bool) -> dict[str, Any]:
    from capd.encoder import resolve_backend

    available, where = availability(manifest)
    row: dict[str, Any] = {
        **manifest.summary(), "current": manifest.name == current or manifest.source == current,
        "available": available, "location": where if available else None, "reason": None if available else where,
        "backend": resolve_backend(backend, manifest.backend) if manifest.source_kind != "builtin" else "hash",
    }
    if verify and available:
        try:
            resolve(manifest)  # no data directory: hashes the weights, whatever a stamp of an earlier check says
            row["verified"] = True
        except ModelError as exc:
            row.update(verified=False, available=False, reason=str(exc))
    return row


@click.command()
@settings_options
@click.option("--verify", is_flag=True, help="Also check the sha256 of each available model's weights.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def models(config: Path | None, taps: tuple[Path, ...], data_dir: Path | None, model: str | None,
           backend: str | None, verify: bool, as_json: bool) -> None:
    """List model manifests: which are on this machine, their backend and default gates.

    Example: capd models --json
    """
    settings = build_settings(config, taps=taps, data_dir=data_dir, model=model, backend=backend)
    broken: dict[str, ModelError] = {}
    manifests = load_manifests(settings.models_dir, broken)
    rows = [_model_row(m, settings.model, settings.backend, verify) for m in manifests.values()]
    rows += [{"name": name, "current": name == settings.model, "available": False, "reason": str(exc)}
             for name, exc in broken.items()]  # listed with their reason: this is where one looks
    if settings.model not in manifests and settings.model not in broken:
        try:  # a model directory: its row is the current model, however the path was spelled
            row = _model_row(manifest_for(settings), settings.model, settings.backend, verify)
            rows.append({**row, "current": True})
        except ModelError as exc:
            rows.append({"name": settings.model, "current": True, "available": False, "reason": str(exc)})
    failed = [row["name"] for row in rows if row.get("verified") is False]
    if as_json:
        emit_json({"models_dir": str(settings.models_dir), "current": settings.model, "models": rows})
    else:
        _print_models(rows)
    if failed:  # a check that ran and failed (tampered or damaged weights), for scripts to see
        raise Failed(f"--verify: the weights of {', '.join(failed)} do not match the manifest's sha256")


def _print_models(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        mark = "*" if row["current"] else " "
        if "gates" not in row:
            click.echo(f"{mark} {row['name']}  not available: {row['reason']}")
            continue
        gates = row["gates"]
        source = row["source"]
        origin = f"{source['kind']} {source['value']}" + (f"@{source['revision'][:12]}" if source["revision"] else "")
        state = "available" if row["available"] else "not available"
        click.echo(f"{mark} {row['name']:<22} {state:<13} backend {row['backend']:<5} dim {row['dim']:<4} "
                   f"gates {gates['threshold']:.2f}/{gates['margin']:.2f}/{gates['top_k']}  {origin}")
        if not row["available"]:
            click.echo(f"      {row['reason']}")
