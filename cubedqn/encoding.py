"""Network input encoding, with optional orientation and symmetry canonicalisation (2x2x2).

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

With symmetry reduction (input_symmetry 6 or 48) the canonical state is further replaced
by the smallest of its images under the cube's symmetries (`cube.symmetries`), so
3,674,160 / 48 ~ 77 k classes remain; a frame index then stands for (rotation, symmetric
view) and act_map relabels actions through both (see `choose_frame`).
"""

from __future__ import annotations

import copy

import numpy as np
from numba import carray, cfunc, njit, types

from .blas import local_slots, range_fn, run_range, share_range_fn, voidptr_at
from .children import ChildCodes
from .cube import conjugate_states, encode_index, encode_onehot, sticker_order, symmetries
from .team import RANGE_MIN


@njit(cache=True, nogil=True)
def find_rotations(states, home_facelets, colours, rot_out):
    """rot_out[i] = index of the first rotation that brings the DBL cubie home (0 if none
    does). home_facelets (R, 3): the facelets rotation r moves into the DBL slot (a flat
    table, rotations[r][fac], so each test is one load: 2.3 against 13.5 us for 64 states
    when read through each rotation's permutation, one-off, same results)."""
    c0, c1, c2 = colours[0], colours[1], colours[2]
    for i in range(states.shape[0]):
        st = states[i]
        rot_out[i] = 0
        for r in range(home_facelets.shape[0]):
            if st[home_facelets[r, 0]] == c0 and st[home_facelets[r, 1]] == c1 and st[home_facelets[r, 2]] == c2:
                rot_out[i] = r
                break


# Framing over the GEMM team (--threads 2 and up): find_rotations and choose_frame on chunks
# of whole states, shared by the team's threads through blas.run_range (each state is
# framed alone, by the same code whichever thread takes it: the same frames and codes).
# About 1 us a state: with the first layer's gather, most of what the cube2 preset's
# two-thread step ran on one core (docs/performance-log.md, stop 37). The chunk
# function reads the encoder's tables from a context the Encoder fills once (FRAME_TABLES:
# each table's address and up to three dimensions in TABLE_STRIDE slots, then the ints).
FRAME_SLOT = 2  # its slot in blas's range-function table
F_STATES, F_ROWS, F_WIDTH, F_FRAME, F_CODES, F_TABLES = range(6)  # a call's context slots
F_LEN = 6
FRAME_UNIT = 1024  # a state's work in units (RANGE_MIN of them: 32 states)
FRAME_TABLES = ("home_facelets", "colours", "search_rotations", "_identity_cmap", "corner_facelets",
                "corner_lookup", "xcubie", "rot_of", "view_src", "view_code", "k_src", "k_code")
(T_HOME, T_COLOURS, T_ROTATIONS, T_CMAP, T_FACELETS, T_LOOKUP, T_XCUBIE, T_ROT_OF, T_VIEW_SRC, T_VIEW_CODE,
 T_K_SRC, T_K_CODE) = range(len(FRAME_TABLES))
TABLE_STRIDE = 4
T_N_VIEW, T_N_RR, T_N_SYM = (len(FRAME_TABLES) * TABLE_STRIDE + k for k in range(3))
T_LEN = len(FRAME_TABLES) * TABLE_STRIDE + 3


def frame_chunk(ctx, lo, hi):
    """find_rotations and choose_frame on states [lo / FRAME_UNIT, hi / FRAME_UNIT) of the
    context's (uint8 states, int64 frames and codes), with the encoder's tables."""
    c = carray(ctx, F_LEN, np.int64)
    t = carray(voidptr_at(c[F_TABLES]), T_LEN, np.int64)
    n, r0, r1 = c[F_ROWS], lo // FRAME_UNIT, hi // FRAME_UNIT
    states = carray(voidptr_at(c[F_STATES]), (n, c[F_WIDTH]), np.uint8)[r0:r1]
    frame = carray(voidptr_at(c[F_FRAME]), n, np.int64)[r0:r1]
    codes = carray(voidptr_at(c[F_CODES]), (n, 8), np.int64)[r0:r1]
    a = TABLE_STRIDE
    home = carray(voidptr_at(t[T_HOME * a]), (t[T_HOME * a + 1], t[T_HOME * a + 2]), np.uint8)
    colours = carray(voidptr_at(t[T_COLOURS * a]), t[T_COLOURS * a + 1], np.uint8)
    rotations = carray(voidptr_at(t[T_ROTATIONS * a]), (t[T_ROTATIONS * a + 1], t[T_ROTATIONS * a + 2]), np.uint8)
    cmap = carray(voidptr_at(t[T_CMAP * a]), t[T_CMAP * a + 1], np.uint8)
    facelets = carray(voidptr_at(t[T_FACELETS * a]), (t[T_FACELETS * a + 1], t[T_FACELETS * a + 2]), np.int64)
    lookup = carray(voidptr_at(t[T_LOOKUP * a]), t[T_LOOKUP * a + 1], np.int64)
    xcubie = carray(voidptr_at(t[T_XCUBIE * a]), t[T_XCUBIE * a + 1], np.int64)
    rot_of = carray(voidptr_at(t[T_ROT_OF * a]), (t[T_ROT_OF * a + 1], t[T_ROT_OF * a + 2]), np.int64)
    view_src = carray(voidptr_at(t[T_VIEW_SRC * a]), (t[T_VIEW_SRC * a + 1], t[T_VIEW_SRC * a + 2]), np.uint8)
    view_code = carray(voidptr_at(t[T_VIEW_CODE * a]),
                       (t[T_VIEW_CODE * a + 1], t[T_VIEW_CODE * a + 2], t[T_VIEW_CODE * a + 3]), np.uint8)
    k_src = carray(voidptr_at(t[T_K_SRC * a]), (t[T_K_SRC * a + 1], t[T_K_SRC * a + 2]), np.uint8)
    k_code = carray(voidptr_at(t[T_K_CODE * a]), (t[T_K_CODE * a + 1], t[T_K_CODE * a + 2], t[T_K_CODE * a + 3]),
                    np.uint8)
    scratch = carray(local_slots(24), 24, np.int64)  # base, where, y: this chunk's own
    find_rotations(states, home, colours, frame)
    choose_frame(states, rotations, cmap, facelets, lookup, t[T_N_VIEW], xcubie, rot_of, view_src, view_code, k_src,
                 k_code, t[T_N_RR], t[T_N_SYM], scratch[0:8], scratch[8:16], scratch[16:24], codes, frame)


