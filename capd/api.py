"""The HTTP API (DESIGN.md "HTTP API", v1), as a FastAPI app whose lifespan owns every resource.

- Errors are JSON ``{"error": code, "detail": text}`` with a 4xx status for bad input.
- Bodies over ``MAX_BODY_BYTES`` and messages over ``MAX_MESSAGE_BYTES`` get 413.
- With a token configured, every endpoint (docs and metrics included) needs
  ``Authorization: Bearer <token>``.
- While the model loads, ``/v1/health`` says ``ready: false``, ``/v1/route`` answers
  ``skipped`` ("warming up") at once, and endpoints that need the catalog answer 503. After a
  failed start every endpoint but ``/v1/health`` (``/metrics`` and the tool schema too; not the
  API's description, ``/docs`` and ``/openapi.json``) answers 503 ``warming_up``, ``failed to
  start: <reason>`` (the daemon keeps running, so that health can say why), and a model that
  fails while serving is 503 ``model_unavailable``.
- Every response is counted in ``capd_requests_total``, those the guard gives before routing
  (401, 413 by Content-Length) under the route the request was for.
- Bad input the framework would let through is refused too, with a reason: a query parameter an
  endpoint does not know or that is given twice (422, as an unknown or repeated body field is:
  ``?sesion=`` must not act without a session), an encoded slash in a session id (422:
  ``victim%2Fenable`` reached session ``victim``), and a JSON body that gives a key twice (the
  last one won silently), is not UTF-8, nests too deeply or holds a number over Python's digit
  limit (422 naming it, not a bare 400).
- Every session id that is not one (path, query, body, encoded slash) answers ``invalid_session_id``.
- ``HEAD`` is answered wherever ``GET`` is, and a 405 lists every method its path allows.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from contextlib import asynccontextmanager
from typing import Annotated, Any
from urllib.parse import parse_qsl

from fastapi import Body, FastAPI, Query, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from capd import api_docs
from capd.capability_tool import TOOL_SCHEMA, run_capability_call
from capd.encoder import Encoder
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
from capd.origin import LocalAddresses
from capd.schemas import (
    SESSION_PATTERN,
    TEXT_ERRORS,
    BumpedOut,
    CapabilitiesOut,
    CapabilityCall,
    CapabilityCallOut,
    CapabilityToolOut,
    DiscoverBody,
    DiscoverOut,
    DroppedOut,
    HealthOut,
    NameBody,
    PlanOut,
    ReloadBody,
    ReloadOut,
    RouteBody,
    RouteOut,
    SessionOut,
    SessionPath,
    ToolResultBody,
    candidates_out,
    responses_for,
)
from capd.service import ClientGone, Service
from capd.sessions import check_session_id
from capd.settings import Settings
from capd.text import DuplicateKey, finite, printable_strings, unique_keys
from capd.watcher import TapWatcher

log = logging.getLogger(__name__)

# Seconds between checks of learned.sqlite3 for commits by other processes (capd learned forget, a
# second daemon on this data directory): a forgotten correction stops routing within this. A check
# costs a few microseconds (PRAGMA data_version) when nothing changed.
LEARNED_CHECK_INTERVAL = 2.0
UPKEEP_INTERVAL = 60.0  # seconds between session upkeep runs: retry the session file, expire idle sessions
MAX_MESSAGE_BYTES = 64 * 1024
MAX_BODY_BYTES = 256 * 1024
BODY_TOO_LARGE = f"request body over {MAX_BODY_BYTES} bytes"
ROUTE_PATH = "/v1/route"


class ApiError(Exception):
    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


def _check_size(text: str, field_name: str) -> str:
    size = len(text.encode("utf-8"))
    if size > MAX_MESSAGE_BYTES:
        raise ApiError(413, "too_large", f"{field_name} is {size} bytes; the limit is {MAX_MESSAGE_BYTES}")
    return text


def _jsonable(value: object) -> str:
    # The only non-JSON values a response can hold: TOML dates and times in a server spec.
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _json(content: Any) -> Response:
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
        return _json(printable_strings(content))


class _JSON(JSONResponse):
    """FastAPI's JSON response for what handlers return as dicts, with :func:`_json`'s care for
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


