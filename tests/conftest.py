"""Test-wide setup: the tests' own cached kernels (test_blas.py's, test_tile_bf16.py's)
call the package's, so their Numba cache is dropped whenever the package's sources or the
tests' change (cubedqn.numba_cache; Numba would keep a caller's copy of a changed callee)."""

from pathlib import Path

from cubedqn.numba_cache import drop_if_stale_for

drop_if_stale_for(Path(__file__).parent)
