"""Settings precedence: flags > CAPD_* environment > config file > defaults."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

import capd.settings as settings_module
from capd.errors import ConfigError
from capd.settings import ENV_VARS, OTHER_ENV_VARS, Settings, load_settings, own_data_dir


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
    settings = load_settings(env={"CAPD_TAPS": f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}",
                                  "CAPD_CONFIG": ""})
    assert settings.taps == (tmp_path / "a", tmp_path / "b")


@pytest.mark.parametrize(
    ("text", "key", "line", "reason"),
    [
        ("port = 'many'\n", "port", 3, "must be an integer"),
        ("colour = 1\n", "colour", 3, "unknown setting"),
        ("backend = 'gpu'\n", "backend", 3, "must be one of"),
        ("watch = 'inotify'\n", "watch", 3, "must be one of"),
        ("threshold = 3\n", "threshold", 3, "between -1 and 1"),
        ("coverage = -0.2\n", "coverage", 3, "between 0 and 1"),
        ("port = [\n", None, 3, "invalid TOML"),
        ("port = " + "[" * 3000 + "]" * 3000 + "\n", None, 3, "nested too deeply"),
        ("[capd]\nport = 'many'\n", "port", 4, "must be an integer"),
        ("[capd]\nport = 7171\n[other]\nx = 1\n", None, 5, "outside the [capd] table"),
    ],
)
def test_bad_config_names_file_line_key_reason(tmp_path: Path, text: str, key: str | None, line: int,
                                               reason: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text("# my settings\n\n" + text)  # every mistake names its line, after these two
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, config=config)
    message = str(info.value)
    assert message.startswith(f"{config}: line {line}: ") and reason in message, message
    if key:
        assert info.value.key == key


def test_a_config_file_is_read_as_tap_files_are(tmp_path: Path) -> None:
    """A byte order mark is fine; a byte that is not UTF-8 names its line; a pipe is refused at once
    (reading one waited forever)."""
    config = tmp_path / "config.toml"
    config.write_bytes("\ufeffport = 7300\n".encode())
    assert load_settings(env={}, config=config).port == 7300
    config.write_bytes(b"port = 7300\ncolour = '\xff'\n")
    with pytest.raises(ConfigError, match=r"line 2: not UTF-8 text \(byte 0xff\)"):
        load_settings(env={}, config=config)
    fifo = tmp_path / "pipe.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is not a file"):
        load_settings(env={}, config=fifo)
    assert load_settings(env={}, config=Path("/dev/null")).port == 7171  # "no config file", as people write it
    with pytest.raises(ConfigError, match="bytes: not a config file"):
        load_settings(env={}, config=Path("/dev/zero"))


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


@pytest.mark.parametrize("var", ["CAPD_HOST", "CAPD_UDS", "CAPD_DATA_DIR", "CAPD_TAPS", "CAPD_MODELS_DIR"])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_environment_value_is_refused(var: str, value: str) -> None:
    # `export CAPD_HOST=` bound every interface; an empty path was the working directory; an empty
    # CAPD_TAPS served no taps with health "ok".
    key = var.removeprefix("CAPD_").lower()
    with pytest.raises(ConfigError, match=f"^environment {var}: {key}: empty; unset it for the default"):
        load_settings(env={var: value, "CAPD_CONFIG": ""})


def test_empty_token_and_config_still_mean_unset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no user config file
    settings = load_settings(env={"CAPD_TOKEN": "", "CAPD_CONFIG": ""})
    assert settings.token is None and settings.config_file is None
    config = tmp_path / "config.toml"
    config.write_text('token = ""\n')
    assert load_settings(env={}, config=config).token is None
    # Empty entries of a path list are skipped, as in PATH; only a list with no path at all is refused.
    assert load_settings(env={"CAPD_CONFIG": "", "CAPD_TAPS": f"{os.pathsep}/t{os.pathsep}"}).taps == (Path("/t"),)


@pytest.mark.parametrize(("text", "key"), [
    ('host = ""\n', "host"),
    ('data_dir = ""\n', "data_dir"),  # was read as the config file's folder
    ('uds = " "\n', "uds"),
    ("taps = []\n", "taps"),
    ('taps = ""\n', "taps"),
])
def test_an_empty_config_value_is_refused(tmp_path: Path, text: str, key: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match="empty; unset it for the default") as info:
        load_settings(env={}, config=config)
    assert info.value.source == str(config) and info.value.key == key


def test_an_empty_path_in_a_config_list_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('taps = ["a", ""]\n')
    with pytest.raises(ConfigError, match="taps: must not hold an empty path"):
        load_settings(env={}, config=config)


def test_an_empty_host_flag_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^--host: host: empty"):
        load_settings(flags={"host": ""}, env={"CAPD_CONFIG": ""})


@pytest.mark.parametrize("token", ["sécret", " padded ", "padded ", "two words", "tab\tbed", "line\n", "del\x7f"])
def test_a_token_that_cannot_be_an_http_header_is_refused(token: str) -> None:
    with pytest.raises(ConfigError, match=r"^environment CAPD_TOKEN: token: character ") as info:
        load_settings(env={"CAPD_TOKEN": token, "CAPD_CONFIG": ""})
    assert "printable ASCII without spaces" in str(info.value)
    assert token.strip() not in str(info.value), "the message never quotes the token"


def test_a_bad_token_in_a_config_file_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('token = "sécret"\n')
    with pytest.raises(ConfigError, match="character 2 is not printable ASCII") as info:
        load_settings(env={}, config=config)
    assert info.value.source == str(config) and info.value.key == "token"


def test_a_printable_token_is_kept() -> None:
    token = "Abc-123._~+/=!#$%&'*^`|"
    assert load_settings(env={"CAPD_TOKEN": token, "CAPD_CONFIG": ""}).token == token


def test_keys_beside_a_capd_table_are_refused(tmp_path: Path) -> None:
    # They were silently ignored, typos included.
    config = tmp_path / "mix.toml"
    config.write_text('max_activ = 2\nport = 7360\n\n[capd]\nhost = "127.0.0.1"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, config=config)
    message = str(info.value)
    assert message.startswith(f"{config}: line 1: max_activ, port: outside the [capd] table")
    only_table = tmp_path / "table.toml"
    only_table.write_text('[capd]\nport = 7360\n')
    assert load_settings(env={}, config=only_table).port == 7360


@pytest.mark.parametrize(("value", "resolved"), [
    ("./mymodel", "cfg/mymodel"),
    ("mymodel/", "cfg/mymodel"),
    ("models/x", "cfg/models/x"),
    ("../shared/m", "cfg/../shared/m"),
])
def test_a_relative_model_directory_in_a_config_file_is_relative_to_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, resolved: str) -> None:
    (tmp_path / "cfg").mkdir()
    config = tmp_path / "cfg" / "capd.toml"
    config.write_text(f'model = "{value}"\n')
    monkeypatch.chdir("/")
    assert Path(load_settings(env={}, config=config).model) == tmp_path / resolved


@pytest.mark.parametrize("value", ["all-minilm-l6-v2", "hash", "/abs/model"])
def test_model_names_and_absolute_paths_in_a_config_file_are_kept(tmp_path: Path, value: str) -> None:
    config = tmp_path / "capd.toml"
    config.write_text(f'model = "{value}"\n')
    assert load_settings(env={}, config=config).model == value


def test_pinned_names_from_a_config_list_are_stripped(tmp_path: Path) -> None:
    config = tmp_path / "capd.toml"
    config.write_text('pinned = [" git", "time ", " "]\n')
    assert load_settings(env={}, config=config).pinned == ("git", "time")
    assert load_settings(env={"CAPD_PINNED": " git, time ,", "CAPD_CONFIG": ""}).pinned == ("git", "time")


def test_an_unknown_capd_variable_is_warned_once(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(settings_module, "_warned_env", set())
    env = {"CAPD_TRESHOLD": "0.9", "CAPD_CONFIG": "", "CAPD_RELIABILITY": "full", "CAPD_PORT": "7000"}
    with caplog.at_level(logging.WARNING, logger="capd.settings"):
        load_settings(env=env)
        load_settings(env=env)
    warnings = [r.getMessage() for r in caplog.records if r.name == "capd.settings"]
    assert warnings == ["environment CAPD_TRESHOLD: not a capd setting, ignored (did you mean CAPD_THRESHOLD?)"]


def test_every_capd_variable_read_anywhere_is_known() -> None:
    # No CAPD_* variable that capd, the benchmarks, the tests or the build read is warned about as a typo.
    root = Path(__file__).resolve().parent.parent
    sources = [*root.glob("capd/**/*.py"), *root.glob("benchmarks/**/*.py"), *root.glob("tests/**/*.py"),
               root / "Makefile", root / ".ci" / "run"]
    named = {name for path in sources if path.is_file() and path != Path(__file__).resolve()
             for name in re.findall(r"\bCAPD_[A-Z0-9_]+", path.read_text(encoding="utf-8"))}
    not_variables = {"CAPD_POINT"}  # a gates constant in tests/test_fused.py
    assert "CAPD_TAPS" in named and "CAPD_RELIABILITY" in named
    assert named - not_variables <= set(ENV_VARS) | set(OTHER_ENV_VARS)


def test_a_data_directory_others_can_write_or_own_is_refused(tmp_path: Path) -> None:
    """capd loads models from its data directory and keeps users' messages there."""
    mine = tmp_path / "deep" / "mine"
    own_data_dir(mine)  # not there yet: created for this user only
    assert oct(mine.stat().st_mode & 0o777) == "0o700"
    mine.chmod(0o755)
    own_data_dir(mine)  # made earlier: keeps its mode
    assert oct(mine.stat().st_mode & 0o777) == "0o755"
    mine.chmod(0o777)
    with pytest.raises(ConfigError, match=r"can be written by every user.*chmod 700"):
        own_data_dir(mine)
    mine.chmod(0o700)
    if os.geteuid() != 0:
        return  # only root can give a directory away
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError, match=r"belongs to another user \(uid 65534\)"):
        own_data_dir(theirs)


