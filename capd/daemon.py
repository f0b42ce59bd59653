"""Run the daemon: configure logging, bind the socket, serve the app with uvicorn.

The only place capd configures logging handlers. Sockets are bound here (not by uvicorn)
so that a port in use is reported as a clear error and a Unix socket gets mode 0600
before anyone can connect. uvicorn handles SIGINT / SIGTERM with a graceful shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import ipaddress
import logging
import os
import socket
from pathlib import Path
from typing import BinaryIO

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from capd.api import create_app
from capd.atomic import flocked
from capd.client import bare_host, base_url
from capd.errors import CapdError, ConfigError
from capd.settings import Settings, own_data_dir

log = logging.getLogger(__name__)


class StartError(CapdError):
    """The daemon cannot start (``capd serve`` exits 3, as DESIGN says of a failed start)."""


class BindError(StartError):
    """The daemon could not listen where it was told to."""


SERVED = "another capd is serving there (stop it, or use another --uds)"


# Libraries whose debug lines describe each file event or HTTP call: at ``--log-level debug`` a log
# file where the daemon watches (a tap's parent folder) made watchdog log an event per line it
# wrote, without end. Debug there means capd's own detail.
# An agent routes once per turn, and turns are seconds to a minute apart: with uvicorn's 5 s default
# nearly every turn would open a new connection (0.2-0.7 ms more per route here, more through httpx).
# An idle connection costs the daemon a file descriptor and a few kB.
KEEP_ALIVE_S = 75
# How long a stopping daemon waits for requests under way. uvicorn's default is no limit: one client
# stalled mid-request (half a body sent, then suspended) kept a SIGTERM-ed daemon running, its
# sessions not stored. A route takes milliseconds and a reload seconds (8-9 s for an edit of a
# 1,000-capability tap on the fused rule); what still runs after this is cancelled (uvicorn answers
# it 500), and the shutdown (storing sessions and corrections) goes on.
SHUTDOWN_GRACE_S = 10
# How long a connection may take to send a request's head (line and headers): from when it opens, and
# from a request's first byte. uvicorn arms its keep-alive timer only after a response, so a client that
# connected and sent nothing, or half a request line, held its file descriptor for as long as it liked:
# 400 such connections took a daemon from 32 to 432 descriptors for good, and with the descriptor limit
# reached, agents' new connections were reset with nothing logged.
HEADERS_S = 10
QUIET_AT_DEBUG = ("watchdog", "httpx", "httpcore", "urllib3", "filelock", "asyncio")


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level.upper() == "DEBUG":
        for name in QUIET_AT_DEBUG:
            logging.getLogger(name).setLevel(logging.INFO)


def bind(settings: Settings) -> tuple[socket.socket, BinaryIO | None]:
    """The listening socket, and for a Unix socket the lock on its path (held while serving)."""
    if settings.uds is not None:
        return _bind_unix(Path(settings.uds))
    host = bare_host(settings.host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
    # without it Nagle + delayed ACK add ~40 ms to every response on loopback.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, settings.port))
        # At once: with SO_REUSEADDR a port nobody listens on yet may be bound twice, so of two daemons
        # starting together both got here, and the later one's listen, in uvicorn, failed silently: it
        # ran "ready", unreachable. Listening here, the later one fails here, with the reason.
        sock.listen()
    except OSError as exc:
        sock.close()
        hint = " (is another capd running? try --port)" if exc.errno == errno.EADDRINUSE else ""
        where = base_url(host, settings.port).removeprefix("http://")
        raise BindError(f"cannot listen on {where}: {exc.strerror or exc}{hint}") from None
    return sock, None


def lock_path(uds: Path) -> Path:
    """The file a daemon serving on ``uds`` holds ``flock``-ed: ``<socket>.lock``, beside it."""
    return uds.with_name(uds.name + ".lock")


def _bind_unix(path: Path) -> tuple[socket.socket, BinaryIO]:
    """Bind ``path``, replacing a stale socket. The probe-unlink-bind sequence runs under an
    exclusive ``flock`` on :func:`lock_path`, kept for as long as the daemon serves: two daemons
    starting at once on a stale socket would otherwise both find it stale, and the later one would
    unlink the earlier one's fresh socket. The kernel drops the lock of a killed daemon, so a stale
    socket never blocks a start. The probe stays for a daemon that holds no lock (an older capd)."""
    try:
        lock = flocked(lock_path(path), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        raise BindError(f"cannot bind {path}: cannot open {lock_path(path).name} beside it: "
                        f"{exc.strerror or exc}") from None
    if lock is None:
        raise BindError(f"cannot bind {path}: {SERVED}")
    try:
        if path.exists():
            if not path.is_socket():
                raise BindError(f"{path} exists and is not a socket; refusing to replace it")
            _refuse_if_served(path)
            try:
                path.unlink(missing_ok=True)  # stale: left by a daemon that was killed
            except OSError as exc:  # another user's, in a folder this user may not write (a sticky /tmp)
                raise BindError(f"cannot bind {path}: no capd serves there, but cannot remove it: "
                                f"{exc.strerror or exc}; remove it, or use another --uds") from None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is created 0600: only this user may talk to the daemon
        try:
            sock.bind(str(path))
        except OSError as exc:  # "AF_UNIX path too long" has no strerror
            sock.close()
            raise BindError(f"cannot bind {path}: {exc.strerror or exc}") from None
        finally:
            os.umask(old)
    except BaseException:
        _release(path, lock)
        raise
    os.chmod(path, 0o600)
    # Listening at once (uvicorn would only later): an older capd starting meanwhile on this path then
    # finds it served, not stale, and refuses instead of replacing it.
    sock.listen()
    return sock, lock


def _release(uds: Path, lock: BinaryIO) -> None:
    """Remove the lock file of ``uds`` and release it: unlinked while still held, so that no daemon
    locks a file about to go (:func:`capd.atomic.flocked` checks it locked the file at the path)."""
    with contextlib.suppress(OSError):
        lock_path(uds).unlink(missing_ok=True)
    lock.close()


def _refuse_if_served(path: Path) -> None:
    """A socket someone still listens on belongs to a live daemon: replacing it would leave that
    daemon running but unreachable. Only a refused connection proves the socket stale."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return
        except OSError as exc:  # a full backlog (timeout), a socket of another user: not provably stale
            raise BindError(f"cannot bind {path}: cannot tell whether it is in use "
                            f"({exc.strerror or exc}); remove it if no capd is serving there") from None
    raise BindError(f"cannot bind {path}: {SERVED}")


