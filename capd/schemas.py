"""Request and response shapes of the HTTP API, for validation and the OpenAPI spec.

Request bodies are validated. Response models are documentation only: handlers return plain
dicts (a request pays no response validation), and the reliability suite (schemathesis)
checks every response against these shapes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from fastapi import Path
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, field_validator

from capd.catalog import CapabilityKind, Severity
from capd.router import DecisionKind
from capd.text import surrogate_at

NAME_MAX_LENGTH = 128  # a capability name in a request (the capability tool's schema says so too)
SESSION_PATTERN = r"^[A-Za-z0-9._:-]*[A-Za-z0-9_:-][A-Za-z0-9._:-]*$"  # capd.sessions.SESSION_ID, for the spec
SessionId = Annotated[str, Field(min_length=1, max_length=128, pattern=SESSION_PATTERN)]
SessionPath = Annotated[str, Path(min_length=1, max_length=128, pattern=SESSION_PATTERN,
                                  description="The agent's session id: 1-128 of A-Z a-z 0-9 . _ : - (not only dots)")]


def _json_integer(value: object) -> object:
    """An integer as JSON Schema has it (the OpenAPI document's ``integer``): a number with no
    fractional part, ``5.0`` included (a schema-driven client may send it so), never ``true`` or
    ``"5"``, which pydantic's lax mode would take as 1 and 5."""
    if isinstance(value, (bool, str)):
        raise ValueError("must be a JSON integer")
    return value


JsonInt = Annotated[int, BeforeValidator(_json_integer)]


class _In(BaseModel):
    """A request body. Its strings must be Unicode text: JSON lets ``\\ud800`` escape a lone
    surrogate, which no encoder, tokenizer or UTF-8 log line accepts (a 422 here, not a 500 later).
    A field it does not know is a 422 naming it: ``{"sesion": …}`` would otherwise route without
    a session, silently."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*")
    @classmethod
    def _text(cls, value: object) -> object:
        if isinstance(value, str) and (at := surrogate_at(value)) is not None:
            raise ValueError(f"not Unicode text: a lone surrogate (\\u{ord(value[at]):04x}) at character {at}")
        return value


class RouteBody(_In):
    session: SessionId | None = Field(None, description="The agent's session id; omit to route without a session.")
    message: str = Field(..., description="The user's message (tags are stripped before routing).")


class ReloadBody(_In):
    """``POST /v1/reload`` takes no fields: no body, or ``{}``."""


class DiscoverBody(_In):
    intent: str = Field(..., description="What the user wants to do.")
    limit: JsonInt = Field(5, ge=1, le=100)


class NameBody(_In):
    name: str = Field(..., min_length=1, max_length=NAME_MAX_LENGTH)


class ToolResultBody(_In):
    tool: str = Field(..., min_length=1, max_length=256)
    server: str = Field(..., min_length=1, max_length=256)
    ok: StrictBool  # not 1, "yes" or "true"


class CapabilityCall(_In):
    action: Literal["list", "discover", "enable", "disable"]
    name: str | None = Field(None, max_length=NAME_MAX_LENGTH)
    intent: str | None = None


# -- response shapes: documentation only (handlers return plain dicts, so a request pays no validation);
#    the reliability suite (schemathesis) checks every response against them. ---------------------------

class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorOut(_Out):
    error: str
    detail: str


class CandidateOut(_Out):
    name: str
    score: float


def candidates_out(found: Iterable[tuple[str, float]]) -> list[dict[str, Any]]:
    """Ranked ``(name, score)`` pairs as :class:`CandidateOut` dicts, scores to 4 places.

    A candidate whose score is NaN or infinite is dropped, not clamped: such a score (only a
    custom encoder gone wrong gives one; the bundled models raise ``ModelError``) ranks nothing,
    and any number put in its place would be invented. The route's candidates drop them too
    (:meth:`capd.router.Decision.as_dict`), so ``score`` is always the number OpenAPI promises."""
    return [{"name": name, "score": round(float(score), 4)} for name, score in found if math.isfinite(score)]


class ServerOut(BaseModel):
    """An ``[[mcp.servers]]`` entry verbatim (``{{ENV:…}}`` unresolved); tap-defined keys pass through."""

    model_config = ConfigDict(extra="allow")
    name: str
    type: str
    command: str | None
    args: list[str]
    url: str | None
    timeout_seconds: float | None


class StartOut(_Out):
    capability: str
    server: ServerOut
    tools: list[str]


class TeardownOut(_Out):
    capability: str
    server: str
    kill: bool
    tools: list[str]


class PlanOut(_Out):
    start: list[StartOut]
    teardown: list[TeardownOut]
    active: list[str]


class FileErrorOut(_Out):
    """A problem health reports: a tap file that failed to load (with its line when known), a
    state file capd cannot write (it serves from memory meanwhile), or a tap that live reload
    scans instead of being notified of its changes."""

    file: str
    line: int | None
    reason: str


class TuningOut(_Out):
    """``tune = true``: the tuned model in use and what the daemon is doing about it."""

    enabled: bool
    status: Literal["off", "untuned", "tuning", "ready", "stale", "failed"]
    key: str | None
    wanted: str | None
    model: str | None
    error: str | None
    seconds: float | None


class HealthOut(_Out):
    status: Literal["ok", "starting", "error"]
    ready: bool
    model: str
    rule: str = Field(description="the routing rule in use (capd, anchor or fused)")
    rule_from: str = Field(description='where the rule came from: "default", "settings" (a flag, CAPD_RULE or the '
                           "config file), or the path of the tap's capd.toml that names it")
    capabilities: int
    triggers: int
    embedded: int
    cached: int
    errors: list[FileErrorOut]
    startup_error: str | None
    tuning: TuningOut


class CapabilityOut(_Out):
    name: str
    kind: CapabilityKind
    title: str | None
    description: str | None
    domains: list[str]
    triggers: int
    servers: list[str]
    requires: list[str]
    tap: str
    active: bool


class CapabilitiesOut(_Out):
    capabilities: list[CapabilityOut]


class DiscoverOut(_Out):
    candidates: list[CandidateOut]


class RouteOut(_Out):
    decision: DecisionKind
    capability: str | None
    score: float | None
    margin: float | None
    reason: str
    candidates: list[CandidateOut]
    plan: PlanOut | None


class ActiveServerOut(_Out):
    name: str
    tools: list[str]


class ActiveOut(_Out):
    name: str
    last_used: float
    origin: Literal["auto", "manual", "pinned"]
    servers: list[ActiveServerOut]


class SessionOut(_Out):
    session: str
    last_seen: float
    active: list[ActiveOut]


class DroppedOut(_Out):
    dropped: str
    plan: PlanOut


class BumpedOut(_Out):
    bumped: list[str]


class ProblemOut(_Out):
    severity: Severity
    code: str
    file: str
    line: int | None
    capability: str | None
    reason: str


class ReloadOut(_Out):
    capabilities: int
    added: list[str]
    removed: list[str]
    changed: list[str]
    embedded: int
    cached: int
    errors: list[ProblemOut]


class CapabilityToolOut(_Out):
    name: str
    description: str
    parameters: dict[str, Any]


class CapabilityCallOut(_Out):
    text: str
    plan: PlanOut | None
    error: str | None = None
    candidates: list[CandidateOut] | None = None


ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorOut, "description": "Bad input, unknown session or capability, missing token, a host "
                                           "that is not this machine (no token)"},
    503: {"model": ErrorOut, "description": "Still warming up or failed to start (the reason), running without "
                                            "sessions, session state or the model unavailable"},
}


def responses_for(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "description": "Success"}, **ERRORS}


# /metrics answers text, but its errors are JSON like every other endpoint's.
TEXT_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": doc["description"],
           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorOut"}}}}
    for code, doc in ERRORS.items()}
