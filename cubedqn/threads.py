"""One `--threads` knob for both sides: Numba's own threads and the BLAS the kernels call.

The kernels' GEMMs run on numpy's bundled OpenBLAS or on scipy's (blas.py); numba's np.dot
calls scipy's, which is loaded lazily on first use. A thread limit
applied before it is loaded does not reach it (it then starts with one thread per core,
and two such processes on two cores busy-wait against each other: measured here at ~4.6x
slower steps). So the library is loaded first, then limited.
"""

from __future__ import annotations


def limit_threads(threads: int):
    """Limit numba and every loaded BLAS to `threads`; returns the threadpoolctl limiter."""
    import numba
    import scipy.linalg.cython_blas  # noqa: F401  (loads the OpenBLAS that njit np.dot uses)
    from . import blas  # noqa: F401  (binds the GEMM's library before it is limited)
    from threadpoolctl import threadpool_limits
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    return threadpool_limits(limits=threads, user_api="blas")
