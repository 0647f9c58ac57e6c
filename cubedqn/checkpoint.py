"""Atomic file writes and pickle-free loading for run directories.

A run directory holds config.json, model.npz (online + target parameters, optimizer
state), state.json (counters, RNG state, curriculum) and optionally replay.npz (the
replay buffer and the environments, for an exact resume). Every file is written to a
temporary name in the same directory and renamed into place, so a crash mid-write never
leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np


class CheckpointError(ValueError):
    """A missing, corrupt or mismatched checkpoint. The message is one line."""


def _atomic(path, write):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_savez(path, arrays: dict):
    _atomic(path, lambda f: np.savez(f, **arrays))


def atomic_write_json(path, obj):
    _atomic(path, lambda f: f.write((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()))


def read_json(path) -> dict:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt ({e.__class__.__name__})") from None


def read_npz(path) -> dict:
    """All arrays of an .npz file (never with pickle); CheckpointError if missing or corrupt."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt ({e.__class__.__name__})") from None
