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
export. The file appears atomically (:func:`capd.atomic.replacing`); a temporary file left by a
process killed mid-export is removed by the next one that holds the lock (:func:`sweep`).
A read-only data directory falls back to a per-process temporary directory, with a warning;
the caller removes it once ONNX Runtime has read the graph (``cleanup``).

Damage: ``export.json`` records the file's sha256 with its size and mtime, and a *probe*: fixed
token ids spread over the vocabulary and the mean of the hidden states the published graph
gives for them. :func:`damage` checks both against a loaded session at every start (one short
forward pass, ~7 ms here; the file is re-hashed, ~0.1 s, only when its size or mtime moved), so a
``model.onnx`` written over after export, or one that computes NaN or different numbers, is
set aside and exported again instead of poisoning the vector cache. Damage to rows of the
word-embedding table that the probe does not use is found by the hash when the file was
written to; not when its bits rot in place with the mtime untouched.

Only :func:`export` imports torch / transformers; :func:`ensure_onnx` on an existing export
touches neither, which keeps a warm start fast.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock, Timeout

from capd import atomic
from capd.errors import ModelError
from capd.model_weights import sha256_file
from capd.models import quiet_progress_bars

log = logging.getLogger(__name__)

# Bump when the export procedure changes; older exports are redone. 2: export.json records the
# file's sha256 and a probe (:func:`damage`); an export without them is redone once, rather than
# trusted unchecked (checking it against torch costs about as much as exporting it again).
EXPORT_RECIPE = 2
OPSET = 17
META_FILE = "export.json"
MODEL_FILE = "model.onnx"
LOCK_TIMEOUT_S = 900.0
PARITY_TOLERANCE = 1e-3
PROBE_TOKENS = 32
PROBE_TOLERANCE = 1e-4  # the same graph on the same runtime: differences are rounding only
SCRATCH_PREFIX = "capd-onnx-"


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


def ensure_onnx(model_dir: Path, weights_sha: str, data_dir: Path, cleanup: contextlib.ExitStack | None = None,
                *, replacing: Path | None = None) -> Path:
    """The path of the exported ``model.onnx`` for these weights, exporting it first if needed.

    ``replacing``: a damaged export (:func:`damage`) to set aside and redo, unless another
    process has already replaced it. A data directory that cannot be written gets an export in
    a per-process temporary directory, removed when ``cleanup`` closes (without one, at exit).
    """
    directory = onnx_dir(data_dir, weights_sha)
    if replacing is None and is_current(directory, weights_sha):
        sweep(directory, wait=False)
        return directory / MODEL_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(directory / ".export.lock"), timeout=LOCK_TIMEOUT_S)
        lock.acquire()
    except Timeout:  # before OSError: filelock's Timeout is a TimeoutError
        raise ModelError(f"{directory}: another process has held the export lock for {LOCK_TIMEOUT_S:.0f} s; "
                         "remove .export.lock there if no capd process is running") from None
    except OSError as exc:
        return _export_private(model_dir, weights_sha, cleanup, f"cannot write the ONNX export into {directory} "
                               f"({exc})")
    try:
        sweep(directory, wait=None)
        if replacing is not None and _same_file(directory / MODEL_FILE, replacing) and not discard(directory):
            return _export_private(model_dir, weights_sha, cleanup, f"cannot set aside the damaged {replacing}")
        if is_current(directory, weights_sha):
            return directory / MODEL_FILE
        target = directory / MODEL_FILE
        if (target.exists() or target.is_symlink()) and not target.is_file():  # a folder there failed the start
            log.warning("%s is not a file; setting it aside and exporting again", target)
            if not discard(directory):
                return _export_private(model_dir, weights_sha, cleanup, f"cannot set aside {target}")
        return _export_into(model_dir, weights_sha, directory, kept=True)
    finally:
        lock.release()


