#!/usr/bin/env python
"""Start-up cost: `cubedqn train --profile cube2-quick --steps 10` with a cold and a warm
Numba cache, timed as whole commands (so an upper bound on "time until training begins":
it includes imports, compilation or cache loads, filling replay to learning_starts, the
10 steps and the final checkpoint). The warm run must compile nothing: with
NUMBA_DEBUG_CACHE=1 numba reports every cache save, and a warm run should report none.

  python scripts/bench_startup.py [--repeats 3]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time


def run_once(cache_dir, out_dir):
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, NUMBA_DEBUG_CACHE="1")
    cmd = [sys.executable, "-m", "cubedqn.cli", "train", "--profile", "cube2-quick", "--steps", "10",
           "--minutes", "0", "--out", out_dir]
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(r.stderr[-2000:])
    saves = r.stdout.count("data saved to")
    loads = r.stdout.count("data loaded from")
    return wall, saves, loads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="cubedqn-startup-")
    try:
        cold, warm = [], []
        for k in range(args.repeats):
            cache = os.path.join(tmp, f"cache{k}")
            cold.append(run_once(cache, os.path.join(tmp, f"cold{k}")))
            warm.append(run_once(cache, os.path.join(tmp, f"warm{k}")))
        for name, rows in (("cold cache", cold), ("warm cache", warm)):
            walls = sorted(w for w, _, _ in rows)
            print(f"{name}: median {walls[len(walls) // 2]:.2f} s (runs: {', '.join(f'{w:.2f}' for w in walls)}); "
                  f"cache saves {rows[0][1]}, cache loads {rows[0][2]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
