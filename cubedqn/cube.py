"""Cube models: 2x2x2 and 3x3x3 sticker states, moves, notation, facelets, cubies.

What this file is: the single source of truth for cube geometry. Every sticker has a
3-D position and an outward normal; face turns and whole-cube rotations are derived
from rotating those vectors, so no move table is typed in by hand. It also holds the
Numba kernels that act on batches of states (apply, scramble, solved check, encodings).

What it is not: search, learning or the oracle (see `oracle.py`).

Conventions (shared by everything downstream):
- A state is a uint8 array of sticker colours, length 24 (2x2x2) or 54 (3x3x3), in
  Kociemba's facelet order: faces U R F D L B, each read row by row on the unfolded net.
  Colour c is the face whose stickers carry it when solved: 0=U 1=R 2=F 3=D 4=L 5=B.
- A move is a sticker permutation P with new[j] = old[P[j]].
- Actions (fixed numbering): 0..11 are the quarter turns U U' D D' L L' R R' F F' B B'
  (the quarter-turn metric, QTM, uses these 12); 12..17 are U2 D2 L2 R2 F2 B2 (the
  half-turn metric, HTM, uses all 18). The inverse of a < 12 is a ^ 1; a half turn is
  its own inverse.
- Solved means every face is one colour. On the 2x2x2 that counts all 24 orientations
  of the solved cube as solved (it has no centres to fix an orientation).
"""

from __future__ import annotations

import itertools

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from numba import njit

from .rng import below

FACES = "URFDLB"
MOVE_NAMES = ("U", "U'", "D", "D'", "L", "L'", "R", "R'", "F", "F'", "B", "B'",
              "U2", "D2", "L2", "R2", "F2", "B2")
METRICS = {"qtm": 12, "htm": 18}
PUZZLES = {"cube2": 2, "cube3": 3}

# Outward normal, direction of increasing row, direction of increasing column, per face,
# as the face is seen from outside on Kociemba's unfolded net (x right, y up, z front).
_FACE_FRAMES = {
    "U": ((0, 1, 0), (0, 0, 1), (1, 0, 0)),
    "R": ((1, 0, 0), (0, -1, 0), (0, 0, -1)),
    "F": ((0, 0, 1), (0, -1, 0), (1, 0, 0)),
    "D": ((0, -1, 0), (0, 0, -1), (1, 0, 0)),
    "L": ((-1, 0, 0), (0, -1, 0), (0, 0, 1)),
    "B": ((0, 0, -1), (0, -1, 0), (-1, 0, 0)),
}

# Kociemba's cubie slot order.
CORNER_NAMES = ("URF", "UFL", "ULB", "UBR", "DFR", "DLF", "DBL", "DRB")
EDGE_NAMES = ("UR", "UF", "UL", "UB", "DR", "DF", "DL", "DB", "FR", "FL", "BL", "BR")


class CubeError(ValueError):
    """Bad cube input from a user (notation, facelets). The message is one line."""


def _vec(face):
    return np.array(_FACE_FRAMES[face][0], dtype=np.int64)


def _quarter_turn(axis):
    """The integer matrix R of a -90 degree turn about unit axis k (clockwise seen from +k):
    R v = -k x v + k (k . v)."""
    k = np.asarray(axis, dtype=np.int64)
    k_cross = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])  # k_cross @ v == k x v
    return -k_cross + np.outer(k, k)


def _sticker_geometry(n):
    """Positions (doubled cubie coordinates) and normals of all 6*n*n stickers."""
    pos, nrm = [], []
    for face in FACES:
        normal, drow, dcol = (np.array(v, dtype=np.int64) for v in _FACE_FRAMES[face])
        for r in range(n):
            for c in range(n):
                p = normal * (n - 1) + drow * (2 * r - (n - 1)) + dcol * (2 * c - (n - 1))
                pos.append(p)
                nrm.append(normal)
    return np.array(pos), np.array(nrm)


def _perm_from_rotation(pos, nrm, axis, moving):
    """Sticker permutation for turning the stickers where `moving` is true about axis."""
    index = {(tuple(p), tuple(q)): i for i, (p, q) in enumerate(zip(pos.tolist(), nrm.tolist()))}
    turn = _quarter_turn(axis)
    perm = np.arange(len(pos))
    for i, (p, q) in enumerate(zip((pos @ turn.T).tolist(), (nrm @ turn.T).tolist())):
        if moving[i]:
            perm[index[(tuple(p), tuple(q))]] = i  # sticker i moves to place j: new[j] = old[i]
    return perm


