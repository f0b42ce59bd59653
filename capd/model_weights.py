"""A model's weights file, and checking it is the one a manifest pins.

:func:`verify_weights` hashes the weights (sha256) before anything loads them and refuses a file
that is not the pinned one. With a data directory it records what it verified
(:data:`VERIFIED_FILE`: the file's stat data and its hash), so an unchanged file is not hashed
again at every start; a changed one (size, times, inode) is.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capd import atomic
from capd.errors import ModelNotAvailable, WeightsMismatch

if TYPE_CHECKING:
    from capd.models import ModelManifest

log = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
VERIFIED_FILE = "verified-weights.json"


def weights_file(directory: Path, manifest: ModelManifest | None = None) -> Path:
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    label = manifest.name if manifest else str(directory)
    raise ModelNotAvailable(f"model {label!r}: {directory} has no model.safetensors (or pytorch_model.bin); "
                            "point `model` at a complete sentence-transformers directory")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def stat_stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _load_stamps(stamp_file: Path) -> dict[str, Any]:
    try:
        data = json.loads(stamp_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_stamps(stamp_file: Path, stamps: dict[str, Any]) -> None:
    try:
        stamp_file.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(stamp_file, json.dumps(stamps, indent=1, sort_keys=True))
    except OSError as exc:  # a read-only data dir only costs a re-hash next time
        log.debug("cannot record weight verification in %s: %s", stamp_file, exc)


def verify_weights(weights: Path, expected: str | None, data_dir: Path | None = None) -> str:
    """The sha256 of ``weights``; raises :class:`WeightsMismatch` when it is not ``expected``.

    With ``data_dir``, a file already verified with identical stat data is not re-hashed.
    """
    stamp_file = data_dir / VERIFIED_FILE if data_dir else None
    key = str(weights.resolve())
    stat_key = stat_stamp(weights)
    stamps = _load_stamps(stamp_file) if stamp_file else {}
    known = stamps.get(key)
    if isinstance(known, dict) and known.get("stat") == stat_key and isinstance(known.get("sha256"), str):
        actual = str(known["sha256"])
    else:
        actual = sha256_file(weights)
    if expected is not None and actual != expected.lower():
        raise WeightsMismatch(
            f"{weights}: sha256 is {actual}, but the manifest pins {expected}; refusing to load weights that "
            "are not the verified ones (reinstall the model, or fix sha256 in the manifest if you changed "
            "the model on purpose)")
    if stamp_file is not None and known != {"stat": stat_key, "sha256": actual}:
        stamps[key] = {"stat": stat_key, "sha256": actual}
        _save_stamps(stamp_file, stamps)
    return actual
