"""Network input encoding, with optional orientation canonicalisation for the 2x2x2.

What this file is: the step between cube states and the network. Without
canonicalisation a state is encoded as is (`cube.encode_index` / `encode_onehot`).

With it (the 2x2x2 default), each state is first turned as a whole so that the DBL corner
cubie sits home with its D sticker down (the same normal form the oracle uses). The 2x2x2
has no centres, so the 24 orientations of one position are 24 different sticker arrays;
canonicalising lets the network see 3,674,160 positions instead of 88,179,840 sticker
states. Actions are relabelled through the rotation: if s' = s[R] then move a on s is
move act_map[r, a] on s' (M_a[R] == R[M_a'] as permutations), so
Q(s, a) = Q_canonical(s', act_map[r, a]). Values are rotation invariant; only the action
axis needs the relabelling. On the 3x3x3 centres fix the orientation and this is a no-op.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cube import encode_index, encode_onehot


@njit(cache=True)
def find_rotations(states, rotations, fac, colours, rot_out):
    """rot_out[i] = index of the rotation that brings the DBL cubie home (0 if none does)."""
    for i in range(states.shape[0]):
        rot_out[i] = 0
        for r in range(rotations.shape[0]):
            rot = rotations[r]
            if (states[i, rot[fac[0]]] == colours[0] and states[i, rot[fac[1]]] == colours[1]
                    and states[i, rot[fac[2]]] == colours[2]):
                rot_out[i] = r
                break


@njit(cache=True)
def encode_index_rotated(states, rotations, rot, out):
    """out[i, j] = 6*j + colour of sticker j of states[i] turned by rotation rot[i]."""
    n, s = states.shape
    for i in range(n):
        perm = rotations[rot[i]]
        for j in range(s):
            out[i, j] = 6 * j + states[i, perm[j]]


@njit(cache=True)
def encode_onehot_rotated(states, rotations, rot, out):
    n, s = states.shape
    out[:] = 0
    for i in range(n):
        perm = rotations[rot[i]]
        for j in range(s):
            out[i, 6 * j + states[i, perm[j]]] = 1


@njit(cache=True)
def encode_cubies_rotated(states, rotations, rot, corner_facelets, corner_lookup, out):
    """out[i, k] = 24*k + 3*cubie + twist of corner slot k of states[i] turned by rot[i].

    The cubie-level input: which corner cubie sits in each slot and how it is twisted,
    one active input per slot (8 of 192), instead of three sticker colours per corner.
    """
    n = states.shape[0]
    for i in range(n):
        perm = rotations[rot[i]]
        for k in range(corner_facelets.shape[0]):
            c0 = states[i, perm[corner_facelets[k, 0]]]
            c1 = states[i, perm[corner_facelets[k, 1]]]
            c2 = states[i, perm[corner_facelets[k, 2]]]
            if c0 == 0 or c0 == 3:
                t, key = 0, c0 * 36 + c1 * 6 + c2
            elif c1 == 0 or c1 == 3:
                t, key = 1, c1 * 36 + c2 * 6 + c0
            else:
                t, key = 2, c2 * 36 + c0 * 6 + c1
            cubie = corner_lookup[key]
            out[i, k] = 24 * k + 3 * (cubie if cubie >= 0 else 0) + t


@njit(cache=True)
def q_to_world(qc, rot, act_map, out):
    """out[i, a] = qc[i, act_map[rot[i], a]]: canonical-frame Q-values to the state's own frame."""
    n, a_n = out.shape
    for i in range(n):
        m = act_map[rot[i]]
        for a in range(a_n):
            out[i, a] = qc[i, m[a]]


@njit(cache=True)
def actions_to_canonical(actions, rot, act_map, out):
    for i in range(actions.shape[0]):
        out[i] = act_map[rot[i], actions[i]]


@njit(cache=True)
def rows_to_canonical(y, rot, act_map, out):
    """out[i, act_map[rot[i], a]] = y[i, a] (a per-action target vector into the canonical frame)."""
    n, a_n = y.shape
    for i in range(n):
        m = act_map[rot[i]]
        for a in range(a_n):
            out[i, m[a]] = y[i, a]


def action_map(puzzle, n_actions) -> np.ndarray:
    """act_map[r, a]: the move on the rotated cube that corresponds to move a on the original."""
    moves = puzzle.moves.astype(np.int64)
    rots = puzzle.rotations.astype(np.int64)
    out = np.zeros((len(rots), n_actions), np.int64)
    for r, R in enumerate(rots):
        for a in range(n_actions):
            lhs = moves[a][R]
            hits = [b for b in range(n_actions) if np.array_equal(lhs, R[moves[b]])]
            assert len(hits) == 1
            out[r, a] = hits[0]
    return out


