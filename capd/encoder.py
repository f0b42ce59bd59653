"""Encoders turn texts into L2-normalised float32 vectors; :func:`open_encoder` builds them all.

Three implementations of one narrow :class:`Encoder` interface:

- :class:`OnnxEncoder`: ONNX Runtime + ``tokenizers``, pooling and normalisation in numpy.
  The default ("auto"): about 0.3x torch's latency for one short message on this machine
  (3.7 ms against 12.5 ms p50, ``benchmarks/results/engine.md``), with the same vectors
  (cosine >= 0.999, tested). Once the graph is exported (:mod:`capd.onnx_export`) it imports
  neither torch nor sentence-transformers, so a warm start stays fast.
- :class:`TorchEncoder`: sentence-transformers on the CPU, taking its token embeddings and
  pooling them exactly like the ONNX encoder, so both follow the manifest.
- :class:`HashEncoder`: a deterministic fake for unit tests (hashed words and character
  trigrams): cosine reflects lexical overlap, no model needed. Chosen with
  ``Settings(model="hash")`` (a model name rather than a backend, because it replaces the
  model, and the backend setting stays one of the real backends).

Besides one pooled vector per text, every encoder gives, from the same forward pass, each
text's *token vectors* (:meth:`Encoder.embed_tokens`: the contextual vectors of its word
pieces, special tokens dropped, each L2-normalised). The ``fused`` rule's second stage
re-scores its nearest candidates by late interaction over them (:mod:`capd.fused`).

``model_id`` names everything that shapes a vector: the manifest name (or directory), the
weights' sha256, backend, pooling, normalisation, max_seq_length, query_prefix and
:data:`RECIPE_VERSION`. The vector cache keys on it, so changing any of them re-embeds.

Nothing is downloaded: this module sets ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from capd.errors import ModelError
from capd.models import ResolvedModel, manifest_for, quiet_progress_bars, resolve
from capd.onnx_export import damage, ensure_onnx
from capd.settings import Settings

log = logging.getLogger(__name__)

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

Vectors = npt.NDArray[np.float32]
TokenVectors = list[Vectors]  # per text: [tokens, dim], unit rows
Embedded = tuple[Vectors, TokenVectors]  # what embed_tokens returns

RECIPE_VERSION = 1  # bump when pooling / tokenisation code changes what a vector is
HASH_RECIPE = 1
DEFAULT_BATCH = 32


@runtime_checkable
class Encoder(Protocol):
    """Texts in, one L2-normalised float32 row per text out: shape ``(len(texts), dim)``."""

    @property
    def model_id(self) -> str: ...

    @property
    def dim(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> Vectors: ...

    def embed_tokens(self, texts: Sequence[str]) -> Embedded:
        """:meth:`embed` and each text's unit token vectors, from one forward pass."""
        ...


def model_identity(label: str, weights_sha: str, backend: str, pooling: str, normalize: bool,
                   max_seq_length: int, query_prefix: str) -> str:
    """A short, readable id that changes whenever anything that shapes a vector changes."""
    payload = json.dumps({"model": label, "weights": weights_sha, "backend": backend, "pooling": pooling,
                          "normalize": normalize, "max_seq_length": max_seq_length, "query_prefix": query_prefix,
                          "recipe": RECIPE_VERSION}, sort_keys=True, ensure_ascii=False)
    short = hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(label).name)[:40] or "model"
    return f"{readable}:{backend}:{short}"


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("embed() takes a sequence of texts, not one string")
    return list(texts)


def l2_normalize(vectors: npt.NDArray[Any]) -> Vectors:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.asarray(vectors / np.maximum(norms, 1e-12), dtype=np.float32)


def token_rows(hidden: npt.NDArray[Any], mask: npt.NDArray[Any]) -> TokenVectors:
    """Per text, the unit vectors of its real tokens (the first and last, [CLS] and [SEP], dropped
    when there is anything between them)."""
    out = []
    for states, keep in zip(hidden, mask, strict=True):
        rows = np.asarray(states[np.asarray(keep, dtype=bool)], dtype=np.float32)
        out.append(l2_normalize(rows[1:-1] if len(rows) > 2 else rows))
    return out


