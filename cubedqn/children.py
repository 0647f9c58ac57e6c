"""The children of a batch's 2x2x2 states, for all-actions targets: corner codes, solved flags.

What this file is: `ChildCodes`, which gives every representative child of a batch of
states (encoding.child_representatives: the moves whose children differ up to a rotation)
its corner codes in its own canonical frame, which are what the target network's input
(slot pairs or cubies) and the target cache's key are made from, and whether it is solved.
Finding a child's frame among 48 symmetries (encoding.choose_frame) was most of the `cube2`
preset's "encode" part: 247 us of a step's ~310 for its 768 children
(runs/perf24/encode_split.txt). The answer depends on the parent's position alone, and the
2x2x2 has only 77,802 positions up to the 48 symmetries (runs/perf24/count_positions.txt):
a minute of the preset samples 2.8 M parents, each position ~36 times
(runs/perf24/parent_recur.txt). So a table maps a parent position (its corner codes) to
its children's codes, one row per canonical action.

Why one row per canonical action is enough: encoding a parent s in frame f shows the
canonical image x, and the world action a on s is the action act_map[f, a] on x (encoding.py),
so the child s.a is x.act_map[f, a] seen through the same frame, and both have one code:
code(s.a) = table[x][act_map[f, a]], whichever frame brought s to x. A missing parent's
representative children are expanded and framed as before, and every canonical action's row
is filled from them (action a's child is its representative's, up to a rotation). The codes
never go stale: nothing here is invalidated by training (the target cache in learner.py keeps
values, which are). A solved child is one whose codes are the solved cube's: canonical frames
bring every rotation and mirror image of the solved cube to that one code (tested against
cube.solved_batch).

The table is 2-way set associative (a key maps to a set of two entries; a new key replaces
the one used less recently): with 65,536 sets (131,072 entries, 13.7 MB for 12 actions, the
pages touched as entries are) a minute of the preset's parents hit 91% of the time, against
85% for a direct-mapped table of as many entries and 95% for twice as many (parent_recur.txt).

What it is not: for sticker inputs (their rows need the child's stickers, not its codes) or
frames without rotations (a turned solved cube would not have the solved code): Learner
keeps expanding and framing every child there.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cube import expand_children

EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)  # no key: codes are 8 x 5 bits


@njit(cache=True, nogil=True, error_model="numpy")
def code_key(codes, i):
    """Row i of codes (n, 8), each < 32, packed into one number (exact for corner codes)."""
    k = np.uint64(0)
    for j in range(codes.shape[1]):
        k = (k << np.uint64(5)) | np.uint64(codes[i, j])
    return k


@njit(cache=True, nogil=True, error_model="numpy")
def key_slot(key, mask):
    """A table slot for key (Fibonacci hashing; mask = slots - 1, slots a power of two)."""
    return np.int64((key * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)) & mask


@njit(cache=True, nogil=True, error_model="numpy")
def take_rows(src, rows, n, out):
    """out[t] = src[rows[t]] for t < n."""
    for t in range(n):
        r = rows[t]
        for j in range(src.shape[1]):
            out[t, j] = src[r, j]


@njit(cache=True, nogil=True, error_model="numpy")
def rows_equal(rows, row, out):
    """out[i] = rows[i] equals row element by element."""
    for i in range(rows.shape[0]):
        same = True
        for j in range(rows.shape[1]):
            if rows[i, j] != row[j]:
                same = False
                break
        out[i] = same


@njit(cache=True, nogil=True, error_model="numpy")
def child_codes_lookup(parent_codes, frame, act_map, reps, table_key, table_codes, victim, kid_codes, missing):
    """kid_codes[i*R + r] = the codes of parent i's child under representative action reps[r]
    where the table holds parent i's position; lists the other parents in missing[:n].
    parent_codes (B, 8) and frame (B,) are the parents' (Encoder.encode); table_key (sets, 2),
    table_codes (sets, 2, A, 8): a row per canonical action. Returns n."""
    mask = table_key.shape[0] - 1
    n_rep = reps.shape[0]
    n_miss = 0
    for i in range(parent_codes.shape[0]):
        key = code_key(parent_codes, i)
        s = key_slot(key, mask)
        if table_key[s, 0] == key:
            w = 0
        elif table_key[s, 1] == key:
            w = 1
        else:
            missing[n_miss] = i
            n_miss += 1
            continue
        victim[s] = 1 - w  # the other entry goes first
        amap = act_map[frame[i]]
        for r in range(n_rep):
            c = amap[reps[r]]
            for j in range(kid_codes.shape[1]):
                kid_codes[i * n_rep + r, j] = table_codes[s, w, c, j]
    return n_miss


@njit(cache=True, nogil=True, error_model="numpy")
def child_codes_store(parent_codes, frame, act_map, rep_of, n_rep, missing, n_miss, new_codes, table_key,
                      table_codes, victim):
    """new_codes[t*R + r] holds the codes of parent missing[t]'s r-th representative child
    (just framed): they go into the table under the parent's key, one row per canonical
    action act_map[frame, a] from its representative rep_of[a]."""
    mask = table_key.shape[0] - 1
    for t in range(n_miss):
        i = missing[t]
        key = code_key(parent_codes, i)
        s = key_slot(key, mask)
        if table_key[s, 0] == key or table_key[s, 1] == key:
            continue  # the same position twice in one batch
        w = victim[s]
        table_key[s, w] = key
        victim[s] = 1 - w
        amap = act_map[frame[i]]
        for a in range(amap.shape[0]):
            c = amap[a]
            r = rep_of[a]
            for j in range(new_codes.shape[1]):
                table_codes[s, w, c, j] = new_codes[t * n_rep + r, j]


@njit(cache=True, nogil=True, error_model="numpy")
def child_codes_place(missing, n_miss, new_codes, n_rep, source, kid_codes):
    """kid_codes[i*K + k] = new_codes[t*R + source[k]] for parent i = missing[t] (K = len(source)):
    source is 0..R-1 for the representative children, rep_of for every action's child."""
    n_out = source.shape[0]
    for t in range(n_miss):
        i = missing[t]
        for k in range(n_out):
            r = source[k]
            for j in range(kid_codes.shape[1]):
                kid_codes[i * n_out + k, j] = new_codes[t * n_rep + r, j]