def child_representatives(puzzle, n_actions, trials=8):
    """(reps, rep_of): actions whose children are distinct up to whole-cube rotation.

    On the 2x2x2, D is U followed by a whole-cube rotation (likewise D' ~ U', L ~ R, B ~ F,
    and the half turns in pairs), so a state's 12 quarter-turn children are 6 positions.
    rep_of[a] is the index into reps of the representative of action a. Found by
    comparing canonical children on random states, then used as exact identities.
    """
    rng = np.random.default_rng(0)
    rots = puzzle.rotations.astype(np.int64)
    moves = puzzle.moves.astype(np.int64)
    fac, col = puzzle.corner_facelets[6], puzzle.corner_colours[6]

    def canon(state):
        for R in rots:
            if np.array_equal(state[R][fac], col):
                return state[R].tobytes()
        raise AssertionError("no rotation homes the DBL corner")

    states = [puzzle.solved.copy() for _ in range(trials)]
    for k in range(trials):
        for a in rng.integers(0, 18, 25):
            states[k] = states[k][moves[a]]
    keys = [tuple(canon(s[moves[a]]) for s in states) for a in range(n_actions)]
    reps, rep_of = [], np.zeros(n_actions, np.int64)
    for a in range(n_actions):
        for r, b in enumerate(reps):
            if keys[b] == keys[a]:
                rep_of[a] = r
                break
        else:
            rep_of[a] = len(reps)
            reps.append(a)
    return np.array(reps, np.int64), rep_of


ENCODINGS = ("stickers", "cubies")


class Encoder:
    """Encodes states for a network, canonicalising 2x2x2 orientation when enabled.

    inputs="stickers": 6*sticker + colour per sticker (the 144-d / 324-d one-hot).
    inputs="cubies" (2x2x2, sparse only): 24*slot + 3*cubie + twist per corner slot.
    `in_dim` and `n_active` give the network's first-layer shape.
    """

    def __init__(self, puzzle, n_actions, canonical=True, sparse=True, inputs="stickers"):
        if inputs not in ENCODINGS:
            raise ValueError(f"unknown input encoding '{inputs}' (expected stickers or cubies)")
        if inputs == "cubies" and (puzzle.n != 2 or not sparse):
            raise ValueError("input_encoding = cubies is implemented for cube2 with the sparse first layer")
        self.puzzle, self.n_actions, self.sparse, self.inputs = puzzle, n_actions, sparse, inputs
        self.canonical = bool(canonical and puzzle.n == 2)
        self.in_dim, self.n_active = (192, 8) if inputs == "cubies" else (puzzle.n_stickers * 6, puzzle.n_stickers)
        self.corner_facelets = np.ascontiguousarray(puzzle.corner_facelets)
        self.corner_lookup = np.ascontiguousarray(puzzle.corner_lookup)
        self.rotations = np.ascontiguousarray(puzzle.rotations)
        self.fac = np.ascontiguousarray(puzzle.corner_facelets[6])  # DBL slot
        self.colours = np.ascontiguousarray(puzzle.corner_colours[6])
        self.act_map = action_map(puzzle, n_actions) if self.canonical else \
            np.tile(np.arange(n_actions), (1, 1))
        # children worth scoring in all-actions targets (all of them unless canonical)
        self.child_reps, self.child_rep_of = child_representatives(puzzle, n_actions) if self.canonical \
            else (np.arange(n_actions), np.arange(n_actions))

    def encode(self, states, ws, row0=0, rot=None):
        """Write the input rows [row0, row0+n) of workspace ws; fills rot (n,) if canonical."""
        n = len(states)
        if self.inputs == "cubies":
            if self.canonical:
                find_rotations(states, self.rotations, self.fac, self.colours, rot)
            else:
                rot[:] = 0
            encode_cubies_rotated(states, self.rotations, rot, self.corner_facelets, self.corner_lookup,
                                  ws.idx[row0:row0 + n])
            return
        if not self.canonical:
            if self.sparse:
                encode_index(states, ws.idx[row0:row0 + n])
            else:
                encode_onehot(states, ws.x[row0:row0 + n])
            return
        find_rotations(states, self.rotations, self.fac, self.colours, rot)
        if self.sparse:
            encode_index_rotated(states, self.rotations, rot, ws.idx[row0:row0 + n])
        else:
            encode_onehot_rotated(states, self.rotations, rot, ws.x[row0:row0 + n])


class Policy:
    """A network plus its encoder: Q-values of states in their own frame (for acting and search)."""

    def __init__(self, net, encoder: Encoder, chunk=4096):
        self.net, self.encoder, self.chunk = net, encoder, chunk
        self._ws = {}

    def q_values(self, states) -> np.ndarray:
        states = np.ascontiguousarray(np.atleast_2d(states), dtype=np.uint8)
        n = len(states)
        out = np.empty((n, self.net.layout.n_actions), self.net.dtype)
        rows = min(self.chunk, max(n, 1))
        if rows not in self._ws:
            self._ws[rows] = (self.net.workspace(rows), np.zeros(rows, np.int64))
        ws, rot = self._ws[rows]
        for start in range(0, n, rows):
            part = states[start:start + rows]
            k = len(part)
            self.encoder.encode(part, ws, 0, rot[:k])
            qc = self.net.forward_ws(ws, k)
            if self.encoder.canonical:
                q_to_world(qc, rot[:k], self.encoder.act_map, out[start:start + k])
            else:
                out[start:start + k] = qc
        return out
