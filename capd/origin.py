"""Which requests may reach a daemon that has no token: those addressed to this machine.

Without a token the daemon trusts whoever can connect to it, which on ``127.0.0.1`` is meant to
be the local user. A web page the user opens can connect too. Cross-origin, the browser keeps
it from reading answers and from sending JSON, but through *DNS rebinding* (the page's own host
name made to resolve to ``127.0.0.1``) its requests are same-origin: it could read sessions and
enable capabilities, whose plans start MCP servers in the user's agent. Such a request names the
page's host in ``Host`` (and ``Origin``), never this machine's address, so without a token:

- ``Host`` must be an IP address, ``localhost`` (or a name under ``.localhost``), or the host the
  daemon was told to listen on (``--host``); a request without ``Host`` (HTTP/1.0) passes;
- ``Origin``, when a browser sends one, must name a loopback address, ``localhost`` (or a name
  under ``.localhost``) or the ``--host``: not any IP address, since a page served from one (a
  public address) could otherwise send the requests a browser sends cross-site without asking
  (``POST /v1/reload`` with no body: a rescan of every tap per request). ``null`` is refused.

With a token the check is off: a page cannot know the token, and the token is how to reach the
daemon under another name (a machine name on the LAN). A Unix socket has no host names to check.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from urllib.parse import urlsplit

from capd.client import bare_host


def _hostname(authority: str) -> str:
    """``host`` of a Host header's ``host``, ``host:port``, ``[v6]`` or ``[v6]:port``, lower case."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority[1:].partition("]")[0]
    host, _, port = authority.rpartition(":")
    if host and port.isdigit():
        return host
    return authority.rstrip(":")


def _origin_host(origin: str) -> str:
    """The host an ``Origin`` names, or "" (refused) when it cannot be parsed (``http://[::1``)."""
    try:
        return _hostname(urlsplit(origin).netloc)
    except ValueError:
        return ""


class LocalAddresses:
    """The host names a token-less daemon answers to (:func:`refusal` explains a refusal)."""

    def __init__(self, listen_host: str) -> None:
        self.names = {"localhost", bare_host(listen_host).lower()}

    def allows(self, host: str) -> bool:
        if host in self.names or host.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(host)
        except ValueError:
            return False
        return True

    def allows_origin(self, host: str) -> bool:
        if host in self.names or host.endswith(".localhost"):
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def refusal(self, headers: Sequence[tuple[bytes, bytes]]) -> str | None:
        """Why a request with these raw headers is refused, or None when it may go on."""
        for raw_name, raw_value in headers:
            name = raw_name.lower()
            if name not in (b"host", b"origin"):
                continue
            value = raw_value.decode("latin-1")
            if name == b"host":
                if not self.allows(_hostname(value)):
                    return (f"Host {value!r} is neither an IP address, localhost nor the host capd listens on, and "
                            "a daemon without a token answers only to those (a guard against DNS rebinding by web "
                            "pages): use one of them, or set a token")
            elif not self.allows_origin("" if value.strip() == "null" else _origin_host(value.strip())):
                return (f"Origin {value!r} is neither a loopback address, localhost nor the host capd listens on, "
                        "and a daemon without a token answers only to pages from those (a guard against web pages "
                        "driving it): use one of them, or set a token")
        return None