class ChildCodes:
    """Codes and solved flags of the representative children of up to `rows` states at a
    time, through the parent table (see the module docstring). Use where `applies(encoder)`."""

    def __init__(self, encoder, moves, rows, sets=1 << 16):
        if not self.applies(encoder):
            raise ValueError("child codes need a canonical 2x2x2 encoder with code inputs (pairs or cubies)")
        if sets & (sets - 1):
            raise ValueError(f"sets must be a power of two, got {sets}")
        self.encoder = encoder
        self.reps = np.ascontiguousarray(encoder.child_reps, np.int64)
        self.rep_of = np.ascontiguousarray(encoder.child_rep_of, np.int64)
        self.reps_index = np.arange(len(self.reps), dtype=np.int64)
        self.all_actions = np.arange(encoder.n_actions, dtype=np.int64)
        self.n_rep = n_rep = len(self.reps)
        self.rep_moves = np.ascontiguousarray(moves[encoder.child_reps])
        # read-only like the puzzle's moves that search passes to expand_children: a writeable
        # array is another numba type, and the kernel was compiled twice in a cold start
        self.rep_moves.setflags(write=False)
        n_s = moves.shape[1]
        self.table_key = np.full((sets, 2), EMPTY, np.uint64)
        self.victim = np.zeros(sets, np.uint8)
        self.table_codes = np.zeros((sets, 2, encoder.n_actions, 8), np.uint8)
        self.codes = np.zeros((rows * n_rep, 8), np.int64)
        self.solved = np.zeros(rows * n_rep, np.bool_)
        self.missing = np.zeros(rows, np.int64)
        self.miss_states = np.zeros((rows, n_s), np.uint8)
        self.children = np.zeros((rows, n_rep, n_s), np.uint8)
        self.miss_codes = np.zeros((rows * n_rep, 8), np.int64)
        self.miss_frames = np.zeros(rows * n_rep, np.int64)
        self._solved_code = None  # made at the first call (see solved_code)
        self.all_codes = None  # every_child's output, made on its first call
        self.lookups = self.hits = 0  # parents looked up, and found, so far

    @staticmethod
    def applies(encoder) -> bool:
        return bool(encoder.canonical and encoder.framed and encoder.inputs != "stickers")

    @property
    def solved_code(self):
        """The solved cube's (8,) corner codes, made when first needed, not when the cache is
        built: a cold start compiles the framing kernel then, in one process only (see
        precompile.py)."""
        if self._solved_code is None:
            code = np.zeros((1, 8), np.int64)
            # a writable copy: the puzzle's read-only solved state gave the framing kernels a
            # signature of their own (a second or more of a cold start)
            self.encoder.frames(np.array(self.encoder.puzzle.solved[None], order="C"), np.zeros(1, np.int64), code)
            self._solved_code = code[0].copy()
        return self._solved_code

    def compute(self, states, parent_codes, frame):
        """(codes (n*R, 8), solved (n*R,)) of the representative children of states (n, S),
        whose codes and frames Encoder.encode gave; views of this object's buffers, valid
        until the next call."""
        n, r = len(states), self.n_rep
        codes = self._look_up(states, parent_codes, frame, self.reps, self.codes)
        rows_equal(codes, self.solved_code, self.solved[:n * r])
        return codes, self.solved[:n * r]

    def every_child(self, states, parent_codes, frame):
        """(n*A, 8) codes of the children of states (n, S) under every action 0..A-1 (row
        i*A + a: state i's child under world action a): what Encoder.position_keys gives
        those children. For search, which compares every child (a view, valid until the next
        call)."""
        if self.all_codes is None:
            self.all_codes = np.zeros((len(self.missing) * self.encoder.n_actions, 8), np.int64)
        return self._look_up(states, parent_codes, frame, self.all_actions, self.all_codes)

    def _look_up(self, states, parent_codes, frame, actions, out):
        """out[i*K + k] = the codes of state i's child under world action actions[k] (K = len(actions),
        each a representative or every action); parents not in the table are expanded,
        framed and stored."""
        n, r = len(states), self.n_rep
        n_miss = child_codes_lookup(parent_codes, frame, self.encoder.act_map, actions, self.table_key,
                                    self.table_codes, self.victim, out, self.missing)
        if n_miss:
            take_rows(states, self.missing, n_miss, self.miss_states)
            expand_children(self.miss_states[:n_miss], self.rep_moves, r, self.children[:n_miss])
            self.encoder.frames(self.children[:n_miss].reshape(n_miss * r, -1), self.miss_frames[:n_miss * r],
                                self.miss_codes[:n_miss * r])
            child_codes_store(parent_codes, frame, self.encoder.act_map, self.rep_of, r, self.missing, n_miss,
                              self.miss_codes, self.table_key, self.table_codes, self.victim)
            # a representative child's row is its own; any action's child is its representative's
            source = self.reps_index if actions is self.reps else self.rep_of
            child_codes_place(self.missing, n_miss, self.miss_codes, r, source, out)
        self.lookups += n
        self.hits += n - n_miss
        return out[:n * len(actions)]

    @property
    def hit_rate(self):
        """Share of the parents looked up so far whose children came from the table."""
        return self.hits / max(self.lookups, 1)

    @property
    def nbytes(self):
        return self.table_key.nbytes + self.victim.nbytes + self.table_codes.nbytes
