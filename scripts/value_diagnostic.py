#!/usr/bin/env python
"""How good are a 2x2x2 checkpoint's values, by true distance? (uses the exact oracle)

For 500 uniformly random positions at each optimal distance d, prints the exact
discounted value -(1 - gamma^d)/(1 - gamma), the network's mean V = max_a Q, the mean
absolute error, and how often the greedy move leads to a position at distance d - 1.

  python scripts/value_diagnostic.py runs/cube2-final
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cubedqn.cube import expand_children, get_puzzle  # noqa: E402
from cubedqn.dqn import load_policy  # noqa: E402
from cubedqn.oracle import N_STATES, decode_states, load_oracle  # noqa: E402


def main(run_dir, per_distance=500):
    cfg, policy = load_policy(run_dir)
    if cfg.puzzle != "cube2":
        raise SystemExit("value_diagnostic: needs a cube2 checkpoint (the oracle is 2x2x2 only)")
    oracle = load_oracle(cfg.metric)
    p = get_puzzle("cube2")
    n_actions = 12 if cfg.metric == "qtm" else 18
    moves = np.ascontiguousarray(p.moves[:n_actions])
    idx = np.random.default_rng(0).integers(0, N_STATES, 200_000)
    dist = oracle.dist[idx]
    g = cfg.gamma
    print(f"{'d':>2s} {'n':>4s} {'V true':>7s} {'V mean':>7s} {'|err|':>6s} {'best move optimal':>18s}")
    for d in range(1, int(dist.max()) + 1):
        states = decode_states(idx[dist == d][:per_distance])
        if len(states) == 0:
            continue
        q = policy.q_values(states)
        v = q.max(axis=1)
        v_true = -(1 - g ** d) / (1 - g) if g < 1 else -float(d)
        kids = np.empty((len(states), n_actions, 24), np.uint8)
        expand_children(states, moves, n_actions, kids)
        kd = oracle.distances(kids.reshape(-1, 24)).reshape(len(states), n_actions)
        ok = (kd[np.arange(len(states)), q.argmax(axis=1)] == d - 1).mean()
        print(f"{d:>2d} {len(states):>4d} {v_true:>7.2f} {v.mean():>7.2f} {np.abs(v - v_true).mean():>6.2f} {ok:>18.3f}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
