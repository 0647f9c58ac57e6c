#!/usr/bin/env python
"""Ablation runner for the 2x2x2 learning goal: train variants, score them with the oracle.

Each variant is `name:key=value,key=value` (settings as in profiles/*.toml, hidden as
256x256). For every variant and seed it runs the real CLI:

  cubedqn train --profile BASE --out DIR --seed S --threads 1 [--key value ...]
  cubedqn eval --checkpoint DIR --random-states N --search greedy --json
  cubedqn eval --checkpoint DIR --random-states N --search beam --beam-width W --json

and prints one table row per run (greedy solved within 30 moves, beam solved / optimal,
median ms per cube), appending the raw JSON to --log.

Example:
  python scripts/ablate.py --base cube2 --minutes 5 \
      "preset:" "no-curriculum:curriculum=fixed" "mse:loss=mse"
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", help="name:key=value,... (empty after ':' = the base preset)")
    ap.add_argument("--base", default="cube2")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--random-states", type=int, default=1000)
    ap.add_argument("--beam-width", type=int, default=64)
    ap.add_argument("--no-beam", action="store_true")
    ap.add_argument("--runs", default="runs/ablate")
    ap.add_argument("--log", default="runs/ablate/results.jsonl")
    args = ap.parse_args()
    exe = [sys.executable, "-m", "cubedqn.cli"]
    Path(args.runs).mkdir(parents=True, exist_ok=True)
    print(f"{'variant':<22s} {'seed':>4s} {'steps':>7s} {'greedy':>7s} {'g.opt':>6s} "
          f"{'beam':>6s} {'b.opt':>6s} {'b.ms':>7s}  overrides", flush=True)
    for spec in args.variants:
        name, _, kv = spec.partition(":")
        flags = []
        for item in filter(None, kv.split(",")):
            k, _, v = item.partition("=")
            v = v.replace("x", ",") if k == "hidden" else v
            if v in ("true", "false"):
                flags.append(f"--{k.replace('_', '-')}" if v == "true" else f"--no-{k.replace('_', '-')}")
            else:
                flags += [f"--{k.replace('_', '-')}", v]
        for seed in args.seeds.split(","):
            out = Path(args.runs) / f"{name}-s{seed}"
            if (out / "state.json").exists():
                out = Path(str(out) + time.strftime("-%H%M%S"))
            t = time.perf_counter()
            run(exe + ["train", "--profile", args.base, "--out", str(out), "--seed", seed, "--threads", "1",
                       "--minutes", str(args.minutes)] + flags)
            wall = time.perf_counter() - t
            state = json.loads((out / "state.json").read_text())
            ev = ["eval", "--checkpoint", str(out), "--random-states", str(args.random_states), "--json"]
            g = json.loads(run(exe + ev + ["--search", "greedy", "--max-moves", "30"]))
            b = None if args.no_beam else json.loads(run(exe + ev + ["--search", "beam", "--beam-width",
                                                                      str(args.beam_width)]))
            rec = {"variant": name, "overrides": kv, "seed": int(seed), "minutes": args.minutes,
                   "train_wall_s": wall, "grad_steps": state["grad_steps"], "depth": state["depth"],
                   "greedy": g, "beam": b}
            with open(args.log, "a") as f:
                f.write(json.dumps(rec) + "\n")
            bs = f"{b['solved_frac']:>6.3f} {b['optimal_frac']:>6.3f} {b['median_seconds'] * 1e3:>7.1f}" if b \
                else f"{'-':>6s} {'-':>6s} {'-':>7s}"
            print(f"{name:<22s} {seed:>4s} {state['grad_steps']:>7d} {g['solved_frac']:>7.3f} "
                  f"{g['optimal_frac']:>6.3f} {bs}  {kv}", flush=True)


if __name__ == "__main__":
    main()
