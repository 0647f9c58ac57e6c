"""Atomic file writes and pickle-free loading for run directories.

A run directory holds config.json, model.npz (online + target parameters, optimizer
state), state.json (counters, RNG state, curriculum) and optionally replay.npz (the
replay buffer and the environments, for an exact resume). Every file is written to a
temporary name in the same directory and renamed into place, so a crash mid-write never
leaves a half-written checkpoint behind. metrics.jsonl, a record per log interval, is
appended instead; a resumed run first drops the records past its checkpoint
(`rewind_metrics`), and a new run in a directory without a checkpoint keeps the earlier
run's files under other names (`set_aside_unfinished`).
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


def read_metrics(path) -> tuple[list, int]:
    """(records, lines dropped) of a metrics.jsonl: one JSON object per line, appended at each
    log interval. A last line that does not parse (a process killed while writing it) is
    dropped; any other line that does not parse raises CheckpointError."""
    path = Path(path)
    lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            if i == len(lines) - 1:
                return records, 1
            raise CheckpointError(f"{path} is corrupt (line {i + 1} is not a metrics record)")
        records.append(rec)
    return records, 0


def rewind_metrics(path, step: int) -> int:
    """Resuming at gradient step `step`: rewrite metrics.jsonl (atomically) without the records
    of later steps, which a run logged after that checkpoint and then stopped without saving
    again (those steps run again and log again), and without a cut-short last line. Returns
    how many records or lines it dropped (0: the file is left as it is)."""
    path = Path(path)
    if not path.exists():
        return 0
    records, torn = read_metrics(path)
    keep = [r for r in records if r["step"] <= step]
    dropped = len(records) - len(keep) + torn
    if dropped:
        _atomic(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in keep).encode()))
    return dropped


def set_aside_unfinished(run_dir) -> list:
    """A new run in a directory where an earlier run logged but never saved a checkpoint (no
    state.json): that run's metrics.jsonl and config.json are renamed to
    metrics.unfinished.jsonl and config.unfinished.json (.1, .2, ... before the suffix
    where those are taken), so that the new run's record starts empty and the old one is
    kept with the config that made it. Returns the new paths (none without a metrics.jsonl:
    a config.json alone is the new run's to overwrite)."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        return []
    n = 0
    while True:
        tag = "unfinished" if n == 0 else f"unfinished.{n}"
        names = {"metrics.jsonl": f"metrics.{tag}.jsonl", "config.json": f"config.{tag}.json"}
        if not any((run_dir / new).exists() for new in names.values()):
            break
        n += 1
    kept = []
    for old, new in names.items():
        if (run_dir / old).exists():
            os.replace(run_dir / old, run_dir / new)
            kept.append(run_dir / new)
    return kept