def test_a_file_as_the_data_directory_is_refused(tmp_path: Path) -> None:
    """A file named as --data-dir ran with every store in memory and an ONNX export per start, and
    its warning asked to make the 'directory' writable."""
    from click.testing import CliRunner

    from capd.cli import main

    a_file = tmp_path / "afile"
    a_file.write_text("mine\n")
    for path in (a_file, a_file / "under"):
        with pytest.raises(ConfigError, match=r"is not a directory"):
            own_data_dir(path)
    result = CliRunner().invoke(main, ["serve", "--tap", str(tmp_path), "--data-dir", str(a_file), "--port", "0"])
    assert result.exit_code == 3 and "is not a directory" in result.output, result.output
    assert a_file.read_text() == "mine\n"


def test_a_daemon_on_a_refused_data_directory_fails_at_once(tmp_path: Path) -> None:
    """`capd serve` says why and exits 3 (a failed start) before it listens."""
    from click.testing import CliRunner

    from capd.cli import main

    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o777)
    result = CliRunner().invoke(main, ["serve", "--tap", str(tmp_path), "--data-dir", str(data), "--port", "0"])
    assert result.exit_code == 3, result.output
    assert "can be written by every user" in result.output
    assert oct(data.stat().st_mode & 0o777) == "0o777"  # nothing changed on the user's directory