def compose(p, q):
    """Permutation for applying p, then q (both in new[j] = old[P[j]] form)."""
    return p[q]


@dataclass(frozen=True)
class Puzzle:
    """Geometry and tables of one puzzle. Obtain it with `get_puzzle`."""

    name: str
    n: int
    n_stickers: int
    moves: np.ndarray          # (18, n_stickers) uint8 sticker permutations, action order
    rotations: np.ndarray      # (24, n_stickers) uint8 whole-cube rotations; [0] is identity
    solved: np.ndarray         # (n_stickers,) uint8
    corner_facelets: np.ndarray  # (8, 3) facelet indices, U/D facelet first, then clockwise
    edge_facelets: np.ndarray    # (12, 2) reference facelet first; empty on the 2x2x2
    centre_facelets: np.ndarray  # (6,) on the 3x3x3; empty on the 2x2x2
    corner_colours: np.ndarray   # (8, 3) colours of each corner cubie in its home slot order
    edge_colours: np.ndarray     # (12, 2)
    corner_lookup: np.ndarray = field(repr=False)  # (216,) colour triple -> cubie id or -1

    @property
    def n_colours(self):
        return 6

    @property
    def onehot_dim(self):
        return self.n_stickers * 6

    def n_actions(self, metric):
        return METRICS[metric]


def _cubie_slots(n, pos, nrm):
    """Facelet indices of each corner and edge slot, ordered per Kociemba's conventions."""
    m = n - 1
    by_cubie = {}
    for i, (p, q) in enumerate(zip(pos, nrm)):
        cubie = tuple(p)  # a sticker sits at its cubie's (doubled) coordinates
        by_cubie.setdefault(cubie, []).append(i)

    def corner(name):
        sign = {"U": (1, 1), "D": (1, -1), "R": (0, 1), "L": (0, -1), "F": (2, 1), "B": (2, -1)}
        c = [0, 0, 0]
        for ch in name:
            ax, s = sign[ch]
            c[ax] = s * m
        return tuple(c)

    corners = []
    for name in CORNER_NAMES:
        stickers = by_cubie[corner(name)]
        ud = [i for i in stickers if nrm[i][1] != 0][0]
        rest = [i for i in stickers if i != ud]
        # Order the other two so that (ud, b, c) runs clockwise seen from outside:
        # for outward normals a, b, c that is (a x b) . c = -1.
        b, c = rest
        if int(np.cross(nrm[ud], nrm[b]) @ nrm[c]) != -1:
            b, c = c, b
        corners.append((ud, b, c))
    edges = []
    if n == 3:
        for name in EDGE_NAMES:
            stickers = by_cubie[corner(name)]
            if name[0] in "UD":
                ref = [i for i in stickers if nrm[i][1] != 0][0]
            else:
                ref = [i for i in stickers if nrm[i][2] != 0][0]
            other = [i for i in stickers if i != ref][0]
            edges.append((ref, other))
    return np.array(corners, dtype=np.int64), np.array(edges, dtype=np.int64).reshape(-1, 2)