class _Route(APIRoute):
    """Every route's body is read with :func:`strict_json` (FastAPI's documented way to change
    how a request is read: a route class whose handler gets a request class of capd's own)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict


def _error(status: int, error: str, detail: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers)


class _BodyTooLarge(StarletteHTTPException):
    """Raised by the guard's ``receive`` once a body passes ``MAX_BODY_BYTES``. An HTTP exception
    because FastAPI re-raises those from body reading (any other one becomes a 400)."""

    def __init__(self) -> None:
        super().__init__(413, BODY_TOO_LARGE)


def _install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.error, exc.detail)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing and body-parsing errors (404, 405, unreadable JSON) get capd's shape too.
        codes = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}
        headers = dict(exc.headers) if exc.headers else {}
        if exc.status_code == 405:  # Starlette names the methods of the first route on the path only
            headers["Allow"] = ", ".join(_allowed_methods(request.scope))
        return _error(exc.status_code, codes.get(exc.status_code, "http_error"), str(exc.detail), headers or None)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {_reason(e)}" for e in exc.errors())
        kind = request.headers.get("content-type", "")
        if request.method == "POST" and not _is_json(kind) and any(e["loc"] == ("body",) for e in exc.errors()):
            # `curl -d '{…}'` sends a form: the JSON is there, but not read as JSON
            sent = f"as {kind}" if kind else "without a content type"
            detail += f" (the body was sent {sent}; send Content-Type: application/json)"
        code = InvalidSessionId.code if any(_is_session_id_error(e) for e in exc.errors()) else "invalid_request"
        return _error(422, code, detail)

    statuses: list[tuple[type[CapdError], int]] = [
        (UnknownSession, 404), (UnknownCapability, 404), (InvalidSessionId, 422), (PinnedCapability, 409),
        # capd cannot answer (a model giving NaN, a shutdown under way): not the request's fault
        (StateError, 503), (ModelError, 503), (Stopping, 503),
    ]
    for cls, status in statuses:
        def make(status: int, code: str) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
            async def handler(_: Request, exc: Exception) -> JSONResponse:
                return _error(status, code, str(exc))
            return handler
        app.add_exception_handler(cls, make(status, cls.code))

    @app.exception_handler(CapdError)
    async def capd_error(_: Request, exc: CapdError) -> JSONResponse:
        return _error(400, "bad_request", str(exc))


class _Guard:
    """Host and Origin (:mod:`capd.origin`), bearer token and body-size checks, unexpected errors as
    JSON 500s, request counting.

    A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's
    BaseHTTPMiddleware runs every request through an extra task and memory streams, which
    cost ~0.5 ms of CPU per request here (benchmarks/bench_daemon.py, about a sixth of the
    HTTP overhead of a route).
    """

    def __init__(self, app: ASGIApp, token: str | None, route: Any, addresses: LocalAddresses | None) -> None:
        self.app = app
        self.token = token
        self.addresses = addresses  # None: any Host (a token, or a Unix socket)
        self.fast_route = _FastRoute(app, route)  # POST /v1/route; ``route`` is the app's route object

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.addresses is not None and (why := self.addresses.refusal(scope["headers"])) is not None:
            await self._reject(scope, receive, send, _error(403, "forbidden_host", why))
            return
        headers = Headers(scope=scope)
        if self.token is not None:
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), self.token.encode()):
                await self._reject(scope, receive, send, _error(401, "unauthorized", "missing or wrong bearer token",
                                                                headers={"WWW-Authenticate": "Bearer"}))
                return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            await self._reject(scope, receive, send, _error(413, "too_large", BODY_TOO_LARGE))
            return
        head = scope["method"] == "HEAD"  # answered as GET, without the body (Content-Length kept)
        if head:
            scope = {**scope, "method": "GET"}
        if (refusal := _refusal(scope)) is not None:
            await self._reject(scope, receive, send, refusal)
            return
        status = 500
        started = False
        received = 0

        async def receive_counting() -> Message:
            # A chunked body has no Content-Length: count what actually arrives.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > MAX_BODY_BYTES:
                    raise _BodyTooLarge()
            return message

        async def send_noting_status(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            elif head and message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        fast = scope["method"] == "POST" and scope["path"] == ROUTE_PATH
        try:
            await (self.fast_route if fast else self.app)(scope, receive_counting, send_noting_status)
        except _BodyTooLarge:  # read outside a route's handlers (they answer it themselves)
            if started:
                raise
            status = 413
            await _error(413, "too_large", BODY_TOO_LARGE)(scope, receive, send)
        except Exception:  # a bug, not bad input: log it, answer JSON
            log.exception("internal error on %s %s", scope["method"], scope["path"])
            if started:
                raise
            status = 500
            await _error(500, "internal", "internal error; see the daemon log")(scope, receive, send)
        self._count({**scope, "method": "HEAD"} if head else scope, status)

    @classmethod
    async def _reject(cls, scope: Scope, receive: Receive, send: Send, response: JSONResponse) -> None:
        """Answer before the app has seen the request (a bad token, a Content-Length over the
        limit), counted under the route the app would have matched."""
        await response(scope, receive, send)
        cls._count({**scope, "route": _matching_route(scope)}, response.status_code)

    @staticmethod
    def _count(scope: Scope, status: int) -> None:
        service: Service | None = getattr(scope["app"].state, "service", None)
        if service is None:
            return
        path = getattr(scope.get("route"), "path", "unmatched")  # the template, so ids do not explode the series
        service.metrics.inc("capd_requests_total", "HTTP requests by method, path and status.",
                            method=scope["method"], path=path, status=str(status))


def _matching_route(scope: Scope) -> BaseRoute | None:
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


def _install_middleware(app: FastAPI, settings: Settings) -> None:
    """After the routes: the guard's fast path counts its requests under the app's route object."""
    route = next(r for r in app.routes if getattr(r, "path", None) == ROUTE_PATH)
    token_less_tcp = settings.token is None and settings.uds is None
    app.add_middleware(_Guard, token=settings.token, route=route,
                       addresses=LocalAddresses(settings.host) if token_less_tcp else None)


def create_app(settings: Settings, encoder: Encoder | None = None, watch: bool = True,
               warm_in_background: bool = True) -> FastAPI:
    """Build the app. ``encoder`` replaces the configured model (tests pass a fake)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = Service(settings, encoder=encoder, sessions=True)
        app.state.service = service
        watcher: TapWatcher | None = None
        stop = threading.Event()
        creating = threading.Lock()  # the shutdown sees the watcher, or the warm-up sees the stop

        def warm() -> None:
            nonlocal watcher
            with creating:
                if stop.is_set():
                    return
                if watch and settings.watch != "off":  # before the taps load: edits made meanwhile apply once they have
                    watcher = TapWatcher(service)
                    watcher.observe()
            try:
                service.start()
            except Exception as exc:
                if stop.is_set() or isinstance(exc, Stopping):
                    log.info("start interrupted: capd is stopping")
                elif isinstance(exc, CapdError):  # a model that is not there, a data directory that cannot be used
                    log.error("capd failed to start: %s", exc)
                else:
                    log.exception("capd failed to start")
                return
            log.info("ready: %d capabilities in %.2fs", len(service.catalog_now()), service.ready_after or 0)
            if watcher is not None and not stop.is_set():
                watcher.apply()
            upkeep(service, stop)

        thread = threading.Thread(target=warm, name="capd-warmup", daemon=True)
        thread.start()
        if not warm_in_background:
            while thread.is_alive() and not service.ready and service.startup_error is None:
                thread.join(0.05)
        try:
            yield
        finally:
            stop.set()
            service.interrupt()  # before joining the watcher, which may be publishing a reload
            with creating:
                started = watcher
            if started is not None:
                started.stop()
            service.close()

    app = FastAPI(title="capd", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,  # CDN pages
                  default_response_class=_JSON,
                  description="Local capability router for AI agents. Every endpoint: the README, *HTTP API*.",
                  redirect_slashes=False)  # a trailing slash is a 404 with a reason, not a bare 307
    app.router.route_class = _Route
    _install_handlers(app)
    _install_routes(app)
    _install_middleware(app, settings)
    return app