def _tap_naming(root: Path, rule: str | None, name: str = "tap") -> Path:
    """A tap whose capd.toml names ``rule`` (none: no capd.toml)."""
    tap = root / name
    (tap / "capabilities").mkdir(parents=True)
    if rule is not None:
        (tap / "capd.toml").write_text(f'# measured on our fixtures\nrule = "{rule}"\n')
    return tap


def test_a_tap_names_its_rule_and_any_setting_beats_it(tmp_path: Path) -> None:
    """The rule a tap's capd.toml names is the default for it; a flag, CAPD_RULE or the config file
    beats it, and the first tap (in precedence order) that names one decides."""
    fused, plain = _tap_naming(tmp_path, "fused", "a"), _tap_naming(tmp_path, None, "b")
    anchor = _tap_naming(tmp_path, "anchor", "c")
    taps = os.pathsep.join(map(str, (plain, fused, anchor)))
    named = load_settings(env={"CAPD_TAPS": taps, "CAPD_CONFIG": ""})
    assert (named.rule, named.rule_from) == ("fused", str(fused / "capd.toml"))
    assert load_settings(env={"CAPD_TAPS": str(plain), "CAPD_CONFIG": ""}).rule_from == "default"
    assert load_settings(env={"CAPD_TAPS": str(plain), "CAPD_CONFIG": ""}).rule == "capd"
    config = tmp_path / "config.toml"
    config.write_text('rule = "anchor"\n')
    for settings in (load_settings(flags={"rule": "capd"}, env={"CAPD_TAPS": taps, "CAPD_CONFIG": ""}),
                     load_settings(env={"CAPD_TAPS": taps, "CAPD_RULE": "capd", "CAPD_CONFIG": ""}),
                     load_settings(env={"CAPD_TAPS": taps}, config=config)):
        assert settings.rule_from == "settings" and settings.rule in ("capd", "anchor")
    assert settings_module.for_one_tap(named, anchor).rule == "anchor"  # `capd test` holds each tap to its own
    assert settings_module.for_one_tap(named, plain).rule == "capd"
    told = load_settings(flags={"rule": "capd"}, env={"CAPD_TAPS": taps, "CAPD_CONFIG": ""})
    assert settings_module.for_one_tap(told, fused).rule == "capd"


def test_a_rule_capd_does_not_know_is_an_error_on_its_line_and_names_no_rule(tmp_path: Path) -> None:
    from capd.taps import load_catalog

    tap = _tap_naming(tmp_path, "semantic")
    (problem,) = load_catalog([tap]).errors
    assert (problem.line, problem.reason) == (2, "rule must be one of capd, anchor, fused (got 'semantic')")
    assert load_settings(env={"CAPD_TAPS": str(tap), "CAPD_CONFIG": ""}).rule == "capd"


def test_the_shipped_tap_routes_with_the_rule_it_names() -> None:
    settings = load_settings(env={"CAPD_CONFIG": ""})
    assert settings.rule == "fused" and settings.rule_from.endswith("core/capd.toml")


def test_a_daemon_says_an_edited_rule_waits_for_a_restart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from capd.live_taps import LiveTaps

    tap = _tap_naming(tmp_path, "fused")
    live = LiveTaps([tap])
    live.load()
    (tap / "capd.toml").write_text('rule = "capd"\n')
    with caplog.at_level(logging.WARNING, logger="capd.live_taps"):
        live.load([tap / "capd.toml"])
    assert any("rule fused is now capd" in r.getMessage() and "restarts" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="capd.live_taps"):
        live.load([tap / "capd.toml"])  # unchanged: nothing to say
    assert not caplog.records