def check_finite(model_id: str, vectors: Vectors, tokens: TokenVectors, hint: str) -> None:
    """Raise :class:`ModelError` when a model gave NaN or inf (damaged files): NaN scores compare
    False against every gate, and the vector cache would have kept them for good."""
    bad = ~np.isfinite(vectors).all(axis=1)  # [texts, dim]
    if tokens:
        bad |= np.array([not np.isfinite(m).all() for m in tokens], dtype=bool)
    if bad.any():
        raise ModelError(f"{model_id}: the model gave NaN or inf for {int(bad.sum())} of {len(vectors)} text(s), "
                         f"so its files are damaged; {hint}")


def pool(hidden: npt.NDArray[Any], mask: npt.NDArray[Any], pooling: str) -> Vectors:
    """Pool ``hidden [batch, tokens, dim]`` over the tokens that ``mask`` marks."""
    if pooling == "cls":
        return np.asarray(hidden[:, 0, :], dtype=np.float32)
    weights = mask[:, :, None].astype(np.float32)
    summed = (hidden * weights).sum(axis=1)
    return np.asarray(summed / np.maximum(weights.sum(axis=1), 1e-9), dtype=np.float32)


class _ModelEncoder:
    """What every encoder here shares: identity and dimension, set by their constructors."""

    _model_id: str
    _dim: int

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def dim(self) -> int:
        return self._dim


class HashEncoder(_ModelEncoder):
    """Deterministic lexical fake: signed feature hashing of lowercase words and char trigrams."""

    _WORD = re.compile(r"\w+")

    def __init__(self, dim: int = 384, normalize: bool = True) -> None:
        self._dim = dim
        self._normalize = normalize
        recipe = json.dumps({"recipe": HASH_RECIPE, "dim": dim, "normalize": normalize})
        self._model_id = f"hash-{dim}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"

    def _vector(self, text: str) -> Vectors:
        features: list[tuple[str, float]] = []
        for word in self._WORD.findall(text.lower()):
            features.append(("w:" + word, 1.0))
            padded = f"#{word}#"
            features.extend(("c:" + padded[i:i + 3], 0.5) for i in range(len(padded) - 2))
        return self._hashed(features)

    def _hashed(self, features: list[tuple[str, float]]) -> Vectors:
        vector = np.zeros(self._dim, dtype=np.float32)
        for feature, weight in features or [("<empty>", 1.0)]:
            digest = hashlib.blake2b(feature.encode("utf-8"), digest_size=8).digest()
            index = int.from_bytes(digest[:4], "little") % self._dim
            vector[index] += weight if digest[4] & 1 else -weight
        return vector

    def embed(self, texts: Sequence[str]) -> Vectors:
        items = _check_texts(texts)
        if not items:
            return np.zeros((0, self._dim), dtype=np.float32)
        matrix = np.stack([self._vector(t) for t in items])
        return l2_normalize(matrix) if self._normalize else matrix

    def embed_tokens(self, texts: Sequence[str]) -> Embedded:
        """:meth:`embed` (so subclasses that wrap it still see every call) and one hashed
        vector per word as the "tokens"."""
        vectors = self.embed(texts)
        tokens = [l2_normalize(np.stack([self._hashed([("w:" + w, 1.0)]) for w in self._WORD.findall(t.lower())]
                                        or [self._hashed([])])) for t in _check_texts(texts)]
        return vectors, tokens


