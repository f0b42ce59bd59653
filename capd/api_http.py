"""HTTP plumbing under capd's endpoints: how a request body is read (:func:`strict_json`), what
is refused before an endpoint runs (:func:`refusal`), and how errors and answers become JSON
(:func:`install_handlers`, :func:`json_response`). :mod:`capd.api`'s docstring says what a
client sees of it.
"""

from __future__ import annotations

import datetime
import json
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any
from urllib.parse import parse_qsl

from fastapi import FastAPI, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

from capd.errors import (
    FAILED_START,
    CapdError,
    InvalidSessionId,
    ModelError,
    PinnedCapability,
    StateError,
    Stopping,
    UnknownCapability,
    UnknownSession,
)
from capd.schemas import SESSION_PATTERN
from capd.service import Service
from capd.text import DuplicateKey, finite, printable_strings, unique_keys

MAX_MESSAGE_BYTES = 64 * 1024
MAX_BODY_BYTES = 256 * 1024
BODY_TOO_LARGE = f"request body over {MAX_BODY_BYTES} bytes"
# How long a request's body may take to arrive, from its head (capd.daemon's HEADERS_S bounds the head).
# A body is at most MAX_BODY_BYTES from a local client: milliseconds. A client that sent a head and
# part of its body, then stalled (a suspended agent), held its connection and a request task for good.
BODY_S = 10.0


class ApiError(Exception):
    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


def check_size(text: str, field_name: str) -> str:
    size = len(text.encode("utf-8"))
    if size > MAX_MESSAGE_BYTES:
        raise ApiError(413, "too_large", f"{field_name} is {size} bytes; the limit is {MAX_MESSAGE_BYTES}")
    return text


def _jsonable(value: object) -> str:
    # The only non-JSON values a response can hold: TOML dates and times in a server spec.
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def json_response(content: Any) -> Response:
    """A JSON response rendered as it stands. A handler that returns a dict has FastAPI walk it
    with ``jsonable_encoder`` first, a tenth of the event loop's time per route; the JSON bytes
    are the same (``response_model`` stays declared for the OpenAPI document)."""
    try:
        body = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_jsonable)
    except ValueError:  # NaN or inf (a damaged model): null, rather than a 500 or invalid JSON
        body = json.dumps(finite(content), ensure_ascii=False, allow_nan=False, separators=(",", ":"),
                          default=_jsonable)
    try:
        return Response(body.encode("utf-8"), media_type="application/json")
    except UnicodeEncodeError:  # a path that is not UTF-8 (a tap folder named with a 0xff byte)
        return json_response(printable_strings(content))


class DefaultJSON(JSONResponse):
    """FastAPI's JSON response for what handlers return as dicts, with :func:`json_response`'s care for
    paths that are not UTF-8 (a 500 for as long as such a tap was loaded)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return super().render(printable_strings(content))


def strict_json(body: bytes) -> Any:
    """A request body's JSON as capd reads it: UTF-8 (RFC 8259), no key given twice (Python's
    parser keeps the last one, so ``{"session": "a", "session": "b"}`` routed in ``b`` without a
    word). Every failure is a :class:`json.JSONDecodeError` saying what is wrong, which FastAPI
    answers 422 (anything else it answers with a bare 400, "There was an error parsing the body")."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise json.JSONDecodeError("the body is not UTF-8 text", "", exc.start) from None
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError:
        raise
    except DuplicateKey as exc:
        quoted = json.dumps(exc.key, ensure_ascii=False)
        second = text.find(quoted, text.find(quoted) + 1)
        raise json.JSONDecodeError(f"key {quoted} given twice", text, max(second, 0)) from None
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None
    except ValueError:  # an integer over the interpreter's digit limit
        raise json.JSONDecodeError(f"a number of more than {sys.get_int_max_str_digits()} digits", text, 0) from None


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = strict_json(await self.body())
        return self._json