@lru_cache(maxsize=None)
def get_puzzle(name: str) -> Puzzle:
    if name not in PUZZLES:
        raise CubeError(f"unknown puzzle '{name}' (expected one of: {', '.join(PUZZLES)})")
    n = PUZZLES[name]
    pos, nrm = _sticker_geometry(n)
    s = len(pos)
    quarter = []
    for face in "UDLRFB":
        axis = _vec(face)
        cw = _perm_from_rotation(pos, nrm, axis, pos @ axis >= n - 1)
        quarter.append(cw)
        quarter.append(compose(compose(cw, cw), cw))
    half = [compose(quarter[2 * f], quarter[2 * f]) for f in range(6)]
    moves = np.array(quarter + half, dtype=np.uint8)

    everything = np.ones(s, dtype=bool)
    whole_x = _perm_from_rotation(pos, nrm, np.array([1, 0, 0]), everything)
    whole_y = _perm_from_rotation(pos, nrm, np.array([0, 1, 0]), everything)
    ident = np.arange(s)
    rots = [ident]
    seen = {ident.tobytes()}
    frontier = [ident]
    while frontier:
        nxt = []
        for r in frontier:
            for g in (whole_x, whole_y):
                c = compose(r, g)
                if c.tobytes() not in seen:
                    seen.add(c.tobytes())
                    rots.append(c)
                    nxt.append(c)
        frontier = nxt
    assert len(rots) == 24
    solved = np.repeat(np.arange(6, dtype=np.uint8), n * n)
    corners, edges = _cubie_slots(n, pos, nrm)
    centres = np.array([f * 9 + 4 for f in range(6)], dtype=np.int64) if n == 3 else np.zeros(0, np.int64)
    corner_colours = solved[corners]
    edge_colours = solved[edges] if n == 3 else np.zeros((0, 2), np.uint8)
    lookup = np.full(216, -1, dtype=np.int64)
    for j, (a, b, c) in enumerate(corner_colours):
        lookup[a * 36 + b * 6 + c] = j
    p = Puzzle(name, n, s, moves, np.array(rots, dtype=np.uint8), solved, corners, edges,
               centres, corner_colours, edge_colours, lookup)
    for arr in (p.moves, p.rotations, p.solved, p.corner_facelets, p.edge_facelets,
                p.corner_colours, p.edge_colours, p.corner_lookup):
        arr.setflags(write=False)
    return p


@lru_cache(maxsize=None)
def symmetries(name: str):
    """The 48 symmetries of the cube (24 rotations x mirror) as (perm, colour_map, move_map).

    Conjugating a state by symmetry k: new = colour_map[k][state[perm[k]]], i.e. every
    sticker is carried to its image and every colour renamed to the face that face was
    carried to. The solved cube maps to itself and distances to it are preserved.
    move_map[k, a] is the move playing the role of move a in the conjugated cube:
    conj(s . a) == conj(s) . move_map[k, a] (mirrors turn clockwise into anticlockwise).
    [0] is the identity and [0:6] are the axis permutations, the symmetries that keep the
    DBL corner (the 2x2x2 canonical frame) in place; the other 42 follow.
    """
    puzzle = get_puzzle(name)
    n = puzzle.n
    pos, nrm = _sticker_geometry(n)
    index = {(tuple(p), tuple(q)): i for i, (p, q) in enumerate(zip(pos, nrm))}
    face_of = {tuple(_vec(f)): c for c, f in enumerate(FACES)}
    mats = []
    for axes in itertools.permutations(range(3)):
        for signs in itertools.product((1, -1), repeat=3):
            m = np.zeros((3, 3), np.int64)
            for r in range(3):
                m[r, axes[r]] = signs[r]
            mats.append(m)
    # identity first, then the other sign-free permutations, then the rest
    mats.sort(key=lambda m: (int((m < 0).any()), not np.array_equal(m, np.eye(3, dtype=np.int64))))
    moves = puzzle.moves.astype(np.int64)
    perms, cmaps, mmaps = [], [], []
    for m in mats:
        perm = np.zeros(len(pos), np.int64)
        for i, (p, q) in enumerate(zip((pos @ m.T).tolist(), (nrm @ m.T).tolist())):
            perm[index[(tuple(p), tuple(q))]] = i   # new[j] = old[perm[j]]
        cmap = np.array([face_of[tuple(m @ _vec(f))] for f in FACES], np.int64)
        # move b plays move a's role when perm[moves[b]] == moves[a][perm] (one such b each)
        role = {row.tobytes(): b for b, row in enumerate(perm[moves])}
        mmap = np.array([role[row.tobytes()] for row in moves[:, perm]], np.int64)
        perms.append(perm)
        cmaps.append(cmap)
        mmaps.append(mmap)
    out = (np.array(perms, np.int64), np.array(cmaps, np.uint8), np.array(mmaps, np.int64))
    for arr in out:
        arr.setflags(write=False)
    return out


@njit(cache=True, nogil=True)
def conjugate_states(states, perm, colour_map, out):
    """out[i] = colour_map[states[i][perm]]: every state seen through one symmetry."""
    n, s = states.shape
    for i in range(n):
        for j in range(s):
            out[i, j] = colour_map[states[i, perm[j]]]


def check_metric(metric: str) -> int:
    if metric not in METRICS:
        raise CubeError(f"unknown metric '{metric}' (expected qtm or htm)")
    return METRICS[metric]


