"""Q-guided search: batched greedy rollouts and beam search, every solution verified.

Greedy: all cubes advance together, one forward pass per move over the unsolved ones;
each takes its best-Q action whose result it has not visited before (a cube with no such
action is stuck and counts as unsolved).

Beam search (Q*-style): a parent's single forward pass scores all of its children, since
Q(s, a) estimates -(1 + cost-to-go of child a). A beam of width W therefore costs W
forward rows per depth, not W x actions. Children are deduplicated exactly (hash, then a
byte comparison) and the W best distinct ones form the next beam.

Both return action lists, and `verify` replays each on its start state.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from .cube import apply_moves, expand_children, is_solved, solved_batch


@njit(cache=True)
def _state_hash(state):
    h = np.uint64(14695981039346656037)
    for j in range(state.shape[0]):
        h = (h ^ np.uint64(state[j])) * np.uint64(1099511628211)
    return h


@njit(cache=True)
def _visited(hist, n_hist, child):
    s = child.shape[0]
    for k in range(n_hist):
        same = True
        for j in range(s):
            if hist[k, j] != child[j]:
                same = False
                break
        if same:
            return True
    return False


@njit(cache=True)
def greedy_step(q, rows, states, moves, hist, hist_len, actions_out, stuck):
    """For each cube rows[k] (q row k): best action to an unvisited state; apply it in place."""
    n_a = q.shape[1]
    s = states.shape[1]
    child = np.empty(s, np.uint8)
    order = np.empty(n_a, np.int64)
    for k in range(rows.shape[0]):
        i = rows[k]
        order[:] = np.argsort(-q[k])
        chosen = -1
        for r in range(n_a):
            a = order[r]
            perm = moves[a]
            for j in range(s):
                child[j] = states[i, perm[j]]
            if not _visited(hist[i], hist_len[i], child):
                chosen = a
                break
        if chosen < 0:
            stuck[i] = True
            continue
        states[i] = child
        hist[i, hist_len[i]] = child
        hist_len[i] += 1
        actions_out[i] = chosen


def greedy_solve(policy, states, moves, max_moves=30):
    """Batched greedy rollouts. Returns (solved (N,), lengths (N,), solutions list)."""
    states = np.array(np.atleast_2d(states), dtype=np.uint8, copy=True)
    n, s = states.shape
    hist = np.zeros((n, max_moves + 1, s), np.uint8)
    hist[:, 0] = states
    hist_len = np.ones(n, np.int64)
    solved = np.zeros(n, np.bool_)
    stuck = np.zeros(n, np.bool_)
    path = np.full((n, max_moves), -1, np.int64)
    step_actions = np.full(n, -1, np.int64)
    solved_batch(states, solved)
    for t in range(max_moves):
        rows = np.flatnonzero(~solved & ~stuck)
        if rows.size == 0:
            break
        q = policy.q_values(states[rows])
        step_actions[:] = -1
        greedy_step(q, rows, states, moves, hist, hist_len, step_actions, stuck)
        path[rows, t] = step_actions[rows]
        solved_batch(states, solved)
    lengths = np.where(solved, hist_len - 1, -1)
    sols = [path[i, :lengths[i]].tolist() if solved[i] else None for i in range(n)]
    return solved, lengths, sols


@njit(cache=True)
def select_beam(kids, scores, width, out_idx):
    """Indices of the `width` best (lowest score) distinct rows of kids (M, S). Returns count."""
    m, s = kids.shape
    order = np.argsort(scores)
    size = 1
    while size < 4 * width:
        size *= 2
    table = np.full(size, -1, np.int64)
    count = 0
    for r in range(m):
        if count >= width:
            break
        c = order[r]
        h = _state_hash(kids[c])
        slot = np.int64(h & np.uint64(size - 1))
        dup = False
        while table[slot] >= 0:
            o = table[slot]
            same = True
            for j in range(s):
                if kids[o, j] != kids[c, j]:
                    same = False
                    break
            if same:
                dup = True
                break
            slot = (slot + 1) & (size - 1)
        if dup:
            continue
        table[slot] = c
        out_idx[count] = c
        count += 1
    return count


def beam_search(policy, state, moves, n_actions, width=64, max_depth=30):
    """Beam search from one state; returns the action list or None if not found."""
    state = np.asarray(state, dtype=np.uint8)
    if is_solved(state):
        return []
    s = state.shape[0]
    beam = state[None].copy()
    parents, acts = [], []
    kids = np.empty((width, n_actions, s), np.uint8)
    solved = np.empty(width * n_actions, np.bool_)
    sel = np.empty(width, np.int64)
    for _ in range(max_depth):
        w = beam.shape[0]
        q = policy.q_values(beam)
        k = kids[:w]
        expand_children(beam, moves, n_actions, k)
        flat = k.reshape(w * n_actions, s)
        solved_batch(flat, solved[:w * n_actions])
        hit = np.flatnonzero(solved[:w * n_actions])
        if hit.size:
            c = int(hit[np.argmax(q.reshape(-1)[hit])])
            path = [c % n_actions]
            parent = c // n_actions
            for par, act in zip(reversed(parents), reversed(acts)):
                path.append(int(act[parent]))
                parent = int(par[parent])
            return path[::-1]
        scores = -q.reshape(-1).astype(np.float64)
        cnt = select_beam(flat, scores, width, sel)
        chosen = sel[:cnt]
        parents.append(chosen // n_actions)
        acts.append(chosen % n_actions)
        beam = flat[chosen].copy()
    return None


def verify(puzzle, state, solution) -> bool:
    return solution is not None and is_solved(apply_moves(puzzle, state, solution))


def solve_many(policy, puzzle, states, n_actions, search="greedy", beam_width=64, max_moves=30):
    """Solve each state; returns (solved, lengths, seconds per cube, solutions), all verified."""
    states = np.atleast_2d(states)
    n = len(states)
    moves = np.ascontiguousarray(puzzle.moves)
    if search == "greedy":
        t = time.perf_counter()
        _, lengths, sols = greedy_solve(policy, states, moves, max_moves)
        per = np.full(n, (time.perf_counter() - t) / max(n, 1))
    elif search == "beam":
        sols, per = [], np.zeros(n)
        for i in range(n):
            t = time.perf_counter()
            sols.append(beam_search(policy, states[i], moves, n_actions, beam_width, max_moves))
            per[i] = time.perf_counter() - t
    else:
        raise ValueError(f"unknown search '{search}' (expected greedy or beam)")
    ok = np.array([verify(puzzle, states[i], sols[i]) for i in range(n)], dtype=bool)
    lengths = np.array([len(sols[i]) if ok[i] else -1 for i in range(n)])
    sols = [sols[i] if ok[i] else None for i in range(n)]
    return ok, lengths, per, sols
