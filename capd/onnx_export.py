"""Export a model's transformer to ONNX once, into the data directory, and reuse it.

Layout: ``<data_dir>/onnx/<weights sha256[:16]>/model.onnx`` plus ``export.json`` (written
last: its presence marks a complete export). The graph outputs ``last_hidden_state``;
pooling and normalisation happen in numpy (:mod:`capd.encoder`), so one export serves every
pooling / prefix / max-length setting of the same weights.

Why torch's own exporter (``torch.onnx.export(..., dynamo=False)``) and not optimum: optimum
pins transformers / huggingface-hub ranges that fight sentence-transformers' pins, and the
exporter that ships with torch needs nothing extra. The graph is checked against torch on a
sample batch before it is published.

Concurrency: two processes exporting at once take a file lock; the loser finds the finished
export. The file appears atomically (:func:`capd.atomic.replacing`).
A read-only data directory falls back to a per-process temporary directory, with a warning.

Only :func:`export` imports torch / transformers; :func:`ensure_onnx` on an existing export
touches neither, which keeps a warm start fast.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from capd import atomic
from capd.errors import ModelError
from capd.models import quiet_progress_bars

log = logging.getLogger(__name__)

EXPORT_RECIPE = 1  # bump when the export procedure changes; older exports are redone
OPSET = 17
META_FILE = "export.json"
MODEL_FILE = "model.onnx"
LOCK_TIMEOUT_S = 900.0
PARITY_TOLERANCE = 1e-3


def onnx_dir(data_dir: Path, weights_sha: str) -> Path:
    return data_dir / "onnx" / weights_sha[:16]


def is_current(directory: Path, weights_sha: str) -> bool:
    """True when ``directory`` holds a complete export of these weights by this recipe."""
    try:
        meta = json.loads((directory / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(meta, dict) and meta.get("weights_sha256") == weights_sha
            and meta.get("recipe") == EXPORT_RECIPE and (directory / MODEL_FILE).is_file())


def ensure_onnx(model_dir: Path, weights_sha: str, data_dir: Path) -> Path:
    """The path of the exported ``model.onnx`` for these weights, exporting it first if needed."""
    directory = onnx_dir(data_dir, weights_sha)
    if is_current(directory, weights_sha):
        return directory / MODEL_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(directory / ".export.lock"), timeout=LOCK_TIMEOUT_S)
        lock.acquire()
    except Timeout:  # before OSError: filelock's Timeout is a TimeoutError
        raise ModelError(f"{directory}: another process has held the export lock for {LOCK_TIMEOUT_S:.0f} s; "
                         "remove .export.lock there if no capd process is running") from None
    except OSError as exc:
        scratch = Path(tempfile.mkdtemp(prefix="capd-onnx-"))
        log.warning("cannot write the ONNX export into %s (%s); exporting into %s for this process only",
                    directory, exc, scratch)
        return _export_into(model_dir, weights_sha, scratch)
    try:
        if is_current(directory, weights_sha):
            return directory / MODEL_FILE
        return _export_into(model_dir, weights_sha, directory)
    finally:
        lock.release()


def discard(directory: Path) -> None:
    """Set a broken export aside so that the next :func:`ensure_onnx` redoes it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in (META_FILE, MODEL_FILE):
        path = directory / name
        if path.exists():
            try:
                path.rename(path.with_name(f"{name}.broken-{stamp}"))
            except OSError as exc:
                log.warning("cannot set aside %s: %s", path, exc)


def _export_into(model_dir: Path, weights_sha: str, directory: Path) -> Path:
    target = directory / MODEL_FILE
    started = time.perf_counter()
    log.info("exporting %s to ONNX (once; reused from %s afterwards)", model_dir, directory)
    with atomic.replacing(target) as tmp:
        info = export(model_dir, tmp)
    meta = {"weights_sha256": weights_sha, "recipe": EXPORT_RECIPE, "opset": OPSET, "source": str(model_dir),
            "seconds": round(time.perf_counter() - started, 3), **info}
    atomic.write_text(directory / META_FILE, json.dumps(meta, indent=1))
    log.info("ONNX export done in %.1f s", meta["seconds"])
    return target


def export(model_dir: Path, out: Path) -> dict[str, Any]:
    """Export the transformer of ``model_dir`` to ``out`` and check it against torch."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import inspect

    import numpy as np
    import onnxruntime as ort
    import torch
    from transformers import AutoModel

    quiet_progress_bars()
    try:
        model = AutoModel.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{model_dir}: cannot load the model for ONNX export: {exc}") from None
    model.eval()
    with_types = "token_type_ids" in inspect.signature(model.forward).parameters

    class Wrapper(torch.nn.Module):
        """Keyword arguments only: transformers 5 clashes on positional ones (use_cache)."""

        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None) -> Any:
            kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
            if token_type_ids is not None:
                kwargs["token_type_ids"] = token_type_ids
            return self.inner(**kwargs).last_hidden_state

    vocab = int(getattr(model.config, "vocab_size", 1000))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, min(vocab, 2000), (2, 11), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    args: tuple[Any, ...] = (ids, mask, torch.zeros_like(ids)) if with_types else (ids, mask)
    names = ["input_ids", "attention_mask", "token_type_ids"][: len(args)]
    axes = {name: {0: "batch", 1: "sequence"} for name in [*names, "last_hidden_state"]}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The reference comes first: tracing leaves the torch module in a state that computes differently.
        expected = Wrapper()(*args).numpy()
        torch.onnx.export(Wrapper(), args, str(out), input_names=names, output_names=["last_hidden_state"],
                          dynamic_axes=axes, opset_version=OPSET, dynamo=False)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, {n: a.numpy() for n, a in zip(names, args, strict=True)})[0]
    valid = mask.numpy().astype(bool)
    diff = float(np.abs(np.asarray(got)[valid] - expected[valid]).max())
    if diff > PARITY_TOLERANCE:
        raise ModelError(f"{model_dir}: the ONNX export differs from torch by {diff:.2e} (tolerance "
                         f"{PARITY_TOLERANCE}); use backend = \"torch\" for this model")
    return {"inputs": names, "max_abs_diff": diff, "torch": str(torch.__version__)}
