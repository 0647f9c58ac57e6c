"""cubedqn.numba_cache: the package's Numba cache is dropped when any of its sources changes,
since Numba checks a cached kernel against its own module only."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import cubedqn
from cubedqn import numba_cache
from cubedqn.numba_cache import STAMP_NAME, cache_folders, drop_if_stale_for, refresh, source_files, sources_stamp


def _tree(root: Path):
    (root / "sub").mkdir(parents=True)
    (root / "a.py").write_text("x = 1\n")
    (root / "sub" / "b.py").write_text("y = 2\n")
    return source_files(root)


def _entries(folder: Path):
    return sorted(p.name for p in folder.iterdir())


def test_refresh_drops_numba_entries_only_when_a_source_changes(tmp_path):
    root, c1, c2 = tmp_path / "pkg", tmp_path / "c1", tmp_path / "c2"
    files = _tree(root)
    for c in (c1, c2):
        c.mkdir()
        for name in ("k.f-1.py311.nbi", "k.f-1.py311.1.nbc", "a.cpython-311.pyc", "tile-abc.o"):
            (c / name).write_text("")
    assert refresh(files, root, [c1, c2])  # no stamp yet: whatever is there may be stale
    assert _entries(c1) == sorted(["a.cpython-311.pyc", "tile-abc.o", STAMP_NAME])
    assert _entries(c2) == ["a.cpython-311.pyc", "tile-abc.o"]
    assert (c1 / STAMP_NAME).read_text() == sources_stamp(files, root)
    (c2 / "k.g-3.py311.nbi").write_text("")
    assert not refresh(files, root, [c1, c2])  # nothing changed: the entries stay
    assert "k.g-3.py311.nbi" in _entries(c2)
    (root / "sub" / "b.py").write_text("y = 3\n")  # same size, a new modification time
    st = (root / "sub" / "b.py").stat()
    os.utime(root / "sub" / "b.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert refresh(files, root, [c1, c2])
    assert "k.g-3.py311.nbi" not in _entries(c2)
    (root / "new.py").write_text("")  # a file more changes the stamp too
    assert refresh(source_files(root), root, [c1, c2])
    assert not refresh(source_files(root), root, [c1, c2])


def test_the_package_stamps_its_cache_when_imported():
    """Importing cubedqn left the stamp of its current sources in its cache folder (so a
    second look deletes nothing), and the folders are Numba's for its two source folders."""
    files = source_files()
    folders = cache_folders(files)
    assert {f.parent for f in files} == {Path(cubedqn.__file__).parent, Path(cubedqn.__file__).parent / "cuda"}
    assert len(folders) == 2
    assert (folders[0] / STAMP_NAME).read_text() == sources_stamp(files)
    assert not numba_cache.drop_if_stale()


def test_a_folder_outside_the_package_gets_its_own_stamp(tmp_path):
    """drop_if_stale_for (tests/conftest.py, the benchmark scripts): the folder's Numba
    cache is dropped when its own modules change, under a stamp over the package's sources
    and its own kept in its cache folder."""
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "bench.py").write_text("x = 1\n")
    (cache,) = cache_folders([folder / "bench.py"])  # its __pycache__, or under NUMBA_CACHE_DIR
    (cache / "bench.k-3.py311.nbi").write_text("")
    assert drop_if_stale_for(folder) and not (cache / "bench.k-3.py311.nbi").exists()
    assert (cache / STAMP_NAME).read_text() == sources_stamp(source_files() + [folder / "bench.py"])
    (cache / "bench.k-3.py311.nbi").write_text("")
    assert not drop_if_stale_for(folder) and (cache / "bench.k-3.py311.nbi").exists()
    st = (folder / "bench.py").stat()
    os.utime(folder / "bench.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert drop_if_stale_for(folder) and not (cache / "bench.k-3.py311.nbi").exists()


CALLEE = "from numba import njit\n\n@njit(cache=True)\ndef f():\n    return {}\n"
CALLER = "from numba import njit\nfrom .callee import f\n\n@njit(cache=True)\ndef g():\n    return f()\n"
HOOK = """
from pathlib import Path
from cubedqn.numba_cache import cache_folders, refresh, source_files
root = Path(__file__).parent
files = source_files(root)
refresh(files, root, cache_folders(files))
"""


def _run(tmp_path, name):
    env = dict(os.environ, PYTHONPATH=str(tmp_path) + os.pathsep + str(Path(cubedqn.__file__).parents[1]))
    env.pop("NUMBA_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", f"from {name}.caller import g; print(g())"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


def test_a_cached_caller_runs_the_changed_callee_only_with_the_stamp(tmp_path):
    """Two copies of a package whose cached g() calls f() in another module: after f is
    changed, Numba alone runs g's cached copy of the old f; with the stamp refreshed at
    import (as cubedqn's __init__ does) g is compiled again and runs the new one."""
    for name, hook in (("plainpkg", ""), ("stampedpkg", HOOK)):
        pkg = tmp_path / name
        pkg.mkdir()
        (pkg / "__init__.py").write_text(textwrap.dedent(hook))
        (pkg / "callee.py").write_text(CALLEE.format(1))
        (pkg / "caller.py").write_text(CALLER)
    assert _run(tmp_path, "plainpkg") == 1 and _run(tmp_path, "stampedpkg") == 1
    for name in ("plainpkg", "stampedpkg"):
        callee = tmp_path / name / "callee.py"
        callee.write_text(CALLEE.format(2))
        st = callee.stat()
        os.utime(callee, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert _run(tmp_path, "plainpkg") == 1  # Numba's own check: the stale copy
    assert _run(tmp_path, "stampedpkg") == 2
