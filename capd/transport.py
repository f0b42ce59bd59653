"""HTTP/1.1 to the daemon on the standard library's :mod:`http.client`: what :class:`capd.client.CapdClient`
sends its requests with.

An agent calls the daemon once per turn, so a client's own work is part of every turn: through
httpx one route per turn took 0.3-1.1 ms longer than through this transport, on kept-alive
connections both (``python -m benchmarks.bench_daemon --turns``, three runs, both rules).

Connections are kept alive and reused, one per concurrent caller (a small pool, so a client may
be shared between threads). The daemon closes a connection that stays idle for longer than its
keep-alive time; before a connection is reused it is checked, and one the daemon has closed is
replaced, so a request is never written into a closed connection. A request that fails on the way
is not sent again (a route changes session state).
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit

# A connection idle longer than this is not reused: the daemon closes one idle for 75 s
# (capd.daemon.KEEP_ALIVE_S), and one reused just as that close is under way fails its request
# (a route, which is not sent again). Opening a new one costs a fraction of a millisecond.
MAX_IDLE_S = 60.0


class TransportError(Exception):
    """The request did not get an answer: no daemon, a refused or broken connection, a timeout
    (``timed_out``: something may be there, busy or stopped)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes


class _UnixConnection(http.client.HTTPConnection):
    """:class:`http.client.HTTPConnection` over a Unix socket (the daemon's ``--uds``)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("capd", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class Transport:
    """Keep-alive connections to one daemon (``url``, or the Unix socket ``uds``)."""

    def __init__(self, url: str, uds: str | None, timeout: float, headers: dict[str, str]) -> None:
        parts = urlsplit(url)
        if uds is None and (parts.scheme not in ("http", "https") or not parts.hostname):
            raise ValueError(f"not an http:// or https:// URL: {url!r}")
        self._parts, self._uds, self._timeout = parts, uds, timeout
        self._prefix = "" if uds else parts.path.rstrip("/")
        self._headers = headers
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []  # and when it was given back
        self._clock = time.monotonic
        self._lock = threading.Lock()
        self._closed = False

    def request(self, method: str, path: str, body: bytes | None = None,
                params: dict[str, str] | None = None) -> Answer:
        """Send one request and read its whole answer; raises :class:`TransportError` when none came."""
        target = self._prefix + path + (f"?{urlencode(params)}" if params else "")
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = "application/json"
        connection = self._take()
        try:
            connection.request(method, target, body=body, headers=headers)
            response = connection.getresponse()
            answer = Answer(response.status, response.getheader("Content-Type") or "", response.read())
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise TransportError(exc.__class__.__name__, isinstance(exc, TimeoutError)) from exc
        except BaseException:
            connection.close()
            raise
        if response.will_close:
            connection.close()
        else:
            self._give_back(connection)
        return answer

    def close(self) -> None:
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for connection, _ in idle:
            connection.close()

    def _take(self) -> http.client.HTTPConnection:
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the client has been closed")
                connection, since = self._idle.pop() if self._idle else (None, 0.0)
            if connection is None:
                return self._open()
            if self._clock() - since <= MAX_IDLE_S and _still_open(connection):
                return connection
            connection.close()

    def _give_back(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append((connection, self._clock()))
                return
        connection.close()

    def _open(self) -> http.client.HTTPConnection:
        if self._uds is not None:
            return _UnixConnection(self._uds, self._timeout)
        kind = http.client.HTTPSConnection if self._parts.scheme == "https" else http.client.HTTPConnection
        return kind(self._parts.hostname or "", self._parts.port, timeout=self._timeout)


def _still_open(connection: http.client.HTTPConnection) -> bool:
    """An idle kept-alive connection has nothing to read: if it has, the daemon closed it (or broke it)."""
    sock = connection.sock
    if sock is None:
        return True  # not connected yet: http.client connects on the next request
    try:
        if hasattr(select, "poll"):  # not limited to descriptors below 1024, as select() is
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return not poller.poll(0)
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable
