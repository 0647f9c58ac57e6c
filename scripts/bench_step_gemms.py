#!/usr/bin/env python
"""Do the training step's GEMM layers run slower inside a step than on their own?

In one process, one thread, alternating blocks of rounds: a float32 Double-DQN learner's
train_step (clipped momentum, the peer benchmark's step) with its "GEMM layers" parts
timed by the step's own PhaseTimer, and the same layer kernels (nn.mlp_forward_upper for
the target and the online rows, nn.mlp_backward_upper) on the learner's own buffers, run
back to back with nothing in between. Prints per-round times and their ratio: a ratio
near 1 means what a step's GEMMs cost is what they cost alone, at that moment; a
`cubedqn profile` percentage below the sgemm peak is then the GEMMs' own efficiency at
these shapes and the host's speed when they ran, not the rest of the step evicting them.

  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_step_gemms.py [--shape small|large]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from numba import njit

from cubedqn.blas import BACKEND
from cubedqn.cube import get_puzzle
from cubedqn.encoding import Encoder
from cubedqn.learner import Learner, PhaseTimer
from cubedqn.nn import Layout, mlp_backward_upper, mlp_forward_upper
from cubedqn.numba_cache import drop_if_stale_for
from cubedqn.replay import Batch
from cubedqn.threads import limit_threads

drop_if_stale_for(Path(__file__).parent)  # the cached kernel below calls the package's

SHAPES = {"small": ("cube2", (256, 256), 64, 50), "large": ("cube3", (1024, 512), 256, 10)}


@njit(cache=True)
def gemm_layers(Ws, bs, Wt, bt, acts, deltas, acts_t, dWs, dbs, taken, best, head_t, head_tt, m, n):
    """The step's GEMM-layer calls: online forward on 2m rows (the first m heads at the
    taken actions), target forward on m (its heads at `best`), backward on m."""
    for _ in range(n):
        mlp_forward_upper(Ws, bs, acts, 2 * m, np.bool_(True), taken[:m], head_t[0])
        mlp_forward_upper(Wt, bt, acts_t, m, np.bool_(False), best[:taken.shape[0]], head_tt[0])
        mlp_backward_upper(Ws, acts, deltas, dWs, dbs, m, taken, head_t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=SHAPES, default="large")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    limit_threads(1)
    puzzle_name, hidden, batch, steps = SHAPES[args.shape]
    puzzle = get_puzzle(puzzle_name)
    enc = Encoder(puzzle, 12, canonical=False)
    layout = Layout(enc.in_dim, enc.n_active, hidden, 12)
    lr = Learner(layout, np.ascontiguousarray(puzzle.moves[:12]), batch, enc, targets="double",
                 optimizer="momentum", dtype=np.float32)
    b = Batch(batch, puzzle.n_stickers, np.float32)
    rng = np.random.default_rng(0)
    b.states[:] = rng.integers(0, 6, b.states.shape)
    b.next_states[:] = rng.integers(0, 6, b.next_states.shape)
    b.actions[:] = rng.integers(0, 12, batch)
    b.rewards[:] = -1
    b.discounts[:] = 0.9
    on, tg = lr.online, lr.target
    kernel_args = (on.Ws, on.bs, tg.Ws, tg.bs, lr.ws.acts, lr.ws.deltas, lr.ws_t.acts, lr.gWs, lr.gbs, lr.head_taken,
                   lr.best_next, lr.ws.head_t, lr.ws_t.head_t, batch)
    for _ in range(5):
        lr.train_step(b)
    gemm_layers(*kernel_args, 2)
    in_step, alone, whole = [], [], []
    for r in range(args.rounds):
        for which in (("step", "alone") if r % 2 == 0 else ("alone", "step")):
            if which == "step":
                timer = PhaseTimer()
                t = time.perf_counter()
                for _ in range(steps):
                    lr.train_step(b, timer)
                whole.append((time.perf_counter() - t) / steps * 1e3)
                in_step.append(sum(timer.parts[p]["GEMM layers"] for p in ("forward", "backward")) / steps * 1e3)
            else:
                t = time.perf_counter()
                gemm_layers(*kernel_args, steps)
                alone.append((time.perf_counter() - t) / steps * 1e3)
    ratio = np.array(in_step) / np.array(alone)
    print(f"{layout.describe()} batch {batch}, Double DQN, momentum, 1 thread, BLAS: {BACKEND}'s OpenBLAS; "
          f"{args.rounds} alternating rounds of {steps} steps; ms per step")
    print("train step             ", " ".join(f"{x:7.3f}" for x in whole))
    print("GEMM layers in the step", " ".join(f"{x:7.3f}" for x in in_step), f"| median {np.median(in_step):.3f}")
    print("the same, back to back ", " ".join(f"{x:7.3f}" for x in alone), f"| median {np.median(alone):.3f}")
    print("ratio per round        ", " ".join(f"{x:7.3f}" for x in ratio), f"| median {np.median(ratio):.3f}")


if __name__ == "__main__":
    main()
