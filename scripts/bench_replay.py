#!/usr/bin/env python
"""Replay buffer throughput and memory: batch add (transitions/s), uniform and prioritized
sampling (batches of 64 per second), bytes per transition. Medians of repeated timings.

Each buffer is first filled once, timed on its own ("first fill"): that pass writes the
buffer's pages for the first time, and the page faults it takes vary a lot from run to run
on a shared host (adds of 256 read 7-9 M/s in some runs and 54-77 in others while they
were the first to write most pages). The add rates after it are a running buffer's, whose
pages are all written.

Targets (trainer issue): add >= 20M transitions/s, sample >= 100k batches of 64/s,
<= 64 bytes per 2x2x2 transition. The seeds' C++ buffer: 207k adds/s, 131 batches/s.

  python scripts/bench_replay.py
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cubedqn.replay import Batch, ReplayBuffer  # noqa: E402
from cubedqn.rng import make_rng  # noqa: E402


def median_rate(f, units, reps=7, inner=200):
    f()
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            f()
        rates.append(units * inner / (time.perf_counter() - t))
    return float(np.median(rates))


def main():
    rng = np.random.default_rng(0)
    for name, s in (("cube2", 24), ("cube3", 54)):
        cap = 1_000_000
        for prioritized in (False, True):
            buf = ReplayBuffer(cap, s, 0.99, prioritized=prioritized)
            kind = "prioritized" if prioritized else "uniform"
            fill = rng.integers(0, 6, (4096, buf.layout.width)).astype(np.uint8)
            t = time.perf_counter()
            for _ in range(-(-cap // len(fill))):
                buf.add(fill)
            took = time.perf_counter() - t
            print(f"{name} {kind:<11s} first fill of {cap:,} in batches of 4096: {took:6.3f} s "
                  f"({cap / took / 1e6:.1f} M transitions/s)")
            for n in (64, 256, 4096):
                rec = rng.integers(0, 6, (n, buf.layout.width)).astype(np.uint8)
                rate = median_rate(lambda: buf.add(rec), n)
                print(f"{name} {kind:<11s} add  batches of {n:>4d}: {rate / 1e6:8.2f} M transitions/s")
            batch = Batch(64, s, np.float32)
            srng = make_rng(1)
            rate = median_rate(lambda: buf.sample(srng, batch), 1, inner=2000)
            print(f"{name} {kind:<11s} sample batches of 64: {rate / 1e3:8.1f} k batches/s")
            if prioritized:
                td = rng.normal(0, 1, 64).astype(np.float32)
                rate = median_rate(lambda: buf.update_priorities(batch.indices, td), 1, inner=2000)
                print(f"{name} {kind:<11s} priority updates of 64: {rate / 1e3:8.1f} k batches/s")
        print(f"{name} memory: {buf.nbytes_per_transition} bytes per transition "
              f"({buf.nbytes / cap:.1f} with the sum-tree)")


if __name__ == "__main__":
    main()
