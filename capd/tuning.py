"""Few-shot tuning of the model on the taps' own examples (``tune = true``, ``capd tune``).

The bundled model was trained for general sentence similarity; a tap needs one thing from
it: messages for one capability close together, apart from the others. A short
contrastive fine-tune on each capability's examples (its triggers, its description and
its name; never fixture rows, never learned corrections) teaches exactly that, SetFit-
style, on the CPU in seconds to minutes. Measured on every shared eval set and taps/core
(``make quality``, "Tuned model"): higher top-1 on every set, and a large gain in
fired_right on sets whose capabilities share words (hwu64).

Recipe (:data:`RECIPE`, fixed; measured with ``benchmarks/quality/tune_trial.py``): every
example is paired with up to 10 other examples of its capability; batches of 32 pairs hold
each capability at most once, so every other pair's positive is a true negative; the loss
is the symmetric in-batch cross-entropy of cosines × 20 (multiple-negatives ranking);
one epoch of AdamW at 2e-5 with a 10% linear warm-up, seed 0.

The result is a sentence-transformers directory under ``<data>/tuned/<key>/``, where the
key hashes the recipe, the base model's weights and every capability's examples: the same
taps give the same key, so a restart reuses it, and an edit that changes any example gives
a new one. Tuning runs in a child process (niced, so routing keeps the CPU first; its
memory is returned when it ends) and writes into a temporary directory renamed into place
when complete, so a crash never leaves a half-written model behind.

Processes: the child dies with the process that started it (:func:`die_with_parent`), so a
``kill -9`` of the daemon or of ``capd tune`` never leaves a trainer publishing on its own.
A per-key lock (``tuned/.KEY.lock``, ``flock``) lets one process train a key at a time; another
one waits and then uses its result. The kernel drops the lock when its holder dies, so a
crashed holder never blocks anyone. Leftovers of killed runs (``.KEY.PID.tmp``,
``.KEY.PID.spec.json``) are swept at the next tuning or prune once their PID is gone; a child
that failed (a full disk) or was killed has its own swept by its parent at once.

Where tuned models are kept, which are in use and which are pruned: :mod:`capd.tuned_models`;
when a service tunes: :mod:`capd.tuner`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from capd.catalog import Catalog
from capd.errors import CapdError, ModelError
from capd.models import quiet_progress_bars
from capd.router import example_texts
from capd.tuned_models import MARKER, is_tuned, sweep

log = logging.getLogger(__name__)

VERSION = "tune-1"  # bump when the training code changes what a recipe produces
NICE = 10
ERROR_PREFIX = "capd tuning: error: "  # the child's last stderr line when it fails: the reason shown
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
OS_ERROR = re.compile(r"\(os error \d+\)")  # an OSError as Rust libraries word it
PARENT_POLL = 0.5  # seconds between checks of the parent where prctl is unavailable


@dataclass(frozen=True)
class Recipe:
    epochs: int = 1
    learning_rate: float = 2e-5
    batch_size: int = 32
    scale: float = 20.0
    pairs_per_example: int = 10
    seed: int = 0


RECIPE = Recipe()

Groups = list[tuple[str, list[str]]]  # (capability, its examples)
Pair = tuple[int, str, str]  # (capability index, example, another example of it)
Labelled = TypeVar("Labelled", bound=tuple[int, Any, Any])  # a pair of some kind, capability index first
Batcher = Callable[[list[Pair], int, random.Random], list[list[Pair]]]


def groups_for(catalog: Catalog) -> Groups:
    """Each capability's examples under the fused rule, for capabilities with at least two
    (one example has no partner to be pulled towards), sorted by name: :func:`tuning_key` does
    not depend on the taps' order, so neither may what is trained under it (within one tap the
    catalog is already in this order)."""
    out = []
    for capability in catalog:
        texts = list(example_texts(capability, "fused"))
        if len(texts) > 1:
            out.append((capability.name, texts))
    return sorted(out)


def tuning_key(base_weights_sha: str, groups: Groups, recipe: Recipe = RECIPE) -> str:
    digest = hashlib.sha256(f"{VERSION}\n{json.dumps(asdict(recipe), sort_keys=True)}\n{base_weights_sha}\n".encode())
    for name, texts in sorted(groups):
        digest.update(json.dumps([name, texts]).encode() + b"\n")
    return digest.hexdigest()[:24]


@contextlib.contextmanager
def key_lock(out: Path) -> Iterator[None]:
    """Hold ``tuned/.KEY.lock`` while tuning ``out``: another process tuning the same key waits
    here (never forever: the kernel releases a dead holder's lock)."""
    with open(out.with_name(f".{out.name}.lock"), "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # a warning: `capd tune` shows nothing else while it waits, maybe for minutes
            log.warning("tuning: another process is tuning %s; waiting for its result", out.name)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def pairs(groups: Groups, per_example: int, rng: random.Random) -> list[Pair]:
    """(capability, example, another example of it): up to ``per_example`` partners per example."""
    out = []
    for label, (_, texts) in enumerate(groups):
        for anchor in texts:
            partners = [t for t in texts if t != anchor]
            out += [(label, anchor, p) for p in rng.sample(partners, min(per_example, len(partners)))]
    return out


def batches(items: list[Labelled], size: int, rng: random.Random) -> list[list[Labelled]]:
    """Shuffled batches of at most ``size`` pairs (capability first) in which no capability appears twice."""
    pending = items[:]
    rng.shuffle(pending)
    out: list[list[Labelled]] = []
    while pending:
        batch: list[Labelled] = []
        seen: set[int] = set()
        rest = []
        for item in pending:
            if len(batch) < size and item[0] not in seen:
                batch.append(item)
                seen.add(item[0])
            else:
                rest.append(item)
        out.append(batch)
        pending = rest
    return out


def train(base_dir: Path, groups: Groups, out: Path, recipe: Recipe = RECIPE,
          batcher: Batcher = batches) -> dict[str, Any]:
    """Fine-tune the model in ``base_dir`` on ``groups`` and save it to ``out`` (replaced atomically).

    ``batcher`` orders the pairs into batches (:func:`batches`; the research harness
    ``benchmarks/quality/tune_trial.py`` tries others); it must keep a capability at most once
    per batch, or a batch holds false negatives."""
    import torch
    from sentence_transformers import SentenceTransformer

    if len(groups) < 2:
        raise ModelError("tuning needs at least two capabilities with two or more examples each")
    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    quiet_progress_bars()
    model = SentenceTransformer(str(base_dir), device="cpu", local_files_only=True)
    model.train()
    features = getattr(model, "preprocess", None) or model.tokenize  # renamed in newer sentence-transformers
    items = pairs(groups, recipe.pairs_per_example, rng)
    plan = [b for _ in range(recipe.epochs) for b in batcher(items, recipe.batch_size, rng)]
    optimiser = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate)
    warm = max(1, len(plan) // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda step: min((step + 1) / warm, max(0.0, (len(plan) - step) / max(1, len(plan) - warm))))
    started = time.perf_counter()
    losses: list[float] = []
    for step, batch in enumerate(plan, 1):
        anchors = model(features([a for _, a, _ in batch]))["sentence_embedding"]
        positives = model(features([p for _, _, p in batch]))["sentence_embedding"]
        logits = recipe.scale * (torch.nn.functional.normalize(anchors, dim=1)
                                 @ torch.nn.functional.normalize(positives, dim=1).T)
        target = torch.arange(len(batch))
        loss = (torch.nn.functional.cross_entropy(logits, target)
                + torch.nn.functional.cross_entropy(logits.T, target)) / 2
        optimiser.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimiser.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if step % 50 == 0 or step == len(plan):
            log.info("tuning: step %d/%d, loss %.3f", step, len(plan), sum(losses[-50:]) / len(losses[-50:]))
    model.eval()
    summary = {"version": VERSION, "recipe": asdict(recipe), "capabilities": len(groups),
               "examples": sum(len(t) for _, t in groups), "pairs": len(items), "steps": len(plan),
               "loss_first": round(sum(losses[:20]) / len(losses[:20]), 4),
               "loss_last": round(sum(losses[-20:]) / len(losses[-20:]), 4),
               "seconds": round(time.perf_counter() - started, 1), "base": str(base_dir)}
    scratch = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    model.save(str(scratch))
    (scratch / MARKER).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    publish(scratch, out)
    return summary


def publish(scratch: Path, out: Path) -> None:
    """Move a finished tuned model from ``scratch`` to ``out``.

    The key names the result, so when another process (a daemon and a ``capd eval`` on one data
    directory) finished the same tuning first, its copy stays (something may be loading it) and
    this one is dropped. A leftover ``out`` without the marker is an interrupted copy: replaced.
    """
    if not is_tuned(out):
        shutil.rmtree(out, ignore_errors=True)
        try:
            scratch.replace(out)
            return
        except OSError:  # another process's copy appeared in between
            if not is_tuned(out):
                raise
    log.info("tuning: %s was finished by another process; keeping its copy", out)
    shutil.rmtree(scratch, ignore_errors=True)


def run_child(base_dir: Path, groups: Groups, out: Path, recipe: Recipe = RECIPE,
              started: list[subprocess.Popen[bytes]] | None = None,
              onnx_data_dir: Path | None = None) -> dict[str, Any]:
    """:func:`train` in a niced child process (its log goes to this process's stderr).

    ``started`` receives the child as soon as it runs, so a caller can stop it. With
    ``onnx_data_dir`` the child also exports the published model to ONNX there
    (:func:`export_onnx`), so that the caller only opens the export. When another
    process is tuning the same key, this waits for it and returns its result (``seconds`` None:
    nothing was trained here). The failure's reason is the child's last error line.
    """
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # read-only or immutable data directory, a file in the way
        raise ModelError(f"cannot create {out.parent} for tuned models ({exc.strerror or exc}); make the data "
                         "directory writable, or set tune = false") from None
    sweep(out.parent)
    with key_lock(out):
        if is_tuned(out):
            log.info("tuning: %s was tuned by another process; using it", out)
            return {**_summary(out), "seconds": None}
        spec = out.with_name(f".{out.name}.{os.getpid()}.spec.json")
        errors: list[str] = []
        try:
            spec.write_text(json.dumps({"base": str(base_dir), "out": str(out), "groups": groups,
                                        "recipe": asdict(recipe),
                                        "onnx_data_dir": None if onnx_data_dir is None else str(onnx_data_dir)}),
                            encoding="utf-8")
            child = subprocess.Popen([sys.executable, "-m", "capd.tuning", str(spec), "--parent", str(os.getpid())],
                                     stderr=subprocess.PIPE,
                                     preexec_fn=lambda: os.nice(NICE))  # only os.nice: safe between fork and exec
            if started is not None:
                started.append(child)
            relay = threading.Thread(target=_relay, args=(child, errors), name="capd-tune-log", daemon=True)
            relay.start()
            code = child.wait()
            relay.join(5)
        finally:
            spec.unlink(missing_ok=True)
        if is_tuned(out):  # published: complete even if the child was killed afterwards
            return _summary(out)
        # the child is gone (reaped): its half-written copy (~90 MB, often on the disk that just
        # filled up) goes now, not at the next tuning, which after a failure may never come
        sweep(out.parent)
    reason = errors[-1] if errors else _ended(code)
    raise ModelError(f"tuning failed ({reason}); routing keeps the model it has")


def _ended(code: int) -> str:
    """How a child that printed no error ended: ``killed by SIGKILL`` (the kernel's out-of-memory
    killer, or someone's ``kill -9``) says more than ``exit -9``."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit {code}"


def _summary(out: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((out / MARKER).read_text(encoding="utf-8"))
    return summary


def _relay(child: subprocess.Popen[bytes], errors: list[str]) -> None:
    """Copy the child's stderr to this process's, keeping its error lines for the failure's reason;
    then close the pipe (left open, each run held a file descriptor for as long as the daemon ran)."""
    assert child.stderr is not None
    with child.stderr:
        for raw in child.stderr:
            line = raw.decode("utf-8", "replace")
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.startswith(ERROR_PREFIX):
                errors.append(line[len(ERROR_PREFIX):].strip())


def export_onnx(out: Path, data_dir: Path) -> None:
    """In the tuning child, once ``out`` is published: export it to ONNX under ``data_dir``, where
    the daemon's loader finds it (:func:`capd.onnx_export.ensure_onnx`; a file lock keeps two
    exporters apart). Left to the daemon, the export imported torch into it at full priority and
    kept about 600 MB there after the switch. A failure only logs: the loader exports it then."""
    from capd.encoder import open_encoder  # the child's work only
    from capd.settings import Settings

    try:
        open_encoder(Settings(model=str(out), data_dir=data_dir, backend="onnx", taps=()))
    except Exception as exc:
        log.warning("could not export %s to ONNX (%s); the process that loads it will", out, exc)


def die_with_parent(parent: int) -> None:
    """Make this process (the tuning child) end when ``parent`` does, even by ``kill -9``.

    On Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the child when the thread
    that started it ends (capd always waits for the child in that thread). A parent that died
    before the prctl took effect is caught by comparing ``getppid()`` with the one that started
    us. Elsewhere (or if prctl fails), a watchdog thread polls ``getppid()``."""
    watchdog = True
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            watchdog = libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)  # the parent is already gone: we were re-parented before the prctl

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL)
        os._exit(1)

    if watchdog:
        threading.Thread(target=watch, name="capd-tune-parent", daemon=True).start()


def _environmental(exc: Exception) -> bool:
    """A full disk, a missing file or bad input rather than a bug: its message says it all. Rust
    libraries (safetensors saving the weights, tokenizers) report an OS error as their own
    exception type whose message ends in ``(os error N)``."""
    return isinstance(exc, (OSError, CapdError)) or OS_ERROR.search(str(exc)) is not None


def main(argv: Sequence[str] | None = None) -> int:
    """Child-process entry: ``python -m capd.tuning SPEC.json``."""
    parser = argparse.ArgumentParser(description="capd's tuning worker (started by capd itself)")
    parser.add_argument("spec", type=Path)
    parser.add_argument("--parent", type=int, help="the PID of the capd process that started this one")
    args = parser.parse_args(argv)
    if args.parent is not None:
        die_with_parent(args.parent)
    logging.basicConfig(level=logging.INFO, format="capd tuning: %(message)s")
    try:
        spec = json.loads(args.spec.read_text(encoding="utf-8"))
        groups = [(str(name), [str(t) for t in texts]) for name, texts in spec["groups"]]
        summary = train(Path(spec["base"]), groups, Path(spec["out"]), Recipe(**spec.get("recipe", {})))
        if spec.get("onnx_data_dir"):
            export_onnx(Path(spec["out"]), Path(spec["onnx_data_dir"]))
    except Exception as exc:  # the last line is the reason the parent reports (health, capd tune)
        if not _environmental(exc):  # a bug, not a full disk or bad input: keep the trace
            traceback.print_exc()
        sys.stderr.write(f"{ERROR_PREFIX}{exc}\n")
        return 1
    log.info("done: %d steps in %.1f s", summary["steps"], summary["seconds"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
