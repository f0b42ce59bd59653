"""What runs before FastAPI for every request: the guard (Host and Origin, bearer token, body
size, the refusals of :mod:`capd.api_http`, JSON 500s, request counting) and the fast path of
``POST /v1/route``, the call an agent makes every turn, with the turn it runs.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from capd import api_http
from capd.api_http import (
    BODY_TOO_LARGE,
    MAX_BODY_BYTES,
    ApiError,
    BodyLate,
    BodyTooLarge,
    check_size,
    check_started,
    error_response,
    json_response,
    matching_route,
    media_type,
    refusal,
    strict_json,
)
from capd.errors import CapdError
from capd.origin import LocalAddresses
from capd.schemas import RouteBody
from capd.service import Service
from capd.session_routing import ClientGone
from capd.settings import Settings

log = logging.getLogger(__name__)

ROUTE_PATH = "/v1/route"


class _CountingReceive:
    """A request's ``receive`` that counts the body as it arrives (a chunked body has no
    Content-Length) and gives it ``api_http.BODY_S`` to arrive; once the body is in, the wait (for a
    disconnect while a route is under way) has no limit."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.received = 0
        self.body_by: float | None = asyncio.get_running_loop().time() + api_http.BODY_S  # None: the body is in

    async def __call__(self) -> Message:
        if self.body_by is None:
            message = await self.receive()
        else:
            try:
                async with asyncio.timeout_at(self.body_by):
                    message = await self.receive()
            except TimeoutError:
                raise BodyLate() from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > MAX_BODY_BYTES:
                raise BodyTooLarge()
            if not message.get("more_body", False):
                self.body_by = None
        return message


class Guard:
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
        self.fast_route = FastRoute(app, route)  # POST /v1/route; ``route`` is the app's route object

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (turned_away := self._turned_away(scope)) is not None:
            await self._reject(scope, receive, send, turned_away)
            return
        head = scope["method"] == "HEAD"  # answered as GET, without the body (Content-Length kept)
        if head:
            scope = {**scope, "method": "GET"}
        if (refused := refusal(scope)) is not None:
            await self._reject(scope, receive, send, refused)
            return
        status = 500
        started = False
        receive_counting = _CountingReceive(receive)

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
        except (BodyTooLarge, BodyLate) as exc:  # read outside a route's handlers (they answer it themselves)
            if started:
                raise
            status = exc.status_code
            code = "too_large" if isinstance(exc, BodyTooLarge) else "timeout"
            await error_response(status, code, exc.detail, dict(exc.headers or {}))(scope, receive, send)
        except Exception:  # a bug, not bad input: log it, answer JSON
            log.exception("internal error on %s %s", scope["method"], scope["path"])
            if started:
                raise
            status = 500
            await error_response(500, "internal", "internal error; see the daemon log")(scope, receive, send)
        self._count({**scope, "method": "HEAD"} if head else scope, status)

    def _turned_away(self, scope: Scope) -> JSONResponse | None:
        """The answer to a request refused before anything else: a Host or Origin that is not this
        daemon's, a missing or wrong bearer token, a declared body over the limit."""
        if self.addresses is not None and (why := self.addresses.refusal(scope["headers"])) is not None:
            return error_response(403, "forbidden_host", why)
        headers = Headers(scope=scope)
        if self.token is not None:
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), self.token.encode()):
                return error_response(401, "unauthorized", "missing or wrong bearer token",
                                      headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return error_response(413, "too_large", BODY_TOO_LARGE)
        return None

    @classmethod
    async def _reject(cls, scope: Scope, receive: Receive, send: Send, response: JSONResponse) -> None:
        """Answer before the app has seen the request (a bad token, a Content-Length over the
        limit), counted under the route the app would have matched."""
        await response(scope, receive, send)
        cls._count({**scope, "route": matching_route(scope)}, response.status_code)

    @staticmethod
    def _count(scope: Scope, status: int) -> None:
        service: Service | None = getattr(scope["app"].state, "service", None)
        if service is None:
            return
        path = getattr(scope.get("route"), "path", "unmatched")  # the template, so ids do not explode the series
        service.metrics.inc("capd_requests_total", "HTTP requests by method, path and status.",
                            method=scope["method"], path=path, status=str(status))


async def route_turn(service: Service, body: RouteBody, gone: threading.Event | None = None) -> Response:
    """``POST /v1/route``. async: the turn waits on the micro-batcher's future, not in a threadpool
    thread (:meth:`~capd.session_routing.SessionRouting.aroute` says where the decision runs)."""
    check_size(body.message, "message")
    check_started(service)
    result = await service.aroute(body.message, body.session, gone)
    return json_response(result.as_dict())


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


class FastRoute:
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
        route = asyncio.ensure_future(route_turn(fastapi_app.state.service, body, gone))
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
        if media_type(content_type) != "application/json":
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


def install_middleware(app: FastAPI, settings: Settings) -> None:
    """After the routes: the guard's fast path counts its requests under the app's route object."""
    route = next(r for r in app.routes if getattr(r, "path", None) == ROUTE_PATH)
    token_less_tcp = settings.token is None and settings.uds is None
    app.add_middleware(Guard, token=settings.token, route=route,
                       addresses=LocalAddresses(settings.host) if token_less_tcp else None)