def _frame_chunk_address():
    return cfunc(types.void(types.voidptr, types.int64, types.int64), cache=True, nogil=True)(frame_chunk).address


@njit(cache=True, nogil=True)
def frame_states(states, home_facelets, colours, rotations, identity_cmap, corner_facelets, corner_lookup, n_view,
                 xcubie, rot_of, view_src, view_code, k_src, k_code, n_rr, n_sym, base, where, y, codes, frame,
                 tables):
    """find_rotations then choose_frame (Encoder.frames), the states shared by the team's
    threads where it runs and there are enough of them (tables: the Encoder's
    FRAME_TABLES context; the chunks use their own scratch instead of base, where, y)."""
    n, w = states.shape
    fn = range_fn(np.int64(FRAME_SLOT))
    whole = (states.strides[1] == 1 and states.strides[0] == w and frame.strides[0] == 8 and
             codes.strides[1] == 8 and codes.strides[0] == 64)  # C order: the context's pointers
    if fn == 0 or n * FRAME_UNIT < RANGE_MIN or not whole:
        find_rotations(states, home_facelets, colours, frame)
        choose_frame(states, rotations, identity_cmap, corner_facelets, corner_lookup, n_view, xcubie, rot_of,
                     view_src, view_code, k_src, k_code, n_rr, n_sym, base, where, y, codes, frame)
        return
    ctx = local_slots(F_LEN)
    c = carray(ctx, F_LEN, np.int64)
    c[F_STATES], c[F_ROWS], c[F_WIDTH] = states.ctypes.data, n, w
    c[F_FRAME], c[F_CODES], c[F_TABLES] = frame.ctypes.data, codes.ctypes.data, tables.ctypes.data
    run_range(voidptr_at(fn), ctx, n * FRAME_UNIT, FRAME_UNIT)


@njit(cache=True, nogil=True)
def corner_code(state, perm, cmap, fac, corner_lookup):
    """3*cubie + twist of the corner slot with facelets fac, the state seen through (perm, cmap)."""
    c0 = cmap[state[perm[fac[0]]]]
    c1 = cmap[state[perm[fac[1]]]]
    c2 = cmap[state[perm[fac[2]]]]
    if c0 == 0 or c0 == 3:
        t, key = 0, c0 * 36 + c1 * 6 + c2
    elif c1 == 0 or c1 == 3:
        t, key = 1, c1 * 36 + c2 * 6 + c0
    else:
        t, key = 2, c2 * 36 + c0 * 6 + c1
    cubie = corner_lookup[key]
    return 3 * (cubie if cubie >= 0 else 0) + t


