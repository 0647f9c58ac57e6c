#!/usr/bin/env python
"""Time the engine's register-tile sgemm (cubedqn/tile_gemm.py) against the library sgemm it
stands in front of (numpy's OpenBLAS), on the products the networks make, one thread,
alternating in one process.

Both are called by their symbols from an njit loop, as the kernels call the GEMM (no
Python between calls); for products the tile leaves to the library ("library" in the
last column) the two columns time the same code. Prints medians in microseconds per
product, GFLOP/s and the speed-up, and the library's kernel.

With --library-threads 2 the library runs on two threads (the tile always runs on one,
and takes products only while the library does too): what `--threads 2` would get from
OpenBLAS instead of the tile.

With --bf16 the columns are the tile in float32 and the same symbol with the matmul
precision bfloat16 (tile_bf16.py, CPUs with AVX512_BF16; its results checked bit for bit
against reference.gemm_bf16), and the two ceilings (float32 FMAs, bf16 dot products)
are printed first.

With --sparse FILL the columns are the tile with tile_sparse.py's path off and on (both
the tile: blas.tile_sparse_as), op(A) a ReLU layer's output with that fraction of nonzeros
(|normal| values, independent zeros; FILL may be a comma-separated list), the results
checked bit for bit; "listed" is what the walks cost, in entries of a pair's union list,
as a fraction of K (profiling.listed_fraction), and products the sparse path leaves to
the dense loops (walks past tile_sparse.FILL_MAX or FILL_MAX_OWN, or N not whole panels)
say "dense".

  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_tile_gemm.py [--library-threads 2 | --bf16 |
      --sparse 0.3,0.5]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from numba import njit, types
from threadpoolctl import threadpool_limits

from cubedqn import blas
from cubedqn.blas import NO_TRANS, ROW_MAJOR, SGEMM_SIG, TRANS
from cubedqn.profiling import blas_info, listed_fraction, sparse_path_takes
from cubedqn.threads import limit_threads

# (label, M, K, N, which is transposed: True for A, "B" for B, False for neither):
# C (M, N) = op(A) (M, K) @ op(B) (K, N)
PRODUCTS = [
    ("144-256-256-12 B64: target forward", 64, 256, 256, False),
    ("  online forward (s and s')", 128, 256, 256, False),
    ("  the head's online forward (N = 12)", 128, 256, 12, False),
    ("  dW of the 256 x 256 layer", 256, 64, 256, True),
    ("  dx of it (B^T)", 64, 256, 256, "B"),
    ("  a batch of 67 (a leftover row)", 67, 256, 256, False),
    ("cube2 preset B128: children's forward", 1536, 256, 256, False),
    ("  their head (N = 12)", 1536, 256, 12, False),
    ("  dW", 256, 128, 256, True),
    ("  dx (B^T)", 128, 256, 256, "B"),
    ("512-512 net B256: forward", 256, 512, 512, False),
    ("  dW", 512, 256, 512, True),
    ("  dx (B^T)", 256, 512, 512, "B"),
    ("324-1024-512-12 B256: 1024 -> 512", 512, 1024, 512, False),
    ("  dW of it", 1024, 256, 512, True),
    ("  dx of it (B^T)", 256, 512, 1024, "B"),
    ("dense 3x3x3 input B256: 324 -> 1024", 256, 324, 1024, False),
]


_library = types.ExternalFunction(blas.tile_gemm.LIBRARY, SGEMM_SIG)
_tile = types.ExternalFunction(blas.tile_gemm.TILE, SGEMM_SIG)


@njit
def _repeat(use_tile, ta, tb, m, n, k, a, lda, b, ldb, c, reps):
    one, zero = np.float32(1.0), np.float32(0.0)
    for _ in range(reps):
        if use_tile:
            _tile(ROW_MAJOR, ta, tb, m, n, k, one, a.ctypes, lda, b.ctypes, ldb, zero, c.ctypes, n)
        else:
            _library(ROW_MAJOR, ta, tb, m, n, k, one, a.ctypes, lda, b.ctypes, ldb, zero, c.ctypes, n)


def operands(rng, m, k, n, trans, trans_b, fill=None):
    """(A, B, C, ta, tb, reps) for C (m, n) = op(A) @ op(B) as the engine lays them out, and
    products enough for ~0.1 s; fill: A as a ReLU's output with that fraction of nonzeros."""
    a = rng.standard_normal((k, m) if trans else (m, k)).astype(np.float32)
    if fill is not None:
        a = np.abs(a) * (rng.random(a.shape) < fill)
    bm = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    outs = [np.zeros((m, n), np.float32) for _ in range(2)]
    return a, bm, outs, TRANS if trans else NO_TRANS, TRANS if trans_b else NO_TRANS, \
        max(5, int(2e8 // (2 * m * n * k)))


def time_us(use_tile, args, reps):
    """us per product over `reps` back-to-back products (after two untimed)."""
    _repeat(use_tile, *args, 2)
    t = time.perf_counter()
    _repeat(use_tile, *args, reps)
    return (time.perf_counter() - t) / reps * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--library-threads", type=int, default=1, help="BLAS threads for the library column")
    ap.add_argument("--bf16", action="store_true", help="float32 tile against bfloat16 matmuls instead")
    ap.add_argument("--sparse", default=None, metavar="FILL",
                    help="the tile with and without tile_sparse.py's path, A with this fraction of nonzeros")
    args = ap.parse_args()
    if args.sparse is not None:
        return sparse_main(args)
    if args.library_threads < 1:
        ap.error(f"--library-threads: expected 1 or more, got {args.library_threads}")
    if not blas.TILE:
        sys.exit(f"the tile GEMM is not bound here: {blas.TILE_STATUS}")
    if args.bf16 and blas.bf16_problem():
        sys.exit(f"--bf16: bfloat16 matmuls {blas.bf16_problem()}")
    limit_threads(1)
    b = blas_info()
    cols = ("float32", "bf16") if args.bf16 else ("library", "tile")
    if args.bf16:
        from cubedqn.profiling import fma_ceiling_gflops
        print(f"one core's ceilings: float32 FMAs {fma_ceiling_gflops():.1f} GFLOP/s, bf16 dot products "
              f"{fma_ceiling_gflops('bf16'):.1f} GFLOP/s; both columns the tile, medians of {args.rounds} "
              f"alternating rounds, us per product")
    else:
        print(f"library: {b['library']} {b['version']} ({b['source']}'s) kernel {b['kernel']}, "
              f"{args.library_threads} thread(s); tile ({'AVX-512' if blas.tile_gemm.AVX512 else 'AVX2'}): one thread; "
              f"medians of {args.rounds} alternating rounds, us per product")
    print(f"{'product':<40s} {'M x K x N':>22s} {cols[0]:>9s} {cols[1]:>9s} {'GFLOP/s':>15s} {'speed-up':>9s}")
    rng = np.random.default_rng(0)
    for label, m, k, n, trans in PRODUCTS:
        trans_b, trans = trans == "B", trans is True
        a, bm, outs, ta, tb, reps = operands(rng, m, k, n, trans, trans_b)
        times = [[], []]
        for _ in range(args.rounds):
            for second, (t, out) in enumerate(zip(times, outs)):
                call = (ta, tb, m, n, k, a, a.shape[1], bm, bm.shape[1], out)
                if args.bf16:
                    with blas.matmul_precision_as("bfloat16" if second else "float32"):
                        t.append(time_us(True, call, reps))
                    continue
                with threadpool_limits(limits=1 if second else args.library_threads, user_api="blas"):
                    t.append(time_us(bool(second), call, reps))
        op_a, op_b = (a.T if trans else a), (bm.T if trans_b else bm)
        want = op_a.astype(np.float64) @ op_b.astype(np.float64)
        np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
        if args.bf16:
            from cubedqn.reference import gemm_bf16
            np.testing.assert_array_equal(outs[1], gemm_bf16(op_a, op_b))
        else:
            np.testing.assert_allclose(outs[1], want, rtol=1e-4, atol=1e-4 * np.sqrt(k))
        lib_us, tile_us = (float(np.median(t)) for t in times)
        flops = 2.0 * m * n * k
        taken = blas.tile_gemm.takes(m, n, k, trans, trans_b)
        shape = f"{m} x {k} x {n}{' (A^T)' if trans else ' (B^T)' if trans_b else ''}"
        print(f"{label:<40s} {shape:>22s} {lib_us:9.1f} {tile_us:9.1f} {flops / lib_us / 1e3:7.1f} "
              f"{flops / tile_us / 1e3:7.1f} {lib_us / tile_us:8.2f}x{'' if taken or args.bf16 else ' library'}")


def sparse_main(args):
    try:
        fills = [float(f) for f in args.sparse.split(",")]
    except ValueError:
        sys.exit(f"--sparse: expected fractions such as 0.3,0.5, got {args.sparse!r}")
    if not all(0 <= f <= 1 for f in fills):
        sys.exit(f"--sparse: fractions must be within [0, 1], got {args.sparse!r}")
    if blas.SPARSE_STATUS:
        sys.exit(f"--sparse: tile_sparse.py's path {blas.SPARSE_STATUS}")
    limit_threads(1)
    from cubedqn import tile_sparse
    isa = "AVX-512" if blas.tile_gemm.AVX512 else "AVX2"
    print(f"the tile (cubedqn/tile_gemm.py, {isa}), one thread, with tile_sparse.py's path off and on (walks "
          f"taken up to {tile_sparse.FILL_MAX:.2f} of K in union entries, {tile_sparse.FILL_MAX_OWN:.2f} walking own "
          f"lists); op(A) with the given fraction of nonzeros; medians of {args.rounds} "
          f"alternating rounds, us per product")
    print(f"{'product':<40s} {'M x K x N':>22s} {'fill':>5s} {'listed':>6s} {'dense':>9s} {'sparse':>9s} "
          f"{'speed-up':>9s}")
    rng = np.random.default_rng(0)
    for label, m, k, n, trans in PRODUCTS:
        trans_b, trans = trans == "B", trans is True
        for fill in fills:
            a, bm, outs, ta, tb, reps = operands(rng, m, k, n, trans, trans_b, fill)
            times = [[], []]
            for _ in range(args.rounds):
                for on, (t, out) in enumerate(zip(times, outs)):
                    with blas.tile_sparse_as(bool(on)):
                        t.append(time_us(True, (ta, tb, m, n, k, a, a.shape[1], bm, bm.shape[1], out), reps))
            np.testing.assert_array_equal(outs[1], outs[0])
            dense_us, sparse_us = (float(np.median(t)) for t in times)
            listed = listed_fraction(a.T if trans else a)
            taken = blas.tile_gemm.takes(m, n, k, trans, trans_b) and n % tile_sparse.PANEL == 0 and \
                sparse_path_takes(a.T if trans else a)
            shape = f"{m} x {k} x {n}{' (A^T)' if trans else ' (B^T)' if trans_b else ''}"
            print(f"{label:<40s} {shape:>22s} {fill:5.2f} {listed:6.2f} {dense_us:9.1f} {sparse_us:9.1f} "
                  f"{dense_us / sparse_us:8.2f}x{'' if taken else ' dense'}")


if __name__ == "__main__":
    main()
