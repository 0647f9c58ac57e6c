#!/usr/bin/env python
"""Start-up cost: `cubedqn train --profile cube2-quick --steps 10` with a cold and a warm
Numba cache, timed as whole commands (an upper bound on "time until training begins": it
includes imports, compilation or cache loads, filling replay to learning_starts, the 10
steps, the curriculum's evaluation and the final checkpoint, and whatever those compile)
and to the moment the command prints "kernels ready" (its warm-up done: training begins
there). The warm run must compile nothing: with
NUMBA_DEBUG_CACHE=1 numba reports every cache save, and a warm run should report none.

  python scripts/bench_startup.py [--repeats 3] [--compare-ahead]

A cold run on two or more CPUs has a second process compile the learner's kernels
(cubedqn/precompile.py); --compare-ahead adds cold runs with that off, alternating.

With --against DIR (another checkout of cubedqn, e.g. `git worktree add /tmp/old REV`),
it instead times warm whole commands of that tree and of this one alternating, round by
round (PYTHONPATH picks the tree; each tree keeps its own Numba cache, warmed first), and
prints medians and per-round ratios:

  python scripts/bench_startup.py --against /tmp/old --rounds 6
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = str(Path(__file__).resolve().parent.parent)
WARM_COMMANDS = {
    "train --profile cube2-quick --steps 10": ["train", "--profile", "cube2-quick", "--steps", "10", "--out"],
    "train --profile cube2 --steps 10 --learning-starts 1000": ["train", "--profile", "cube2", "--steps", "10",
                                                                "--learning-starts", "1000", "--out"],
    "scramble --puzzle cube3 --depth 5": ["scramble", "--puzzle", "cube3", "--depth", "5"],
}


def run_once(cache_dir, out_dir, ahead=True):
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, NUMBA_DEBUG_CACHE="1", CUBEDQN_COMPILE_AHEAD=str(int(ahead)))
    # the command as a user types it: the preset's one-minute budget stays, so train
    # warms the kernels up first (Trainer.warm_up) and the time includes that
    cmd = [sys.executable, "-m", "cubedqn.cli", *WARM_COMMANDS["train --profile cube2-quick --steps 10"], out_dir]
    t = time.perf_counter()
    begins, lines = None, []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:  # as the command prints it
            if begins is None and line.startswith("kernels ready"):
                begins = time.perf_counter() - t
            lines.append(line)
    wall = time.perf_counter() - t
    out = "".join(lines)
    if p.returncode != 0:
        raise SystemExit(out[-2000:])
    return wall, begins, out.count("data saved to"), out.count("data loaded from")


def cold_and_warm(repeats, tmp, compare_ahead=False):
    """repeats cold runs (each a fresh cache) and a warm run after each; with compare_ahead
    also a cold run with CUBEDQN_COMPILE_AHEAD=0 (the second process off), alternating."""
    off = "cold cache, CUBEDQN_COMPILE_AHEAD=0"
    rows = {"cold cache": [], "warm cache": [], **({off: []} if compare_ahead else {})}
    for k in range(repeats):
        cache = os.path.join(tmp, f"cache{k}")
        runs = [("cold cache", cache, f"cold{k}", True), ("warm cache", cache, f"warm{k}", True)]
        if compare_ahead:  # the "off" run after the pair in even rounds, before it in odd ones
            runs.insert(0 if k % 2 else 2, (off, os.path.join(tmp, f"cache-off{k}"), f"cold-off{k}", False))
        for name, cache_dir, out, ahead in runs:
            rows[name].append(run_once(cache_dir, os.path.join(tmp, out), ahead=ahead))
    for name, runs in rows.items():
        walls = sorted(w for w, _, _, _ in runs)
        begins = sorted(b for _, b, _, _ in runs if b is not None)
        begin = (f"training began (\"kernels ready\") at median {begins[len(begins) // 2]:.2f} s "
                 f"(runs: {', '.join(f'{b:.2f}' for b in begins)}); ") if begins else ""
        print(f"{name}: median {walls[len(walls) // 2]:.2f} s (runs: {', '.join(f'{w:.2f}' for w in walls)}); "
              f"{begin}this process's cache saves {runs[0][2]}, cache loads {runs[0][3]}")


def against(other, rounds, tmp):
    if not (Path(other) / "cubedqn" / "__init__.py").is_file():
        # PYTHONPATH would then name nothing and both runs would import this tree's cubedqn
        print(f"bench_startup.py: error: --against {other}: no cubedqn package there", file=sys.stderr)
        sys.exit(2)
    trees = {"other": str(Path(other).resolve()), "this": HERE}
    count = [0]

    def run(tree, name):
        argv = list(WARM_COMMANDS[name])
        if argv[-1] == "--out":
            count[0] += 1
            argv.append(os.path.join(tmp, f"run{count[0]}"))
        env = dict(os.environ, PYTHONPATH=trees[tree])
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "cubedqn.cli", *argv], env=env, capture_output=True, text=True,
                           cwd=tmp)
        if r.returncode != 0:
            raise SystemExit(f"{tree} tree, {name}: {r.stderr[-2000:]}")
        return time.perf_counter() - t

    for name in WARM_COMMANDS:  # warm both trees' caches
        for tree in trees:
            run(tree, name)
    walls = {(tree, name): [] for tree in trees for name in WARM_COMMANDS}
    for k in range(rounds):
        for name in WARM_COMMANDS:
            for tree in (("other", "this") if k % 2 == 0 else ("this", "other")):
                walls[(tree, name)].append(run(tree, name))
    print(f"warm whole commands, {rounds} alternating rounds; other tree: {trees['other']}")
    for name in WARM_COMMANDS:
        o, t = walls[("other", name)], walls[("this", name)]
        ratios = [a / b for a, b in zip(o, t)]
        print(f"{name:58s} other median {statistics.median(o):.2f} s, this {statistics.median(t):.2f} s; "
              f"other/this per round {min(ratios):.2f}-{max(ratios):.2f} (median {statistics.median(ratios):.2f}x); "
              f"other {' '.join(f'{x:.2f}' for x in o)} | this {' '.join(f'{x:.2f}' for x in t)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--against", metavar="DIR", help="another checkout: time warm commands of both, alternating")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--compare-ahead", action="store_true",
                    help="also cold runs with CUBEDQN_COMPILE_AHEAD=0 (no second compiling process), alternating")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="cubedqn-startup-")
    try:
        if args.against:
            against(args.against, args.rounds, tmp)
        else:
            cold_and_warm(args.repeats, tmp, args.compare_ahead)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