def inverse_action(a: int) -> int:
    return a ^ 1 if a < 12 else a


# ---------------------------------------------------------------------------------------
# Notation

def parse_moves(text: str, metric: str = "htm") -> list[int]:
    """Parse Singmaster notation ("R U2 F'", any whitespace) into action numbers.

    In the quarter-turn metric a half turn X2 is expanded to two quarter turns X X.
    """
    n_actions = check_metric(metric)
    actions = []
    for pos, tok in enumerate(text.split(), start=1):
        norm = tok.replace("’", "'").replace("2'", "2")
        if norm not in MOVE_NAMES:
            raise CubeError(f"unknown move '{tok}' at position {pos} "
                            f"(expected a face U D L R F B followed by nothing, ' or 2)")
        a = MOVE_NAMES.index(norm)
        if a >= n_actions:
            q = 2 * (a - 12)
            actions += [q, q]
        else:
            actions.append(a)
    return actions


def format_moves(actions) -> str:
    return " ".join(MOVE_NAMES[int(a)] for a in actions)


def invert_moves(actions) -> list[int]:
    return [inverse_action(int(a)) for a in reversed(list(actions))]


def apply_moves(puzzle: Puzzle, state: np.ndarray, actions) -> np.ndarray:
    s = np.array(state, dtype=np.uint8, copy=True)
    for a in actions:
        s = s[puzzle.moves[int(a)]]
    return s


def is_solved(state: np.ndarray, n: int | None = None) -> bool:
    state = np.asarray(state)
    per_face = state.size // 6
    faces = state.reshape(6, per_face)
    return bool(np.all(faces == faces[:, :1]))


# ---------------------------------------------------------------------------------------
# Facelets and cubies

def to_facelets(state: np.ndarray) -> str:
    return "".join(FACES[int(c)] for c in state)


def corner_cubies(puzzle: Puzzle, state: np.ndarray):
    """(cp, co): which corner cubie sits in each slot and its twist. Raises CubeError."""
    cp = np.empty(8, dtype=np.int64)
    co = np.empty(8, dtype=np.int64)
    for i, fac in enumerate(puzzle.corner_facelets):
        cols = [int(state[f]) for f in fac]
        ud = [k for k, c in enumerate(cols) if c in (0, 3)]
        names = "".join(FACES[c] for c in cols)
        if len(ud) != 1:
            raise CubeError(f"no corner has colours {names} (corner slot {CORNER_NAMES[i]})")
        k = ud[0]
        a, b, c = cols[k], cols[(k + 1) % 3], cols[(k + 2) % 3]
        j = int(puzzle.corner_lookup[a * 36 + b * 6 + c])
        if j < 0:
            raise CubeError(f"no corner has colours {names} (corner slot {CORNER_NAMES[i]})")
        cp[i], co[i] = j, k
    dup = [CORNER_NAMES[j] for j in range(8) if np.count_nonzero(cp == j) > 1]
    if dup:
        raise CubeError(f"corner {dup[0]} appears more than once")
    return cp, co


def edge_cubies(puzzle: Puzzle, state: np.ndarray):
    """(ep, eo) of a 3x3x3 state: edge cubie in each slot and its flip. Raises CubeError."""
    table = {(int(a), int(b)): (j, 0) for j, (a, b) in enumerate(puzzle.edge_colours)}
    table.update({(int(b), int(a)): (j, 1) for j, (a, b) in enumerate(puzzle.edge_colours)})
    ep = np.empty(12, dtype=np.int64)
    eo = np.empty(12, dtype=np.int64)
    for i, (f0, f1) in enumerate(puzzle.edge_facelets):
        key = (int(state[f0]), int(state[f1]))
        if key not in table:
            raise CubeError(f"no edge has colours {FACES[key[0]]}{FACES[key[1]]} "
                            f"(edge slot {EDGE_NAMES[i]})")
        ep[i], eo[i] = table[key]
    dup = [EDGE_NAMES[j] for j in range(12) if np.count_nonzero(ep == j) > 1]
    if dup:
        raise CubeError(f"edge {dup[0]} appears more than once")
    return ep, eo


