"""Exact 2x2x2 oracle: every position's optimal distance, by breadth-first search.

What this file is: an index of all 3,674,160 2x2x2 positions with the DBL corner fixed
(7! corner permutations x 3^6 twists), move tables on that index for the face turns that
leave DBL alone (U, R, F; on a 2x2x2, L is R times a whole-cube rotation, so these reach
every position), a Numba BFS into a uint8 distance table per metric, and a lookup from any
sticker state, in any of the 24 orientations, to its optimal distance.

The table is cached in the user's cache directory (`$CUBEDQN_CACHE_DIR`, else
`$XDG_CACHE_HOME/cubedqn`, else `~/.cache/cubedqn`), written atomically.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
from numba import njit

from .cube import check_metric, get_puzzle

N_STATES = 3674160
N_PERM = 5040  # 7!
N_TWIST = 729  # 3^6
FIXED_SLOT = 6  # DBL in Kociemba's corner order
FREE_SLOTS = np.array([0, 1, 2, 3, 4, 5, 7], dtype=np.int64)
# Generators that keep DBL in place, as action numbers: U U' R R' F F' (QTM) + U2 R2 F2.
GENERATORS = {"qtm": np.array([0, 1, 6, 7, 8, 9], dtype=np.int64),
              "htm": np.array([0, 1, 6, 7, 8, 9, 12, 15, 16], dtype=np.int64)}
PUBLISHED_COUNTS = {
    "htm": [1, 9, 54, 321, 1847, 9992, 50136, 227536, 870072, 1887748, 623800, 2644],
    "qtm": [1, 6, 27, 120, 534, 2256, 8969, 33058, 114149, 360508, 930588, 1350852,
            782536, 90280, 276],
}
_FACT = np.array([math.factorial(k) for k in range(8)], dtype=np.int64)
_UNSET = 255


@njit(cache=True)
def _encode(cp, co, fact):
    """Index of a 2x2x2 corner state; cp/co over Kociemba slots, cubie DBL in slot DBL."""
    # Free cubies renumbered 0..6 (cubie 7 -> 6) in free-slot order.
    perm = np.empty(7, np.int64)
    for k in range(7):
        slot = k if k < 6 else 7
        c = cp[slot]
        perm[k] = c if c < 6 else 6
    p = 0
    for i in range(7):
        smaller = 0
        for j in range(i + 1, 7):
            if perm[j] < perm[i]:
                smaller += 1
        p += smaller * fact[6 - i]
    t = 0
    for k in range(6):
        t = t * 3 + co[k]
    return p * 729 + t


@njit(cache=True)
def _decode(index, fact, cp, co):
    p = index // 729
    t = index % 729
    used = np.zeros(7, np.bool_)
    for i in range(7):
        r = p // fact[6 - i]
        p = p % fact[6 - i]
        for v in range(7):
            if not used[v]:
                if r == 0:
                    used[v] = True
                    slot = i if i < 6 else 7
                    cp[slot] = v if v < 6 else 7
                    break
                r -= 1
    total = 0
    for k in range(5, -1, -1):
        co[k] = t % 3
        total += co[k]
        t //= 3
    co[7] = (3 - total % 3) % 3
    cp[6] = 6
    co[6] = 0


@njit(cache=True)
def _state_from_cubies(cp, co, corner_facelets, corner_colours, out):
    for i in range(8):
        for k in range(3):
            out[corner_facelets[i, (k + co[i]) % 3]] = corner_colours[cp[i], k]


@njit(cache=True)
def states_to_index(states, rotations, corner_facelets, corner_colours, corner_lookup, fact, out):
    """out[i] = oracle index of states[i] (any orientation); -1 if it is no valid 2x2x2."""
    n, s = states.shape
    rotated = np.empty(s, np.uint8)
    cp = np.empty(8, np.int64)
    co = np.empty(8, np.int64)
    f0 = corner_facelets[6, 0]
    f1 = corner_facelets[6, 1]
    f2 = corner_facelets[6, 2]
    for i in range(n):
        out[i] = -1
        for r in range(rotations.shape[0]):
            rot = rotations[r]
            if (states[i, rot[f0]] == corner_colours[6, 0] and states[i, rot[f1]] == corner_colours[6, 1]
                    and states[i, rot[f2]] == corner_colours[6, 2]):
                for j in range(s):
                    rotated[j] = states[i, rot[j]]
                ok = True
                twist = 0
                seen = 0
                for slot in range(8):
                    k = -1
                    for q in range(3):
                        c = rotated[corner_facelets[slot, q]]
                        if c == 0 or c == 3:
                            k = q
                    if k < 0:
                        ok = False
                        break
                    a = rotated[corner_facelets[slot, k]]
                    b = rotated[corner_facelets[slot, (k + 1) % 3]]
                    c = rotated[corner_facelets[slot, (k + 2) % 3]]
                    cubie = corner_lookup[a * 36 + b * 6 + c]
                    if cubie < 0 or (seen >> cubie) & 1:
                        ok = False
                        break
                    seen |= 1 << cubie
                    cp[slot] = cubie
                    co[slot] = k
                    twist += k
                if ok and twist % 3 == 0:
                    out[i] = _encode(cp, co, fact)
                break


@njit(cache=True)
def index_to_states(indices, corner_facelets, corner_colours, fact, out):
    """out[i] = sticker state (home orientation) of oracle index indices[i]."""
    cp = np.empty(8, np.int64)
    co = np.empty(8, np.int64)
    for i in range(indices.shape[0]):
        _decode(indices[i], fact, cp, co)
        _state_from_cubies(cp, co, corner_facelets, corner_colours, out[i])


@njit(cache=True)
def _bfs(perm_move, twist_move, solved_index, dist):
    n_gen = perm_move.shape[1]
    dist[:] = 255
    dist[solved_index] = 0
    depth = 0
    frontier = 1
    while frontier > 0:
        frontier = 0
        for idx in range(dist.shape[0]):
            if dist[idx] != depth:
                continue
            p = idx // 729
            t = idx % 729
            for g in range(n_gen):
                child = perm_move[p, g] * 729 + twist_move[t, g]
                if dist[child] == 255:
                    dist[child] = depth + 1
                    frontier += 1
        depth += 1


class Oracle:
    """Optimal distances for the 2x2x2 in one metric. Use `load_oracle(metric)`."""

    def __init__(self, metric: str, dist: np.ndarray):
        self.metric = metric
        self.dist = dist
        p = get_puzzle("cube2")
        self._args = (p.rotations, p.corner_facelets.copy(), p.corner_colours.copy(),
                      p.corner_lookup.copy(), _FACT)

    def indices(self, states: np.ndarray) -> np.ndarray:
        states = np.ascontiguousarray(np.atleast_2d(states), dtype=np.uint8)
        out = np.empty(len(states), np.int64)
        states_to_index(states, *self._args, out)
        return out

    def distances(self, states: np.ndarray) -> np.ndarray:
        """Optimal distance of each state (int64); raises ValueError for an invalid state."""
        idx = self.indices(states)
        if np.any(idx < 0):
            raise ValueError("state is not a valid 2x2x2 position")
        return self.dist[idx].astype(np.int64)

    def counts(self) -> list[int]:
        return np.bincount(self.dist).tolist()

    def random_states(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n positions drawn uniformly from all 3,674,160 (home orientation)."""
        return decode_states(rng.integers(0, N_STATES, size=n))


