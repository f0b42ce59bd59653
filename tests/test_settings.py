"""Settings precedence: flags > CAPD_* environment > config file > defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from capd.errors import ConfigError
from capd.settings import Settings, load_settings


def test_defaults(tmp_path: Path) -> None:
    settings = load_settings(env={})
    assert settings.host == "127.0.0.1" and settings.port == 7171
    assert settings.max_active == 4 and settings.min_chars == 8 and settings.token is None
    assert settings.model == "all-minilm-l6-v2"
    assert settings.taps, "defaults to the shipped taps"


def test_precedence(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('port = 8000\nhost = "127.0.0.2"\nthreshold = 0.5\ntaps = ["rel"]\n')
    env = {"CAPD_CONFIG": str(config), "CAPD_PORT": "9000", "CAPD_MAX_ACTIVE": "6"}
    settings = load_settings(flags={"max_active": 2}, env=env)
    assert settings.port == 9000  # env beats file
    assert settings.host == "127.0.0.2"  # file beats default
    assert settings.max_active == 2  # flag beats env
    assert settings.threshold == 0.5
    assert settings.taps == (tmp_path / "rel",)  # relative to the config file
    assert settings.config_file == config
    flagged = load_settings(flags={"port": 1234}, env=env, config=config)
    assert flagged.port == 1234


def test_taps_env_uses_pathsep(tmp_path: Path) -> None:
    import os

    settings = load_settings(env={"CAPD_TAPS": f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}",
                                  "CAPD_CONFIG": ""})
    assert settings.taps == (tmp_path / "a", tmp_path / "b")


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ("port = 'many'\n", "port", "must be an integer"),
        ("colour = 1\n", "colour", "unknown setting"),
        ("backend = 'gpu'\n", "backend", "must be one of"),
        ("threshold = 3\n", "threshold", "between -1 and 1"),
        ("coverage = -0.2\n", "coverage", "between 0 and 1"),
        ("port = [\n", None, "invalid TOML"),
    ],
)
def test_bad_config_names_file_key_reason(tmp_path: Path, text: str, key: str | None, reason: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, config=config)
    message = str(info.value)
    assert str(config) in message and reason in message
    if key:
        assert info.value.key == key


def test_coverage_gate_from_the_environment() -> None:
    assert load_settings(env={"CAPD_COVERAGE": "0.42"}).coverage == 0.42
    assert load_settings(env={}).coverage is None  # each tap's capd.toml, the auto gates or the manifest decide
    with pytest.raises(ConfigError, match="environment CAPD_COVERAGE: coverage: must be between 0 and 1"):
        load_settings(env={"CAPD_COVERAGE": "1.5"})


@pytest.mark.parametrize(("var", "value", "reason"), [
    ("CAPD_SESSION_TTL", "0", "session_ttl: must be a positive number of seconds"),
    ("CAPD_SESSION_TTL", "-5", "session_ttl: must be a positive number of seconds"),
    ("CAPD_SESSION_TTL", "nan", "session_ttl: must be a positive number of seconds"),
    ("CAPD_MIN_CHARS", "-1", "min_chars: must be 0 or more"),
    ("CAPD_MODEL", "", "model: must name a model"),  # was read as the working directory
    ("CAPD_MODEL", "  ", "model: must name a model"),
])
def test_session_ttl_and_min_chars_are_checked_up_front(var: str, value: str, reason: str) -> None:
    # Refused here, not when the daemon's session registry is built (which left a running daemon
    # that could never route).
    with pytest.raises(ConfigError, match=f"environment {var}: {reason}"):
        load_settings(env={var: value})
    assert load_settings(env={"CAPD_MIN_CHARS": "0", "CAPD_SESSION_TTL": "0.5"}).min_chars == 0


def test_bad_env_value_names_variable() -> None:
    with pytest.raises(ConfigError, match="environment CAPD_PORT: port: must be"):
        load_settings(env={"CAPD_PORT": "seventy"})


def test_missing_explicit_config() -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings(env={}, config=Path("/nonexistent/capd.toml"))


def test_settings_are_frozen_and_token_masked() -> None:
    settings = Settings(token="s3cret")
    with pytest.raises(AttributeError):
        settings.port = 1  # type: ignore[misc]
    assert settings.public_dict()["token"] == "***"
