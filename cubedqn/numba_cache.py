"""Numba's cache kept in step with the whole package's sources.

What this file is: `drop_if_stale()`, which the package runs when it is imported, before
any kernel loads from Numba's cache. Numba checks a cached kernel against its own module's
source file only, so a kernel that calls a function of another module keeps the callee's
old machine code after that module changes (numba issues #1833, #9483): after an upgrade, a
pull or an edit of `optim.py`, a cached `learner.fused_sampled_step` would go on running
the old `optim.sq_norm`. Here a stamp of every source file of the package (its path, size
and modification time, as Numba stamps one file) is kept in the package's cache folder;
where it differs from the sources' own, the package's cache entries (`*.nbi`, `*.nbc`) are
deleted and the new stamp written. So any change to the package's code compiles every
kernel once more (a cold start), and nothing else does.

`drop_if_stale_for(folder)` does the same for a folder of modules outside the package
whose cached kernels call the package's (the tests', the benchmark scripts').

What it is not: a lock. Two processes importing a changed package at the same moment may
both delete entries (the later one compiles again); `precompile.py`'s second process
starts after its parent has written the stamp. The tile GEMM's object files (native.py)
are keyed by their own source and left alone.
"""

from __future__ import annotations

import hashlib
import os
import types
from pathlib import Path

STAMP_NAME = "cubedqn-sources.stamp"
PACKAGE = Path(__file__).resolve().parent


def source_files(root: Path = PACKAGE) -> list[Path]:
    """The package's Python sources, in a fixed order."""
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def sources_stamp(files, root: Path = PACKAGE) -> str:
    """A digest of each file's path from root, size and modification time."""
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{Path(os.path.relpath(p, root)).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _probe():
    """A function whose code object stands in for one of each source folder's (cache_folders)."""


def cache_folders(files) -> list[Path]:
    """Numba's cache folder for the kernels of each source folder among files (the one its
    locators pick for a function there, NUMBA_CACHE_DIR and all), first folder first; none
    where Numba could not cache there (no writable place)."""
    from numba.core.caching import FunctionCache
    impl = FunctionCache._impl_class  # what an njit(cache=True) kernel's cache is made by
    out, seen = [], set()
    for p in files:
        if p.parent in seen:
            continue
        seen.add(p.parent)
        probe = types.FunctionType(_probe.__code__.replace(co_filename=str(p)), {})
        try:
            folder = Path(impl(probe)._locator.get_cache_path())
        except RuntimeError:  # no locator for the file: Numba does not cache there
            continue
        if folder not in out:
            out.append(folder)
    return out


def refresh(files, root: Path, folders) -> bool:
    """Where the stamp in folders[0] is not the sources' (files under root): delete the
    Numba cache entries in folders and write the stamp. Returns whether it deleted."""
    if not folders:
        return False
    stamp = sources_stamp(files, root)
    stamp_file = Path(folders[0]) / STAMP_NAME
    try:
        if stamp_file.read_text() == stamp:
            return False
    except OSError:
        pass
    for folder in folders:
        for entry in Path(folder).glob("*.nb[ic]"):
            try:
                entry.unlink()
            except FileNotFoundError:
                pass
    tmp = stamp_file.with_name(f"{STAMP_NAME}.{os.getpid()}.tmp")
    tmp.write_text(stamp)
    os.replace(tmp, stamp_file)
    return True


def drop_if_stale() -> bool:
    """refresh() for this package; never raises (a cache it cannot check is left as Numba
    keeps it). Returns whether it deleted entries."""
    try:
        files = source_files()
        return refresh(files, PACKAGE, cache_folders(files))
    except Exception:  # noqa: BLE001 - a read-only tree, another Numba's internals: leave the cache be
        return False


def drop_if_stale_for(folder) -> bool:
    """drop_if_stale for the cached kernels of another folder's modules that call the
    package's (tests/, scripts/): their cache is dropped when the package's sources or the
    folder's own change (the folder's stamp in its cache folder covers both)."""
    try:
        own = sorted(Path(folder).resolve().glob("*.py"))
        return refresh(source_files() + own, PACKAGE, cache_folders(own))
    except Exception:  # noqa: BLE001 - as drop_if_stale
        return False