def file_stamp(path: Path) -> tuple[int, int, int, int] | None:
    """What tells one version of a file from another without reading it (None: no file)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _same_file(path: Path, other: Path) -> bool:
    """Whether ``path`` still is the file ``other`` named (a damaged export nobody replaced yet)."""
    stamp = file_stamp(path)
    return stamp is not None and stamp == file_stamp(other)


def _export_private(model_dir: Path, weights_sha: str, cleanup: contextlib.ExitStack | None, why: str) -> Path:
    """Export into a temporary directory of this process only (removed by ``cleanup``, or at exit)."""
    _remove_orphaned_scratch()
    scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
    if cleanup is not None:
        cleanup.callback(shutil.rmtree, scratch, ignore_errors=True)
    else:
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    log.warning("%s; exporting into %s for this process only", why, scratch)
    return _export_into(model_dir, weights_sha, scratch, kept=False)


def _remove_orphaned_scratch() -> None:
    """Remove the per-process export directories of processes that no longer run (killed before
    their cleanup); each directory's name carries its process id."""
    for path in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = path.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not atomic.process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def sweep(directory: Path, wait: bool | None) -> int:
    """Remove temporary files an export killed midway left in ``directory``; returns how many.

    Exports write only while holding the export lock, so with the lock held every temporary file
    there is an orphan. ``wait=None``: the caller holds the lock; ``False``: take it only if it is
    free (a start never waits for another process's export), skipping the sweep otherwise.
    """
    try:
        leftovers = [p for p in directory.iterdir() if p.name.startswith((f".{MODEL_FILE}.", f".{META_FILE}."))
                     and p.name.endswith(".tmp")]
    except OSError:
        return 0
    if not leftovers:
        return 0
    if wait is None:
        return _unlink(leftovers)
    try:
        with FileLock(str(directory / ".export.lock"), timeout=-1 if wait else 0):
            return _unlink([p for p in leftovers if p.exists()])
    except (Timeout, OSError):  # an export is running, or the directory is read-only
        return 0


def _unlink(paths: list[Path]) -> int:
    removed = 0
    for path in paths:
        try:
            path.unlink()
            removed += 1
        except OSError as exc:
            log.debug("cannot remove %s: %s", path, exc)
    if removed:
        log.warning("removed %d temporary file(s) an interrupted ONNX export left in %s", removed, paths[0].parent)
    return removed


