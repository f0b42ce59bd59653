"""Shared fixtures. The real bundled model runs in the suite; the hash fake serves fast unit tests.

- ``model_settings``: Settings for the real bundled model (ONNX backend) with one data
  directory per test session, so the ONNX export happens once per run.
- ``real_encoder``: the real model through :func:`capd.encoder.open_encoder`.
- ``hash_encoder``: the deterministic fake (:class:`capd.encoder.HashEncoder`).
- ``settings_factory``: ``settings_factory(**overrides)`` gives Settings with a fresh data
  directory, the fake model and no taps unless overridden.
- ``isolated_data_dir(settings, tmp_path)``: the same settings with a fresh data directory
  that shares the session's ONNX export (a cold vector cache without re-exporting).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from capd.encoder import Encoder, HashEncoder, open_encoder
from capd.model_weights import VERIFIED_FILE
from capd.settings import Settings

SettingsFactory = Callable[..., Settings]

# The suite makes data directories with plain mkdir; under a machine's umask 000 they would be
# 0777, which capd refuses as a data directory every user may write to (capd.settings.own_data_dir).
# The usual umask, whatever the machine's: the tests that check permissions set their own.
os.umask(0o022)


@pytest.fixture(scope="session")
def model_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(data_dir=tmp_path_factory.mktemp("capd-data"), backend="onnx")


@pytest.fixture(scope="session")
def real_encoder(model_settings: Settings) -> Encoder:
    return open_encoder(model_settings)


@pytest.fixture(scope="session")
def hash_encoder() -> HashEncoder:
    return HashEncoder()


@pytest.fixture(scope="session")
def settings_factory(tmp_path_factory: pytest.TempPathFactory) -> SettingsFactory:
    def make(**overrides: Any) -> Settings:
        values: dict[str, Any] = {"data_dir": tmp_path_factory.mktemp("data"), "model": "hash", "taps": ()}
        values.update(overrides)
        return Settings(**values)

    return make


@contextmanager
def file_held(path: Path) -> Iterator[Callable[[], None]]:
    """Another process's writer holding the SQLite file at ``path`` (``BEGIN EXCLUSIVE``): every write
    of ours fails, reads still work. Until the block ends, or the callable it yields is called."""
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN EXCLUSIVE")

    def release() -> None:
        if writer.in_transaction:
            writer.execute("ROLLBACK")

    try:
        yield release
    finally:
        release()
        writer.close()


def isolated_data_dir(settings: Settings, tmp_path: Path) -> Settings:
    """``settings`` with a fresh data directory under ``tmp_path`` sharing its ONNX export."""
    fresh = tmp_path / "capd-data"
    fresh.mkdir(parents=True, exist_ok=True)
    shared = settings.data_dir / "onnx"
    shared.mkdir(parents=True, exist_ok=True)
    (fresh / "onnx").symlink_to(shared, target_is_directory=True)
    if (settings.data_dir / VERIFIED_FILE).is_file():
        shutil.copy2(settings.data_dir / VERIFIED_FILE, fresh / VERIFIED_FILE)
    return replace(settings, data_dir=fresh)


@pytest.fixture(scope="session")
def core_service(model_settings: Settings) -> Any:
    """A started Service (no sessions) on the shipped taps with the real model."""
    from capd.service import Service
    from capd.settings import default_taps

    return Service(replace(model_settings, taps=default_taps())).start()


@pytest.fixture(scope="session")
def fused_core(model_settings: Settings) -> Iterator[Any]:
    """A started Service with the ``fused`` rule on the shipped taps (their capd.toml gates) and the real model."""
    from capd.service import Service
    from capd.settings import default_taps

    service = Service(replace(model_settings, taps=default_taps(), rule="fused")).start()
    yield service
    service.close()


class HeldEncoder(HashEncoder):
    """The deterministic fake; while ``hold`` is set, each embed counts its texts (``texts``), says
    it got there (``reached``) and waits for ``release``: work caught in the middle."""

    def __init__(self) -> None:
        super().__init__()
        self.texts = 0
        self.hold, self.reached, self.release = threading.Event(), threading.Event(), threading.Event()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if self.hold.is_set():
            self.texts += len(texts)
            self.reached.set()
            self.release.wait(30)
        return super().embed(texts)


class GatedEncoder(HashEncoder):
    """The deterministic fake, holding every embed until ``gate`` is set: a daemon kept loading."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.gate.wait(30)
        return super().embed(texts)
