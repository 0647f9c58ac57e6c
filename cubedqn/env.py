"""Vectorised cube environments and epsilon-greedy acting, as Numba kernels.

What this file is: N cubes stepped together in one kernel call. Reward is -1 per move,
an episode terminates when the cube is solved (cost-to-go formulation) and is truncated
(not terminal: the value is bootstrapped) after `max_episode_moves`; both reset the cube
to a fresh scramble whose depth is drawn uniformly from the curriculum's [lo, hi].

n-step returns are formed here, per environment, as transitions leave a short history:
(s_t, a_t, R = sum_k gamma^k r_{t+k}, s_{t+m}, done, m) with m = n, or fewer at the end
of an episode. n = 1 is ordinary one-step transitions.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cube import scramble_row, solved_row
from .rng import below, uniform


@njit(cache=True)
def reset_envs(states, mask, solved_state, depth_lo, depth_hi, moves, n_actions, rng, ep_steps, hist_len):
    """Re-scramble envs where mask[i]: depth uniform in [lo, hi], never an already solved cube."""
    n, s = states.shape
    tmp = np.empty(s, np.uint8)
    no_record = np.empty(0, np.int8)
    for i in range(n):
        if not mask[i]:
            continue
        while True:
            for j in range(s):  # element by element: see the note above cube.py's kernels
                states[i, j] = solved_state[j]
            depth = depth_lo + below(rng, depth_hi - depth_lo + 1)
            scramble_row(states[i], depth, moves, n_actions, rng, np.bool_(True), tmp, no_record, np.bool_(False))
            if not solved_row(states[i]):
                break
        ep_steps[i] = 0
        hist_len[i] = 0


@njit(cache=True)
def select_actions(q, eps, rng, out):
    """epsilon-greedy over the rows of q (N, A)."""
    n, a_n = q.shape
    for i in range(n):
        if uniform(rng) < eps:
            out[i] = below(rng, a_n)
        else:
            best = 0
            for a in range(1, a_n):
                if q[i, a] > q[i, best]:
                    best = a
            out[i] = best


@njit(cache=True)
def draw_explorers(states, eps, n_actions, rng, out, greedy, greedy_states):
    """select_actions' draws without its Q-values: the rows that explore get their random
    action in out; the others' row numbers go to greedy[:k] and their states to
    greedy_states[:k]. Returns k. The draws are select_actions' own, in its order, so
    greedy_actions on those k states' Q-values completes the same actions: the network
    need not score the states whose Q-values epsilon-greedy throws away.

    states (N, S) uint8; out, greedy (N,) int64; greedy_states (N, S) uint8."""
    n, s = states.shape
    k = 0
    for i in range(n):
        if uniform(rng) < eps:
            out[i] = below(rng, n_actions)
        else:
            greedy[k] = i
            for j in range(s):
                greedy_states[k, j] = states[i, j]
            k += 1
    return k


@njit(cache=True)
def greedy_actions(qc, rot, act_map, greedy, out):
    """out[greedy[j]] = the best action of row j of qc (k, A), Q-values in the state's
    canonical frame rot[j]: the action a maximising qc[j, act_map[rot[j], a]], the first
    such a on ties (select_actions on q_to_world's rows)."""
    k, a_n = qc.shape
    for j in range(k):
        m = act_map[rot[j]]
        best, best_q = 0, qc[j, m[0]]
        for a in range(1, a_n):
            v = qc[j, m[a]]
            if v > best_q:
                best, best_q = a, v
        out[greedy[j]] = best


@njit(cache=True)
def step_envs(states, actions, moves, ep_steps, max_moves, gamma, hist_s, hist_a, hist_len,
              out, reward_f32, ended):
    """Step every env; emit finished n-step transitions as replay records into out; mark ended envs.

    out (M, width) uint8 records (see replay.RecordLayout); reward_f32 (M,) is the float32
    view of their reward field.

    Returns (transitions emitted, episodes solved, episodes ended). Ended envs still hold
    their final state: reset them with reset_envs(mask=ended).
    """
    n, s = states.shape
    nstep = hist_s.shape[1]
    tmp = np.empty(s, np.uint8)
    count = 0
    n_solved = n_ended = 0
    for i in range(n):
        k = hist_len[i]
        for j in range(s):
            hist_s[i, k, j] = states[i, j]
        hist_a[i, k] = actions[i]
        hist_len[i] = k + 1
        perm = moves[actions[i]]
        for j in range(s):
            tmp[j] = states[i, perm[j]]
        for j in range(s):
            states[i, j] = tmp[j]
        ep_steps[i] += 1
        solved = solved_row(states[i])
        truncated = (not solved) and ep_steps[i] >= max_moves
        ended[i] = solved or truncated
        if solved:
            n_solved += 1
        if ended[i]:
            n_ended += 1
        m = hist_len[i]
        if m == nstep or ended[i]:
            n_emit = m if ended[i] else 1
            for e in range(n_emit):
                ret = 0.0
                g = 1.0
                for _ in range(e, m):
                    ret += -1.0 * g
                    g *= gamma
                rec = out[count]
                for j in range(s):
                    rec[j] = hist_s[i, e, j]
                    rec[s + j] = states[i, j]
                rec[2 * s] = hist_a[i, e]
                rec[2 * s + 1] = 1 if solved else 0
                rec[2 * s + 2] = m - e
                reward_f32[count] = ret
                count += 1
            if ended[i]:
                hist_len[i] = 0
            else:
                for e in range(1, m):
                    for j in range(s):
                        hist_s[i, e - 1, j] = hist_s[i, e, j]
                    hist_a[i, e - 1] = hist_a[i, e]
                hist_len[i] = m - 1
    return count, n_solved, n_ended


class VecEnv:
    """N cubes, their episode counters, n-step histories and the emitted-transition buffers."""

    def __init__(self, puzzle, n_envs, n_actions, max_moves, gamma, n_step):
        self.puzzle, self.n, self.n_actions = puzzle, n_envs, n_actions
        self.max_moves, self.gamma, self.n_step = max_moves, gamma, n_step
        s = puzzle.n_stickers
        self.states = np.repeat(puzzle.solved[None], n_envs, axis=0)
        self.ep_steps = np.zeros(n_envs, np.int64)
        self.hist_s = np.zeros((n_envs, n_step, s), np.uint8)
        self.hist_a = np.zeros((n_envs, n_step), np.int64)
        self.hist_len = np.zeros(n_envs, np.int64)
        from .replay import RecordLayout
        self.record_layout = RecordLayout(s)
        self.out = np.zeros((n_envs * n_step, self.record_layout.width), np.uint8)
        (self.out_s, self.out_next, self.out_a, self.out_done, self.out_n,
         self.out_r) = self.record_layout.views(self.out)
        self.ended = np.zeros(n_envs, np.bool_)
        self.n_ended = 0  # of the last step: its count of True in `ended`
        self.actions = np.zeros(n_envs, np.int64)
        self._moves = np.ascontiguousarray(puzzle.moves)

    def reset(self, mask, lo, hi, rng):
        reset_envs(self.states, mask, self.puzzle.solved, lo, hi, self._moves, self.n_actions, rng,
                   self.ep_steps, self.hist_len)

    def step(self, actions):
        """Step every env (step_envs); returns (transitions emitted, episodes solved), and
        n_ended is the number of episodes that ended (their envs marked in `ended`)."""
        count, solved, self.n_ended = step_envs(self.states, actions, self._moves, self.ep_steps, self.max_moves,
                                                self.gamma, self.hist_s, self.hist_a, self.hist_len, self.out,
                                                self.out_r, self.ended)
        return count, solved

    ARRAYS = ("states", "ep_steps", "hist_s", "hist_a", "hist_len")

    def arrays(self):
        return {f"env_{k}": getattr(self, k) for k in self.ARRAYS}

    def load_arrays(self, data):
        for k in self.ARRAYS:
            src = data[f"env_{k}"]
            if src.shape != getattr(self, k).shape:
                raise ValueError(f"saved environments '{k}' have shape {src.shape}, "
                                 f"config needs {getattr(self, k).shape}")
            getattr(self, k)[:] = src