def socket_identity(path: Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file at ``path``, or None if there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def exposed_without_token(settings: Settings) -> bool:
    """Whether a daemon on these settings listens beyond this machine with no token: a TCP host
    that is not a loopback address (all of 127.0.0.0/8 and ::1 are) or ``localhost``."""
    if settings.uds is not None or settings.token:
        return False
    host = bare_host(settings.host).lower()
    if host == "localhost" or host.endswith(".localhost"):
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return True


def serve(settings: Settings) -> None:
    # What the daemon writes is this user's alone: sessions and learned corrections keep users'
    # messages word for word (a prompt holding a password), and the default umask made them 0644.
    os.umask(0o077)
    configure_logging(settings.log_level)
    try:
        own_data_dir(settings.data_dir)  # before listening: a refused directory is a start that fails at once
    except ConfigError as exc:
        raise StartError(str(exc)) from None
    sock, lock = bind(settings)
    # The port actually bound: with --port 0 the system chooses one.
    where = str(settings.uds) if settings.uds is not None else base_url(settings.host, sock.getsockname()[1])
    log.info("capd listening on %s; taps: %s; data: %s; rule %s (%s)", where, ", ".join(map(str, settings.taps)),
             settings.data_dir, settings.rule, settings.rule_from)
    if exposed_without_token(settings):
        log.warning("listening on %s without a token: anyone who can reach it can drive your agent's tools",
                    settings.host)
    app = create_app(settings)
    # httptools: uvicorn's C HTTP parser; ~0.4 ms less event-loop CPU per route than h11 (measured, 1 client).
    # loop "auto": uvloop (a dependency) where it imports, else asyncio; uvloop took ~0.15 ms (about a tenth)
    # off the daemon's own cost per route (`bench_daemon --overhead`, interleaved with asyncio).
    # log_config=None: uvicorn's lines go through capd's format, with the time (its own has none).
    config = uvicorn.Config(app, log_level=settings.log_level, access_log=False, lifespan="on", http=_Protocol,
                            loop="auto", log_config=None, timeout_keep_alive=KEEP_ALIVE_S,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    uds = Path(settings.uds) if settings.uds is not None else None
    server = _Server(config, uds, socket_identity(uds) if uds is not None else None, lock)
    try:
        server.run(sockets=[sock])
    finally:
        server.remove_socket()
        sock.close()


class _Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's head (:data:`HEADERS_S`)."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._await_head()

    def on_headers_complete(self) -> None:
        self._stop_waiting()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._stop_waiting()
        self._head_timer = self.loop.call_later(HEADERS_S, self._head_late)

    def _stop_waiting(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            log.debug("closing a connection that sent no complete request head within %s s", HEADERS_S)
            self.transport.close()


class _Server(uvicorn.Server):
    """Removes its Unix socket at shutdown: uvicorn re-raises SIGTERM afterwards, so a
    ``finally`` around ``run`` would never see a signal-triggered stop."""

    def __init__(self, config: uvicorn.Config, uds: Path | None, identity: tuple[int, int] | None,
                 lock: BinaryIO | None) -> None:
        super().__init__(config)
        self.uds = uds
        self.identity = identity  # (st_dev, st_ino) of the socket this process bound
        self.lock = lock  # the flock on the socket's lock file (:func:`lock_path`)

    def remove_socket(self) -> None:
        """Unlink the socket only while the path is still the one this process bound: after it was
        replaced (by a newer daemon, say) the path is someone else's, who would become unreachable.
        Then the lock file, while still holding it (a daemon waiting on it reopens the path)."""
        if self.uds is not None and self.identity is not None and socket_identity(self.uds) == self.identity:
            self.uds.unlink(missing_ok=True)
            self.identity = None
        if self.uds is not None and self.lock is not None:
            _release(self.uds, self.lock)
            self.lock = None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.remove_socket()  # first: a client then finds no daemon rather than one shutting down
        await super().shutdown(sockets)
        # A forced quit (a second Ctrl-C) stops waiting for requests under way, and uvicorn then skips
        # the app's shutdown too: its lifespan was cancelled at exit instead, logging two tracebacks.
        # Stopping the service (storing sessions and corrections) takes well under a second: do it.
        if self.force_exit and not self.lifespan.shutdown_event.is_set():
            await self.lifespan.shutdown()
