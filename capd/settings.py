"""One frozen :class:`Settings`, built once and passed down.

Precedence, highest first: CLI flags > ``CAPD_*`` environment > config file
(``--config``, ``CAPD_CONFIG``, else ``~/.config/capd/config.toml``) > defaults.
This is the only module that reads ``os.environ``; everything else receives
a ``Settings``.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

from capd.errors import ConfigError, TapFileError
from capd.learned import MAX_PER_CAPABILITY
from capd.setting_values import CONVERTERS, names_a_path
from capd.tap_config import load_tap_config
from capd.tap_files import MAX_FILE_BYTES, line_of, parse_toml_bytes

log = logging.getLogger(__name__)

DEFAULT_MODEL = "all-minilm-l6-v2"


def package_root() -> Path:
    """The directory that holds capd's shipped ``taps/`` and ``models/``.

    In a wheel they are packaged under ``capd/_data``; in a source checkout
    (editable install) they sit next to the ``capd`` package.
    """
    here = Path(__file__).resolve().parent
    bundled = here / "_data"
    return bundled if bundled.is_dir() else here.parent


def shipped_taps_dir() -> Path:
    return package_root() / "taps"


def shipped_models_dir() -> Path:
    return package_root() / "models"


def default_taps() -> tuple[Path, ...]:
    root = shipped_taps_dir()
    if not root.is_dir():
        return ()
    return tuple(sorted(p for p in root.iterdir() if (p / "capabilities").is_dir()))


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("capd", appauthor=False))


def own_data_dir(path: Path) -> None:
    """Create the data directory for this user only (0700) if it is missing, and refuse one another
    user could have filled: one owned by another user, or one every user may write to. capd loads
    models from it (ONNX exports, tuned models) and keeps users' messages in it, so a directory
    someone else controls would route with their model and read what this user types. One made
    earlier keeps its mode. A path that is a file, or lies under one, is refused: it names the wrong
    place. One that cannot be created or looked at otherwise (a read-only disk) is left to the stores,
    which fall back to memory."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(str(path), "data_dir", "is not a directory (a file is in the way); name a directory "
                          "for the vector cache, session state and model exports (--data-dir)") from None
    except OSError:
        return
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        raise ConfigError(str(path), "data_dir", f"belongs to another user (uid {info.st_uid}): capd loads models "
                          "from it and keeps your messages in it; use a directory of your own (--data-dir)")
    if info.st_mode & stat.S_IWOTH:
        raise ConfigError(str(path), "data_dir", "can be written by every user: capd loads models from it and "
                          f"keeps your messages in it; make it yours alone (chmod 700 {path}) or use another")


def default_config_path() -> Path:
    return Path(platformdirs.user_config_dir("capd", appauthor=False, roaming=False)) / "config.toml"