def upkeep(service: Service, stop: threading.Event) -> None:
    """The daemon's periodic work, in its warm-up thread (off the event loop) until ``stop``:
    learned examples changed by another process every :data:`LEARNED_CHECK_INTERVAL` seconds,
    session upkeep every :data:`UPKEEP_INTERVAL`. A failure is logged and the loop goes on."""
    upkeep_at = time.monotonic() + UPKEEP_INTERVAL
    while not stop.wait(LEARNED_CHECK_INTERVAL):
        try:
            service.refresh_learned()  # logs a file it cannot read once; a failing publish once per change
        except Stopping:
            return
        except Exception:
            log.exception("cannot route with the learned examples changed by another process")
        if time.monotonic() < upkeep_at or stop.is_set():
            continue
        upkeep_at = time.monotonic() + UPKEEP_INTERVAL
        if service.registry is not None:
            try:
                service.reattach_state()
                service.registry.expire()
            except Exception:
                log.exception("session upkeep failed; retrying in %.0f s", UPKEEP_INTERVAL)


def _service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


def _started(request: Request) -> Service:
    """The service, unless its start failed: then 503 ``warming_up``, ``failed to start: <reason>``
    (README), also for the endpoints that need no model (``/metrics``, the tool schema)."""
    service = _service(request)
    _check_started(service)
    return service


