#!/usr/bin/env python
"""Time the sparse first layer's two float32 kernels side by side: the row gather /
scatter (nn.sparse_forward, sparse_backward) and the column panels (panels.py, through
nn.sparse_forward_panels, sparse_backward_panels), alternating in one process, one thread.

Prints the median microseconds per call and the panels' speed-up for the 2x2x2 sticker
layer (144 x 256, 24 stickers) and the 3x3x3's (324 x 1024, 54 stickers) over batch
sizes around the workspaces' 8x rule (nn.Workspace gives panels to workspaces whose rows
gather at least 8x as many W1 rows as W1 has: 48 rows at both shapes).

  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_first_layer.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cubedqn import panels
from cubedqn.nn import (NO_GROUPS, aligned_zeros, panel_scratch_size, sparse_backward, sparse_backward_panels, sparse_forward,
                        sparse_forward_panels)
from cubedqn.threads import limit_threads

SHAPES = {"cube2": (144, 24, 256), "cube3": (324, 54, 1024)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,48,64,128,256,512")
    ap.add_argument("--reps", type=int, default=11)
    args = ap.parse_args()
    limit_threads(1)
    print(f"panels: {'LLVM IR (' + panels.SOURCE + ')' if panels.AVAILABLE else 'not available: ' + str(panels.PROBLEM)}, "
          f"{panels.PANEL} columns a panel; medians of {args.reps} rounds, microseconds per call")
    print(f"{'shape':<14s} {'batch':>5s} {'rows fwd':>9s} {'panels fwd':>11s} {'x':>6s} "
          f"{'rows bwd':>9s} {'panels bwd':>11s} {'x':>6s}")
    rng = np.random.default_rng(0)
    for name, (n_in, s, h) in SHAPES.items():
        # buffers as the engine allocates them (aligned), the scratch a workspace of bsz rows gets
        W, b = aligned_zeros((n_in, h), np.float32), aligned_zeros(h, np.float32)
        W[:], b[:] = rng.standard_normal((n_in, h)), rng.standard_normal(h)
        for bsz in (int(x) for x in args.batches.split(",")):
            panel = aligned_zeros(panel_scratch_size(n_in, bsz, s, h, 0, 0), np.float32)
            idx = aligned_zeros((bsz, s), np.int32)
            idx[:] = np.arange(s)[None, :] * (n_in // s) + rng.integers(0, n_in // s, (bsz, s))
            dout, out = aligned_zeros((bsz, h), np.float32), aligned_zeros((bsz, h), np.float32)
            dout[:] = rng.standard_normal((bsz, h))
            dW, db = aligned_zeros((n_in, h), np.float32), aligned_zeros(h, np.float32)
            calls = {"rows fwd": lambda: sparse_forward(idx, W, b, out, True),
                     "panels fwd": lambda: sparse_forward_panels(idx, W, b, out, True, panel, NO_GROUPS),
                     "rows bwd": lambda: sparse_backward(idx, dout, dW, db),
                     "panels bwd": lambda: sparse_backward_panels(idx, dout, dW, db, panel)}
            inner = max(1, 20000 // (bsz * s))
            times = {k: [] for k in calls}
            for f in calls.values():
                f()
            for _ in range(args.reps):
                for k, f in calls.items():
                    t = time.perf_counter()
                    for _ in range(inner):
                        f()
                    times[k].append((time.perf_counter() - t) / inner * 1e6)
            m = {k: float(np.median(v)) for k, v in times.items()}
            print(f"{name + f' {n_in}x{h}':<14s} {bsz:>5d} {m['rows fwd']:>9.1f} {m['panels fwd']:>11.1f} "
                  f"{m['rows fwd'] / m['panels fwd']:>5.2f}x {m['rows bwd']:>9.1f} {m['panels bwd']:>11.1f} "
                  f"{m['rows bwd'] / m['panels bwd']:>5.2f}x", flush=True)


if __name__ == "__main__":
    main()
