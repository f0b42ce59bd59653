"""What ``GET /v1/health`` (and ``capd status``) says about a service.

Whether it is ready or why it failed to start, the model the served snapshot routes with, the rule,
the catalog's size, how many trigger texts were embedded or served from the vector cache, the tuned
model's state, and every error a user can act on: a tap file's (with its line), a state file that
cannot be written (capd then serves from memory), and a tap that cannot be watched for changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from capd.catalog import Problem
from capd.text import printable

if TYPE_CHECKING:
    from capd.service import Service


def health(service: Service) -> dict[str, Any]:
    catalog = service.catalog_now()
    return {
        "status": "error" if service.startup_error else "ok" if service.ready else "starting",
        "ready": service.ready,
        "model": _routing_model_id(service),
        "rule": service.settings.rule,
        "rule_from": service.settings.rule_from,
        "capabilities": len(catalog),
        "triggers": catalog.trigger_count,
        "embedded": service.counters.embedded,
        "cached": service.counters.cached,
        "errors": _shown(catalog.errors) + _state_errors(service) + _shown(service.watch_problems),
        "startup_error": service.startup_error,
        "tuning": service.tuning.as_dict(),
    }


def _shown(problems: Iterable[Problem]) -> list[dict[str, Any]]:
    """Problems as health's ``errors`` shows them."""
    return [{"file": printable(p.file), "line": p.line, "reason": printable(p.reason)} for p in problems]


def _state_errors(service: Service) -> list[dict[str, Any]]:
    """The session file while it cannot be written (capd then serves from memory), and the
    learned-corrections file likewise: corrections learned meanwhile are lost at the next stop."""
    errors = []
    store = service.registry.store if service.registry is not None else None
    reason = service.state_error or (store.last_error if store is not None else None)
    if store is not None and reason is not None:
        errors.append({"file": printable(str(store.path)), "line": None,
                       "reason": printable(reason.removeprefix(f"{store.path}: "))})
    learned = service.learned
    if learned is not None and learned.error is not None:
        errors.append({"file": printable(str(learned.path)), "line": None,
                       "reason": printable(learned.error.removeprefix(f"{learned.path}: "))})
    return errors


def _routing_model_id(service: Service) -> str:
    """The model the served snapshot routes with (a tuned one being switched to is not yet it)."""
    snapshot = service.snapshot
    encoder = snapshot.router.encoder if snapshot is not None else service.encoder
    return encoder.model_id if encoder is not None else service.settings.model