def _check_started(service: Service) -> None:
    if service.startup_error is not None and not service.ready:  # never "warming up" forever
        raise ApiError(503, "warming_up", f"{FAILED_START} {service.startup_error}")


def _ready(request: Request) -> Service:
    service = _started(request)
    if not service.ready:
        raise ApiError(503, "warming_up", "the model and index are still loading")
    return service


def _registry(request: Request) -> Any:
    service = _ready(request)
    if service.registry is None:
        raise ApiError(503, "no_sessions", "this service runs without sessions")
    return service.registry


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


def _media_type(content_type: str) -> str:
    """A Content-Type without its parameters, lower case (``application/json; charset=utf-8``: ``application/json``)."""
    return content_type.partition(";")[0].strip().lower()


def _is_json(content_type: str) -> bool:
    """Whether a Content-Type is JSON as FastAPI reads it: ``application/json`` or ``application/*+json``."""
    media = _media_type(content_type)
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


def _refusal(scope: Scope) -> JSONResponse | None:
    """Bad input the routes would take without a word: an encoded slash in a path (the session id is
    the only path parameter; ``victim%2Fenable`` is decoded before routing and enabled in session
    ``victim``), and a query parameter an API endpoint (``/v1/…``) does not declare or that is given
    more than once."""
    raw_path = scope.get("raw_path", b"")
    if b"%" in raw_path and b"%2f" in raw_path.lower() and scope["path"].startswith("/v1/sessions/"):
        return _error(422, InvalidSessionId.code, f"path.session: invalid session id: {InvalidSessionId.rule}")
    query = scope.get("query_string", b"")
    if not query or not scope["path"].startswith("/v1/"):  # the API's own endpoints (not /docs, /metrics)
        return None
    route = next((r for r in scope["app"].routes if r.matches(scope)[0] is Match.FULL), None)
    if not isinstance(route, APIRoute):
        return None  # no such endpoint, or not this method: the router's 404 or 405 says so
    known = _query_names(route.dependant)
    names = [name for name, _ in parse_qsl(query.decode("latin-1"), keep_blank_values=True)]
    problems = [f"query.{name}: Extra inputs are not permitted" for name in dict.fromkeys(names) if name not in known]
    # the framework keeps the last of a repeated parameter (?session=a&session=b listed b), as a
    # JSON parser keeps the last of a repeated key: both are refused rather than guessed
    problems += [f"query.{name}: given {names.count(name)} times" for name in dict.fromkeys(names)
                 if name in known and names.count(name) > 1]
    if not problems:
        return None
    return _error(422, "invalid_request", "; ".join(problems))


