#!/usr/bin/env python
"""Does a buffer's start address matter? The float32 panel first layer (nn.sparse_forward_panels,
sparse_backward_panels) and the step's 64-row GEMM, with their buffers starting on a
64-byte boundary (nn.aligned_zeros, what the engine allocates) against 16, 32 and 48 bytes
past one (numpy's own buffers start 16 bytes past one here), in one process, one thread,
the placements alternating round by round.

Two cases: only the panel scratch moved (W, out, dout, dW aligned), and every other buffer
moved (the scratch aligned). Prints medians in microseconds and each placement's median
per-round ratio to the aligned one (> 1: slower than aligned).

  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_alignment.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from numba import njit

from cubedqn import panels
from cubedqn.blas import BACKEND, gemm
from cubedqn.numba_cache import drop_if_stale_for
from cubedqn.nn import ALIGN, NO_GROUPS, panel_scratch_size, sparse_backward_panels, sparse_forward_panels
from cubedqn.threads import limit_threads

drop_if_stale_for(Path(__file__).parent)  # the cached kernel below calls the package's

SHAPES = {"cube2 144x256": (144, 24, 256, (64, 128)), "cube3 324x1024": (324, 54, 1024, (256, 512))}
OFFSETS = (0, 16, 32, 48)


def placed(shape, offset, rng=None):
    """float32 zeros (or standard normals) starting `offset` bytes past an ALIGN boundary."""
    n = int(np.prod(shape))
    raw = np.zeros(n * 4 + 2 * ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN + offset
    a = raw[start:start + n * 4].view(np.float32).reshape(shape)
    if rng is not None:
        a[:] = rng.standard_normal(shape)
    return a


@njit(cache=True)
def gemm_calls(a, b, c, calls):
    for _ in range(calls):
        gemm(a, b, c)


def timed(fn, reps):
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def compare(label, cases, rounds):
    """cases: {offset: (fwd callable, bwd callable or None, reps)}; alternating rounds.
    A GEMM case's callable makes 100 calls: its times are per 100 GEMMs."""
    res = {off: ([], []) for off in cases}
    for r in range(rounds):
        for off in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
            fwd, bwd, reps = cases[off]
            res[off][0].append(timed(fwd, reps))
            res[off][1].append(timed(bwd, reps) if bwd else np.nan)
    f0, b0 = np.array(res[0][0]), np.array(res[0][1])
    cells = []
    for off, (f, b) in res.items():
        f, b = np.array(f), np.array(b)
        cell = f"+{off:<2d} B {np.median(f):8.1f}"
        if off:
            cell += f" ({np.median(f / f0):.2f}x)"
        if not np.isnan(b).all():
            cell += f" / {np.median(b):8.1f}" + (f" ({np.median(b / b0):.2f}x)" if off else "")
        cells.append(cell)
    print(f"{label:<38s} " + " | ".join(cells))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    limit_threads(1)
    print(f"panels: {'LLVM IR (' + panels.SOURCE + ')' if panels.AVAILABLE else 'not available'}; "
          f"GEMM: {BACKEND}'s OpenBLAS; {args.rounds} alternating rounds; microseconds per call, "
          f"forward / backward (ratio to the aligned placement)")
    rng = np.random.default_rng(0)
    for name, (n_in, s, h, batches) in SHAPES.items():
        per = n_in // s
        for n in batches:
            idx = (np.arange(s)[None, :] * per + rng.integers(0, per, (n, s))).astype(np.int32)
            reps = max(3, int(2e6 // (n * s * h // 16)))
            for moved in ("panel scratch", "W, b, out, dout, dW"):
                cases = {}
                for off in OFFSETS:
                    o_panel = off if moved == "panel scratch" else 0
                    o_rest = 0 if moved == "panel scratch" else off
                    W, b = placed((n_in, h), o_rest, rng), placed((h,), o_rest, rng)
                    out, dout = placed((n, h), o_rest), placed((n, h), o_rest, rng)
                    dW, db, panel = placed((n_in, h), o_rest), placed((h,), o_rest), placed((panel_scratch_size(n_in, n, s, h, 0, 0),), o_panel)
                    cases[off] = (lambda idx=idx, W=W, b=b, out=out, panel=panel: sparse_forward_panels(idx, W, b, out, True, panel, NO_GROUPS),
                                  lambda idx=idx, dout=dout, dW=dW, db=db, panel=panel: sparse_backward_panels(idx, dout, dW, db, panel),
                                  reps)
                compare(f"{name} first layer, {n} rows, {moved} moved:", cases, args.rounds)
    for m, k, n in ((64, 256, 256), (128, 256, 256)):
        cases = {}
        for off in OFFSETS:
            a, w, c = placed((m, k), off, rng), placed((k, n), off, rng), placed((m, n), off)
            cases[off] = (lambda a=a, w=w, c=c: gemm_calls(a, w, c, 100), None, 2)
        compare(f"100 GEMMs {m}x{k} @ {k}x{n}, operands moved:", cases, args.rounds)


if __name__ == "__main__":
    main()