class StrictRoute(APIRoute):
    """Every route's body is read with :func:`strict_json` (FastAPI's documented way to change
    how a request is read: a route class whose handler gets a request class of capd's own)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict


def error_response(status: int, error: str, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers)


class BodyTooLarge(StarletteHTTPException):
    """Raised by the guard's ``receive`` once a body passes ``MAX_BODY_BYTES``. An HTTP exception
    because FastAPI re-raises those from body reading (any other one becomes a 400)."""

    def __init__(self) -> None:
        super().__init__(413, BODY_TOO_LARGE)


class BodyLate(StarletteHTTPException):
    """Raised by the guard's ``receive`` when a body has not arrived within :data:`BODY_S` of the
    request's head: 408, and the connection closed (the rest of the body, if it came, would be read
    as the next request). An HTTP exception for the reason :class:`BodyTooLarge` is."""

    def __init__(self) -> None:
        super().__init__(408, f"the request body did not arrive within {BODY_S:g} s of its head",
                         headers={"Connection": "close"})


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.error, exc.detail)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing and body-parsing errors (404, 405, unreadable JSON) get capd's shape too.
        codes = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 408: "timeout", 413: "too_large"}
        headers = dict(exc.headers) if exc.headers else {}
        if exc.status_code == 405:  # Starlette names the methods of the first route on the path only
            headers["Allow"] = ", ".join(_allowed_methods(request.scope))
        code = codes.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, str(exc.detail), headers or None)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {_reason(e)}" for e in exc.errors())
        kind = request.headers.get("content-type", "")
        if request.method == "POST" and not _is_json(kind) and any(e["loc"] == ("body",) for e in exc.errors()):
            # `curl -d '{…}'` sends a form: the JSON is there, but not read as JSON
            sent = f"as {kind}" if kind else "without a content type"
            detail += f" (the body was sent {sent}; send Content-Type: application/json)"
        code = InvalidSessionId.code if any(_is_session_id_error(e) for e in exc.errors()) else "invalid_request"
        return error_response(422, code, detail)

    statuses: list[tuple[type[CapdError], int]] = [
        (UnknownSession, 404), (UnknownCapability, 404), (InvalidSessionId, 422), (PinnedCapability, 409),
        # capd cannot answer (a model giving NaN, a shutdown under way): not the request's fault
        (StateError, 503), (ModelError, 503), (Stopping, 503),
    ]
    for cls, status in statuses:
        def make(status: int, code: str) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
            async def handler(_: Request, exc: Exception) -> JSONResponse:
                return error_response(status, code, str(exc))
            return handler
        app.add_exception_handler(cls, make(status, cls.code))

    @app.exception_handler(CapdError)
    async def capd_error(_: Request, exc: CapdError) -> JSONResponse:
        return error_response(400, "bad_request", str(exc))


def check_started(service: Service) -> None:
    if service.startup_error is not None and not service.ready:  # never "warming up" forever
        raise ApiError(503, "warming_up", f"{FAILED_START} {service.startup_error}")


def _reason(error: Mapping[str, Any]) -> str:
    """A validation error's message; a session id that breaks its pattern or length gets the rule in words,
    as the session calls answer it, not the regular expression; a body that is not JSON says
    what the parser found (FastAPI's message is "JSON decode error" alone)."""
    ctx = error.get("ctx") or {}
    if _is_session_id_error(error):
        return f"invalid session id: {InvalidSessionId.rule}"
    if error.get("type") == "json_invalid" and ctx.get("error"):
        return f"invalid JSON: {ctx['error']}"
    return str(error["msg"])


def _is_session_id_error(error: Mapping[str, Any]) -> bool:
    """Whether a validation error is a session id that is not one (its pattern or length), in the
    path, the query or a body: all of them answer ``invalid_session_id``, as the session calls and
    an encoded slash do, whatever else the request got wrong (the detail lists it all)."""
    loc = error.get("loc") or ()
    if not loc or loc[-1] != "session":
        return False
    kind, pattern = error.get("type"), (error.get("ctx") or {}).get("pattern")
    return kind in ("string_too_short", "string_too_long") or (kind == "string_pattern_mismatch"
                                                                and pattern == SESSION_PATTERN)


def media_type(content_type: str) -> str:
    """A Content-Type without its parameters, lower case (``application/json; charset=utf-8``: ``application/json``)."""
    return content_type.partition(";")[0].strip().lower()


def _is_json(content_type: str) -> bool:
    """Whether a Content-Type is JSON as FastAPI reads it: ``application/json`` or ``application/*+json``."""
    media = media_type(content_type)
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _allowed_methods(scope: Scope) -> list[str]:
    """Every method some route on ``scope``'s path answers, ``HEAD`` wherever ``GET`` is (the guard
    answers it)."""
    methods: set[str] = set()
    for route in scope["app"].routes:
        match, _ = route.matches({**scope, "method": "GET"})
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def _query_names(dependant: Dependant) -> set[str]:
    """The query parameters an endpoint declares, its dependencies' included."""
    names = {param.alias for param in dependant.query_params}
    for dependency in dependant.dependencies:
        names |= _query_names(dependency)
    return names


def refusal(scope: Scope) -> JSONResponse | None:
    """Bad input the routes would take without a word: an encoded slash in a path (the session id is
    the only path parameter; ``victim%2Fenable`` is decoded before routing and enabled in session
    ``victim``), and a query parameter an API endpoint (``/v1/…``) does not declare or that is given
    more than once."""
    raw_path = scope.get("raw_path", b"")
    if b"%" in raw_path and b"%2f" in raw_path.lower() and scope["path"].startswith("/v1/sessions/"):
        return error_response(422, InvalidSessionId.code, f"path.session: invalid session id: {InvalidSessionId.rule}")
    query = scope.get("query_string", b"")
    if not query or not scope["path"].startswith("/v1/"):  # the API's own endpoints (not /docs, /metrics)
        return None
    route = next((r for r in scope["app"].routes if r.matches(scope)[0] is Match.FULL), None)
    if not isinstance(route, APIRoute):
        return None  # no such endpoint, or not this method: the router's 404 or 405 says so
    known = _query_names(route.dependant)
    given = Counter(name for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True))
    problems = [f"query.{name}: Extra inputs are not permitted" for name in given if name not in known]
    # the framework keeps the last of a repeated parameter (?session=a&session=b listed b), as a
    # JSON parser keeps the last of a repeated key: both are refused rather than guessed
    problems += [f"query.{name}: given {count} times" for name, count in given.items() if name in known and count > 1]
    if not problems:
        return None
    return error_response(422, "invalid_request", "; ".join(problems))


def matching_route(scope: Scope) -> BaseRoute | None:
    """The route the app's router would pick for ``scope``, as Starlette's ``Router`` picks it: the
    first full match, else the first that matches all but the method (its 405)."""
    routes: list[BaseRoute] = scope["app"].routes
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route
        if match is Match.PARTIAL and partial is None:
            partial = route
    return partial