def decode_states(indices) -> np.ndarray:
    p = get_puzzle("cube2")
    indices = np.asarray(indices, dtype=np.int64)
    out = np.empty((len(indices), p.n_stickers), np.uint8)
    index_to_states(indices, p.corner_facelets.copy(), p.corner_colours.copy(), _FACT, out)
    return out


def _move_tables(metric: str):
    p = get_puzzle("cube2")
    gens = GENERATORS[metric]
    args = (p.rotations, p.corner_facelets.copy(), p.corner_colours.copy(), p.corner_lookup.copy(), _FACT)
    perm_states = decode_states(np.arange(N_PERM, dtype=np.int64) * N_TWIST)
    twist_states = decode_states(np.arange(N_TWIST, dtype=np.int64))
    perm_move = np.empty((N_PERM, len(gens)), np.int64)
    twist_move = np.empty((N_TWIST, len(gens)), np.int64)
    for g, a in enumerate(gens):
        out = np.empty(N_PERM, np.int64)
        states_to_index(np.ascontiguousarray(perm_states[:, p.moves[a]]), *args, out)
        perm_move[:, g] = out // N_TWIST
        out = np.empty(N_TWIST, np.int64)
        states_to_index(np.ascontiguousarray(twist_states[:, p.moves[a]]), *args, out)
        twist_move[:, g] = out % N_TWIST
    return perm_move, twist_move


def build_distances(metric: str) -> np.ndarray:
    check_metric(metric)
    perm_move, twist_move = _move_tables(metric)
    solved = Oracle(metric, np.zeros(0, np.uint8)).indices(get_puzzle("cube2").solved)[0]
    dist = np.empty(N_STATES, np.uint8)
    _bfs(perm_move, twist_move, solved, dist)
    if np.any(dist == _UNSET):
        raise RuntimeError("oracle BFS left positions unreached (move tables are wrong)")
    return dist


def cache_dir() -> Path:
    if os.environ.get("CUBEDQN_CACHE_DIR"):
        return Path(os.environ["CUBEDQN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cubedqn"


def _cache_path(metric: str) -> Path:
    return cache_dir() / f"oracle-cube2-{metric}-v1.npy"


def load_oracle(metric: str = "qtm", use_cache: bool = True) -> Oracle:
    """Load the distance table from the cache, or build it (a few seconds) and cache it."""
    check_metric(metric)
    path = _cache_path(metric)
    if use_cache and path.exists():
        try:
            dist = np.load(path, allow_pickle=False)
            if dist.shape == (N_STATES,) and dist.dtype == np.uint8 and \
                    np.bincount(dist).tolist() == PUBLISHED_COUNTS[metric]:
                return Oracle(metric, dist)
        except (OSError, ValueError):
            pass  # corrupt cache file: rebuild below
    dist = build_distances(metric)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                np.save(f, dist, allow_pickle=False)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache is not an error: the table is just rebuilt next time
    return Oracle(metric, dist)