@njit(cache=True, nogil=True)
def choose_frame(states, rotations, identity_cmap, corner_facelets, corner_lookup, n_view, xcubie, rot_of,
                 view_src, view_code, k_src, k_code, n_rr, n_sym, base, where, y, codes, frame):
    """frame[i] = r0 * n_view + v: the frame state i is encoded in; codes[i] = its 8 corner codes.

    On entry frame[i] holds r0 (find_rotations), the whole-cube rotation that brings the
    DBL cubie home: the canonical state x. With symmetry, v = (c*n_rr + rr)*n_sym + k
    picks one symmetric image of x: x conjugated by coset representative c, turned by the
    rotation rr that brings the new DBL cubie home, then conjugated by a symmetry k that
    keeps DBL home. A view moves each corner on its own, so each step is a table lookup
    per slot: y = view (c, rr, k=0) of x has in slot j the corner of x's slot
    src = view_src[c*n_rr + rr, j], with code view_code[c*n_rr + rr, src, base[src]];
    view k of y has in slot j the corner of y's slot s = k_src[k, j], with code
    k_code[k, s, y[s]]; rr is fixed by where cubie xcubie[c] sits (rot_of[c, 3*slot +
    twist]). The lexicographically smallest of the 6 or 48 images wins, the first on ties:
    each is first compared on its first two slots packed in one number (most lose there,
    on a branch that soon predicts well), the rest slot by slot. base, where, y (8,) are
    scratch. (The search once read one 221 KB table per whole view and compared every view
    slot by slot: 1.13x slower on the cube2 preset's states, with the same frames.)
    """
    n_slots = corner_facelets.shape[0]
    for i in range(states.shape[0]):
        st = states[i]
        r0 = frame[i]
        rot = rotations[r0]
        for j in range(n_slots):
            q = corner_code(st, rot, identity_cmap, corner_facelets[j], corner_lookup)
            base[j] = q
            where[q // 3] = 3 * j + q % 3
        best = codes[i]
        for j in range(n_slots):  # view 0 is x itself
            best[j] = base[j]
        best_v = 0
        best2 = base[0] * 32 + base[1]  # codes are < 24: the first two slots in one number
        for c in range(xcubie.shape[0] if n_view > 1 else 0):
            cr = c * n_rr + rot_of[c, where[xcubie[c]]]
            for j in range(n_slots):
                src = view_src[cr, j]
                y[j] = view_code[cr, src, base[src]]
            for k in range(n_sym):
                s0, s1 = k_src[k, 0], k_src[k, 1]
                key2 = k_code[k, s0, y[s0]] * 32 + k_code[k, s1, y[s1]]
                if key2 > best2:
                    continue
                j0 = 0 if key2 < best2 else 2  # smaller already, or compare the rest
                if j0 == 2:
                    for j in range(2, n_slots):
                        s = k_src[k, j]
                        val = k_code[k, s, y[s]]
                        if val != best[j]:
                            j0 = j if val < best[j] else n_slots
                            break
                    else:
                        j0 = n_slots  # equal: the first stays
                if j0 < n_slots:
                    best_v = cr * n_sym + k
                    best2 = key2
                    for j2 in range(j0, n_slots):
                        s = k_src[k, j2]
                        best[j2] = k_code[k, s, y[s]]
        frame[i] = r0 * n_view + best_v


def corner_codes(c, corner_lookup):
    """corner_code on arrays, in numpy: c (n, 3) the colours a corner slot shows at its three
    facelets (as corner_code reads them), (n,) 3*cubie + twist."""
    c0, c1, c2 = (c[:, k].astype(np.int64) for k in range(3))
    first = (c0 == 0) | (c0 == 3)
    second = ~first & ((c1 == 0) | (c1 == 3))
    key = np.where(first, c0 * 36 + c1 * 6 + c2, np.where(second, c1 * 36 + c2 * 6 + c0, c2 * 36 + c0 * 6 + c1))
    twist = np.where(first, 0, np.where(second, 1, 2))
    cubie = corner_lookup[key]
    return 3 * np.where(cubie >= 0, cubie, 0) + twist


def corner_tables(view_perm, view_cmap, corner_facelets, corner_colours, corner_lookup, slot_of_facelet,
                  slot_map, code_map):
    """For every view v (view = cmap_v[x[perm_v]]): where each corner of x goes, and its code there.

    Each (slot j, cubie, twist) is placed alone into a blank sticker array: a view moves
    the stickers of one corner together, so one corner is all it takes. In numpy, over all
    views at once (once per encoder; as a Numba kernel its compile was 1.5 s of a cold start)."""
    n_v, s = view_perm.shape
    n_c = corner_colours.shape[0]
    views = np.arange(n_v)[:, None]
    inv = np.empty_like(view_perm)
    inv[views, view_perm] = np.arange(s)
    turns = (np.arange(3)[:, None] + np.arange(3)[None]) % 3  # twist t puts colour k at facelet (t + k) % 3
    for j in range(corner_facelets.shape[0]):
        fj = corner_facelets[j]
        j2 = slot_of_facelet[inv[:, fj[0]]]
        slot_map[:, j] = j2
        seen = np.take_along_axis(view_perm, corner_facelets[j2], axis=1)  # (n_v, 3) what each view reads
        x = np.zeros((n_c, 3, s), np.uint8)  # cube (cubie, t): that cubie alone in slot j, twisted t
        x[:, np.arange(3)[:, None], fj[turns]] = corner_colours[:, None, :]
        shown = view_cmap[views, x.reshape(3 * n_c, s)[:, seen]]  # (3 * n_c, n_v, 3)
        code_map[:, j, :] = corner_codes(shown.reshape(-1, 3), corner_lookup).reshape(3 * n_c, n_v).T


def coset_representatives(sym_perm, sym_cmap):
    """8 symmetries g, one per coset S.g of the DBL stabiliser S = symmetries [0:6]."""
    key = lambda p, c: (p.tobytes(), c.tobytes())  # noqa: E731
    covered, reps = set(), []
    for g in range(len(sym_perm)):
        if key(sym_perm[g], sym_cmap[g]) in covered:
            continue
        reps.append(g)
        for k in range(6):  # conj_k(conj_g(x)): perm P_g[P_k], colours c_k[c_g]
            covered.add(key(sym_perm[g][sym_perm[k]], sym_cmap[k][sym_cmap[g]]))
    assert len(reps) == 8 and len(covered) == 48
    return reps


@njit(cache=True, nogil=True)
def encode_index_framed(states, frame_perm, frame_cmap, frame, order, out):
    """out[i, k] = 6*j + colour of sticker j = order[k] of states[i] seen through frame[i]
    (framed_order: the DBL slot's stickers, the same in every frame, first)."""
    n, s = states.shape
    for i in range(n):
        perm, cmap = frame_perm[frame[i]], frame_cmap[frame[i]]
        for k in range(s):
            j = order[k]
            out[i, k] = 6 * j + cmap[states[i, perm[j]]]


@njit(cache=True, nogil=True)
def encode_onehot_framed(states, frame_perm, frame_cmap, frame, out):
    n, s = states.shape
    out[:] = 0
    for i in range(n):
        perm, cmap = frame_perm[frame[i]], frame_cmap[frame[i]]
        for j in range(s):
            out[i, 6 * j + cmap[states[i, perm[j]]]] = 1


@njit(cache=True, nogil=True)
def encode_rotated_or_plain(framed, sparse, states, home_facelets, colours, frame_perm, frame_cmap, order, rot, idx,
                            x):
    """The encodings that need no corner codes, as one kernel (Encoder.encode, and the
    learner's fused step): framed, each state turned by the first rotation that brings its
    DBL cubie home (rot gets the rotations), else the stickers as they are; the index
    columns listed in `order` (Encoder.sticker_order: framed_order, or cube.sticker_order);
    into idx (sparse) or x (dense one-hot)."""
    if framed:
        find_rotations(states, home_facelets, colours, rot)
        if sparse:
            encode_index_framed(states, frame_perm, frame_cmap, rot, order, idx)
        else:
            encode_onehot_framed(states, frame_perm, frame_cmap, rot, x)
    elif sparse:
        encode_index(states, order, idx)
    else:
        encode_onehot(states, x)


@njit(cache=True, nogil=True)
def encode_cubies_from_codes(codes, out):
    """out[i, k] = 24*k + codes[i, k]: which cubie sits in corner slot k and how it is twisted,
    one active input per slot (8 of 192), instead of three sticker colours per corner."""
    for i in range(codes.shape[0]):
        for k in range(codes.shape[1]):
            out[i, k] = 24 * k + codes[i, k]


@njit(cache=True, nogil=True)
def encode_pairs_from_codes(codes, out):
    """out[i, p] = 441*p + 21*v[k] + v[l] for the p-th pair (k < l) of the seven free slots.

    v[k] = codes[i, k] with the seven free cubies numbered 0..6 (canonical frame: the DBL
    cubie 6 never leaves slot 6, which is skipped, so cubie 7 becomes 6). One active input
    per pair of slots: the first layer becomes a sum of pairwise embeddings, which can see
    which cubies sit together.
    """
    for i in range(codes.shape[0]):
        p = 0
        for k in range(8):
            if k == 6:
                continue
            vk = codes[i, k] - 3 if codes[i, k] >= 21 else codes[i, k]
            for l in range(k + 1, 8):
                if l == 6:
                    continue
                vl = codes[i, l] - 3 if codes[i, l] >= 21 else codes[i, l]
                out[i, p] = 441 * p + 21 * vk + vl
                p += 1


@njit(cache=True, nogil=True)
def q_to_world(qc, rot, act_map, out):
    """out[i, a] = qc[i, act_map[rot[i], a]]: canonical-frame Q-values to the state's own frame."""
    n, a_n = out.shape
    for i in range(n):
        m = act_map[rot[i]]
        for a in range(a_n):
            out[i, a] = qc[i, m[a]]


@njit(cache=True, nogil=True)
def actions_to_canonical(actions, rot, act_map, out):
    for i in range(actions.shape[0]):
        out[i] = act_map[rot[i], actions[i]]


@njit(cache=True, nogil=True)
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
        # move b plays move a's role when R[moves[b]] == moves[a][R] (exactly one b)
        role = {row.tobytes(): b for b, row in enumerate(R[moves[:n_actions]])}
        out[r] = [role[row.tobytes()] for row in moves[:n_actions, R]]
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


class InputGroups:
    """Tables for a sparse first layer whose index columns come in groups that take few
    joint values: a cubie's stickers (a corner's three take 24 of the 6^3 colourings).

    Table row t is the sum of the W1 rows of one joint value of one group; a batch row
    then sums one table row per group instead of one W1 row per column. The 3x3x3's 54
    stickers are 26 groups (6 centres, 8 corners, 12 edges) with 516 table rows, the
    2x2x2's 24 are 8 corners with 192 (encoding.sticker_groups). panels.py builds the
    table rows per column panel from W1's panel, so the tables never go to memory; only
    the forward uses them (the backward's scatter through tables was no faster,
    docs/performance-log.md).
    A call whose rows include a value not listed (stickers that are no state of the
    puzzle) sums W1 rows as before.

    groups: tuples of index columns; values: per group, the tuples of W1 rows (one per
    column, in column order) that occur; digit (in_dim,): each W1 row's number among its
    column's rows, below radix. `tables` is what nn's kernels take (nn.NO_GROUPS: none);
    a Workspace takes the tables where `pays` says so."""

    def __init__(self, in_dim, groups, values, digit, radix):
        width = max(len(g) for g in groups)
        cols = np.full((len(groups), width), -1, np.int64)
        place = np.zeros((len(groups), width), np.int64)
        lut = np.full((len(groups), radix ** width), -1, np.int32)
        members = []
        for g, (columns, rows_of_values) in enumerate(zip(groups, values)):
            cols[g, :len(columns)] = columns
            place[g, :len(columns)] = [radix ** (len(columns) - 1 - a) for a in range(len(columns))]
            for rows in rows_of_values:
                lut[g, sum(int(digit[r]) * int(p) for r, p in zip(rows, place[g]))] = len(members)
                members.append(tuple(rows))
        self.in_dim, self.n_groups, self.n_tables = in_dim, len(groups), len(members)
        self.n_members = sum(len(m) for m in members)
        self.tables = (cols, place, lut, np.ascontiguousarray(digit, np.int64),
                       np.array([r for m in members for r in m], np.int32),
                       np.cumsum([0] + [len(m) for m in members]).astype(np.int32))

    def pays(self, rows: int, layout) -> bool:
        """Whether a workspace of `rows` rows takes the tables: the sums they save per call
        (rows x (columns - groups)) at least 3x what building them costs (a load per member,
        a store per table row). Measured alone (Zen 4, docs/performance-log.md): the
        3x3x3's 256 rows ran 20% faster hot and 12% from memory, the 2x2x2's 128 rows no
        faster; 3x takes the first and not the second."""
        return (layout.in_dim == self.in_dim and
                rows * (layout.n_active - self.n_groups) >= 3 * (self.n_members + self.n_tables))


def framed_order(puzzle) -> np.ndarray:
    """The order a framed encoding lists its stickers in: the DBL slot's three first (a
    frame keeps that cubie home and untwisted, so those columns are the same in every row
    and the sparse first layer adds their W1 rows once per batch, nn._fold_constant_columns:
    21 of the 2x2x2's 24 rows gathered per row), then the others in sticker order."""
    first = [int(f) for f in puzzle.corner_facelets[6]]
    return np.array(first + [j for j in range(puzzle.n_stickers) if j not in first], np.int64)


def sticker_groups(puzzle, order, dbl_first=False) -> InputGroups:
    """The sticker input's cubies as InputGroups: each centre alone (any colour), each
    corner slot's three stickers (the 8 corner cubies in 3 twists: 24 values) and each
    edge slot's two (12 edges, 2 flips). order: the index column of each sticker position
    is its place in it (Encoder.sticker_order: cube.sticker_order, or framed_order). Centres
    first, then the corners (with dbl_first, the DBL slot first: a canonical frame keeps
    its cubie home), then the edges: groups whose value is the same in every row lead, so
    the first layer adds their table rows once (nn._fold_constant_columns)."""
    column = np.empty(puzzle.n_stickers, np.int64)
    column[np.asarray(order)] = np.arange(puzzle.n_stickers)
    corners = list(range(len(puzzle.corner_facelets)))
    if dbl_first:
        corners.remove(6)
        corners.insert(0, 6)
    groups, values = [], []
    for p in puzzle.centre_facelets:
        groups.append((column[p],))
        values.append([(6 * p + c,) for c in range(6)])
    # a cubie in any slot shows its colours in the same cyclic order (read from the U/D
    # facelet, clockwise) as at home: its 3 twists are the 3 rotations of that order
    for slot in corners:
        fs = puzzle.corner_facelets[slot]
        groups.append(tuple(column[f] for f in fs))
        values.append([tuple(6 * f + int(cs[(a + t) % 3]) for a, f in enumerate(fs))
                       for cs in puzzle.corner_colours for t in range(3)])
    for fs in puzzle.edge_facelets:
        groups.append(tuple(column[f] for f in fs))
        values.append([tuple(6 * f + int(cs[(a + t) % 2]) for a, f in enumerate(fs))
                       for cs in puzzle.edge_colours for t in range(2)])
    digit = np.arange(puzzle.n_stickers * 6) % 6
    return InputGroups(puzzle.n_stickers * 6, groups, values, digit, 6)


ENCODINGS = ("stickers", "cubies", "pairs")
SYMMETRIES = (1, 6, 48)
INPUT_SHAPES = {"cubies": (192, 8), "pairs": (21 * 441, 21)}  # (in_dim, n_active); stickers: per puzzle


class Encoder:
    """Encodes states for a network, canonicalising 2x2x2 orientation when enabled.

    inputs="stickers": 6*sticker + colour per sticker (the 144-d / 324-d one-hot).
    inputs="cubies" (2x2x2, sparse only): 24*slot + 3*cubie + twist per corner slot.
    inputs="pairs" (2x2x2, sparse, canonical): one input per pair of the 7 free corner slots,
    indexed by both slots' (cubie, twist): 21 active of 9261.
    `in_dim` and `n_active` give the network's first-layer shape.

    Each row is encoded as seen through a frame: a whole-cube rotation that brings the DBL
    cubie home, and with symmetry = 6 or 48 (2x2x2, canonical) also a symmetry of the cube
    (rotations and mirrors, `cube.symmetries`): 6 = those that keep DBL home (turns about
    the DBL-UFR diagonal and mirrors through it), 48 = all of them. Of the symmetric
    images of a position the one with the smallest corner codes is encoded, so all of
    them reach the network as one input; act_map[frame, a] relabels the actions, exactly
    as for rotations alone. Choosing the frame and encoding slot pairs took 1.0 us a state
    with 48 symmetries, 0.5 us with 6 and 0.4 us with none (measured here).
    """

    def __init__(self, puzzle, n_actions, canonical=True, sparse=True, inputs="stickers", symmetry=1):
        if inputs not in ENCODINGS:
            raise ValueError(f"unknown input encoding '{inputs}' (expected {', '.join(ENCODINGS)})")
        if inputs != "stickers" and (puzzle.n != 2 or not sparse):
            raise ValueError(f"input_encoding = {inputs} is implemented for cube2 with the sparse first layer")
        if inputs == "pairs" and not canonical:
            raise ValueError("input_encoding = pairs needs canonical_input (the DBL cubie must stay home)")
        if symmetry not in SYMMETRIES:
            raise ValueError(f"input_symmetry must be 1, 6 or 48, got {symmetry}")
        if symmetry > 1 and not (canonical and puzzle.n == 2):
            raise ValueError("input_symmetry > 1 needs cube2 with canonical_input")
        self.puzzle, self.n_actions, self.sparse, self.inputs = puzzle, n_actions, sparse, inputs
        self.canonical = bool(canonical and puzzle.n == 2)
        # 2x2x2 states go through frames and corner codes unless plain stickers are asked for
        self.framed = puzzle.n == 2 and (self.canonical or inputs != "stickers")
        self.symmetry = int(symmetry)
        self.in_dim, self.n_active = INPUT_SHAPES.get(inputs, (puzzle.n_stickers * 6, puzzle.n_stickers))
        # writable C-ordered copies of the puzzle's read-only tables: frame_chunk's views of
        # them are writable, and a read-only table would give its kernels (choose_frame, a
        # second of a cold start) a signature of their own
        self.corner_facelets = np.array(puzzle.corner_facelets, order="C")
        self.corner_lookup = np.array(puzzle.corner_lookup, order="C")
        self.rotations = np.array(puzzle.rotations, order="C")
        self.fac = np.array(puzzle.corner_facelets[6], order="C")  # DBL slot
        self.colours = np.array(puzzle.corner_colours[6], order="C")
        # Frames: rotation r0 (to the canonical state x), then a view v of x (see choose_frame).
        # With symmetry 48 the views are (coset representative c, rotation rr, symmetry k that
        # keeps DBL home), covering all 48 symmetries; with 6 they are (k); with 1, x itself.
        rots = self.rotations.astype(np.int64) if self.canonical else np.arange(puzzle.n_stickers)[None]
        rot_act = action_map(puzzle, n_actions) if self.canonical else np.arange(n_actions)[None]
        if self.symmetry > 1:
            sym_perm, sym_cmap, sym_moves = symmetries(puzzle.name)
        else:  # the identity alone
            sym_perm, sym_cmap = np.arange(puzzle.n_stickers)[None], np.arange(6, dtype=np.uint8)[None]
            sym_moves = np.arange(len(puzzle.moves))[None]
        cosets = coset_representatives(sym_perm, sym_cmap) if self.symmetry == 48 else [0]
        self.n_sym = 1 if self.symmetry == 1 else 6
        self.n_rr = 24 if self.symmetry == 48 else 1
        # view (g, rr, k), in that nesting order: conj_g, turn by rr, conj_k, i.e.
        # view[q] = c_k[c_g[x[P_g[R_rr[P_k[q]]]]]], playing action a as k(rr(g(a)))
        g, k_perm, k_cmap, k_moves = (np.asarray(cosets), sym_perm[:self.n_sym], sym_cmap[:self.n_sym],
                                      sym_moves[:self.n_sym])
        n_g, n_s = len(g), puzzle.n_stickers
        view_perm = sym_perm[g][:, rots[:self.n_rr][:, k_perm]].reshape(-1, n_s)
        view_cmap = np.broadcast_to(k_cmap[:, sym_cmap[g]].transpose(1, 0, 2)[:, None],
                                    (n_g, self.n_rr, self.n_sym, 6)).reshape(-1, 6)
        g_act = rot_act[:self.n_rr][:, sym_moves[g][:, :n_actions]]            # (rr, g, a)
        view_act = k_moves[:, g_act].transpose(2, 1, 0, 3).reshape(-1, n_actions)  # (g, rr, k, a)
        self.n_view = len(view_perm)
        # inputs that need no corner codes: plain stickers, or stickers in the frame of one
        # rotation (encode_rotated_or_plain)
        self.rotation_only = not self.framed or (self.n_view == 1 and inputs == "stickers")
        # frame f = (rotation r0, view v), r0 outer: sticker indices, colour maps, action maps
        self.frame_perm = np.ascontiguousarray(rots[:, view_perm].reshape(-1, n_s), np.uint8)
        self.frame_cmap = np.ascontiguousarray(np.tile(view_cmap, (len(rots), 1)), np.uint8)
        self.act_map = np.ascontiguousarray(view_act[:, rot_act].transpose(1, 0, 2).reshape(-1, n_actions), np.int64)
        # per-corner tables of every view, and the rotation rr that homes each coset's new DBL cubie
        slot_of = np.zeros(puzzle.n_stickers, np.int64)
        for j, fs in enumerate(puzzle.corner_facelets):
            slot_of[fs] = j
        slot_map, code_map = self._view_tables(view_perm, view_cmap, puzzle, slot_of)
        src_slot = np.argsort(slot_map, axis=1)  # view slot -> x slot
        self.xcubie = np.full(len(cosets), 6, np.int64)
        self.rot_of = np.zeros((len(cosets), 24), np.int64)
        for c in range(len(cosets) if self.n_rr > 1 else 0):
            v0 = [(c * self.n_rr + rr) * self.n_sym for rr in range(self.n_rr)]
            for xc in range(8):  # the cubie view c brings to DBL, untwisted, with rotation rr
                hits = {3 * j + t: rr for rr in range(self.n_rr) for j in range(8) for t in range(3)
                        if slot_map[v0[rr], j] == 6 and code_map[v0[rr], j, 3 * xc + t] == 18}
                if len(hits) == 24:
                    self.xcubie[c] = xc
                    for place, rr in hits.items():
                        self.rot_of[c, place] = rr
                    break
            else:
                raise AssertionError(f"coset view {c} brings no cubie home")
        # choose_frame reads the views with k = 0 (every n_sym-th) and the k-views on their
        # own: a view (c, rr, k) is view k of view (c, rr, 0) (tested against a plain search).
        # uint8: the first table was int64 once (1.8 MB for all views), and going to uint8
        # took the cube2 preset's encode part from 2.16-2.38 to 1.45-1.50 ms a step
        self.view_src = np.ascontiguousarray(src_slot[::self.n_sym], np.uint8)
        self.view_code = np.ascontiguousarray(code_map[::self.n_sym], np.uint8)
        k_slot, k_code = self._view_tables(k_perm, k_cmap, puzzle, slot_of)
        self.k_src = np.ascontiguousarray(np.argsort(k_slot, axis=1), np.uint8)
        self.k_code = np.ascontiguousarray(k_code, np.uint8)
        self._new_scratch()
        self._identity_cmap = np.arange(6, dtype=np.uint8)
        self.search_rotations = self.rotations if self.canonical else \
            np.arange(puzzle.n_stickers, dtype=np.uint8)[None]
        self.home_facelets = np.ascontiguousarray(self.search_rotations[:, self.fac])
        self._frame_tables = self._table_context()
        # the index columns' order: constant columns first (nn._fold_constant_columns)
        self.sticker_order = framed_order(puzzle) if self.framed else sticker_order(puzzle)
        # the first layer's cubie tables (InputGroups), for sparse sticker inputs
        self.input_groups = sticker_groups(puzzle, self.sticker_order, self.canonical) \
            if sparse and inputs == "stickers" else None
        # children worth scoring in all-actions targets (all of them unless canonical)
        self.child_reps, self.child_rep_of = child_representatives(puzzle, n_actions) if self.canonical \
            else (np.arange(n_actions), np.arange(n_actions))

    def _table_context(self):
        """frame_chunk's view of FRAME_TABLES (addresses and shapes; the tables never change)."""
        ctx = np.zeros(T_LEN, np.int64)
        for k, name in enumerate(FRAME_TABLES):
            table = getattr(self, name)
            assert table.flags.c_contiguous and table.ndim < TABLE_STRIDE
            ctx[k * TABLE_STRIDE] = table.ctypes.data
            ctx[k * TABLE_STRIDE + 1:k * TABLE_STRIDE + 1 + table.ndim] = table.shape
        ctx[T_N_VIEW], ctx[T_N_RR], ctx[T_N_SYM] = self.n_view, self.n_rr, self.n_sym
        return ctx

    def fork(self):
        """A copy sharing every table, with its own scratch buffers: one per thread."""
        twin = copy.copy(self)
        twin._new_scratch()
        return twin

    def _new_scratch(self):
        """The buffers encode and choose_frame write into (codes grow on demand)."""
        self._codes = np.zeros((0, 8), np.int64)
        self._base, self._where, self._y = np.zeros(8, np.int64), np.zeros(8, np.int64), np.zeros(8, np.int64)

    def _view_tables(self, perm, cmap, puzzle, slot_of):
        """(slot_map, code_map) of views (n, stickers) perm / (n, 6) cmap (see corner_tables);
        all zero without symmetry, where choose_frame reads none."""
        slot_map = np.zeros((len(perm), 8), np.int64)
        code_map = np.zeros((len(perm), 8, 24), np.int64)
        if self.symmetry > 1:
            corner_tables(np.array(perm, np.int64, order="C"), np.array(cmap, np.uint8, order="C"),
                          self.corner_facelets, np.ascontiguousarray(puzzle.corner_colours), self.corner_lookup,
                          slot_of, slot_map, code_map)
        return slot_map, code_map

    def frames(self, states, frame, codes):
        """frame (n,): the frame each state is encoded in (0 when not canonical); codes (n, 8):
        its corner codes (3*cubie + twist per slot) in that frame (2x2x2 only)."""
        frame_states(states, self.home_facelets, self.colours, self.search_rotations, self._identity_cmap,
                     self.corner_facelets, self.corner_lookup, self.n_view, self.xcubie, self.rot_of, self.view_src,
                     self.view_code, self.k_src, self.k_code, self.n_rr, self.n_sym, self._base, self._where,
                     self._y, codes, frame, self._frame_tables)

    def encode_codes(self, codes, idx):
        """Input rows idx (n, n_active) of states given by their corner codes (n, 8) in their
        frames (pairs or cubies inputs: the codes are all these inputs need)."""
        if self.inputs == "pairs":
            encode_pairs_from_codes(codes, idx)
        elif self.inputs == "cubies":
            encode_cubies_from_codes(codes, idx)
        else:
            raise ValueError("sticker inputs are not made from corner codes")

    def position_keys(self, states):
        """(n, K) uint8 rows, equal exactly when two states are the same position up to the
        symmetries this encoder identifies (their inputs are then equal too): whole-cube
        rotations for the canonical 2x2x2 encoder, all 48 symmetries with input_symmetry 48.
        Otherwise the stickers themselves. Search compares these instead of raw states."""
        states = np.ascontiguousarray(np.atleast_2d(states), dtype=np.uint8)
        if not self.framed:
            return states.copy()
        n = len(states)
        codes = np.zeros((n, 8), np.int64)
        self.frames(states, np.zeros(n, np.int64), codes)
        return codes.astype(np.uint8)

    def encode(self, states, ws, row0=0, rot=None, want_codes=True):
        """Write the input rows [row0, row0+n) of workspace ws; fills rot (n,) with the frames.

        Returns the states' corner codes in their frames (n, 8), which identify the input
        exactly (a view of scratch, valid until the next call), or None when not framed.
        With want_codes=False it may return None instead: sticker inputs in the one frame
        per rotation need only the rotation, not the codes (64 states: 5.0 us, 11.0 with them)."""
        n = len(states)
        if self.rotation_only and not (want_codes and self.framed):
            encode_rotated_or_plain(self.framed, self.sparse, states, self.home_facelets, self.colours,
                                    self.frame_perm, self.frame_cmap, self.sticker_order,
                                    np.zeros(n, np.int64) if rot is None else rot, ws.idx[row0:row0 + n],
                                    ws.x[row0:row0 + n])
            return None
        if len(self._codes) < n:
            self._codes = np.zeros((n, 8), np.int64)
        codes = self._codes[:n]
        self.frames(states, rot, codes)
        if self.inputs != "stickers":
            self.encode_codes(codes, ws.idx[row0:row0 + n])
        elif self.sparse:
            encode_index_framed(states, self.frame_perm, self.frame_cmap, rot, self.sticker_order,
                                ws.idx[row0:row0 + n])
        else:
            encode_onehot_framed(states, self.frame_perm, self.frame_cmap, rot, ws.x[row0:row0 + n])
        return codes


class Policy:
    """A network plus its encoder: Q-values of states in their own frame (for acting and search).

    views > 1 averages the network over that many cube symmetries (`cube.symmetries`:
    1 = as is, 6 = those keeping the DBL corner, up to 48 = all rotations and mirrors):
    Q(s, a) = mean_k Q_net(conj_k(s), move_map[k, a]). Distances are symmetry invariant, so
    this is the same function with its errors averaged, at `views` times the forward cost.
    """

    def __init__(self, net, encoder: Encoder, chunk=4096, views=1, child_table_sets=1 << 16):
        if not 1 <= int(views) <= 48:
            raise ValueError(f"symmetry views must be between 1 and 48, got {views}")
        self.net, self.encoder, self.chunk, self.views = net, encoder, chunk, int(views)
        self.child_table_sets = child_table_sets
        self._ws = {}
        self._child_codes = None  # children.ChildCodes for q_values_and_child_keys, made on first use
        if self.views > 1:
            perm, cmap, mmap = symmetries(encoder.puzzle.name)
            self._sym = (np.ascontiguousarray(perm[:self.views]), np.ascontiguousarray(cmap[:self.views]),
                         np.ascontiguousarray(mmap[:self.views, :net.layout.n_actions]))

    def fork(self):
        """A policy on the same network (weights shared, not copied) with its own workspaces
        and encoder scratch, so that several threads can search at once."""
        twin = copy.copy(self)
        twin.encoder, twin._ws, twin._child_codes = self.encoder.fork(), {}, None
        return twin

    def position_keys(self, states) -> np.ndarray:
        """Rows equal exactly for equivalent positions (see Encoder.position_keys)."""
        return self.encoder.position_keys(states)

    @property
    def keys_are_states(self) -> bool:
        """Whether position_keys returns the stickers as they are (no frames: the 3x3x3)."""
        return not self.encoder.framed

    def q_values(self, states) -> np.ndarray:
        states = np.ascontiguousarray(np.atleast_2d(states), dtype=np.uint8)
        if self.views == 1:
            return self._q_plain(states)
        perm, cmap, mmap = self._sym
        conj = np.empty_like(states)
        total = np.zeros((len(states), self.net.layout.n_actions), np.float64)
        for k in range(self.views):
            conjugate_states(states, perm[k], cmap[k], conj)
            total += self._q_plain(conj)[:, mmap[k]]
        return (total / self.views).astype(self.net.dtype)

    def q_values_and_child_keys(self, states):
        """(Q-values (n, A), keys (n*A, K) uint8 or None): row i*A + a of keys is position_keys
        of state i's child under action a. Search needs both for every state it expands;
        here the states are framed once, for the network, and their children's keys come
        from a table keyed by the parent's position (children.ChildCodes), not from framing
        every child (a third of a 2x2x2 beam search's time). keys is None where that table
        does not apply (symmetry views, sticker inputs, encoders without canonical frames):
        then the caller keys the children itself."""
        states = np.ascontiguousarray(np.atleast_2d(states), dtype=np.uint8)
        if self.views != 1 or not ChildCodes.applies(self.encoder):
            return self.q_values(states), None
        n_a = self.net.layout.n_actions
        if self._child_codes is None:
            moves = np.ascontiguousarray(self.encoder.puzzle.moves[:n_a])
            self._child_codes = ChildCodes(self.encoder, moves, self.chunk, sets=self.child_table_sets)
        keys = np.empty((len(states) * n_a, 8), np.uint8)
        return self._q_plain(states, keys), keys

    def _q_plain(self, states, child_keys=None) -> np.ndarray:
        n = len(states)
        out = np.empty((n, self.net.layout.n_actions), self.net.dtype)
        rows = min(self.chunk, max(n, 1))
        if rows not in self._ws:
            self._ws[rows] = (self.net.workspace(rows, self.encoder.input_groups), np.zeros(rows, np.int64))
        ws, rot = self._ws[rows]
        for start in range(0, n, rows):
            part = states[start:start + rows]
            k = len(part)
            codes = self.encoder.encode(part, ws, 0, rot[:k], want_codes=child_keys is not None)
            if child_keys is not None:
                n_a = out.shape[1]
                child_keys[start * n_a:(start + k) * n_a] = self._child_codes.every_child(part, codes, rot[:k])
            qc = self.net.forward_ws(ws, k)
            if self.encoder.canonical:
                q_to_world(qc, rot[:k], self.encoder.act_map, out[start:start + k])
            else:
                out[start:start + k] = qc
        return out


# at the end: where the team already runs, this compiles frame_chunk now, and what it
# calls must be defined by then
share_range_fn(FRAME_SLOT, _frame_chunk_address)