def discard(directory: Path) -> bool:
    """Set a broken export aside so that the next :func:`ensure_onnx` redoes it; False when it
    could not be."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    done = True
    for name in (META_FILE, MODEL_FILE):
        path = directory / name
        if path.exists() or path.is_symlink():
            try:
                path.rename(path.with_name(f"{name}.broken-{stamp}"))
            except OSError as exc:
                log.warning("cannot set aside %s: %s", path, exc)
                done = False
    return done


def damage(directory: Path, session: Any) -> str | None:
    """Why the export in ``directory``, loaded as ``session`` (an ONNX Runtime session), cannot be
    trusted, or None. Checks the recorded sha256 (only when size or mtime moved) and the probe."""
    try:
        meta = json.loads((directory / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"{META_FILE} is unreadable ({exc})"
    model = directory / MODEL_FILE
    fingerprint = meta.get("model")
    if isinstance(fingerprint, dict):
        stamp = file_stamp(model)
        if stamp is None or [stamp[2], stamp[3]] != fingerprint.get("stat"):
            actual = sha256_file(model) if stamp is not None else "missing"
            if actual != fingerprint.get("sha256"):
                return f"{MODEL_FILE} changed since it was exported (sha256 {actual[:16]}, recorded " \
                       f"{str(fingerprint.get('sha256'))[:16]})"
    probe = meta.get("probe")
    if not isinstance(probe, dict):
        return None  # an export by a stand-in (tests); every export() records one
    try:
        got = run_probe(session, [int(i) for i in probe["input_ids"]])
        reference = np.asarray(probe["mean"], dtype=np.float32)
    except (KeyError, TypeError, ValueError) as exc:
        return f"the probe in {META_FILE} is unusable ({exc})"
    if not np.isfinite(got).all():
        return "it computes NaN or inf"
    if got.shape != reference.shape:
        return f"its output has shape {got.shape}, the probe recorded {reference.shape}"
    diff = float(np.abs(got - reference).max())
    if not diff <= PROBE_TOLERANCE:
        return f"its output differs from the one recorded at export by {diff:.2e} (tolerance {PROBE_TOLERANCE})"
    return None


def run_probe(session: Any, input_ids: list[int]) -> Any:
    """The mean hidden state ``session`` gives for one sequence of ``input_ids`` (float32 [dim])."""
    ids = np.asarray([input_ids], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    names = [i.name for i in session.get_inputs()]
    hidden = session.run(["last_hidden_state"], {name: feeds[name] for name in names})[0]
    return np.asarray(hidden, dtype=np.float32)[0].mean(axis=0)


def _export_into(model_dir: Path, weights_sha: str, directory: Path, kept: bool) -> Path:
    target = directory / MODEL_FILE
    started = time.perf_counter()
    if kept:
        log.info("exporting %s to ONNX (once; reused from %s afterwards)", model_dir, directory)
    else:
        log.info("exporting %s to ONNX", model_dir)
    with atomic.replacing(target) as tmp:
        info = export(model_dir, tmp)
    stamp = file_stamp(target)
    assert stamp is not None
    meta = {"weights_sha256": weights_sha, "recipe": EXPORT_RECIPE, "opset": OPSET, "source": str(model_dir),
            "seconds": round(time.perf_counter() - started, 3),
            "model": {"sha256": sha256_file(target), "stat": [stamp[2], stamp[3]]}, **info}
    atomic.write_text(directory / META_FILE, json.dumps(meta, indent=1))
    log.info("ONNX export done in %.1f s", meta["seconds"])
    return target


def export(model_dir: Path, out: Path) -> dict[str, Any]:
    """Export the transformer of ``model_dir`` to ``out`` and check it against torch."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import inspect

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
    probe_ids = probe_tokens(vocab)
    probe = torch.tensor([probe_ids])
    probe_args = (probe, torch.ones_like(probe), torch.zeros_like(probe))[: len(args)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The reference comes first: tracing leaves the torch module in a state that computes differently.
        expected = Wrapper()(*args).numpy()
        expected_probe = Wrapper()(*probe_args).numpy()[0].mean(axis=0)
        torch.onnx.export(Wrapper(), args, str(out), input_names=names, output_names=["last_hidden_state"],
                          dynamic_axes=axes, opset_version=OPSET, dynamo=False)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, {n: a.numpy() for n, a in zip(names, args, strict=True)})[0]
    valid = mask.numpy().astype(bool)
    mean = run_probe(session, probe_ids)
    diff = max(float(np.abs(np.asarray(got)[valid] - expected[valid]).max()),
               float(np.abs(mean - expected_probe).max()))
    if not diff <= PARITY_TOLERANCE:  # NaN fails too
        raise ModelError(f"{model_dir}: the ONNX export differs from torch by {diff:.2e} (tolerance "
                         f"{PARITY_TOLERANCE}); use backend = \"torch\" for this model")
    return {"inputs": names, "max_abs_diff": diff, "torch": str(torch.__version__),
            "probe": {"input_ids": probe_ids, "mean": [float(x) for x in mean]}}


def probe_tokens(vocab: int) -> list[int]:
    """:data:`PROBE_TOKENS` token ids spread over the vocabulary (past BERT's unused ids when it is
    large enough), so the probe's forward pass reads many rows of the embedding table."""
    low = 1000 if vocab > 4 * PROBE_TOKENS + 1000 else 1
    return [int(i) for i in np.linspace(low, vocab - 1, PROBE_TOKENS)]