async def _route(service: Service, body: RouteBody, gone: threading.Event | None = None) -> Response:
    """``POST /v1/route``. async: the turn waits on the micro-batcher's future, not in a threadpool
    thread (:meth:`~capd.service.Service.aroute` says where the decision runs)."""
    _check_size(body.message, "message")
    _check_started(service)
    result = await service.aroute(body.message, body.session, gone)
    return _json(result.as_dict())


async def _until_gone(receive: Receive, gone: threading.Event, route: asyncio.Future[Response]) -> None:
    """Once the request's body is read, the next message is ``http.disconnect``: when it comes
    before the answer, the client stopped waiting, so the route is cancelled (its encoding is skipped
    if it has not run: 2,000 routes sent and dropped delayed a live agent's next route by 5.8 s) and
    its session left unchanged (``gone``)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()
    route.cancel()


def _cancelled() -> bool:
    """Whether the running task itself is being cancelled (a stop), not only something it awaited."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _FastRoute:
    """``POST /v1/route`` (the call an agent makes every turn) without FastAPI's routing, dependency
    solving and exception middleware. Measured as the daemon's own cost per route (``python -m
    benchmarks.bench_daemon --overhead``: hash model, raw-socket client), the previous commit against
    this one, three interleaved rounds: p50 1.99 / 2.14 / 2.14 → 1.92 / 2.09 / 1.96 ms, daemon CPU
    1.89 / 2.08 / 2.11 → 1.84 / 2.00 / 1.89 ms per route. A small share of a 7–10 ms route, on
    the path every turn takes.

    Only a request FastAPI would accept as it stands takes this path: a JSON content type and a
    body that parses as JSON and validates as :class:`~capd.schemas.RouteBody` (the same parser and
    the same model). Anything else is handed to ``app`` with the body it read replayed, so every
    rejection keeps its one code path and its answer. Errors the service raises are answered by the
    app's own exception handlers; ``scope["route"]`` is the app's route, for the request metrics.
    """

    def __init__(self, app: ASGIApp, route: Any) -> None:
        self.app = app
        self.route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["route"] = self.route  # as the app's router would set it: a body over the limit is counted here too
        read: list[Message] = []
        while not read or (read[-1]["type"] == "http.request" and read[-1].get("more_body", False)):
            read.append(await receive())
        body = self._parse(scope, read)
        if body is None:
            await self.app(scope, self._replay(read, receive), send)
            return
        fastapi_app = scope["app"]
        gone = threading.Event()
        route = asyncio.ensure_future(_route(fastapi_app.state.service, body, gone))
        watch = asyncio.ensure_future(_until_gone(receive, gone, route))
        try:
            response = await route
        except (asyncio.CancelledError, ClientGone):
            if gone.is_set() and not _cancelled():  # the client left: nobody to answer
                log.debug("route dropped: its client disconnected before the answer")
                return
            raise
        except (ApiError, CapdError) as exc:
            handler = next(fastapi_app.exception_handlers[cls] for cls in type(exc).__mro__
                           if cls in fastapi_app.exception_handlers)
            response = await handler(Request(scope), exc)
        finally:
            watch.cancel()
        await response(scope, receive, send)

    @staticmethod
    def _parse(scope: Scope, read: list[Message]) -> RouteBody | None:
        if read[-1]["type"] != "http.request":  # the client went away: the app deals with it
            return None
        content_type = Headers(scope=scope).get("content-type", "")
        if _media_type(content_type) != "application/json":
            return None
        try:
            return RouteBody.model_validate(strict_json(b"".join(m.get("body", b"") for m in read)))
        except Exception:  # any failure (JSON, validation) is the app's to answer, its own way
            return None

    @staticmethod
    def _replay(read: list[Message], receive: Receive) -> Receive:
        pending = list(read)

        async def replayed() -> Message:
            return pending.pop(0) if pending else await receive()

        return replayed


