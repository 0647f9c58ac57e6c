#!/usr/bin/env python
"""Time the lazy first layer's backward + optimizer at the cube2 preset's shape: the
compact gradient rows the engine uses (nn.sparse_backward_compact, Optimizer.step_rows)
against the scheme they replaced, on real batches of the preset, alternating in one
process.

The replaced scheme (kept below only as this benchmark's baseline): W1's gradient was a
full (in, H) array; each step cleared the rows the previous batch touched, scatter-added
this batch's rows into it, and the optimizer read those rows back from wherever they lay
in the 9.5 MB array. The compact scheme keeps the touched rows' gradients in one small
block (B*S rows at most) reused every step. Both give the same parameters bitwise (checked
here on every batch before timing). Also prints the compact step's parts: scatter, norm,
Adam over the touched rows (whose parameter and moment rows are the memory traffic left).

  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_lazy_rows.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from numba import njit

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cubedqn.cli import make_trainer  # noqa: E402
from cubedqn.config import load_profile  # noqa: E402
from cubedqn.nn import aligned_zeros, sparse_backward_compact  # noqa: E402
from cubedqn.optim import adam_update, adam_update_rows, sq_norm  # noqa: E402
from cubedqn.threads import limit_threads  # noqa: E402


@njit(cache=False, error_model="numpy")
def previous_backward(idx, dout, dW, db, mark, touched, n_prev):
    """The replaced kernel: clear the previous batch's rows of the full dW, scatter-add
    this batch's, list its distinct rows ascending."""
    n, s = idx.shape
    h = dout.shape[1]
    for k in range(n_prev):
        w = dW[touched[k]]
        for j in range(h):
            w[j] = 0
    for j in range(h):
        db[j] = 0
    for i in range(n):
        d = dout[i]
        for j in range(h):
            db[j] += d[j]
        for k in range(s):
            r = idx[i, k]
            mark[r] = 1
            w = dW[r]
            for j in range(h):
                w[j] += d[j]
    n_rows = 0
    for r in range(mark.shape[0]):
        if mark[r]:
            mark[r] = 0
            touched[n_rows] = r
            n_rows += 1
    return n_rows


@njit(cache=False, fastmath=True, error_model="numpy")
def previous_norm_and_adam(p, g, m, v, touched, n, width, scale, lr, b1, b2, eps, bc1, bc2):
    """The replaced optimizer pass: norm and Adam read the gradient rows in the full dW."""
    total = 0.0
    for k in range(n):
        lo = touched[k] * width
        total += sq_norm(g[lo:lo + width])
    for k in range(n):
        lo = touched[k] * width
        adam_update(p[lo:lo + width], g[lo:lo + width], m[lo:lo + width], v[lo:lo + width], scale, lr,
                    b1, b2, eps, bc1, bc2, p.dtype.type(0), False)
    return total


def preset_batches(n_batches, steps):
    """(idx, dout) of the cube2 preset's online batches after `steps` training steps."""
    cfg = load_profile("cube2").replace(steps=10 ** 9, minutes=0.0, log_interval=10 ** 9, eval_interval=10 ** 9,
                                        checkpoint_interval=0, learning_starts=512, threads=1)
    tr = make_trainer(cfg, "cpu")
    tr.run(max_steps=steps)
    lr, out = tr.learner, []
    for _ in range(n_batches):
        tr.run(max_steps=lr.updates + 1)
        out.append((lr.ws.idx[:lr.micro].copy(), lr.ws.deltas[0][:lr.micro].copy()))
    return lr, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--train-steps", type=int, default=300, help="preset steps before the batches are taken")
    args = ap.parse_args()
    limit_threads(1)
    lr, batches = preset_batches(args.batches, args.train_steps)
    lay = lr.layout
    in_dim, h, s = lay.in_dim, lay.widths[1], lay.n_active
    head = in_dim * h
    f = np.float32
    c = (f(1.0), f(1e-3), f(0.9), f(0.999), f(1e-8), f(0.1), f(0.001))

    def state():
        p = aligned_zeros(head, f)
        p[:] = lr.online.params[:head]
        return p, aligned_zeros(head, f), aligned_zeros(head, f)

    db = np.zeros(h, f)
    mark = np.zeros(in_dim, np.uint8)
    # previous scheme
    p0, m0, v0 = state()
    dW = aligned_zeros((in_dim, h), f)
    t0 = np.zeros(lr.micro * s, np.int64)
    prev_n = [0]
    # compact scheme
    p1, m1, v1 = state()
    G = aligned_zeros((lr.micro * s, h), f)
    slot = np.zeros(in_dim, np.int32)
    t1 = np.zeros(lr.micro * s, np.int64)
    starts, terms = np.zeros(lr.micro * s + 2, np.int32), np.zeros(lr.micro * s, np.int32)

    def previous(b):
        idx, d = batches[b]
        n = previous_backward(idx, d, dW, db, mark, t0, prev_n[0])
        prev_n[0] = n
        return n, previous_norm_and_adam(p0, dW.reshape(-1), m0, v0, t0, n, h, *c)

    def compact(b):
        idx, d = batches[b]
        n = sparse_backward_compact(idx, d, G, db, mark, slot, t1, starts, terms)
        total = sq_norm(G.reshape(-1)[:n * h])
        adam_update_rows(p1, G.reshape(-1), m1, v1, t1, n, h, *c, f(0), False)
        return n, total

    rows = []
    for b in range(len(batches)):
        (na, sa), (nb, sb) = previous(b), compact(b)
        assert na == nb and abs(sa - sb) <= 1e-9 * sa
        rows.append(na)
    assert np.array_equal(p0, p1) and np.array_equal(m0, m1) and np.array_equal(v0, v1), "schemes differ"
    evict = np.zeros(8_000_000, f)  # the rest of a training step passes through the caches in between
    times = {"previous": [], "compact": []}
    for rep in range(args.reps):
        order = (("previous", previous), ("compact", compact))
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            evict += 1
            t = time.perf_counter()
            for b in range(len(batches)):
                fn(b)
            times[name].append((time.perf_counter() - t) / len(batches))
    parts = {"scatter": [], "norm": [], "adam": []}
    for rep in range(args.reps // 2):
        for b in range(len(batches)):
            evict += 1
            idx, d = batches[b]
            a = time.perf_counter()
            n = sparse_backward_compact(idx, d, G, db, mark, slot, t1, starts, terms)
            bb = time.perf_counter()
            sq_norm(G.reshape(-1)[:n * h])
            cc = time.perf_counter()
            adam_update_rows(p1, G.reshape(-1), m1, v1, t1, n, h, *c, f(0), False)
            parts["scatter"].append(bb - a)
            parts["norm"].append(cc - bb)
            parts["adam"].append(time.perf_counter() - cc)
    print(f"cube2 preset: W1 {in_dim} x {h}, batch {lr.micro} x {s} active inputs, touched rows per batch "
          f"{min(rows)}-{max(rows)}; same parameters and moments bitwise")
    med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    print(f"backward first layer + norm + lazy Adam, ms per step (medians of {args.reps} x {len(batches)}, "
          f"alternating): previous {med['previous']:.3f}, compact {med['compact']:.3f} "
          f"({med['previous'] / med['compact']:.2f}x)")
    print("compact, its parts (ms): " + ", ".join(f"{k} {np.median(v) * 1e3:.3f}" for k, v in parts.items()))


if __name__ == "__main__":
    main()
