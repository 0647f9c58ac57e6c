#!/usr/bin/env python
"""Time the Double-DQN training step of bench_peers.py on a GPU: cubedqn's CUDA path
(`--device cuda`), the same step in PyTorch eager and JAX jit on the GPU when installed,
and cubedqn's CPU step on the same host (one thread) for scale. Alternating repetitions,
medians; every step is timed to its end (cubedqn reads its loss back, PyTorch
synchronises, JAX blocks on its result).

What it is not: a kernel benchmark. cubedqn's step includes what its users pay per step:
the host encoding the batch, the copies of the index arrays, every launch; the peers get
their one-hot inputs already on the device, as in bench_peers.py. Then cubedqn's CUDA
step split by its PhaseTimer, waiting for the GPU at each phase's end (as `cubedqn profile
--device cuda` does). With --launches, first the cost of one numba-cuda launch of an empty
kernel by its number of array arguments (what the step pays per launch on the host).

  python scripts/bench_cuda.py [--shapes cube2,cube3] [--reps 15] [--inner 20] [--only NAMES] [--launches]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

from bench_peers import (CLIP, GAMMA, LR, MU, SHAPES, bench, cubedqn_step, jax_step, make_data,  # noqa: E402
                         print_table, torch_step)
from cubedqn.cube import get_puzzle  # noqa: E402
from cubedqn.encoding import Encoder  # noqa: E402
from cubedqn.nn import Layout  # noqa: E402


def cuda_step(layout, puzzle, batch):
    from cubedqn.cuda.learner import CudaLearner
    moves = np.ascontiguousarray(puzzle.moves[:12])
    lr = CudaLearner(layout, moves, len(batch.actions), Encoder(puzzle, 12, canonical=False), targets="double",
                     gamma=GAMMA, optimizer="momentum", lr=LR, momentum=MU, max_grad_norm=CLIP,
                     target_update_interval=10 ** 9)
    step = lambda: lr.train_step(batch)  # noqa: E731
    step.learner = lr
    return step


def phases(learner, batch, steps):
    from cubedqn.learner import PhaseTimer
    timer = PhaseTimer()
    learner.sync_phases = True
    for _ in range(steps):
        learner.train_step(batch, timer)
    learner.sync_phases = False
    return {k: v / steps * 1e3 for k, v in timer.total.items() if v}


def launch_overhead(reps=2000):
    """us per launch of an empty kernel with 0, 2, 4 and 8 float32 array arguments."""
    import time
    from numba import cuda

    @cuda.jit
    def k0():
        pass

    @cuda.jit
    def k2(a, b):
        pass

    @cuda.jit
    def k4(a, b, c, d):
        pass

    @cuda.jit
    def k8(a, b, c, d, e, f, g, h):
        pass

    x = cuda.device_array(1024, np.float32)
    out = {}
    for n, k in ((0, k0), (2, k2), (4, k4), (8, k8)):
        cfg, args = k[1, 32], (x,) * n
        cfg(*args)
        cuda.synchronize()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(reps):
                cfg(*args)
            cuda.synchronize()
            ts.append((time.perf_counter() - t) / reps)
        out[n] = float(np.median(ts)) * 1e6
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="cube2,cube3")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated implementations to time (default: all)")
    ap.add_argument("--launches", action="store_true", help="time empty-kernel launches first")
    args = ap.parse_args()
    if set(args.shapes.split(",")) - set(SHAPES):
        ap.error(f"--shapes: expected a comma-separated list of {', '.join(SHAPES)}, got {args.shapes!r}")
    only = set(filter(None, args.only.split(",")))
    known = {"cubedqn cuda", "cubedqn cpu", "pytorch cuda", "jax gpu jit"}
    if only - known:
        ap.error(f"--only: unknown implementation(s) {', '.join(sorted(only - known))} "
                 f"(known: {', '.join(sorted(known))})")
    from cubedqn.cuda import gpu_status
    ok, why = gpu_status()
    if not ok or why != "gpu":
        sys.exit(f"no GPU to benchmark on: {why}")
    from numba import cuda
    dev = cuda.get_current_device()
    print(f"GPU: {dev.name.decode() if isinstance(dev.name, bytes) else dev.name}, "
          f"compute capability {dev.compute_capability}; CPU threads for cubedqn cpu: 1")
    from cubedqn.threads import limit_threads
    limit_threads(1)
    if args.launches:
        lo = launch_overhead()
        print("one launch of an empty kernel (us, median of 5 x 2000): " +
              ", ".join(f"{n} array args {t:.1f}" for n, t in lo.items()))
    for shape in args.shapes.split(","):
        pname, hidden, bsz = SHAPES[shape]
        puzzle = get_puzzle(pname)
        layout = Layout(puzzle.n_stickers * 6, puzzle.n_stickers, hidden, 12)
        batch = make_data(puzzle, bsz)
        impls = {"cubedqn cuda": cuda_step(layout, puzzle, batch)}
        skipped = []
        for name, make in (("cubedqn cpu", lambda: cubedqn_step(layout, puzzle, batch)),
                           ("pytorch cuda", lambda: torch_step(layout, puzzle, batch, "cuda")),
                           ("jax gpu jit", lambda: jax_step(layout, puzzle, batch))):
            if only and name not in only:
                continue
            try:
                impls[name] = make()
            except Exception as e:  # noqa: BLE001 - a missing or CPU-only peer is reported, not fatal
                skipped.append(f"{name} ({e.__class__.__name__}: {str(e)[:80]})")
        if "jax gpu jit" in impls:
            import jax
            if jax.default_backend() != "gpu":
                del impls["jax gpu jit"]
                skipped.append(f"jax gpu jit (JAX's backend here is {jax.default_backend()})")
        inner = max(1, args.inner // (4 if shape == "cube3" else 1))
        med = bench(impls, args.reps, inner)
        flops = 3 * layout.flops_forward(bsz, sparse=False) + layout.flops_backward(bsz, sparse=False)
        print(f"\n{layout.describe()}  batch {bsz}  (Double DQN, Huber, clipped momentum; medians of "
              f"{args.reps} x {inner} steps)")
        print_table(med, "cubedqn cuda", flops, width=14)
        if skipped:
            print("skipped: " + "; ".join(skipped))
        lr = impls["cubedqn cuda"].learner
        ph = phases(lr, batch, max(20, args.reps * inner // 4))
        print(f"cubedqn cuda step by phase (ms; launches: {getattr(lr, 'launch_mode', 'one by one')}): " +
              ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))


if __name__ == "__main__":
    main()
