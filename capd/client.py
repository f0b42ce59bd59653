"""The Python client of the capd daemon (also what the CLI uses).

Example, before each agent turn::

    from capd.client import CapdClient

    with CapdClient() as capd:
        result = capd.route("session-1", user_message)
        apply(result["plan"])        # start / stop MCP servers, adjust the tool list
"""

from __future__ import annotations

import ipaddress
import json
from types import TracebackType
from typing import Any

from capd.errors import (
    FAILED_START,
    CapdError,
    ClientError,
    DaemonFailedToStart,
    DaemonUnreachable,
    PinnedCapability,
    UnknownCapability,
    UnknownSession,
)
from capd.sessions import check_session_id
from capd.transport import Transport, TransportError


class ApiError(ClientError):
    """The daemon answered with an error: ``status``, ``error`` code and ``detail``."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(f"{status} {error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail


def _error(status: int, payload: dict[str, Any], session: str | None, name: object) -> CapdError:
    """The exception for an error answer; the typed ones are built from the id or name asked about
    (their message says "unknown session 'x'" by itself; the daemon's detail would say it twice)."""
    error, detail = str(payload.get("error")), str(payload.get("detail"))
    if error == "unknown_session" and session is not None:
        return UnknownSession(session)
    if error == "unknown_capability" and isinstance(name, str):
        return UnknownCapability(name)
    if error == PinnedCapability.code and isinstance(name, str):
        return PinnedCapability(name)
    if status == 503 and error == "warming_up" and detail.startswith(FAILED_START):
        # not warming up: it will not answer until restarted, and the CLI exits 3 for it (DESIGN)
        return DaemonFailedToStart(f"the daemon failed to start: {detail.removeprefix(FAILED_START).strip()}")
    return ApiError(status, error, detail)


def base_url(host: str, port: int) -> str:
    """The daemon's URL: an IPv6 host is bracketed (``http://[::1]:7171``), given with brackets or not."""
    host = bare_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bare_host(host: str) -> str:
    """``host`` without the brackets of a URL (``[::1]`` -> ``::1``), as sockets want it."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def check_host(host: str) -> str:
    """``host`` if it is a host name or an IP address (IPv6 with or without brackets); else a
    ValueError saying why. A port given with it (``127.0.0.1:7171``), a URL or a space made every
    client die with a traceback from :mod:`urllib.parse` or :mod:`http.client`."""
    bare = bare_host(host)
    if ":" in bare:  # only IPv6 addresses hold a colon
        try:
            ipaddress.IPv6Address(bare)
        except ValueError:
            one_port = bare.count(":") == 1 and bare.rpartition(":")[2].isdigit()  # 127.0.0.1:7171
            hint = "; give the port apart (--port, CAPD_PORT)" if one_port else ""
            raise ValueError(f"{host!r} is not a host name or IP address{hint}") from None
    elif not bare or any(c.isspace() or not c.isprintable() or c in "/[]@?#%\\" for c in bare):
        raise ValueError(f"{host!r} is not a host name or IP address")
    return host


# The keys every answer of these endpoints has (README, "HTTP API (v1)").
HEALTH_KEYS = ("status", "ready", "model", "capabilities", "triggers", "embedded", "cached", "errors")
PLAN_KEYS = ("start", "teardown", "active")


def _session_path(session: str, action: str = "") -> str:
    """``/v1/sessions/<id>[/<action>]``, the id checked first: sent as it is, an id such as
    ``a/../b`` would name another session (HTTP clients collapse ``..``), so the daemon's rule
    (:func:`capd.sessions.check_session_id`) is applied here and a bad id raises
    :class:`capd.errors.InvalidSessionId` before anything is sent."""
    return f"/v1/sessions/{check_session_id(session)}" + (f"/{action}" if action else "")


class CapdClient:
    def __init__(self, url: str = "http://127.0.0.1:7171", token: str | None = None, uds: str | None = None,
                 timeout: float = 10.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url if not uds else "http://capd"
        self._where = uds or url
        self._timeout = timeout
        self._http = Transport(url, uds, timeout, headers)

    def __enter__(self) -> CapdClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              params: dict[str, str] | None = None, session: str | None = None,
              expect: tuple[str, ...] = ()) -> dict[str, Any]:
        """One request; ``session`` is the session id in ``path``, for :class:`UnknownSession`;
        ``expect`` the keys a capd answer has (an answer without them is from something else)."""
        try:
            data = None if body is None else json.dumps(body, ensure_ascii=False).encode("utf-8")
            answer = self._http.request(method, path, data, params)
        except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800"), which no UTF-8 request can carry
            raise ClientError("the request is not Unicode text: it holds a lone surrogate "
                              f"({exc.object[exc.start:exc.end]!r})") from None
        except TransportError as exc:
            if exc.timed_out:  # a daemon may be there, busy or stopped: starting another would find its address taken
                raise DaemonUnreachable(f"{self._where} did not answer within {self._timeout:g} s ({exc}); "
                                        "is the daemon there stopped or overloaded?") from None
            raise DaemonUnreachable(f"no capd daemon answering at {self._where} ({exc}); "
                                    "start one with `capd serve` (or `make serve` in a checkout)") from None
        try:
            payload = json.loads(answer.body)
        except ValueError:
            payload = None
        # capd answers every call, errors included, with a JSON object; another HTTP server (a web
        # server left on the port, a proxy's error page) is said to be one, not shown as raw HTML.
        keys = ("error",) if answer.status >= 400 else expect
        if not isinstance(payload, dict) or any(key not in payload for key in keys):
            kind = (answer.content_type or "no content type").split(";")[0]
            raise DaemonUnreachable(f"{self._where} does not look like a capd daemon ({method} {path} answered "
                                    f"{answer.status} with {kind}, not capd's JSON)")
        if answer.status >= 400:
            raise _error(answer.status, payload, session, (body or {}).get("name"))
        return payload

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/v1/health", expect=HEALTH_KEYS)

    def route(self, session: str | None, message: str) -> dict[str, Any]:
        """Route one message; a bad session id raises :class:`capd.errors.InvalidSessionId` before
        anything is sent, as the session calls do."""
        if session is not None:
            check_session_id(session)
        return self._call("POST", "/v1/route", {"session": session, "message": message}, expect=("decision",))

    def discover(self, intent: str, limit: int = 5) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("POST", "/v1/discover", {"intent": intent, "limit": limit},
                                                  expect=("candidates",))["candidates"]
        return result

    def capabilities(self, session: str | None = None) -> list[dict[str, Any]]:
        # "" is a (bad) session id, for the daemon to refuse: not no session, which lists none active
        params = {"session": session} if session is not None else None
        result: list[dict[str, Any]] = self._call("GET", "/v1/capabilities", params=params,
                                                  expect=("capabilities",))["capabilities"]
        return result

    def session(self, session: str) -> dict[str, Any]:
        return self._call("GET", _session_path(session), session=session, expect=("active",))

    def resume_plan(self, session: str) -> dict[str, Any]:
        """``GET /v1/sessions/{id}/plan``: every server the session's active capabilities run, to
        start from nothing (after a route or enable whose answer was lost to a transport error)."""
        return self._call("GET", _session_path(session, "plan"), session=session, expect=PLAN_KEYS)

    def drop(self, session: str) -> dict[str, Any]:
        return self._call("DELETE", _session_path(session), session=session, expect=("dropped",))

    def enable(self, session: str, name: str) -> dict[str, Any]:
        return self._call("POST", _session_path(session, "enable"), {"name": name}, session=session, expect=PLAN_KEYS)

    def disable(self, session: str, name: str) -> dict[str, Any]:
        return self._call("POST", _session_path(session, "disable"), {"name": name}, session=session,
                          expect=PLAN_KEYS)

    def tool_result(self, session: str, server: str, tool: str, ok: bool) -> list[str]:
        result: list[str] = self._call("POST", _session_path(session, "tool-result"),
                                       {"server": server, "tool": tool, "ok": ok}, session=session,
                                       expect=("bumped",))["bumped"]
        return result

    def reload(self) -> dict[str, Any]:
        return self._call("POST", "/v1/reload", expect=("capabilities", "added", "removed", "changed"))

    def capability_tool(self) -> dict[str, Any]:
        return self._call("GET", "/v1/capability-tool", expect=("name", "parameters"))

    def capability_call(self, session: str, action: str, name: str | None = None,
                        intent: str | None = None) -> dict[str, Any]:
        body = {"action": action, "name": name, "intent": intent}
        return self._call("POST", _session_path(session, "capability"), body, session=session, expect=("text", "plan"))
