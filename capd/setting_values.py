"""How each setting's value is read and checked: one converter per key (:data:`CONVERTERS`),
whose ValueError says what the value must be. :mod:`capd.settings` applies them to the config
file, the ``CAPD_*`` environment and the CLI's flags alike, and names the source in its error.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from capd.catalog import RULES

BACKENDS = ("auto", "onnx", "torch")
WATCH_MODES = ("auto", "poll", "off")  # live reload: notifications (scanning if they fail), scanning, none


EMPTY = "empty; unset it for the default"


def _not_blank(text: str) -> str:
    """``text`` unless it is blank: ``Path("")`` is the working directory and ``""`` as a host binds
    every interface, so an exported but empty ``CAPD_HOST=`` must not pass for a value."""
    if not text.strip():
        raise ValueError(EMPTY)
    return text


def _as_paths(value: object) -> tuple[Path, ...]:
    if isinstance(value, str):
        parts = [p for p in value.split(os.pathsep) if p.strip()]  # "a::b" as in PATH
    elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, Path)) for v in value):
        parts = [str(v) for v in value]
        if any(not isinstance(v, Path) and not v.strip() for v in value):
            raise ValueError("must not hold an empty path")
    else:
        raise ValueError("must be a path or a list of paths")
    if not parts:  # no taps at all: every route would abstain, and health would still say ok
        raise ValueError(EMPTY)
    return distinct_taps(Path(part).expanduser() for part in parts)


def distinct_taps(taps: Iterable[Path]) -> tuple[Path, ...]:
    """Each tap once, where first named, however spelt (``taps/x``, ``taps/x/``, a link to it):
    named twice, each of its capabilities was a duplicate of itself (a warning each, and lint said
    so of every one), and ``capd learned list`` listed its corrections twice."""
    unique: dict[Path, Path] = {}
    for path in taps:
        try:
            key = path.expanduser().resolve()
        except (OSError, RuntimeError):  # a symlink loop: the loader names the problem
            key = path.expanduser().absolute()
        unique.setdefault(key, path)
    return tuple(unique.values())


def _as_names(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        names = value.split(",")
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        names = list(value)
    else:
        raise ValueError("must be a list of names")
    return tuple(v.strip() for v in names if v.strip())


def _as_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError("must be an integer")
    try:
        return int(value)
    except ValueError:
        raise ValueError("must be an integer") from None


def _as_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("must be a number")
    try:
        return float(value)
    except ValueError:
        raise ValueError("must be a number") from None


def _as_str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("must be a string")
    return value


def _model_name(value: object) -> str:
    """A manifest name, ``hash`` or a model directory; empty would name the working directory."""
    name = _as_str(value).strip()
    if not name:
        raise ValueError("must name a model (a manifest such as all-minilm-l6-v2, hash, or a model directory)")
    return name


def _as_path(value: object) -> Path:
    if isinstance(value, Path):
        return value.expanduser()
    return Path(_not_blank(_as_str(value))).expanduser()


def _host(value: object) -> str:
    return _not_blank(_as_str(value))


def _token(value: object) -> str:
    """The bearer token. It travels in an HTTP header, so printable ASCII without spaces; ``""``
    passes here and means no token. The reason never quotes the token."""
    token = _as_str(value)
    for at, char in enumerate(token, 1):
        if not "!" <= char <= "~":
            what = "whitespace" if char.isspace() else "not printable ASCII"
            raise ValueError(f"character {at} is {what}; a token must be printable ASCII without spaces "
                             "(it is sent in an HTTP header)")
    return token


def names_a_path(model: str) -> bool:
    """Whether a ``model`` value is written as a path (``./m``, ``models/x``, ``~/m``) rather than
    a name (a manifest such as ``all-minilm-l6-v2``, or ``hash``)."""
    return os.sep in model or "/" in model or model.startswith(("~", "."))


def _as_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise ValueError("must be true or false")


def _choice(options: tuple[str, ...]) -> Callable[[object], str]:
    def convert(value: object) -> str:
        text = _as_str(value).lower()
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return text

    return convert


def _positive_int(value: object) -> int:
    number = _as_int(value)
    if number < 1:
        raise ValueError("must be at least 1")
    return number


def _non_negative_int(value: object) -> int:
    number = _as_int(value)
    if number < 0:
        raise ValueError("must be 0 or more")
    return number


def _seconds(value: object) -> float:
    number = _as_float(value)
    if not number > 0:  # NaN too
        raise ValueError("must be a positive number of seconds")
    return number


def _port(value: object) -> int:
    number = _as_int(value)
    if not 0 <= number <= 65535:
        raise ValueError("must be between 0 and 65535")
    return number


def _float_between(low: float, high: float, note: str = "") -> Callable[[object], float]:
    """A number from ``low`` to ``high`` (NaN is not one); ``note`` ends the error."""
    def convert(value: object) -> float:
        number = _as_float(value)
        if not low <= number <= high:
            raise ValueError(f"must be between {low:g} and {high:g}{note}")
        return number

    return convert


CONVERTERS: dict[str, Callable[[object], object]] = {
    "host": _host,
    "port": _port,
    "taps": _as_paths,
    "data_dir": _as_path,
    "model": _model_name,
    "models_dir": _as_path,
    "backend": _choice(BACKENDS),
    "rule": _choice(RULES),
    "threshold": _float_between(-1.0, 1.0),
    # a cosine gap (anchor, capd) or a log-odds gap (fused, often above 1)
    "margin": _float_between(0.0, 100.0),
    "top_k": _positive_int,
    "abstain_corpus": _as_bool,
    # the fused rule's coverage gate: a mean of token cosines (0 turns the gate off)
    "coverage": _float_between(0.0, 1.0, " (0 turns the coverage gate off)"),
    "auto_gates": _as_bool,
    "max_active": _positive_int,
    "min_chars": _non_negative_int,
    "pinned": _as_names,
    "session_ttl": _seconds,
    "token": _token,
    "uds": _as_path,
    "log_level": _choice(("debug", "info", "warning", "error")),
    "learn": _as_bool,
    "learn_max": _positive_int,
    "tune": _as_bool,
    "watch": _choice(WATCH_MODES),
}


def check_setting(key: str, value: object) -> object:
    """``value`` converted and checked by the rule of setting ``key``; a ValueError says why not
    (the CLI checks flags that override a setting this way)."""
    return CONVERTERS[key](value)