def _install_routes(app: FastAPI) -> None:
    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:  # offline: capd.api_docs, not Swagger UI from a CDN
        return HTMLResponse(api_docs.render(app.openapi()))

    @app.get("/v1/health", response_model=None, responses=responses_for(HealthOut))
    def health(request: Request) -> dict[str, Any]:
        return _service(request).health()

    @app.get("/v1/capabilities", response_model=None, responses=responses_for(CapabilitiesOut))
    def capabilities(request: Request, session: Annotated[str | None, Query(
            min_length=1, max_length=128, pattern=SESSION_PATTERN)] = None) -> dict[str, Any]:
        service = _ready(request)
        active = set(service.registry.active_names(session)) if session and service.registry else set()
        return {"capabilities": [{**c.summary(), "active": c.name in active} for c in service.catalog_now()]}

    @app.post("/v1/discover", response_model=None, responses=responses_for(DiscoverOut))
    def discover(request: Request, body: DiscoverBody) -> Response:
        service = _ready(request)
        _check_size(body.intent, "intent")
        return _json({"candidates": candidates_out(service.discover(body.intent, body.limit))})

    @app.post(ROUTE_PATH, response_model=None, responses=responses_for(RouteOut))
    async def route(request: Request, body: RouteBody) -> Response:
        # Normally answered by _FastRoute, which shares _route; this handler serves what it passes on.
        return await _route(_service(request), body)

    @app.get("/v1/sessions/{session}", response_model=None, responses=responses_for(SessionOut))
    def get_session(request: Request, session: SessionPath) -> dict[str, Any]:
        state: dict[str, Any] = _registry(request).get(session).as_dict()
        return state

    # A plan carries server specs verbatim, tap-defined keys too: it goes out through _json, which
    # writes a NaN or inf there as null where FastAPI's encoder would raise (a 500 after the change).
    @app.get("/v1/sessions/{session}/plan", response_model=None, responses=responses_for(PlanOut))
    def resume_plan(request: Request, session: SessionPath) -> Response:
        """What to start, from nothing, to run the session as capd holds it (after a lost plan)."""
        return _json(_registry(request).resume(session).as_dict())

    @app.delete("/v1/sessions/{session}", response_model=None, responses=responses_for(DroppedOut))
    def drop_session(request: Request, session: SessionPath) -> Response:
        return _json({"dropped": session, "plan": _registry(request).drop(session).as_dict()})

    @app.post("/v1/sessions/{session}/enable", response_model=None, responses=responses_for(PlanOut))
    def enable(request: Request, session: SessionPath, body: NameBody) -> Response:
        return _json(_registry(request).activate(session, body.name, "manual").as_dict())

    @app.post("/v1/sessions/{session}/disable", response_model=None, responses=responses_for(PlanOut))
    def disable(request: Request, session: SessionPath, body: NameBody) -> Response:
        return _json(_registry(request).deactivate(session, body.name).as_dict())

    @app.post("/v1/sessions/{session}/tool-result", response_model=None,
              responses=responses_for(BumpedOut))
    def tool_result(request: Request, session: SessionPath, body: ToolResultBody) -> dict[str, Any]:
        bumped = _registry(request).tool_result(session, body.server, body.tool, body.ok)
        return {"bumped": bumped}

    @app.post("/v1/reload", response_model=None, responses=responses_for(ReloadOut))
    def reload(request: Request, body: ReloadBody | None = None) -> dict[str, Any]:
        return _ready(request).reload()  # a body is only checked: a field it does not know is a 422

    @app.get("/metrics", response_class=PlainTextResponse, responses=TEXT_ERRORS)
    def metrics(request: Request) -> str:
        return _started(request).metrics.render()

    @app.get("/v1/capability-tool", response_model=None, responses=responses_for(CapabilityToolOut))
    def capability_tool(request: Request) -> dict[str, Any]:
        _started(request)
        return TOOL_SCHEMA

    @app.post("/v1/sessions/{session}/capability", response_model=None,
              responses=responses_for(CapabilityCallOut))
    def capability_call(request: Request, session: SessionPath,
                        body: Annotated[CapabilityCall, Body()]) -> Response:
        service = _ready(request)
        check_session_id(session)  # a bad id is the agent's bug (422), not a tool result for the model
        if body.intent is not None:
            _check_size(body.intent, "intent")
        return _json(run_capability_call(service, session, body.action, body.name, body.intent))
