#!/usr/bin/env python
"""The step's GEMMs on the two OpenBLAS builds a numpy + scipy install carries, side by side.

numba's np.dot inside njit always calls scipy's OpenBLAS; cubedqn's kernels call
`blas.gemm`, bound at import to numpy's bundled OpenBLAS where there is one (see
cubedqn/blas.py). This times every GEMM of one Double-DQN step (layers 1..L-1: online
forward on [s; s'], target forward on s', dW and dx, in the layouts nn.py passes them)
through both, alternating in one process, one thread, and prints medians and ratios.

  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_blas.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_peers import SHAPES, step_gemms  # noqa: E402
from cubedqn import blas  # noqa: E402
from cubedqn.cube import get_puzzle  # noqa: E402
from cubedqn.nn import Layout  # noqa: E402
from cubedqn.numba_cache import drop_if_stale_for  # noqa: E402
from cubedqn.threads import limit_threads  # noqa: E402

drop_if_stale_for(os.path.dirname(os.path.abspath(__file__)))  # its cached kernels call the package's

EXTRA = {"cube2-b128": ("cube2", (256, 256), 128)}  # the preset's hidden widths and batch size


@njit(cache=True, nogil=True)
def via_np_dot(a, b, out):
    np.dot(a, b, out)


@njit(cache=True, nogil=True)
def via_gemm(a, b, out):
    blas.gemm(a, b, out)


def describe(a, b):
    ta = "T" if a.strides[0] == 4 and a.shape[1] > 1 else "N"
    tb = "T" if b.strides[0] == 4 and b.shape[1] > 1 else "N"
    return f"{a.shape[0]}x{b.shape[1]}x{a.shape[1]} {ta}{tb}"


def time_pair(a, b, out, reps, inner):
    fns = {"scipy": via_np_dot, "cubedqn": via_gemm}
    times = {k: [] for k in fns}
    for f in fns.values():
        f(a, b, out)
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(inner):
                f(a, b, out)
            times[k].append((time.perf_counter() - t) / inner)
    return {k: float(np.median(v)) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="cube2,cube2-b128,cube3")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    limit_threads(1)
    from cubedqn.profiling import blas_info
    from pathlib import Path
    from threadpoolctl import threadpool_info
    scipy_lib = next((i for i in threadpool_info() if i.get("user_api") == "blas"
                      and {"scipy.libs", "scipy"} & set(Path(i.get("filepath", "")).parts)), {})
    b = blas_info()
    print(f"cubedqn's gemm: {b['source']}'s {b['library']} {b['version']} kernel {b['kernel']}; "
          f"np.dot in njit: scipy's {scipy_lib.get('version')} kernel {scipy_lib.get('architecture')}; "
          f"OPENBLAS_CORETYPE={b['OPENBLAS_CORETYPE']}; 1 thread")
    n = 1024
    rng = np.random.default_rng(0)
    big = rng.standard_normal((n, n)).astype(np.float32), rng.standard_normal((n, n)).astype(np.float32)
    peak = time_pair(big[0], big[1], np.empty((n, n), np.float32), 5, 1)
    print(f"sgemm n = 1024: scipy {2 * n ** 3 / peak['scipy'] / 1e9:.1f} GFLOP/s, "
          f"cubedqn's gemm {2 * n ** 3 / peak['cubedqn'] / 1e9:.1f} GFLOP/s")
    shapes = dict(SHAPES, **EXTRA)
    for name in args.shapes.split(","):
        pname, hidden, bsz = shapes[name]
        puzzle = get_puzzle(pname)
        layout = Layout(puzzle.n_stickers * 6, puzzle.n_stickers, hidden, 12)
        print(f"\n{name}: layers 1..L-1 of {layout.describe()}, batch {bsz} (Double DQN step)")
        print(f"{'GEMM (MxNxK, op)':<24s} {'scipy us':>10s} {'cubedqn us':>11s} {'ratio':>7s}")
        tot = {"scipy": 0.0, "cubedqn": 0.0}
        for a, bm, out in step_gemms(layout, bsz):
            flops = 2 * a.shape[0] * a.shape[1] * bm.shape[1]
            inner = max(1, int(2e7 // max(flops, 1)))
            t = time_pair(a, bm, out, args.reps, inner)
            for k in tot:
                tot[k] += t[k]
            print(f"{describe(a, bm):<24s} {t['scipy'] * 1e6:>10.1f} {t['cubedqn'] * 1e6:>11.1f} "
                  f"{t['scipy'] / t['cubedqn']:>6.2f}x")
        print(f"{'all of the step':<24s} {tot['scipy'] * 1e6:>10.1f} {tot['cubedqn'] * 1e6:>11.1f} "
              f"{tot['scipy'] / tot['cubedqn']:>6.2f}x")


if __name__ == "__main__":
    main()
