"""The HTTP API (DESIGN.md "HTTP API", v1), as a FastAPI app whose lifespan owns every resource.

- Errors are JSON ``{"error": code, "detail": text}`` with a 4xx status for bad input.
- Bodies over ``MAX_BODY_BYTES`` and messages over ``MAX_MESSAGE_BYTES`` get 413; a body not in
  whole within ``BODY_S`` of its head gets 408, its connection closed.
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

Its parts: the endpoints and the lifespan here; how a body is read, what is refused and how
errors become JSON in :mod:`capd.api_http`; the guard and the route fast path in
:mod:`capd.api_guard`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Body, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response

from capd import api_docs
from capd.api_guard import ROUTE_PATH, install_middleware, route_turn
from capd.api_http import ApiError, DefaultJSON, StrictRoute, check_size, check_started, install_handlers, json_response
from capd.capability_tool import TOOL_SCHEMA, run_capability_call
from capd.encoder import Encoder
from capd.errors import CapdError, Stopping
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
from capd.service import Service
from capd.sessions import check_session_id
from capd.settings import Settings
from capd.watcher import TapWatcher

log = logging.getLogger(__name__)

# Seconds between checks of learned.sqlite3 for commits by other processes (capd learned forget, a
# second daemon on this data directory): a forgotten correction stops routing within this. A check
# costs a few microseconds (PRAGMA data_version) when nothing changed.
LEARNED_CHECK_INTERVAL = 2.0
UPKEEP_INTERVAL = 60.0  # seconds between session upkeep runs: retry the session file, expire idle sessions


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
                  default_response_class=DefaultJSON,
                  description="Local capability router for AI agents. Every endpoint: the README, *HTTP API*.",
                  redirect_slashes=False)  # a trailing slash is a 404 with a reason, not a bare 307
    app.router.route_class = StrictRoute
    install_handlers(app)
    _install_routes(app)
    install_middleware(app, settings)
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
    check_started(service)
    return service


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


def _install_routes(app: FastAPI) -> None:
    """Every endpoint, in the order the OpenAPI document (and /docs) lists them."""
    _install_routing_routes(app)
    _install_session_routes(app)
    _install_daemon_routes(app)


def _install_routing_routes(app: FastAPI) -> None:
    """The docs page, health, the catalog, discover and route."""

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
        check_size(body.intent, "intent")
        return json_response({"candidates": candidates_out(service.discover(body.intent, body.limit))})

    @app.post(ROUTE_PATH, response_model=None, responses=responses_for(RouteOut))
    async def route(request: Request, body: RouteBody) -> Response:
        # Normally answered by FastRoute, which shares route_turn; this handler serves what it passes on.
        return await route_turn(_service(request), body)


def _install_session_routes(app: FastAPI) -> None:
    """A session's state and plan, and what an agent does to it."""

    @app.get("/v1/sessions/{session}", response_model=None, responses=responses_for(SessionOut))
    def get_session(request: Request, session: SessionPath) -> dict[str, Any]:
        state: dict[str, Any] = _registry(request).get(session).as_dict()
        return state

    # A plan carries server specs verbatim, tap-defined keys too: it goes out through json_response, which
    # writes a NaN or inf there as null where FastAPI's encoder would raise (a 500 after the change).
    @app.get("/v1/sessions/{session}/plan", response_model=None, responses=responses_for(PlanOut))
    def resume_plan(request: Request, session: SessionPath) -> Response:
        """What to start, from nothing, to run the session as capd holds it (after a lost plan)."""
        return json_response(_registry(request).resume(session).as_dict())

    @app.delete("/v1/sessions/{session}", response_model=None, responses=responses_for(DroppedOut))
    def drop_session(request: Request, session: SessionPath) -> Response:
        return json_response({"dropped": session, "plan": _registry(request).drop(session).as_dict()})

    @app.post("/v1/sessions/{session}/enable", response_model=None, responses=responses_for(PlanOut))
    def enable(request: Request, session: SessionPath, body: NameBody) -> Response:
        return json_response(_registry(request).activate(session, body.name, "manual").as_dict())

    @app.post("/v1/sessions/{session}/disable", response_model=None, responses=responses_for(PlanOut))
    def disable(request: Request, session: SessionPath, body: NameBody) -> Response:
        return json_response(_registry(request).deactivate(session, body.name).as_dict())

    @app.post("/v1/sessions/{session}/tool-result", response_model=None,
              responses=responses_for(BumpedOut))
    def tool_result(request: Request, session: SessionPath, body: ToolResultBody) -> dict[str, Any]:
        bumped = _registry(request).tool_result(session, body.server, body.tool, body.ok)
        return {"bumped": bumped}


def _install_daemon_routes(app: FastAPI) -> None:
    """Reload, metrics, and the capability tool an agent can hand its model."""

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
            check_size(body.intent, "intent")
        return json_response(run_capability_call(service, session, body.action, body.name, body.intent))
