"""The ``capability`` tool an agent hands to its LLM, so the model can manage its own tools.

``GET /v1/capability-tool`` serves :data:`TOOL_SCHEMA` (JSON-schema ``parameters``, the
shape OpenAI- and Anthropic-style tool definitions share); ``POST
/v1/sessions/{id}/capability`` executes a call and returns ``text`` for the model plus the
``plan`` for the agent to apply.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from capd.errors import CapdError
from capd.schemas import NAME_MAX_LENGTH, candidates_out
from capd.text import strip_tags

if TYPE_CHECKING:
    from capd.service import Service

TOOL_SCHEMA: dict[str, Any] = {
    "name": "capability",
    "description": (
        "Manage which tool groups (capabilities) are loaded in this conversation. "
        "Use 'discover' with an intent to find the right capability, 'enable' to load it, "
        "'disable' to unload one you no longer need (or one loaded by mistake for this message: "
        "capd learns from that), 'list' to see what exists and what is active."
    ),
    "parameters": {
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": ["list", "discover", "enable", "disable"]},
            "name": {"type": "string", "maxLength": NAME_MAX_LENGTH,
                     "description": "Capability name (for enable / disable)."},
            "intent": {"type": "string", "description": "What you want to do (for discover)."},
        },
        "required": ["action"],
        "additionalProperties": False,
    },
}


def run_capability_call(service: Service, session: str, action: str, name: str | None,
                        intent: str | None) -> dict[str, Any]:
    registry = service.registry
    assert registry is not None
    if action == "list":
        active = set(registry.active_names(session))
        lines = [f"{'*' if c.name in active else '-'} {c.name}: {c.summary()['description'] or ''}".rstrip(": ")
                 for c in service.catalog_now()]
        return {"text": "Capabilities (* = active):\n" + "\n".join(lines), "plan": None}
    if action == "discover":
        if not intent or not strip_tags(intent).strip():  # as discovery reads it: tags say nothing of intent
            return {"text": "discover needs an 'intent'.", "plan": None, "error": "missing_intent"}
        found = [(n, s) for n, s in service.discover(intent, 5) if math.isfinite(s)]  # as candidates_out drops
        if not found:
            return {"text": "No capability matches that intent.", "plan": None, "candidates": []}
        # names only: under `fused` a candidate's score is its level, which need not fall down the
        # ranking, and a model reading the numbers would re-rank by them (`candidates` carries them)
        return {"text": "Best matches, best first: " + ", ".join(n for n, _ in found)
                + ". Enable one with action 'enable'.", "plan": None,
                "candidates": candidates_out(found)}
    if not name:
        return {"text": f"{action} needs a 'name'.", "plan": None, "error": "missing_name"}
    try:
        plan = registry.activate(session, name, "manual") if action == "enable" else registry.deactivate(session,
                                                                                                         name)
    except CapdError as exc:
        return {"text": f"Could not {action} {name}: {exc}", "plan": None, "error": exc.code}
    if action == "enable":
        done = f"Enabled {name}." if name in plan.activated else f"{name} was already active."
    else:
        done = f"Disabled {name}." if name in plan.removed else f"{name} was not active."
    unloaded = [n for n in plan.removed if n != name]  # evicted to make room, or gone from the taps
    text = done + (f" Unloaded: {', '.join(unloaded)}." if unloaded else "") + \
        f" Active now: {', '.join(plan.active) or 'none'}."
    return {"text": text, "plan": plan.as_dict()}
