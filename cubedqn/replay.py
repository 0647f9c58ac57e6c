"""Replay: a ring buffer of compact cube transitions, uniform or prioritized sampling.

What this file is: storage of (state, action, n-step return, next state, done, n) with
states as uint8 stickers (55 bytes per 2x2x2 transition, never float one-hot); a batch
add and a batch sample, each one Numba call; a proportional sum-tree (Schaul et al. 2016)
for prioritized replay with importance weights; save/load to .npz without pickle.

Randomness comes from a np.random.Generator passed in, so a run is reproducible and its
state can be checkpointed.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _ring_add(states, actions, rewards, next_states, dones, nsteps,
              b_states, b_actions, b_rewards, b_next, b_dones, b_nsteps, pos, count):
    cap = b_states.shape[0]
    for i in range(count):
        j = (pos + i) % cap
        b_states[j] = states[i]
        b_next[j] = next_states[i]
        b_actions[j] = actions[i]
        b_rewards[j] = rewards[i]
        b_dones[j] = dones[i]
        b_nsteps[j] = nsteps[i]


@njit(cache=True)
def _gather(idx, b_states, b_actions, b_rewards, b_next, b_dones, b_nsteps, gamma,
            o_states, o_actions, o_rewards, o_next, o_dones, o_discounts):
    for k in range(idx.shape[0]):
        j = idx[k]
        o_states[k] = b_states[j]
        o_next[k] = b_next[j]
        o_actions[k] = b_actions[j]
        o_rewards[k] = b_rewards[j]
        o_dones[k] = b_dones[j]
        o_discounts[k] = gamma ** b_nsteps[j]


@njit(cache=True)
def _uniform_indices(rng, size, out):
    for k in range(out.shape[0]):
        out[k] = rng.integers(0, size)


# -- sum-tree: tree[1] is the root, leaves at tree[cap2 + i] ------------------------------

@njit(cache=True)
def tree_set(tree, cap2, idx, values):
    for k in range(idx.shape[0]):
        j = idx[k] + cap2
        delta = values[k] - tree[j]
        while j >= 1:
            tree[j] += delta
            j //= 2


@njit(cache=True)
def tree_find(tree, cap2, mass):
    """Leaf index i such that the prefix sum of leaves before i <= mass < prefix incl. i."""
    j = 1
    while j < cap2:
        left = 2 * j
        if mass < tree[left] or tree[left + 1] <= 0.0:
            j = left
        else:
            mass -= tree[left]
            j = left + 1
    return j - cap2


@njit(cache=True)
def _prioritized_indices(rng, tree, cap2, size, beta, out, weights):
    """Stratified proportional sampling; weights = (size * P(i))^-beta / max weight."""
    total = tree[1]
    n = out.shape[0]
    seg = total / n
    wmax = 0.0
    for k in range(n):
        m = (k + rng.random()) * seg
        i = tree_find(tree, cap2, m)
        if i >= size:
            i = size - 1
        out[k] = i
        p = tree[cap2 + i] / total
        w = (size * p) ** (-beta) if p > 0 else 0.0
        weights[k] = w
        if w > wmax:
            wmax = w
    if wmax > 0:
        for k in range(n):
            weights[k] /= wmax


class Batch:
    """Preallocated sample arrays (reused every step)."""

    def __init__(self, n, n_stickers, dtype):
        self.states = np.zeros((n, n_stickers), np.uint8)
        self.next_states = np.zeros((n, n_stickers), np.uint8)
        self.actions = np.zeros(n, np.int64)
        self.rewards = np.zeros(n, dtype)
        self.dones = np.zeros(n, dtype)
        self.discounts = np.zeros(n, dtype)
        self.weights = np.ones(n, dtype)
        self.indices = np.zeros(n, np.int64)


class ReplayBuffer:
    """Ring buffer of compact transitions; optional proportional prioritization."""

    FIELDS = ("states", "actions", "rewards", "next_states", "dones", "nsteps")

    def __init__(self, capacity: int, n_stickers: int, gamma: float, prioritized=False,
                 alpha=0.6, eps=1e-3):
        if capacity <= 0:
            raise ValueError("buffer_size must be positive")
        self.capacity, self.n_stickers, self.gamma = capacity, n_stickers, gamma
        self.states = np.zeros((capacity, n_stickers), np.uint8)
        self.next_states = np.zeros((capacity, n_stickers), np.uint8)
        self.actions = np.zeros(capacity, np.uint8)
        self.rewards = np.zeros(capacity, np.float32)
        self.dones = np.zeros(capacity, np.uint8)
        self.nsteps = np.zeros(capacity, np.uint8)
        self.pos = 0
        self.size = 0
        self.prioritized, self.alpha, self.eps = prioritized, alpha, eps
        self.cap2 = 1 << max(0, (capacity - 1).bit_length())
        self.tree = np.zeros(2 * self.cap2 if prioritized else 0, np.float64)
        self.max_priority = 1.0
        self._new_idx = np.zeros(0, np.int64)

    @property
    def nbytes_per_transition(self):
        return sum(getattr(self, f)[0:1].nbytes for f in self.FIELDS)

    @property
    def nbytes(self):
        return sum(getattr(self, f).nbytes for f in self.FIELDS) + self.tree.nbytes

    def add(self, states, actions, rewards, next_states, dones, nsteps, count=None):
        """Add the first `count` rows of the given arrays (one Numba call, wraps around)."""
        count = len(actions) if count is None else count
        if count == 0:
            return
        if count > self.capacity:
            raise ValueError("cannot add more transitions at once than the buffer holds")
        _ring_add(states, actions, rewards, next_states, dones, nsteps, self.states, self.actions,
                  self.rewards, self.next_states, self.dones, self.nsteps, self.pos, count)
        if self.prioritized:
            if self._new_idx.shape[0] < count:
                self._new_idx = np.zeros(count, np.int64)
                self._new_pri = np.zeros(count, np.float64)
            idx = self._new_idx[:count]
            idx[:] = (self.pos + np.arange(count)) % self.capacity
            self._new_pri[:count] = self.max_priority ** self.alpha
            tree_set(self.tree, self.cap2, idx, self._new_pri[:count])
        self.pos = (self.pos + count) % self.capacity
        self.size = min(self.size + count, self.capacity)

    def sample(self, rng: np.random.Generator, batch: Batch, beta: float = 0.4):
        if self.size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        if self.prioritized:
            _prioritized_indices(rng, self.tree, self.cap2, self.size, beta, batch.indices, batch.weights)
        else:
            _uniform_indices(rng, self.size, batch.indices)
        _gather(batch.indices, self.states, self.actions, self.rewards, self.next_states, self.dones,
                self.nsteps, batch.discounts.dtype.type(self.gamma), batch.states, batch.actions,
                batch.rewards, batch.next_states, batch.dones, batch.discounts)
        return batch

    def update_priorities(self, indices, td_errors):
        """Priority of each sampled transition becomes (|td| + eps)^alpha."""
        pri = np.abs(td_errors).astype(np.float64) + self.eps
        self.max_priority = max(self.max_priority, float(pri.max()))
        tree_set(self.tree, self.cap2, indices, pri ** self.alpha)

    # -- persistence --------------------------------------------------------------------
    def arrays(self):
        out = {f"replay_{f}": getattr(self, f)[:self.size] for f in self.FIELDS}
        out["replay_meta"] = np.array([self.pos, self.size, self.capacity], np.int64)
        if self.prioritized:
            out["replay_tree"] = self.tree
            out["replay_max_priority"] = np.array([self.max_priority])
        return out

    def load_arrays(self, data):
        pos, size, cap = (int(v) for v in data["replay_meta"])
        if cap != self.capacity:
            raise ValueError(f"saved replay buffer holds {cap} transitions, config says {self.capacity}")
        for f in self.FIELDS:
            src = data[f"replay_{f}"]
            if src.shape[1:] != getattr(self, f).shape[1:] or len(src) != size:
                raise ValueError(f"saved replay field '{f}' has shape {src.shape}")
            getattr(self, f)[:size] = src
        self.pos, self.size = pos, size
        if self.prioritized:
            if "replay_tree" not in data:
                raise ValueError("saved replay buffer has no priorities but prioritized replay is on")
            self.tree[:] = data["replay_tree"]
            self.max_priority = float(data["replay_max_priority"][0])

    def save(self, path):
        from .checkpoint import atomic_savez
        atomic_savez(path, self.arrays())

    def load(self, path):
        with np.load(path, allow_pickle=False) as data:
            self.load_arrays(data)