def permutation_parity(p) -> int:
    p = list(p)
    seen = [False] * len(p)
    parity = 0
    for i in range(len(p)):
        if not seen[i]:
            j, length = i, 0
            while not seen[j]:
                seen[j] = True
                j = p[j]
                length += 1
            parity ^= (length - 1) & 1
    return parity


def from_cubies(puzzle: Puzzle, cp, co, ep=None, eo=None) -> np.ndarray:
    """Sticker state from cubie permutation/orientation (inverse of corner/edge_cubies)."""
    s = puzzle.solved.copy()
    for i in range(8):
        for k in range(3):
            s[puzzle.corner_facelets[i][(k + co[i]) % 3]] = puzzle.corner_colours[cp[i]][k]
    if puzzle.n == 3 and ep is not None:
        for i in range(12):
            for k in range(2):
                s[puzzle.edge_facelets[i][(k + eo[i]) % 2]] = puzzle.edge_colours[ep[i]][k]
    return s


def from_facelets(puzzle: Puzzle, text: str) -> np.ndarray:
    """Parse and validate a facelet string; returns the uint8 state or raises CubeError."""
    text = "".join(text.split())
    s = puzzle.n_stickers
    if len(text) != s:
        raise CubeError(f"facelet string for {puzzle.name} must have {s} letters, got {len(text)}")
    bad = [(i, ch) for i, ch in enumerate(text) if ch not in FACES]
    if bad:
        i, ch = bad[0]
        raise CubeError(f"invalid letter '{ch}' at position {i + 1} (expected only U R F D L B)")
    state = np.array([FACES.index(ch) for ch in text], dtype=np.uint8)
    per = puzzle.n * puzzle.n
    for c in range(6):
        k = int(np.count_nonzero(state == c))
        if k != per:
            raise CubeError(f"colour {FACES[c]} appears {k} times, expected {per}")
    if puzzle.n == 3:
        for f, idx in enumerate(puzzle.centre_facelets):
            if state[idx] != f:
                raise CubeError(f"centre of face {FACES[f]} is {FACES[state[idx]]}, expected {FACES[f]}")
    cp, co = corner_cubies(puzzle, state)
    if int(co.sum()) % 3:
        raise CubeError(f"unsolvable: corner twist sums to {int(co.sum()) % 3} (mod 3); "
                        "a corner is twisted in place")
    if puzzle.n == 3:
        ep, eo = edge_cubies(puzzle, state)
        if int(eo.sum()) % 2:
            raise CubeError("unsolvable: edge flip is odd; an edge is flipped in place")
        if permutation_parity(cp) != permutation_parity(ep):
            raise CubeError("unsolvable: corner and edge permutation parities differ; "
                            "two pieces are swapped")
    return state