class OnnxEncoder(_ModelEncoder):
    """ONNX Runtime over the exported graph; tokenisation by ``tokenizers``; numpy pooling."""

    def __init__(self, onnx_path: Path, model_dir: Path, *, model_id: str, dim: int, pooling: str = "mean",
                 normalize: bool = True, query_prefix: str = "", max_seq_length: int = 256,
                 batch_size: int = DEFAULT_BATCH) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelError(f"{model_dir}: no tokenizer.json, which the ONNX backend needs; use backend = \"torch\"")
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self._tokenizer.enable_truncation(max_length=max_seq_length)
        padding = self._tokenizer.padding or {}
        pad_token = str(padding.get("pad_token", "[PAD]"))
        pad_id = padding.get("pad_id", self._tokenizer.token_to_id(pad_token) or 0)
        self._tokenizer.enable_padding(pad_id=int(pad_id), pad_token=pad_token)  # to the longest in a batch
        options = ort.SessionOptions()
        options.log_severity_level = 3
        # ORT's worker threads otherwise spin on a core after every run, waiting for the next one:
        # in the daemon that starves the HTTP threads and the caller (2 cores here). Off, a route
        # costs ~30% less CPU and a busy machine no longer triples encode latency; a lone encode
        # on an idle machine is ~4% slower (benchmarks/results/daemon.md).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
        self._inputs = [i.name for i in self._session.get_inputs()]
        self._model_id = model_id
        self._dim = dim
        self._pooling = pooling
        self._normalize = normalize
        self._prefix = query_prefix
        self._batch = batch_size
        self._source = f"remove {onnx_path.parent} to export it again"

    @classmethod
    def load(cls, resolved: ResolvedModel, data_dir: Path, model_id: str) -> OnnxEncoder:
        """Export once (or reuse the export) and open it; a broken or damaged export
        (:func:`capd.onnx_export.damage`) is set aside and redone once."""
        m = resolved.manifest
        if not (resolved.directory / "tokenizer.json").is_file():  # checked before spending an export on it
            raise ModelError(f"{resolved.directory}: no tokenizer.json, which the ONNX backend needs; "
                             "use backend = \"torch\"")
        kwargs: dict[str, Any] = {"model_id": model_id, "dim": m.dim, "pooling": m.pooling, "normalize": m.normalize,
                                  "query_prefix": m.query_prefix, "max_seq_length": m.max_seq_length}
        # A per-process export (read-only data directory) is deleted once the session has read it.
        with contextlib.ExitStack() as scratch:
            path = ensure_onnx(resolved.directory, resolved.weights_sha256, data_dir, scratch)
            encoder, problem = cls._open_checked(path, resolved.directory, kwargs)
            if encoder is not None:
                return encoder
            log.warning("the ONNX export %s is unusable: %s; setting it aside and exporting it again", path, problem)
            path = ensure_onnx(resolved.directory, resolved.weights_sha256, data_dir, scratch, replacing=path)
            encoder, problem = cls._open_checked(path, resolved.directory, kwargs)
            if encoder is None:
                raise ModelError(f"{path}: the ONNX export is unusable even after exporting it again: {problem}; "
                                 f"remove {path.parent} or use backend = \"torch\"")
            return encoder

    @classmethod
    def _open_checked(cls, path: Path, model_dir: Path, kwargs: dict[str, Any]) -> tuple[OnnxEncoder | None, str]:
        """The encoder over ``path``, or None and why it cannot be used."""
        try:
            encoder = cls(path, model_dir, **kwargs)
        except ModelError:
            raise
        except Exception as exc:  # onnxruntime raises its own exception types for unreadable graphs
            return None, f"cannot load it ({exc})"
        problem = damage(path.parent, encoder._session)
        return (None, problem) if problem else (encoder, "")

    def embed(self, texts: Sequence[str]) -> Vectors:
        return self._embed(texts, tokens=False)[0]

    def embed_tokens(self, texts: Sequence[str]) -> Embedded:
        return self._embed(texts, tokens=True)

    def _embed(self, texts: Sequence[str], tokens: bool) -> Embedded:
        items = [self._prefix + t for t in _check_texts(texts)]
        out = np.empty((len(items), self._dim), dtype=np.float32)
        rows: TokenVectors = [out[:0]] * len(items)
        order = sorted(range(len(items)), key=lambda i: len(items[i]))  # similar lengths pad less
        for start in range(0, len(order), self._batch):
            chunk = order[start:start + self._batch]
            hidden, mask = self._run([items[i] for i in chunk])
            out[chunk] = pool(hidden, mask, self._pooling)
            if tokens:
                for i, matrix in zip(chunk, token_rows(hidden, mask), strict=True):
                    rows[i] = matrix
        vectors = l2_normalize(out) if self._normalize and len(items) else out
        check_finite(self._model_id, vectors, rows if tokens else [], self._source)
        return vectors, rows if tokens else []

    def _run(self, texts: list[str]) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """The last hidden states ``[batch, tokens, dim]`` and the attention mask."""
        encodings = self._tokenizer.encode_batch(texts)
        arrays = {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }
        hidden = self._session.run(["last_hidden_state"], {name: arrays[name] for name in self._inputs})[0]
        return np.asarray(hidden), arrays["attention_mask"]


