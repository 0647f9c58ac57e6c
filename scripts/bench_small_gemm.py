#!/usr/bin/env python
"""Can a Numba loop beat OpenBLAS on the step's small GEMMs? (An experiment, not used by
the engine.)

Times C = A @ B for A (M, 256), B (256, 256) with scipy's OpenBLAS (np.dot inside njit, as
the engine calls it) against a register-blocked Numba kernel (4 rows x 4 k per pass, the
inner loop over all 256 columns, which LLVM vectorises), one BLAS thread, alternating.

  python scripts/bench_small_gemm.py          # LLVM's default vector width (256-bit here)
  python scripts/bench_small_gemm.py --zmm    # 512-bit vectors (host features, -prefer-256-bit)
"""
import os
import sys
import time

if "--zmm" in sys.argv:  # must be set before numba is imported
    import llvmlite.binding as ll
    os.environ["NUMBA_CPU_FEATURES"] = ll.get_host_cpu_features().flatten() + ",-prefer-256-bit"
    os.environ["NUMBA_CPU_NAME"] = ll.get_host_cpu_name()

import numpy as np  # noqa: E402
import scipy.linalg.cython_blas  # noqa: E402,F401  (load the BLAS njit calls before limiting it)
from numba import njit  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402


@njit(fastmath=True, error_model="numpy")
def gemm_blocked(A, B, C):
    """C = A @ B (row-major, M and K multiples of 4): 4 rows x 4 k of A per pass over B's rows."""
    M, K = A.shape
    N = B.shape[1]
    C[:] = 0
    for i0 in range(0, M, 4):
        c0, c1, c2, c3 = C[i0], C[i0 + 1], C[i0 + 2], C[i0 + 3]
        for k0 in range(0, K, 4):
            b0, b1, b2, b3 = B[k0], B[k0 + 1], B[k0 + 2], B[k0 + 3]
            a00, a01, a02, a03 = A[i0, k0], A[i0, k0 + 1], A[i0, k0 + 2], A[i0, k0 + 3]
            a10, a11, a12, a13 = A[i0 + 1, k0], A[i0 + 1, k0 + 1], A[i0 + 1, k0 + 2], A[i0 + 1, k0 + 3]
            a20, a21, a22, a23 = A[i0 + 2, k0], A[i0 + 2, k0 + 1], A[i0 + 2, k0 + 2], A[i0 + 2, k0 + 3]
            a30, a31, a32, a33 = A[i0 + 3, k0], A[i0 + 3, k0 + 1], A[i0 + 3, k0 + 2], A[i0 + 3, k0 + 3]
            for j in range(N):
                x0, x1, x2, x3 = b0[j], b1[j], b2[j], b3[j]
                c0[j] += a00 * x0 + a01 * x1 + a02 * x2 + a03 * x3
                c1[j] += a10 * x0 + a11 * x1 + a12 * x2 + a13 * x3
                c2[j] += a20 * x0 + a21 * x1 + a22 * x2 + a23 * x3
                c3[j] += a30 * x0 + a31 * x1 + a32 * x2 + a33 * x3


@njit
def gemm_blas(A, B, C):
    np.dot(A, B, C)


def median_us(f, n=300):
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e6


def main():
    threadpool_limits(1, user_api="blas")
    rng = np.random.default_rng(0)
    print(f"vector width: {'512-bit forced' if '--zmm' in sys.argv else 'LLVM default'}")
    for m in (64, 128, 768):
        A = rng.random((m, 256), np.float32)
        B = rng.random((256, 256), np.float32)
        C1, C2 = np.zeros((m, 256), np.float32), np.zeros((m, 256), np.float32)
        t_blas, t_numba = [], []
        for _ in range(5):
            t_blas.append(median_us(lambda: gemm_blas(A, B, C1)))
            t_numba.append(median_us(lambda: gemm_blocked(A, B, C2)))
        assert np.allclose(C1, C2, rtol=1e-4)
        flops = 2 * m * 256 * 256
        tb, tn = np.median(t_blas), np.median(t_numba)
        print(f"{m:4d} x 256 x 256: OpenBLAS {tb:8.1f} us ({flops / tb / 1e3:5.1f} GFLOP/s)   "
              f"Numba blocked {tn:8.1f} us ({flops / tn / 1e3:5.1f} GFLOP/s)")


if __name__ == "__main__":
    main()