def ascii_net(state: np.ndarray) -> str:
    """The unfolded net (U above F, D below, the ring L F R B) as text."""
    n = int(round((len(state) // 6) ** 0.5))
    face = {f: [FACES[int(c)] for c in state[i * n * n:(i + 1) * n * n]] for i, f in enumerate(FACES)}

    def row(f, r):
        return " ".join(face[f][r * n:(r + 1) * n])

    pad = " " * (2 * n + 1)
    lines = [pad + row("U", r) for r in range(n)]
    lines += [" ".join(row(f, r) for f in "LFRB") for r in range(n)]
    lines += [pad + row("D", r) for r in range(n)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Batched Numba kernels. States are (N, S) uint8, C-contiguous.
# Rows are copied element by element, never as `a[i] = b[j]`: an array-to-array assignment
# makes Numba compile its shape-mismatch error path (string formatting), which cost several
# seconds of every cold start (measured with numba's compile events).

@njit(cache=True, nogil=True)
def apply_actions(states, actions, moves, out):
    """out[i] = states[i] after action actions[i]; states and out (N,S) must not alias."""
    n, s = states.shape
    for i in range(n):
        perm = moves[actions[i]]
        for j in range(s):
            out[i, j] = states[i, perm[j]]


@njit(cache=True, nogil=True)
def apply_actions_inplace(states, actions, moves, tmp):
    """states[i] <- states[i] after actions[i]; tmp is (S,) scratch. A negative action is a no-op."""
    n, s = states.shape
    for i in range(n):
        a = actions[i]
        if a < 0:
            continue
        perm = moves[a]
        for j in range(s):
            tmp[j] = states[i, perm[j]]
        for j in range(s):
            states[i, j] = tmp[j]


@njit(cache=True, nogil=True)
def expand_children(states, moves, n_actions, out):
    """out[i, a] = child of states[i] under action a; states (N,S), out (N,A,S)."""
    n, s = states.shape
    for i in range(n):
        for a in range(n_actions):
            perm = moves[a]
            for j in range(s):
                out[i, a, j] = states[i, perm[j]]


@njit(cache=True, nogil=True)
def inverse_of(a):
    if a < 12:
        return a ^ 1
    return a


@njit(cache=True, nogil=True)
def scramble_into(states, depths, moves, n_actions, rng, no_undo, record):
    """Apply depths[i] random actions to states[i] in place (rng: a cubedqn.rng state).

    With no_undo, an action never undoes the one before it. record (N, K) int8 receives
    the actions taken (K >= max depth, or K == 0 to record nothing); unused slots are -1.
    """
    n, s = states.shape
    tmp = np.empty(s, dtype=states.dtype)
    keep = record.shape[1] > 0
    if keep:
        record[:] = -1
    for i in range(n):
        scramble_row(states[i], depths[i], moves, n_actions, rng, no_undo, tmp, record[i], keep)


@njit(cache=True, nogil=True)
def scramble_row(row, depth, moves, n_actions, rng, no_undo, tmp, record_row, keep):
    """Apply `depth` random actions to one (S,) state in place; tmp is (S,) scratch."""
    s = row.shape[0]
    prev = np.int64(-1)  # not -1: numba would compile inverse_of for that literal too
    for t in range(depth):
        while True:
            a = below(rng, n_actions)
            if not no_undo or prev < 0 or a != inverse_of(prev):
                break
        perm = moves[a]
        for j in range(s):
            tmp[j] = row[perm[j]]
        for j in range(s):
            row[j] = tmp[j]
        if keep:
            record_row[t] = a
        prev = a


@njit(cache=True, nogil=True)
def solved_row(state):
    """Every face of one (S,) state is one colour."""
    per = state.shape[0] // 6
    for f in range(6):
        c = state[f * per]
        for k in range(1, per):
            if state[f * per + k] != c:
                return False
    return True


@njit(cache=True, nogil=True)
def solved_batch(states, out):
    """out[i] = every face of states[i] is one colour."""
    for i in range(states.shape[0]):
        out[i] = solved_row(states[i])


@njit(cache=True, nogil=True)
def encode_onehot(states, out):
    """Dense one-hot input: out (N, S*6) float, out[i, 6*j + c] = 1 where sticker j has colour c."""
    n, s = states.shape
    out[:] = 0
    for i in range(n):
        for j in range(s):
            out[i, 6 * j + states[i, j]] = 1


@njit(cache=True, nogil=True)
def encode_index(states, order, out):
    """Sparse index input: out (N, S) int32, out[i, k] = 6*j + colour of sticker j = order[k]
    (the same W1 rows as encode_onehot's ones, listed in the order sticker_order gives)."""
    n, s = states.shape
    identity = True
    for k in range(s):
        identity = identity and order[k] == k
    for i in range(n):
        if identity:  # the 2x2x2's: a loop LLVM vectorises (the listed one costs the 3x3x3's 512 rows 9 us)
            for k in range(s):
                out[i, k] = 6 * k + states[i, k]
        else:
            for k in range(s):
                j = order[k]
                out[i, k] = 6 * j + states[i, j]


def sticker_order(puzzle: Puzzle) -> np.ndarray:
    """The order encode_index lists stickers in: those no move moves first (the 3x3x3's
    centres), then the others, each in sticker order. The first columns are then the same
    in every row, and the sparse first layer adds their weights once per batch instead of
    once per row (nn._fold_constant_columns; 6 of the 3x3x3's 54)."""
    fixed = np.all(puzzle.moves == np.arange(puzzle.n_stickers)[None, :], axis=0)
    return np.concatenate([np.flatnonzero(fixed), np.flatnonzero(~fixed)]).astype(np.int64)


def solved_states(puzzle: Puzzle, n: int) -> np.ndarray:
    return np.repeat(puzzle.solved[None, :], n, axis=0)


def all_orientations_of_solved(puzzle: Puzzle) -> np.ndarray:
    return puzzle.solved[puzzle.rotations]