@dataclass(frozen=True)
class Settings:
    """Everything configurable about capd. Immutable: build a new one to change it."""

    host: str = "127.0.0.1"
    port: int = 7171
    taps: tuple[Path, ...] = field(default_factory=default_taps)
    data_dir: Path = field(default_factory=default_data_dir)
    model: str = DEFAULT_MODEL
    models_dir: Path = field(default_factory=shipped_models_dir)
    backend: str = "auto"
    rule: str = "capd"
    rule_from: str = "default"  # where ``rule`` came from: "default", "settings", or the capd.toml that named it
    threshold: float | None = None
    margin: float | None = None
    top_k: int | None = None
    abstain_corpus: bool | None = None  # veto with the shipped abstain corpus (None: each tap's capd.toml says)
    coverage: float | None = None  # fused: the coverage gate (0: none; None: capd.toml, auto gates or manifest)
    auto_gates: bool = True  # fused: gates fitted on the examples where no tap sets them (capd/autogates.py)
    max_active: int = 4
    min_chars: int = 8
    pinned: tuple[str, ...] = ()
    session_ttl: float = 24 * 3600.0
    token: str | None = None
    uds: Path | None = None
    log_level: str = "info"
    learn: bool = True  # the daemon learns from corrections (capd/learned.py)
    learn_max: int = MAX_PER_CAPABILITY  # learned corrections of each kind kept per capability (the latest)
    tune: bool = False  # route with a copy of the model tuned on the taps' examples (capd/tuning.py)
    watch: str = "auto"  # live reload of the taps (capd/watcher.py; WATCH_MODES)
    config_file: Path | None = None

    def public_dict(self) -> dict[str, Any]:
        """A JSON-ready view with the token masked."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "token":
                value = "***" if value else None
            elif isinstance(value, Path):
                value = str(value)
            elif isinstance(value, tuple):
                value = [str(v) for v in value]
            out[f.name] = value
        return out


# Environment variable -> setting. DESIGN.md fixes CAPD_TAPS, HOST, PORT, DATA_DIR, CONFIG, MODEL, TOKEN.
ENV_VARS: dict[str, str] = {f"CAPD_{name.upper()}": name for name in CONVERTERS}
# Other CAPD_* variables something reads: the config file's path, and the reliability suite's size.
OTHER_ENV_VARS = ("CAPD_CONFIG", "CAPD_RELIABILITY")
_SECRETS = frozenset({"token"})  # never quoted in an error message
_warned_env: set[str] = set()  # unknown CAPD_* variables already warned about (once per process)


def _convert(source: str, key: str, value: object, line: int | None = None) -> object:
    try:
        return CONVERTERS[key](value)
    except (ValueError, TypeError) as exc:
        got = "" if key in _SECRETS or value == "" else f" (got {value!r})"
        raise ConfigError(source, key, f"{exc}{got}", line) from None


def read_config_file(path: Path) -> dict[str, object]:
    """Read a config file's settings; unknown keys and bad values are errors naming the key and
    its line. Read as tap files are: a leading BOM is fine, a pipe is refused, not waited on, and at
    most :data:`~capd.tap_files.MAX_FILE_BYTES` are read (``--config /dev/null`` is an empty file, a
    device that never ends is refused)."""
    try:
        mode = path.stat().st_mode
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISDIR(mode):
            raise ConfigError(str(path), None, "is not a file (a pipe, socket or folder)")
        with path.open("rb") as stream:
            data = stream.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ConfigError(str(path), None, f"is over {MAX_FILE_BYTES} bytes: not a config file")
        raw, text, _ = parse_toml_bytes(path, data)
    except FileNotFoundError:
        raise ConfigError(str(path), None, "config file not found") from None
    except OSError as exc:
        raise ConfigError(str(path), None, f"cannot read: {exc.strerror or exc}") from None
    except TapFileError as exc:  # not UTF-8, invalid TOML: with the line
        raise ConfigError(str(path), None, exc.reason, exc.line) from None
    table = raw.get("capd", raw)
    if not isinstance(table, dict):
        raise ConfigError(str(path), "capd", "must be a table", line_of(text, "capd"))
    stray = [key for key in raw if key != "capd"] if table is not raw else []
    if stray:
        raise ConfigError(str(path), None, f"{', '.join(stray)}: outside the [capd] table, where they would be "
                                           "ignored; move them under [capd] (or drop the [capd] header)",
                          line_of(text, stray[0]))
    out: dict[str, object] = {}
    for key, value in table.items():
        line = line_of(text, key)
        if key not in CONVERTERS:
            known = ", ".join(sorted(CONVERTERS))
            raise ConfigError(str(path), key, f"unknown setting (known: {known})", line)
        if key in ("taps", "data_dir", "models_dir", "uds") or (
                key == "model" and isinstance(value, str) and names_a_path(value.strip())):
            # Relative paths in a config file are relative to the file, not the cwd.
            value = _resolve_relative(path.parent, value.strip() if key == "model" else value)
        out[key] = _convert(str(path), key, value, line)
    return out


def _resolve_relative(base: Path, value: object) -> object:
    if isinstance(value, str):
        if not value.strip():  # left for the setting's rule to refuse, not read as the file's folder
            return value
        return str(base / Path(value).expanduser()) if not Path(value).expanduser().is_absolute() else value
    if isinstance(value, list):
        return [_resolve_relative(base, v) for v in value]
    return value


def load_settings(
    flags: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    config: Path | None = None,
) -> Settings:
    """Build the one ``Settings``: flags > environment > config file > defaults.

    ``flags`` holds only options the user gave (``None`` values are ignored).
    ``env`` defaults to ``os.environ``. ``config`` is ``--config``; without it
    ``CAPD_CONFIG`` and then the user config path are tried (the latter only if it exists).
    """
    environ = os.environ if env is None else env
    given = {k: v for k, v in (flags or {}).items() if v is not None and v != ()}
    explicit = config or (Path(environ["CAPD_CONFIG"]).expanduser() if environ.get("CAPD_CONFIG") else None)
    config_path = explicit or default_config_path()
    values: dict[str, object] = {}
    if explicit is not None or config_path.is_file():
        values.update(read_config_file(config_path))
    for var, key in ENV_VARS.items():
        if var in environ and var != "CAPD_CONFIG":
            values[key] = _convert(f"environment {var}", key, environ[var])
    _warn_unknown_env(environ)
    for key, value in given.items():
        if key not in CONVERTERS:
            raise ConfigError("flags", key, "unknown setting")
        values[key] = _convert(f"--{key.replace('_', '-')}", key, value)
    if values.get("token") == "":
        values["token"] = None
    chosen = config_path if (explicit is not None or config_path.is_file()) else None
    if "rule" in values:
        values["rule_from"] = "settings"
    else:
        values["rule"], values["rule_from"] = tap_rule(values.get("taps") or default_taps())  # type: ignore[arg-type]
    return Settings(**values, config_file=chosen)  # type: ignore[arg-type]


def for_one_tap(settings: Settings, tap: Path) -> Settings:
    """``settings`` for ``tap`` alone (``capd test`` tests each tap on its own): with the rule that
    tap names, unless a setting named one (the rule of the first tap named no longer decides)."""
    narrowed = dataclasses.replace(settings, taps=(tap,))
    if settings.rule_from == "settings":
        return narrowed
    rule, named = tap_rule((tap,))
    return dataclasses.replace(narrowed, rule=rule, rule_from=named)


def tap_rule(taps: Iterable[Path]) -> tuple[str, str]:
    """The rule a tap asks for (``rule`` in its ``capd.toml``) and the file that asks, from the first
    tap in precedence order that names one, else capd's default (``capd``, ``"default"``); a setting
    (flag, ``CAPD_RULE``, config file) beats it.

    A tap's author who has measured a rule on the tap's fixtures names it there, so that the tap
    routes with it by default: taps/core names ``fused``, which fires right on 0.823 of its fixture
    positives against 0.507 for the ``capd`` rule (``capd test taps/core``). capd's own default stays
    ``capd`` for taps that name none (``fused`` without calibrated gates lets more nulls through:
    README, *Which rule by default*). The rule is chosen when capd starts: a daemon keeps it when the
    file changes (one rule's fitted state cannot be swapped for another's under live routes), and
    says so in its log. A ``capd.toml`` that does not load names no rule (the catalog reports why)."""
    for tap in taps:
        config, _ = load_tap_config(tap)
        if config is not None and config.rule is not None:
            return config.rule, str(config.path)
    return Settings.rule, Settings.rule_from


def _warn_unknown_env(environ: Mapping[str, str]) -> None:
    """A ``CAPD_*`` variable capd does not read is most likely a misspelt setting: say so
    once, since it has no effect (a config file's unknown key is an error, but the environment
    holds other programs' variables too)."""
    for var in sorted(environ):
        if var.startswith("CAPD_") and var not in ENV_VARS and var not in OTHER_ENV_VARS and var not in _warned_env:
            _warned_env.add(var)
            close = difflib.get_close_matches(var, [*ENV_VARS, *OTHER_ENV_VARS], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            log.warning("environment %s: not a capd setting, ignored%s", var, hint)
