"""The typed exception family of capd.

Every error capd raises on purpose derives from :class:`CapdError`, so a host
embedding capd can catch one type. Messages name the file, the key and the fix.

::

    CapdError
    ├── ConfigError            bad settings: config file, environment or flag
    ├── TapError               a tap file that cannot be used
    │   └── TapFileError       one file: path, optional line, reason
    ├── FixtureError           a routing fixture line or floors file that cannot be used
    ├── ModelError             the embedding model cannot be used
    │   ├── ModelNotAvailable  not on this machine (and nothing is downloaded)
    │   └── WeightsMismatch    sha256 of the weights differs from the manifest
    ├── CacheError             the vector cache cannot be opened or written
    ├── StateError             session state cannot be stored or read
    ├── UnknownCapability      a capability name not in the catalog
    ├── PinnedCapability       a pinned capability cannot be disabled
    ├── UnknownSession         a session id with no state
    ├── InvalidSessionId       a session id that is not 1–128 of [A-Za-z0-9._:-], not all dots (a ValueError)
    └── ClientError            the HTTP client could not get an answer
        └── DaemonUnreachable  no daemon listening where the client looked
"""

from __future__ import annotations

from pathlib import Path


class CapdError(Exception):
    """Base class of every error capd raises on purpose. ``code`` names it in the HTTP API's
    ``{"error": code}`` and the capability tool's answers."""

    code = "capd_error"


class ConfigError(CapdError):
    """A setting is invalid; the message names its source, key and reason."""

    def __init__(self, source: str, key: str | None, reason: str, line: int | None = None) -> None:
        self.source = source
        self.key = key
        self.reason = reason
        self.line = line  # in a config file, when known
        where = source if line is None else f"{source}: line {line}"
        where = f"{where}: {key}" if key else where
        super().__init__(f"{where}: {reason}")


class TapError(CapdError):
    """A tap (directory of capabilities) cannot be used."""


class TapFileError(TapError):
    """One file in a tap is broken. Carries the path, the line when known, and why."""

    def __init__(self, path: Path | str, reason: str, line: int | None = None) -> None:
        self.path = Path(path)
        self.reason = reason
        self.line = line
        where = f"{self.path}: line {line}" if line is not None else str(self.path)
        super().__init__(f"{where}: {reason}")

    def as_dict(self) -> dict[str, object]:
        return {"file": str(self.path), "line": self.line, "reason": self.reason}


class FixtureError(CapdError):
    """A fixture file or a floors file cannot be used."""

    def __init__(self, path: Path | str, reason: str, line: int | None = None) -> None:
        self.path = Path(path)
        self.line = line
        self.reason = reason
        where = f"{self.path}: line {line}" if line is not None else str(self.path)
        super().__init__(f"{where}: {reason}")


class ModelError(CapdError):
    """The embedding model cannot be used."""

    code = "model_unavailable"


class ModelNotAvailable(ModelError):
    """The model is not on this machine; capd never downloads one at run time."""


class WeightsMismatch(ModelError):
    """The weights on disk are not the ones the manifest pins."""


class Stopping(CapdError):
    """The service was closed while it was starting or publishing (HTTP 503: capd cannot answer);
    also raised inside a fit that :meth:`capd.service.Service.interrupt` cut short."""

    code = "stopping"


class CacheError(CapdError):
    """The vector cache cannot be opened or written."""


class StateError(CapdError):
    """Session state cannot be stored or read."""

    code = "state_unavailable"


class UnknownCapability(CapdError):
    """A capability name that the catalog does not hold."""

    code = "unknown_capability"

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"unknown capability {name!r}")


class UnknownSession(CapdError):
    """A session id with no state."""

    code = "unknown_session"

    def __init__(self, session: str) -> None:
        self.session = session
        super().__init__(f"unknown session {session!r}")


class PinnedCapability(CapdError):
    """A pinned capability (settings ``pinned``) is always active and cannot be disabled."""

    code = "pinned"

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"capability {name!r} is pinned and cannot be disabled; remove it from the "
                         "'pinned' setting to make it optional")


class InvalidSessionId(CapdError, ValueError):
    """A session id that is not 1–128 characters of ``[A-Za-z0-9._:-]``, or only dots."""

    code = "invalid_session_id"

    rule = "use 1 to 128 characters of A-Z a-z 0-9 . _ : - (not only dots)"

    def __init__(self, session: str) -> None:
        self.session = session
        shown = session if len(session) <= 40 else session[:40] + "…"
        super().__init__(f"invalid session id {shown!r}: {self.rule}")


class ClientError(CapdError):
    """The HTTP client got no usable answer from the daemon."""


class DaemonUnreachable(ClientError):
    """Nothing is listening where the client looked."""


FAILED_START = "failed to start:"  # how the daemon's 503 detail begins after a failed start


class DaemonFailedToStart(DaemonUnreachable):
    """The daemon answers, but only to say its start failed: no call will succeed until it is
    restarted (its 503 ``warming_up`` says ``failed to start: <reason>``)."""
