"""scripts/perf_map.py names numba's compiled code for `perf`: these tests hold its map to
the addresses the code really runs at, for a kernel numba compiles in the process and
for the same kernel loaded from numba's cache (two runs over one fresh cache folder), and
its name reading to numba's mangling."""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "perf_map.py")
_spec = importlib.util.spec_from_file_location("perf_map", _PATH)
perf_map = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(perf_map)

# run under perf_map: calls a cubedqn kernel and prints its entry point's address and the pid
_PROGRAM = """
import os
import numpy as np
from cubedqn import blas
from cubedqn.optim import sq_norm
assert sq_norm(np.arange(4, dtype=np.float32)) == 14.0
(cres,) = sq_norm.overloads.values()
print(os.getpid(), cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name), bool(blas.TILE),
      sum(sq_norm.stats.cache_hits.values()))
"""


def test_readable_names():
    assert perf_map.readable("_ZN7cubedqn5optim7sq_normB3v94B64c8tJTIeFIjxB2IKSE5ArrayIfLi1E1C7mutable7alignedE") \
        == "optim.sq_norm"
    assert perf_map.readable("cfunc._ZN7cubedqn5optim21update_chunk_momentumB3v17B56c8tJTIeFE") \
        == "cfunc:optim.update_chunk_momentum"
    assert perf_map.readable("cpython._ZN7cubedqn2nn9loss_fullB3v70B56c8tE") == "cpython.nn.loss_full"
    assert perf_map.readable("NRT_decref") == "NRT_decref"


def _map_lines(path):
    out = []
    for line in open(path):
        address, size, name = line.rstrip("\n").split(" ", 2)
        out.append((int(address, 16), int(size, 16), name))
    return out


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_map_covers_the_kernels_entry_compiled_and_loaded_from_cache(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(_PROGRAM)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    for hits, run in enumerate(("compiled", "loaded from the cache")):
        done = subprocess.run([sys.executable, _PATH, str(program)], capture_output=True, text=True, env=env,
                              timeout=600)
        assert done.returncode == 0, done.stderr
        pid, entry, tile, cache_hits = done.stdout.split()
        assert int(cache_hits) == hits, run
        path = f"/tmp/perf-{pid}.map"
        assert f"functions named in {path}" in done.stderr
        try:
            lines = _map_lines(path)
        finally:
            os.remove(path)
        named = [(a, s) for a, s, name in lines if name == "optim.sq_norm"]
        assert any(a <= int(entry) < a + s for a, s in named), (run, named, entry)
        assert all(s > 0 for _, s, _ in lines)
        if tile == "True":  # the LLVM IR modules (cubedqn.native) are named too
            assert any(name == "native:cubedqn_tile_sgemm64" for _, _, name in lines), run


def test_usage_without_a_program():
    done = subprocess.run([sys.executable, _PATH], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage:" in done.stdout


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
@pytest.mark.parametrize("args,message", [(["no_such_script.py"], "perf_map: no such script: no_such_script.py"),
                                          (["-m", "no_such_module"], "perf_map: no module named 'no_such_module'"),
                                          (["-m"], "perf_map: -m needs a module name")])
def test_a_program_that_is_not_there_is_one_line(args, message):
    done = subprocess.run([sys.executable, _PATH] + args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr == message + "\n"