class TorchEncoder(_ModelEncoder):
    """sentence-transformers on the CPU; token embeddings pooled like :class:`OnnxEncoder`."""

    def __init__(self, model_dir: Path, *, model_id: str, dim: int, pooling: str = "mean", normalize: bool = True,
                 query_prefix: str = "", max_seq_length: int = 256, batch_size: int = DEFAULT_BATCH) -> None:
        from sentence_transformers import SentenceTransformer

        quiet_progress_bars()
        try:
            self._model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelError(f"{model_dir}: sentence-transformers cannot load it: {exc}") from None
        self._model.max_seq_length = max_seq_length
        self._lock = threading.Lock()  # one forward pass at a time; torch parallelises inside it
        self._model_id = model_id
        self._dim = dim
        self._pooling = pooling
        self._normalize = normalize
        self._prefix = query_prefix
        self._batch = batch_size
        self._source = f"reinstall the model in {model_dir}"

    def embed(self, texts: Sequence[str]) -> Vectors:
        return self._embed(texts, tokens=False)[0]

    def embed_tokens(self, texts: Sequence[str]) -> Embedded:
        return self._embed(texts, tokens=True)

    def _embed(self, texts: Sequence[str], tokens: bool) -> Embedded:
        items = [self._prefix + t for t in _check_texts(texts)]
        if not items:
            return np.zeros((0, self._dim), dtype=np.float32), []
        with self._lock:
            states = self._model.encode(items, output_value="token_embeddings", convert_to_numpy=False,
                                        batch_size=self._batch, show_progress_bar=False)
        hidden = [t.float().cpu().numpy() for t in states]  # each [real tokens, dim]: padding already cut
        rows = [h[0] if self._pooling == "cls" else h.mean(axis=0) for h in hidden]
        out = np.stack(rows).astype(np.float32)
        matrices = [token_rows(h[None], np.ones((1, len(h))))[0] for h in hidden] if tokens else []
        vectors = l2_normalize(out) if self._normalize else out
        check_finite(self._model_id, vectors, matrices, self._source)
        return vectors, matrices


def resolve_backend(settings_backend: str, manifest_backend: str) -> str:
    """``auto`` means the manifest's backend (ONNX for every shipped model: the faster one here)."""
    if settings_backend in ("onnx", "torch"):
        return settings_backend
    return manifest_backend if manifest_backend in ("onnx", "torch") else "onnx"


def open_encoder(settings: Settings) -> Encoder:
    """Build the encoder ``settings`` asks for: the one factory for real models and the fake.

    ``settings.model == "hash"`` gives :class:`HashEncoder`. Otherwise the model is resolved
    and its weights verified (:func:`capd.models.resolve`) before either backend loads it.
    With backend "auto", an ONNX export that fails falls back to torch with a warning.
    """
    manifest = manifest_for(settings)
    if manifest.source_kind == "builtin":
        return HashEncoder(dim=manifest.dim, normalize=manifest.normalize)
    resolved = resolve(manifest, settings.data_dir)
    backend = resolve_backend(settings.backend, manifest.backend)

    def identity(chosen: str) -> str:
        return model_identity(resolved.label, resolved.weights_sha256, chosen, manifest.pooling, manifest.normalize,
                              manifest.max_seq_length, manifest.query_prefix)

    if backend == "onnx":
        try:
            return OnnxEncoder.load(resolved, settings.data_dir, identity("onnx"))
        except ModelError as exc:
            if settings.backend != "auto":
                raise
            log.warning("ONNX backend unavailable (%s); using torch", exc)
    return TorchEncoder(resolved.directory, model_id=identity("torch"), dim=manifest.dim, pooling=manifest.pooling,
                        normalize=manifest.normalize, query_prefix=manifest.query_prefix,
                        max_seq_length=manifest.max_seq_length)
