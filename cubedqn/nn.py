"""The MLP engine: flat parameter layout, batched forward/backward kernels, Q losses.

What this file is: an MLP `in -> h1 -> ... -> hk -> A` (ReLU hidden layers, linear Q
head, optional dueling head) whose weights and biases all live in one contiguous buffer.
`Layout` is the single source of truth for shapes and offsets; parameters, gradients,
optimizer moments and the target network share it, so every layer sees views
`W[l]` (in_l, out_l) and `b[l]` (out_l,) into a flat array.

Every layer is a `*_forward` / `*_backward` pair of `@njit` kernels taking explicit
buffers; each GEMM is one BLAS call (`blas.gemm(a, b, out)` inside njit: numpy's bundled
OpenBLAS where it has one, else np.dot's, scipy's; see blas.py). The first layer
has two interchangeable paths: dense (one-hot float input x W1, a GEMM) and sparse
(sticker indices `6*sticker + colour`: forward gathers and sums rows of W1, backward
scatter-adds into dW1). Sparse is the default. For float32 inputs of at most
PANEL_MAX_IN rows the sparse layer runs by column panels (panels.py, LLVM IR) when a
workspace is big enough to pay for copying W1 (Workspace); otherwise by rows (below).

What it is not: the optimizer (`optim.py`) or anything that knows about replay or DQN.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import llvmlite.ir as ir
import numpy as np
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic, overload

from . import panels
from .blas import gemm, gemm_bias_relu, local_slots, range_fn, run_range, share_range_fn, voidptr_at, want_range_fn
from .team import RANGE_MIN

HUBER, MSE = 0, 1
PANEL_MAX_IN = 384  # widest W1 (input rows) the panel kernels take: a 48 KB panel
# CUBEDQN_PANELS=0 keeps the row gather everywhere (for side-by-side timings); 1 (default)
# uses panels where Workspace says. Another value is reported by the CLI (exit 2).
_PANELS_ENV = os.environ.get("CUBEDQN_PANELS", "1").strip()
PANELS_PROBLEM = None if _PANELS_ENV in ("0", "1") else \
    f"CUBEDQN_PANELS={os.environ['CUBEDQN_PANELS']!r} is not one of: 0, 1"
PANELS = _PANELS_ENV != "0" and panels.AVAILABLE
LOSSES = {"huber": HUBER, "mse": MSE}


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c with one rounding (llvm.fma), as the tile GEMM sums; a, b, c one float type."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, sig, args):
        t = args[0].type
        return builder.call(builder.module.declare_intrinsic("llvm.fma", [t], ir.FunctionType(t, [t, t, t])), args)
    return a(a, b, c), codegen


@dataclass(frozen=True)
class Layout:
    """Shapes and flat offsets of every parameter tensor."""

    in_dim: int            # one-hot width (stickers * 6, or cubie slots * 24)
    n_active: int          # ones per input row: the sparse path's gathers (stickers or cubies)
    hidden: tuple          # hidden widths
    n_actions: int
    dueling: bool = False

    @property
    def widths(self):
        head = self.n_actions + (1 if self.dueling else 0)
        return (self.in_dim,) + tuple(self.hidden) + (head,)

    @property
    def n_layers(self):
        return len(self.hidden) + 1

    @property
    def tensors(self):
        """[(W_offset, fan_in, fan_out, b_offset)] per layer, in order."""
        out, off = [], 0
        w = self.widths
        for l in range(self.n_layers):
            fi, fo = w[l], w[l + 1]
            out.append((off, fi, fo, off + fi * fo))
            off += fi * fo + fo
        return out

    @property
    def size(self):
        off, fi, fo, boff = self.tensors[-1]
        return boff + fo

    def describe(self):
        return "-".join(str(x) for x in (self.in_dim,) + tuple(self.hidden) + (self.n_actions,)) + \
            (" dueling" if self.dueling else "")

    def flops_forward(self, rows, sparse=True, picked=0):
        """Multiply-add FLOPs (2 per MAC) of a forward pass over `rows` rows (`picked` of
        them with one Q-value from the head, see flops_gemm_forward)."""
        w = self.widths
        first = rows * self.n_active * w[1] if sparse else 2 * rows * w[0] * w[1]
        return first + self.flops_gemm_forward(rows, picked)

    def flops_gemm_forward(self, rows, picked=0):
        """FLOPs of layers 1 .. L-1 (the GEMM layers) in a forward pass over `rows` rows;
        `picked` of them get one value from the head, not A (nn.head_forward_picked)."""
        w, L = self.widths, self.n_layers
        full = sum(2 * rows * w[l] * w[l + 1] for l in range(1, L))
        return full if L < 2 else full - 2 * picked * w[L - 1] * (w[L] - 1)

    def flops_gemm_backward(self, rows, head=True):
        """FLOPs of the GEMM layers' dW and dx over `rows` rows. head=False: the Q head's from
        the taken actions alone (head_backward_taken: 1/A of its products, the rest zeros)."""
        w, L = self.widths, self.n_layers
        full = sum(4 * rows * w[l] * w[l + 1] for l in range(1, L))
        return full if head or L < 2 else full - 4 * rows * w[L - 1] * (w[L] - 1)

    def flops_backward(self, rows, sparse=True, head=True):
        w = self.widths
        first = rows * self.n_active * w[1] if sparse else 2 * rows * w[0] * w[1]
        return first + self.flops_gemm_backward(rows, head)


ALIGN = 64  # bytes: a cache line, one AVX-512 vector


def aligned_zeros(shape, dtype) -> np.ndarray:
    """np.zeros whose data starts on an ALIGN-byte boundary. numpy's buffers here start 16
    or 32 bytes past one, so every 64-byte vector load from them straddles two cache
    lines: the panel first layer ran 1.15-1.60x slower from such a scratch, up to 1.15x
    with its other buffers so placed (`scripts/bench_alignment.py`). Parameters,
    gradients, optimizer state and workspaces are allocated here."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def views(flat: np.ndarray, layout: Layout, start: int = 0):
    """(Ws, bs): tuples of views into a flat buffer, one (in, out) matrix and bias per layer.

    flat may hold the layout from offset `start` on only (the lazy first layer's gradient
    buffer starts at b1, see learner.py): a matrix that begins before it is an empty
    (0, out) view, and no tensor may straddle it."""
    Ws, bs = [], []
    for off, fi, fo, boff in layout.tensors:
        if off < start:
            if boff != start:
                raise ValueError(f"offset {start} is not where layer 0's bias begins ({boff})")
            Ws.append(flat[:0].reshape(0, fo))
        else:
            Ws.append(flat[off - start:off - start + fi * fo].reshape(fi, fo))
        bs.append(flat[boff - start:boff - start + fo])
    return tuple(Ws), tuple(bs)


def init_params(layout: Layout, rng: np.random.Generator, dtype=np.float32) -> np.ndarray:
    """He/Kaiming-normal weights (std sqrt(2/fan_in); the linear head sqrt(1/fan_in)), zero biases."""
    flat = aligned_zeros(layout.size, dtype)
    Ws, _ = views(flat, layout)
    for l, W in enumerate(Ws):
        fan_in = W.shape[0]
        gain = 1.0 if l == layout.n_layers - 1 else 2.0
        W[:] = rng.standard_normal(W.shape) * np.sqrt(gain / fan_in)
    return flat


# no tables (encoding.InputGroups.tables' types, empty)
NO_GROUPS = (np.full((0, 1), -1, np.int64), np.zeros((0, 1), np.int64), np.zeros((0, 1), np.int32),
             np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(1, np.int32))
NO_TAKEN = np.zeros(0, np.int64)  # mlp_backward_upper's `taken` where dLoss/dhead is any
NO_PICKS = np.zeros(0, np.int64)  # mlp_forward_upper's `picks` where every row needs all its Q-values


class Workspace:
    """Activations and deltas for one (layout, rows, dtype): allocated once, reused every step.

    acts[l] (rows, width_{l+1}) holds layer l's output (ReLU applied for hidden layers);
    acts[-1] is the raw head. q (rows, A) is the Q-values (a view of the head unless dueling).
    deltas[l] has the shape of acts[l]. idx (rows, S) int32 and x (rows, in) feed layer 0.
    groups (an encoding.InputGroups, or None): the input's cubie tables, which the sparse
    first layer's gather takes where the workspace's rows pay for them (`groups` is then
    their tables, else nn.NO_GROUPS).
    """

    def __init__(self, layout: Layout, rows: int, dtype=np.float32, dense_input=False,
                 groups=None):
        self.layout, self.rows, self.dtype = layout, rows, dtype
        w = layout.widths
        self.acts = tuple(aligned_zeros((rows, w[l + 1]), dtype) for l in range(layout.n_layers))
        self.deltas = tuple(aligned_zeros((rows, w[l + 1]), dtype) for l in range(layout.n_layers))
        self.idx = aligned_zeros((rows, layout.n_active), np.int32)
        # scratch for the panel kernels (panels.py; panel_scratch_size): one column panel of W1
        # for the gather, of the batch's output gradient for the scatter, and the scatter's
        # lists; at its end a second panel area for a call split over the team. For float32
        # sparse inputs narrow enough for a W1 panel to sit in or near L1 (cube2 stickers
        # 18 KB, cube3 41 KB; not the slot pairs).
        # The panels copy all of W1 once per call, so only for workspaces whose rows gather
        # at least 8x as many W1 rows as it has (about where they broke even, forward and
        # backward, at 144 x 256 and 324 x 1024). Decided per workspace, not per call, so
        # that a row's Q-values do not depend on how many rows go with it (the target cache
        # and chunked policies rely on that, bitwise).
        # Where no workspace of this layout could have one (the slot pairs' W1, dense inputs,
        # float64, panels off), the scratch is None: the kernels are then compiled for that
        # type, without the panel code (5.3-5.7 s -> 2.0-2.4 s of the cube2 presets' cold
        # start for the first layer's forward, docs/performance-log.md, stop 28).
        possible = (PANELS and not dense_input and np.dtype(dtype) == np.float32 and layout.in_dim <= PANEL_MAX_IN
                    and layout.widths[1] % panels.PANEL == 0)
        panel = possible and rows * layout.n_active >= 8 * layout.in_dim
        # the gather's tables (encoding.InputGroups) where the workspace's rows pay for them
        tabled = panel and groups is not None and groups.pays(rows, layout)
        self.groups = groups.tables if tabled else NO_GROUPS
        n_t, n_g = (groups.n_tables, groups.n_groups) if tabled else (0, 0)
        self.panel = aligned_zeros(panel_scratch_size(layout.in_dim, rows, layout.n_active, layout.widths[1], n_t,
                                                      n_g) if panel else 0, dtype) if possible else None
        if panel:
            want_range_fn(PANEL_SLOT)  # its calls may split over the team (_run_panel_halves)
        self.x = aligned_zeros((rows, layout.in_dim if dense_input else 0), dtype)
        self.q = aligned_zeros((rows, layout.n_actions), dtype) if layout.dueling else self.acts[-1]
        self.dq = aligned_zeros((rows, layout.n_actions), dtype) if layout.dueling else self.deltas[-1]
        # the head's W and dW transposed, for its backward from the taken actions alone
        # (head_backward_taken), and W's with the bias after it for its forward at picked
        # actions (head_forward_picked); not where the head is the first layer
        self.head_t = aligned_zeros((2, w[-1] + 1, max(w[-2], w[-1])) if layout.n_layers > 1 else (2, 0, 0), dtype)


# ---------------------------------------------------------------------------------------
# Layer kernels

@njit(cache=True, nogil=True, error_model="numpy")
def sparse_forward(idx, W, b, out, relu):
    """idx is (B,S) int32 row indices into W (in,H); out (B,H) = b + sum_s W[idx[:,s]].

    Eight rows of W are summed per pass over the output row (then four, then one), so each
    output element is loaded and stored once per eight stickers. Measured here: four rows a
    pass ran 2x faster than one, and eight 1.05-1.3x faster than four (768 x 21 x 256 up to
    128 x 24 x 256).
    """
    n, s = idx.shape
    h = W.shape[1]
    for i in range(n):
        o = out[i]
        for j in range(h):
            o[j] = b[j]
        k = 0
        while k + 8 <= s:
            a0, a1, a2, a3 = W[idx[i, k]], W[idx[i, k + 1]], W[idx[i, k + 2]], W[idx[i, k + 3]]
            a4, a5, a6, a7 = W[idx[i, k + 4]], W[idx[i, k + 5]], W[idx[i, k + 6]], W[idx[i, k + 7]]
            for j in range(h):
                o[j] += ((a0[j] + a1[j]) + (a2[j] + a3[j])) + ((a4[j] + a5[j]) + (a6[j] + a7[j]))
            k += 8
        if k + 4 <= s:
            a0, a1, a2, a3 = W[idx[i, k]], W[idx[i, k + 1]], W[idx[i, k + 2]], W[idx[i, k + 3]]
            for j in range(h):
                o[j] += (a0[j] + a1[j]) + (a2[j] + a3[j])
            k += 4
        while k < s:
            a0 = W[idx[i, k]]
            for j in range(h):
                o[j] += a0[j]
            k += 1
        if relu:
            for j in range(h):
                if o[j] < 0:
                    o[j] = 0


@njit(cache=True, nogil=True, error_model="numpy")
def sparse_backward(idx, dout, dW, db):
    """dW (in,H) = scatter-add of dout (B,H) rows at idx (B,S); db = sum of dout rows."""
    n, s = idx.shape
    h = dout.shape[1]
    dW[:] = 0
    db[:] = 0
    for i in range(n):
        d = dout[i]
        for j in range(h):
            db[j] += d[j]
        for k in range(s):
            w = dW[idx[i, k]]
            for j in range(h):
                w[j] += d[j]


# The row gather over the GEMM team (--threads 2 and up): sparse_forward on chunks of whole
# rows, shared by the team's threads through blas.run_range. Each row is summed by the same
# compiled code whichever thread takes it, so the bits do not depend on the thread count.
# Where W1 is too big for the panels (the cube2 presets' 9.5 MB slot-pair layer, its rows
# in L3), one thread's gathers wait on memory: a numba prange over two halves of 128 and
# 448 rows of that layer ran 1.6x and 1.8x one thread (docs/performance-log.md, stop 37).
GATHER_SLOT = 0  # its slot in blas's range-function table
G_IDX, G_W, G_B, G_OUT, G_ROWS, G_ACTIVE, G_IN, G_H, G_RELU, G_GRAIN = range(10)  # context slots
G_LEN = G_GRAIN + 1


def gather_chunk(ctx, lo, hi):
    """sparse_forward on rows [lo / grain, hi / grain) of the context's float32 operands."""
    c = carray(ctx, G_LEN, np.int64)
    n, s, h, grain = c[G_ROWS], c[G_ACTIVE], c[G_H], c[G_GRAIN]
    idx = carray(voidptr_at(c[G_IDX]), (n, s), np.int32)
    W = carray(voidptr_at(c[G_W]), (c[G_IN], h), np.float32)
    b = carray(voidptr_at(c[G_B]), h, np.float32)
    out = carray(voidptr_at(c[G_OUT]), (n, h), np.float32)
    r0, r1 = lo // grain, hi // grain
    sparse_forward(idx[r0:r1], W, b, out[r0:r1], c[G_RELU] != 0)


def _gather_chunk_address():
    return cfunc(types.void(types.voidptr, types.int64, types.int64), cache=True, error_model="numpy",
                 nogil=True)(gather_chunk).address


def sparse_forward_shared(idx, W, b, out, relu):
    """sparse_forward, its rows shared by the team's threads where the team runs (float32
    operands in C order, int32 rows; else, or with few rows, the calling thread alone).
    From Python: the calling thread alone (the split is this function's njit overload)."""
    sparse_forward(idx, W, b, out, relu)


@overload(sparse_forward_shared, jit_options={"nogil": True})
def _sparse_forward_shared_overload(idx, W, b, out, relu):
    if not (idx.dtype == types.int32 and W.dtype == b.dtype == out.dtype == types.float32 and
            idx.layout == W.layout == b.layout == out.layout == "C"):
        def alone(idx, W, b, out, relu):
            sparse_forward(idx, W, b, out, relu)
        return alone

    def shared(idx, W, b, out, relu):
        n, s = idx.shape
        h = W.shape[1]
        grain = max(1, h * s // 8)  # a row's work in units of ~8 adds
        fn = range_fn(np.int64(GATHER_SLOT))
        if fn == 0 or n * grain < RANGE_MIN:
            sparse_forward(idx, W, b, out, relu)
            return
        ctx = local_slots(G_LEN)
        c = carray(ctx, G_LEN, np.int64)
        c[G_IDX], c[G_W], c[G_B], c[G_OUT] = idx.ctypes.data, W.ctypes.data, b.ctypes.data, out.ctypes.data
        c[G_ROWS], c[G_ACTIVE], c[G_IN], c[G_H] = n, s, W.shape[0], h
        c[G_RELU], c[G_GRAIN] = 1 if relu else 0, grain
        run_range(voidptr_at(fn), ctx, n * grain, grain)
    return shared


def _panel_gather(idx, W, b, out, relu, panel, groups):
    """Columns [0, return value) of sparse_forward done by panels.py (float32 only)."""
    return 0


def _panel_scatter(idx, dout, dW, db, panel):
    """Columns [0, return value) of sparse_backward done by panels.py (float32 only)."""
    return 0


@njit(cache=True, nogil=True)
def _rows_fit(a):
    """a (2-D) has contiguous rows (its row stride may be wider: a row slice)."""
    return a.strides[1] == a.itemsize and a.strides[0] >= a.shape[1] * a.itemsize


@njit(cache=True, nogil=True)
def _lists_start(in_dim, rows, n_tables):
    """Where the panel scratch's int32 lists begin (float32 elements): after a panel of
    max(in_dim, rows) rows (W1's for the gather, dout's for the scatter) and one of the
    n_tables table rows (see encoding.InputGroups)."""
    return (max(in_dim, rows) + n_tables) * panels.PANEL


@njit(cache=True, nogil=True)
def _lists_end(in_dim, rows, n_active, n_tables, n_groups):
    """Where the panel scratch's lists end (float32 elements, rounded up to 16): from
    _lists_start, as int32, the scatter's lists of batch rows per W1 row (rows * n_active
    entries, in_dim + 1 starts), in_dim cursors for building them, and the gather's table
    rows of the batch (rows * n_groups)."""
    n = _lists_start(in_dim, rows, n_tables) + rows * n_active + 2 * in_dim + 1 + rows * n_groups
    return -(-n // 16) * 16


@njit(cache=True, nogil=True)
def panel_scratch_size(in_dim, rows, n_active, hidden, n_tables, n_groups):
    """float32 elements of the scratch the panel kernels need for `rows` batch rows: the
    panels and lists (_lists_end), then `hidden` floats for the gather's bias with the
    constant columns added (_fold_constant_columns), rounded up to 16, then a second
    working area for a call split over the team (_run_panel_halves)."""
    return _lists_end(in_dim, rows, n_active, n_tables, n_groups) + -(-hidden // 16) * 16 + \
        _lists_start(in_dim, rows, n_tables)


@njit(cache=True, nogil=True)
def _list_views(panel, in_dim, rows, n_active, n_tables, n_groups):
    """(order, starts, cursor, codes) in the scratch (see _lists_end); codes is (rows, n_groups)."""
    ints = panel[_lists_start(in_dim, rows, n_tables):_lists_end(in_dim, rows, n_active, n_tables, n_groups)]
    ints = ints.view(np.int32)
    k, m = rows * n_active, in_dim
    codes = ints[k + 2 * m + 1:k + 2 * m + 1 + rows * n_groups]
    return ints[:k], ints[k:k + m + 1], ints[k + m + 1:k + 2 * m + 1], codes.reshape((rows, n_groups))


@njit(cache=True, nogil=True)
def _constant_prefix(idx):
    """How many of idx's first columns hold the same row in every row of the batch (the
    3x3x3's six centre stickers, which cube.encode_index puts first)."""
    n, s = idx.shape
    if n == 0:
        return 0
    for k in range(s):
        v = idx[0, k]
        for i in range(1, n):
            if idx[i, k] != v:
                return k
    return s


@njit(cache=True, nogil=True)
def _panel_columns(idx, w, rows, vec, panel, need):
    """The columns panels.py can take for weights-shaped w (in,H), batch-shaped rows
    (B,H) and the (H,) vector vec: H rounded down to whole panels, or 0 when the scratch
    is smaller than `need` or a buffer's rows (or vec) are not contiguous."""
    h = w.shape[1]
    fits = vec.strides[0] == 4 and _rows_fit(idx) and _rows_fit(w) and _rows_fit(rows)
    if not fits or panel.shape[0] < need:
        return 0
    return h // panels.PANEL * panels.PANEL


@njit(cache=True, nogil=True)
def _rows_by_w1_row(idx, n_in, order, starts, cursor):
    """order[starts[r]:starts[r + 1]] = the batch rows i with r in idx[i], ascending (a
    counting sort; a row listing r twice is listed twice)."""
    n, s = idx.shape
    cursor[:] = 0
    for i in range(n):
        for k in range(s):
            cursor[idx[i, k]] += 1
    starts[0] = 0
    for r in range(n_in):
        starts[r + 1] = starts[r] + cursor[r]
        cursor[r] = starts[r]
    for i in range(n):
        for k in range(s):
            r = idx[i, k]
            order[cursor[r]] = i
            cursor[r] += 1


@njit(cache=True, nogil=True)
def _table_codes(idx, groups, codes):
    """codes[i, g] = the table row of group g's stickers in row i (encoding.InputGroups); False if
    a row has a combination the tables do not list (not a state of the puzzle)."""
    cols, place, lut, digit = groups[0], groups[1], groups[2], groups[3]
    n = idx.shape[0]
    for i in range(n):
        for g in range(cols.shape[0]):
            key = 0
            for a in range(cols.shape[1]):
                k = cols[g, a]
                if k >= 0:
                    key += digit[idx[i, k]] * place[g, a]
            t = lut[g, key]
            if t < 0:
                return False
            codes[i, g] = t
    return True


@njit(cache=True, nogil=True, error_model="numpy")
def _fold_constant_columns(rows_idx, W, b, hp, panel, off, tabled, groups):
    """(f, c): the gather's first f columns are the same in every row, and c[:hp] = b plus
    their rows (W's, or with tabled the table rows, each zero + its W rows in list order),
    added in column order: the sum every output row starts with, so gathering the other
    columns onto c gives each row's sequential sum bit for bit (the same adds in the same
    order) with 1 - f/S of the loads (3x3x3 stickers: 48 of 54). c lives in the scratch
    at off; (0, b) when it has no room."""
    n, s = rows_idx.shape
    f = _constant_prefix(rows_idx)
    if f == 0 or panel.shape[0] < off + hp:
        return 0, b
    t_order, t_starts = groups[4], groups[5]
    c = panel[off:off + hp]
    for j in range(hp):
        c[j] = b[j]
    for k in range(f):
        r = rows_idx[0, k]
        if tabled:
            for j in range(hp):
                v = np.float32(0)
                for e in range(t_starts[r], t_starts[r + 1]):
                    v += W[t_order[e], j]
                c[j] += v
        else:
            w = W[r]
            for j in range(hp):
                c[j] += w[j]
    return f, c


@njit(cache=True, nogil=True)
def _tables_for(idx, n_in, panel, groups):
    """(rows, n_t): the batch's table rows (the scratch's codes) and the table count where
    the workspace has tables, its scratch their room and every row's stickers are listed;
    else (idx, 0)."""
    n, s = idx.shape
    n_t, g = groups[5].shape[0] - 1, groups[0].shape[0]
    if n_t > 0 and n > 0 and panel.shape[0] >= _lists_end(n_in, n, s, n_t, g):
        codes = _list_views(panel, n_in, n, s, n_t, g)[3]
        if _table_codes(idx, groups, codes):
            return codes, n_t
    return idx, 0


# The panel kernels over the GEMM team (--threads 2 and up): the columns [0, hp) in two
# halves of whole panels, one call of panels.py each, taken by the team's threads through
# blas.run_range (a range of two grains of RANGE_MIN, one per half). The second half
# works in its own area at the scratch's end (panel_scratch_size: the copied panel and the
# table rows); the lists, table codes and folded bias before it are only read while both
# run. Each column is summed by the same code whichever half it falls in (near or far
# kernel: the same adds, panels.py), so the bits do not depend on the thread count.
# Two halves, not more chunks: each takes whole panels and needs its own area, and this
# machine has two cores.
PANEL_SLOT = 3  # its slot in blas's range-function table
(P_SCATTER, P_OUT, P_LDO, P_SRC, P_LDS, P_LIST, P_LDL, P_STARTS, P_N, P_S, P_HP, P_VEC, P_RELU, P_SCRATCH,
 P_AREA, P_IN, P_NT, P_T_ORDER, P_T_STARTS, P_HALF, P_DONE) = range(21)  # context slots (P_DONE: two)
P_LEN = 22
PANEL_SPLIT_MIN = 1 << 17  # loads and stores of a call (~4 us on one Zen 4 core) worth two halves


@njit(cache=True, nogil=True)
def _panel_call(ctx, lo, hi):
    """panels.py's gather (P_SCATTER 0) or scatter on the columns of the halves that
    [lo, hi) covers (grains of RANGE_MIN: 0 the first half, 1 the second); what it returns
    (the columns done, 0 where its panel width is not this caller's) goes in the half's
    P_DONE slot."""
    c = carray(ctx, P_LEN, np.int64)
    c0 = 0 if lo < RANGE_MIN else c[P_HALF]
    c1 = c[P_HALF] if hi <= RANGE_MIN else c[P_HP]
    area = c[P_SCRATCH] + (0 if c0 == 0 else 4 * c[P_AREA])
    out = carray(voidptr_at(c[P_OUT] + 4 * c0), 1, np.float32)
    src = carray(voidptr_at(c[P_SRC] + 4 * c0), 1, np.float32)
    vec = carray(voidptr_at(c[P_VEC] + 4 * c0), 1, np.float32)
    work = carray(voidptr_at(area), 1, np.float32)
    lists = carray(voidptr_at(c[P_LIST]), 1, np.int32)
    if c[P_SCATTER] == 0:
        t_order = carray(voidptr_at(c[P_T_ORDER]), 1, np.int32)
        t_starts = carray(voidptr_at(c[P_T_STARTS]), 1, np.int32)
        done = panels.gather_panels(out.ctypes, c[P_LDO], src.ctypes, c[P_LDS], lists.ctypes, c[P_LDL], c[P_N], c[P_S],
                                    c1 - c0, vec.ctypes, c[P_RELU], work.ctypes, c[P_IN], panels.PANEL, c[P_NT],
                                    t_order.ctypes, t_starts.ctypes)
    else:
        starts = carray(voidptr_at(c[P_STARTS]), 1, np.int32)
        done = panels.scatter_panels(src.ctypes, c[P_LDS], out.ctypes, c[P_LDO], lists.ctypes, starts.ctypes,
                                     c[P_N], c1 - c0, vec.ctypes, work.ctypes, c[P_IN], panels.PANEL)
    c[P_DONE + (0 if c0 == 0 else 1)] = done


def panel_chunk(ctx, lo, hi):
    """_panel_call, as the team's range function (a cfunc)."""
    _panel_call(ctx, lo, hi)


def _panel_chunk_address():
    return cfunc(types.void(types.voidptr, types.int64, types.int64), cache=True, error_model="numpy",
                 nogil=True)(panel_chunk).address


@njit(cache=True, nogil=True)
def _run_panel_halves(ctx, panel, used, in_dim, rows, n_tables, hp, work):
    """The panel call whose context ctx holds (all but P_HP, P_AREA, P_HALF, P_DONE), in
    two halves over the team or as one call on the calling thread: one call where the team
    is off, the call has fewer than two panels or under PANEL_SPLIT_MIN of work, or the
    scratch has no room for the second area past `used` (what the call's lists, codes and
    bias take). Returns the columns done (hp, or 0: see panels.py)."""
    c = carray(ctx, P_LEN, np.int64)
    area = _lists_start(in_dim, rows, n_tables)  # a call's working area: the scratch's head
    at = (panel.shape[0] - area) // 16 * 16      # the second half's, at the scratch's end
    fn = range_fn(np.int64(PANEL_SLOT))
    split = fn != 0 and hp >= 2 * panels.PANEL and work >= PANEL_SPLIT_MIN and at >= used
    c[P_HP], c[P_AREA], c[P_DONE], c[P_DONE + 1] = hp, at, 0, 0
    c[P_HALF] = hp // panels.PANEL // 2 * panels.PANEL if split else hp
    if split:
        run_range(voidptr_at(fn), ctx, 2 * RANGE_MIN, RANGE_MIN)
    else:
        _panel_call(ctx, np.int64(0), np.int64(RANGE_MIN))  # np.int64: no literal compile (learner.py)
    return hp if c[P_DONE] + c[P_DONE + 1] == hp else 0


@overload(_panel_gather, jit_options={"nogil": True})
def _panel_gather_overload(idx, W, b, out, relu, panel, groups):
    if isinstance(panel, types.NoneType) or not (W.dtype == out.dtype == b.dtype == panel.dtype == types.float32
                                                 and idx.dtype == types.int32):
        return lambda idx, W, b, out, relu, panel, groups: 0

    def run(idx, W, b, out, relu, panel, groups):
        n, s = idx.shape
        n_in = W.shape[0]
        hp = _panel_columns(idx, W, out, b, panel, n_in * panels.PANEL)
        if hp == 0:
            return 0
        rows_idx, n_t = _tables_for(idx, n_in, panel, groups)
        f, c = _fold_constant_columns(rows_idx, W, b, hp, panel,
                                      _lists_end(n_in, n, s, n_t, groups[0].shape[0] if n_t else 0), n_t > 0, groups)
        rest = rows_idx[:, f:]
        ctx = local_slots(P_LEN)
        k = carray(ctx, P_LEN, np.int64)
        k[P_SCATTER], k[P_OUT], k[P_LDO], k[P_SRC], k[P_LDS] = 0, out.ctypes.data, out.strides[0] // 4, \
            W.ctypes.data, W.strides[0] // 4
        k[P_LIST], k[P_LDL], k[P_N], k[P_S] = rest.ctypes.data, rows_idx.strides[0] // 4, n, rest.shape[1]
        k[P_VEC], k[P_RELU], k[P_SCRATCH], k[P_IN] = c.ctypes.data, 1 if relu else 0, panel.ctypes.data, n_in
        k[P_NT], k[P_T_ORDER], k[P_T_STARTS] = n_t, groups[4].ctypes.data, groups[5].ctypes.data
        used = _lists_end(n_in, n, s, n_t, groups[0].shape[0] if n_t else 0) + -(-hp // 16) * 16  # + c
        return _run_panel_halves(ctx, panel, used, n_in, n, n_t, hp, (n * rest.shape[1] + n_in) * hp)
    return run


@overload(_panel_scatter, jit_options={"nogil": True})
def _panel_scatter_overload(idx, dout, dW, db, panel):
    if isinstance(panel, types.NoneType) or not (dW.dtype == dout.dtype == db.dtype == panel.dtype == types.float32
                                                 and idx.dtype == types.int32):
        return lambda idx, dout, dW, db, panel: 0

    # W1 rows, not tables (they did not pay here: docs/performance-log.md)
    def run(idx, dout, dW, db, panel):
        n, s = idx.shape
        n_in = dW.shape[0]
        # np.int64(0), not 0: a literal would compile these twice (see learner.fused_sampled_step)
        hp = _panel_columns(idx, dW, dout, db, panel, _lists_end(n_in, n, s, np.int64(0), np.int64(0)))
        if hp == 0:
            return 0
        order, starts, cursor, _ = _list_views(panel, n_in, n, s, np.int64(0), np.int64(0))
        # A W1 row that a constant column hits in every row and nothing else hits sums all
        # of dout's rows in order: db's sum, bit for bit. Such rows are left out of the lists
        # and get db copied in; where another column hits one too, none are left out.
        f = _constant_prefix(idx)
        _rows_by_w1_row(idx[:, f:], n_in, order, starts, cursor)
        for k in range(f):
            r = idx[0, k]
            alone = starts[r + 1] == starts[r]
            for k2 in range(k):
                alone = alone and idx[0, k2] != r
            if not alone:
                f = 0
                _rows_by_w1_row(idx[:, 0:], n_in, order, starts, cursor)  # the type above: one compile
                break
        ctx = local_slots(P_LEN)
        k = carray(ctx, P_LEN, np.int64)
        k[P_SCATTER], k[P_OUT], k[P_LDO], k[P_SRC], k[P_LDS] = 1, dW.ctypes.data, dW.strides[0] // 4, \
            dout.ctypes.data, dout.strides[0] // 4
        k[P_LIST], k[P_STARTS], k[P_N], k[P_VEC] = order.ctypes.data, starts.ctypes.data, n, db.ctypes.data
        k[P_SCRATCH], k[P_IN], k[P_NT] = panel.ctypes.data, n_in, 0
        used = _lists_end(n_in, n, s, np.int64(0), np.int64(0))
        done = _run_panel_halves(ctx, panel, used, n_in, n, np.int64(0), hp, (n_in + n * (s + 1)) * hp)
        for k in range(f):
            w = dW[idx[0, k]]
            for j in range(done):
                w[j] = db[j]
        return done
    return run


@njit(cache=True, nogil=True, error_model="numpy")
def sparse_forward_panels(idx, W, b, out, relu, panel, groups):
    """sparse_forward by column panels (panels.py: float32; panel: the scratch, at least
    in*PANEL floats, panel_scratch_size for the backward too; groups: encoding.InputGroups.tables,
    or NO_GROUPS).
    The last H mod PANEL columns are summed here the same way (bias, then the stickers in
    order); when panels cover nothing (float64, no or too small a scratch, H < PANEL),
    the row kernel runs instead: so this is the sparse forward every network calls."""
    n, s = idx.shape
    h = W.shape[1]
    done = _panel_gather(idx, W, b, out, relu, panel, groups)
    if done == 0:
        sparse_forward_shared(idx, W, b, out, relu)
        return
    for i in range(n):
        for j in range(done, h):
            v = b[j]
            for k in range(s):
                v += W[idx[i, k], j]
            out[i, j] = 0 if (relu and v < 0) else v


@njit(cache=True, nogil=True, error_model="numpy")
def sparse_backward_panels(idx, dout, dW, db, panel):
    """sparse_backward by column panels (see sparse_forward_panels); every element of dW
    and db is written."""
    n, s = idx.shape
    h = dout.shape[1]
    done = _panel_scatter(idx, dout, dW, db, panel)
    if done == 0:
        sparse_backward(idx, dout, dW, db)
        return
    if done == h:
        return
    dW[:, done:] = 0
    db[done:] = 0
    for i in range(n):
        for j in range(done, h):
            d = dout[i, j]
            db[j] += d
            for k in range(s):
                dW[idx[i, k], j] += d


@njit(cache=True, nogil=True, error_model="numpy")
def sparse_backward_compact(idx, dout, G, db, mark, slot, touched, starts, terms):
    """Layer 0's gradient for lazy updates, kept compact: idx (B,S), dout (B,H) -> the n
    distinct rows this batch touched listed ascending in touched[:n] (n is returned), G[k]
    (H,) = dLoss/dW[touched[k]], db (H,) = column sums of dout. G is (B*S, H) or more.

    The rest of dW is zero and never stored: the work and the memory scale with the batch,
    not with the input width (the one pass over mark is 1 byte per input row), which is
    what makes wide sparse inputs such as slot pairs cheap. mark (in,) uint8 is all zero
    between calls; slot (in,) int32, starts (B*S + 2,) and terms (B*S,) int32 are scratch.
    G's rows stay in one small block that is
    reused every step instead of rows scattered over an (in,H) gradient that each step had
    to clear and the optimizer then read back: with the lazy Adam 1.04-1.08x at the cube2
    preset's shape (scripts/bench_lazy_rows.py), the preset step's backward first layer
    0.76 -> 0.63 ms, and 6.7 MB less memory there. Ascending rows matter:
    the optimizer walks the parameters and moments in address order, which ran its lazy
    Adam ~20% faster than first-use order (1,700 rows of 9,261 x 256, measured).

    Each row of G is summed whole and stored once (compact_sums): its terms, the batch rows
    that touch it, are listed first, row by row in batch order (a stable counting sort of
    the B*S terms: terms[starts[k]:starts[k + 1]]). Sums are zero, then the batch rows in
    order: the same as sparse_backward's. At the preset's shape the block (1.7 MB) does not
    fit in L2, and adding each term into it after a pass that zeroed it (a memset of 2.4-2.6%
    of the preset loop's samples under perf) went through L3 each time. Against that, in
    process (runs/perf41/compact_ab.py, each call after a 4 MB sweep, 15 alternating
    rounds, two runs): 1.70x / 1.69x; in the preset's loop, the backward's first-layer
    part 1.29-1.71x in four runs (preset_ab.py, 11-21 alternating rounds of 300 steps),
    while the optimizer phase read 2-12% slower and the whole step 0.97-1.06x. Written in
    descending row order the backward part ran 0.70x / 0.83x of ascending.
    """
    n, s = idx.shape
    for i in range(n):
        for k in range(s):
            mark[idx[i, k]] = 1
    n_rows = 0
    for r in range(mark.shape[0]):
        if mark[r]:
            mark[r] = 0
            slot[r] = n_rows
            touched[n_rows] = r
            n_rows += 1
    for t in range(n_rows + 2):  # starts[t + 2]: row t's count, then the running sums
        starts[t] = 0
    for i in range(n):
        for k in range(s):
            starts[slot[idx[i, k]] + 2] += 1
    for t in range(2, n_rows + 2):
        starts[t] += starts[t - 1]
    for i in range(n):  # starts[t + 1] moves from row t's start to its end, row t + 1's start
        for k in range(s):
            c = slot[idx[i, k]] + 1
            terms[starts[c]] = i
            starts[c] += 1
    if not compact_sums_shared(dout, G, starts, terms, n_rows):
        compact_sums(dout, G, starts, terms, 0, n_rows)
    column_sums(dout, db)
    return n_rows


@njit(cache=True, nogil=True, error_model="numpy")
def column_sums(dout, db):
    """db (H,) = zero, then dout's (B,H) rows in order (sparse_backward's sums)."""
    for j in range(dout.shape[1]):
        db[j] = 0
    for i in range(dout.shape[0]):
        d = dout[i]
        for j in range(dout.shape[1]):
            db[j] += d[j]


@njit(cache=True, nogil=True, error_model="numpy")
def compact_sums(dout, G, starts, terms, t0, t1):
    """Rows [t0, t1) of sparse_backward_compact's G: row t is zero, then dout's rows
    terms[starts[t]:starts[t + 1]] in order, stored once. The first term is stored as
    0 + d, the bits of adding it to zero (0 + -0.0 is +0.0)."""
    h = dout.shape[1]
    zero = G.dtype.type(0)
    for t in range(t0, t1):
        g = G[t]
        a, b = starts[t], starts[t + 1]
        d = dout[terms[a]]
        for j in range(h):
            g[j] = zero + d[j]
        for q in range(a + 1, b):
            d = dout[terms[q]]
            for j in range(h):
                g[j] += d[j]


# The lazy backward's row sums over the team: chunks of whole touched rows, each summing
# its own rows from their lists of terms. Split by columns, every row was
# written by both cores (167 us against 103 alone); by rows it pays since the team's
# chunks go to the same threads every call (the cube2 preset's backward first layer
# 0.164 -> 0.096 ms; docs/performance-log.md, stop 37).
SCATTER_SLOT = 1  # its slot in blas's range-function table
C_DOUT, C_G, C_STARTS, C_TERMS, C_ROWS, C_H, C_G_ROWS, C_N_TERMS = range(8)  # context slots
C_LEN = 8


def scatter_chunk(ctx, lo, hi):
    """compact_sums on rows [lo / h, hi / h) of the context's G (float32, int32 lists)."""
    c = carray(ctx, C_LEN, np.int64)
    n, h, n_terms = c[C_ROWS], c[C_H], c[C_N_TERMS]
    dout = carray(voidptr_at(c[C_DOUT]), (n, h), np.float32)
    G = carray(voidptr_at(c[C_G]), (c[C_G_ROWS], h), np.float32)
    starts = carray(voidptr_at(c[C_STARTS]), n_terms + 2, np.int32)
    terms = carray(voidptr_at(c[C_TERMS]), n_terms, np.int32)
    compact_sums(dout, G, starts, terms, lo // h, hi // h)


def _scatter_chunk_address():
    return cfunc(types.void(types.voidptr, types.int64, types.int64), cache=True, error_model="numpy",
                 nogil=True)(scatter_chunk).address


def compact_sums_shared(dout, G, starts, terms, n_rows):
    """Whether G[:n_rows] of sparse_backward_compact was summed by the team's threads
    (float32 and int32 operands in C order, the team on and enough rows); False: nothing
    done, the caller sums. From Python: False."""
    return False


@overload(compact_sums_shared, jit_options={"nogil": True})
def _compact_sums_shared_overload(dout, G, starts, terms, n_rows):
    if not (starts.dtype == terms.dtype == types.int32 and dout.dtype == G.dtype == types.float32 and
            dout.layout == G.layout == starts.layout == terms.layout == "C"):
        return lambda dout, G, starts, terms, n_rows: False

    def shared(dout, G, starts, terms, n_rows):
        h = dout.shape[1]
        fn = range_fn(np.int64(SCATTER_SLOT))
        if fn == 0 or n_rows * h < RANGE_MIN:
            return False
        ctx = local_slots(C_LEN)
        c = carray(ctx, C_LEN, np.int64)
        c[C_DOUT], c[C_G], c[C_STARTS], c[C_TERMS] = dout.ctypes.data, G.ctypes.data, starts.ctypes.data, \
            terms.ctypes.data
        c[C_ROWS], c[C_H], c[C_G_ROWS], c[C_N_TERMS] = dout.shape[0], h, G.shape[0], starts[n_rows + 1]
        run_range(voidptr_at(fn), ctx, n_rows * h, h)
        return True
    return shared


@njit(cache=True, nogil=True, error_model="numpy")
def dense_forward(x, W, b, out, relu, halves):
    """x (B,in), W (in,out), b (out,) -> out (B,out) = x @ W + b, then ReLU if relu.
    halves: x's rows i and i + B/2 are alike (blas.gemm_bias_relu's hint)."""
    if gemm_bias_relu(x, W, b, out, relu, halves):  # the tile GEMM, bias and ReLU in its stores
        return
    gemm(x, W, out)
    n, h = out.shape
    for i in range(n):
        o = out[i]
        for j in range(h):
            v = o[j] + b[j]
            o[j] = v if (v > 0 or not relu) else 0


@njit(cache=True, nogil=True, error_model="numpy")
def dense_backward(x, dout, W, dW, db, dx, x_is_relu):
    """Given dout (B,out): dW = x.T @ dout, db = sum rows, dx = (dout @ W.T) * (x > 0).

    dx may have zero rows to skip the input gradient (first layer).
    """
    gemm(x.T, dout, dW)
    n, h = dout.shape
    db[:] = 0
    for i in range(n):
        for j in range(h):
            db[j] += dout[i, j]
    if dx.shape[0] > 0:
        gemm(dout, W.T, dx)
        if x_is_relu:
            # a select and a store for every element: LLVM vectorises this, not a store
            # under an if (8.1 against 1.8 us on a 64 x 256 block, one-off timing)
            m, c = dx.shape
            for i in range(m):
                xi, di = x[i], dx[i]
                for j in range(c):
                    di[j] = 0 if xi[j] <= 0 else di[j]


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"}, error_model="numpy")
def head_forward_picked(x, W, b, picks, wt, q):
    """One Q-value per row of a linear head: q[i, picks[i]] = b[a] + x[i] @ W[:, a] with
    a = picks[i]; x (B,in), W (in,A), picks (B,), q (B,A), whose other columns are left
    as they are. wt (A+1, >=in and >=A) gets W transposed and, in its row A, b: the head as
    this forward used it (Workspace.head_t[0]; Learner.last_mean_q reads it after the step's
    update has changed the head).

    Why: a sampled-targets step reads one value of most of its head rows: the online net's
    Q(s, a) at the taken action and, for double targets, the target net's Q(s', a*) at the
    online net's choice. The full head on such rows is a product of N = 12, a quarter of a
    vector's lanes idle (at the 2x2x2's 256 -> 12, 64 rows: 4.8 us alone against 2.0;
    512 -> 12, 256 rows: 37 against 9; runs/perf47/picked_proto2.txt).
    Bits: each dot is summed in vector lanes, then across them (reassociated), not in the
    tile's order over k: within a few ulps of the full head's value, not equal to it."""
    h, a_n = W.shape
    for a in range(a_n):
        col = wt[a]
        for j in range(h):
            col[j] = W[j, a]
        wt[a_n, a] = b[a]
    for i in range(picks.shape[0]):
        a = picks[i]
        xi, w = x[i], wt[a]
        s = x.dtype.type(0)
        for j in range(h):
            s += xi[j] * w[j]
        q[i, a] = s + b[a]


@njit(cache=True, nogil=True, error_model="numpy")
def head_backward_taken(x, dout, taken, W, dW, db, dx, head_t):
    """dense_backward of a Q head whose dout row i is zero but at action taken[i] (what
    loss_taken leaves): x (B,in) post-ReLU, dout (B,A), W (in,A) -> dW = x.T @ dout,
    db = column sums of dout, dx = (dout @ W.T) * (x > 0), without the two GEMMs.
    head_t (2, >=A, >=in): scratch for W and dW transposed (Workspace.head_t).

    Why: at the 2x2x2's 256 -> 12 head and a batch of 64 the GEMMs on a dout that is 11/12
    zeros took 17-25 us of a 0.7 ms step (K = 12 for dx, N = 12 for dW); this, 6-11 us (its
    rows are contiguous in the transposes). Bits: the tile GEMM sums each element with
    fma over k from zero in order; a zero term adds nothing (to +0 it adds +0, the only
    zero such sums hold), so summing the nonzero terms alone, in the same order, gives the
    same floats (tests/test_nn.py)."""
    n, a_n = dout.shape
    h = x.shape[1]
    Wt, dWt = head_t[0], head_t[1]
    for j in range(h):
        for a in range(a_n):
            Wt[a, j] = W[j, a]
    for a in range(a_n):
        db[a] = 0
        col = dWt[a]
        for j in range(h):
            col[j] = 0
    for i in range(n):
        a = taken[i]
        g = dout[i, a]
        db[a] += g
        xi, di, col, w = x[i], dx[i], dWt[a], Wt[a]
        for j in range(h):
            col[j] = fma(xi[j], g, col[j])
            v = w[j] * g + 0  # + 0: the GEMM's sum starts from +0, so a -0 product comes out +0
            di[j] = 0 if xi[j] <= 0 else v
    for j in range(h):
        for a in range(a_n):
            dW[j, a] = dWt[a, j]


@njit(cache=True, nogil=True, error_model="numpy")
def dueling_forward(head, q):
    """head (B, A+1) = [advantages, value] -> q (B,A) = V + A - mean(A)."""
    n, a = q.shape
    for i in range(n):
        m = 0.0
        for j in range(a):
            m += head[i, j]
        m /= a
        for j in range(a):
            q[i, j] = head[i, a] + head[i, j] - m


@njit(cache=True, nogil=True, error_model="numpy")
def dueling_backward(dq, dhead):
    n, a = dq.shape
    for i in range(n):
        s = 0.0
        for j in range(a):
            s += dq[i, j]
        for j in range(a):
            dhead[i, j] = dq[i, j] - s / a
        dhead[i, a] = s


# ---------------------------------------------------------------------------------------
# Whole-network kernels, each direction in two calls (the first layer, then layers 1..L-1)
# so that a profile can time them apart; Ws/bs/acts/deltas are tuples of views

@njit(cache=True, nogil=True, error_model="numpy")
def mlp_forward_first(idx, x, sparse, Ws, bs, acts, rows, panel, groups):
    """Layer 0 over the first `rows` rows: idx (B,S) if sparse else x (B,in) -> acts[0].
    panel, groups: the workspace's panel scratch and tables (see Workspace); empty: the
    row gather; None: the row gather, compiled without the panel code."""
    L = len(Ws)
    if sparse:
        sparse_forward_panels(idx[:rows], Ws[0], bs[0], acts[0][:rows], L > 1, panel, groups)
    else:
        dense_forward(x[:rows], Ws[0], bs[0], acts[0][:rows], L > 1, np.bool_(False))


@njit(cache=True, nogil=True, error_model="numpy")
def mlp_forward_upper(Ws, bs, acts, rows, halves, picks, wt):
    """Layers 1 .. L-1 (one GEMM each) from acts[0] to the head acts[-1]. halves: the rows
    are s, then s' (the online forward of a double-DQN step), whose hidden rows i and
    i + rows/2 share more zeros than neighbours do (see blas.gemm_bias_relu).
    picks (P,), P <= rows (NO_PICKS: none; L > 1): the head's rows [0, P) get one value
    each, at column picks[i] (head_forward_picked, wt its scratch), the rest all of theirs."""
    L = len(Ws)
    for l in range(1, L - 1):
        dense_forward(acts[l - 1][:rows], Ws[l], bs[l], acts[l][:rows], np.bool_(True), halves)
    if L > 1:
        p = picks.shape[0]
        if p < rows:  # a row's values do not depend on the rows beside it (the tile's sums)
            dense_forward(acts[L - 2][p:rows], Ws[L - 1], bs[L - 1], acts[L - 1][p:rows], np.bool_(False),
                          halves if p == 0 else np.bool_(False))
        if p > 0:
            head_forward_picked(acts[L - 2][:p], Ws[L - 1], bs[L - 1], picks, wt, acts[L - 1][:p])


@njit(cache=True, nogil=True, error_model="numpy")
def mlp_backward_upper(Ws, acts, deltas, dWs, dbs, rows, taken, head_t):
    """Backward from deltas[-1] (dLoss/dhead, first `rows` rows) through layers L-1 .. 1 into
    dWs/dbs (overwritten), leaving dLoss/d(first layer output) in deltas[0]; then
    mlp_backward_first does layer 0. Uses deltas[:-1] as scratch. taken (B,): where
    deltas[-1]'s rows are zero but at these actions (loss_taken, no dueling head), the
    head's backward without its GEMMs (head_backward_taken, with the workspace's head_t);
    empty (NO_TAKEN), or shorter than rows: any deltas[-1]."""
    L = len(Ws)
    top = L - 1
    if 0 < rows <= taken.shape[0] and L > 1:
        head_backward_taken(acts[L - 2][:rows], deltas[L - 1][:rows], taken, Ws[L - 1], dWs[L - 1], dbs[L - 1],
                            deltas[L - 2][:rows], head_t)
        top = L - 2
    for l in range(top, 0, -1):
        dense_backward(acts[l - 1][:rows], deltas[l][:rows], Ws[l], dWs[l], dbs[l],
                       deltas[l - 1][:rows], np.bool_(True))


@njit(cache=True, nogil=True, error_model="numpy")
def mlp_backward_first(idx, x, sparse, Ws, deltas, dWs, dbs, rows, panel):
    """Layer 0's gradient from deltas[0] (dLoss/d its output, first `rows` rows)."""
    if sparse:
        sparse_backward_panels(idx[:rows], deltas[0][:rows], dWs[0], dbs[0], panel)
    else:
        dense_backward(x[:rows], deltas[0][:rows], Ws[0], dWs[0], dbs[0], deltas[0][:0], np.bool_(False))


# ---------------------------------------------------------------------------------------
# Losses on the Q head. loss = scale * sum_i w_i * sum_terms l(q - y); dq gets dLoss/dq.

@njit(cache=True, nogil=True, error_model="numpy")
def _elem_loss(d, kind):
    """(loss, dloss/dd) for residual d: Huber (delta 1, smooth L1) or 0.5 d^2."""
    if kind == 0:
        ad = abs(d)
        if ad <= 1.0:
            return 0.5 * d * d, d
        return ad - 0.5, (1.0 if d > 0 else -1.0)
    return 0.5 * d * d, d


@njit(cache=True, nogil=True, error_model="numpy")
def loss_taken(q, actions, targets, weights, scale, kind, dq, td, rows):
    """Loss on the taken action's Q. q,dq (B,A); actions,targets,weights,td (B,).

    dq is fully written (zero except the taken action); td = q_taken - target.
    """
    loss = 0.0
    for i in range(rows):
        a = actions[i]
        d = q[i, a] - targets[i]
        td[i] = d
        l, g = _elem_loss(d, kind)
        loss += weights[i] * l
        for j in range(q.shape[1]):
            dq[i, j] = 0
        dq[i, a] = weights[i] * g * scale
    return loss * scale


@njit(cache=True, nogil=True, error_model="numpy")
def loss_full(q, targets, weights, scale, kind, dq, td, rows):
    """Loss on every action's Q against a target vector: q, targets, dq (B,A); td (B,) = max |q - y|."""
    loss = 0.0
    n_a = q.shape[1]
    for i in range(rows):
        m = 0.0
        for j in range(n_a):
            d = q[i, j] - targets[i, j]
            if abs(d) > m:
                m = abs(d)
            l, g = _elem_loss(d, kind)
            loss += weights[i] * l
            dq[i, j] = weights[i] * g * scale
        td[i] = m
    return loss * scale


# ---------------------------------------------------------------------------------------
# The network object: parameters + views + helpers. Kernels above never see this class.

class MLP:
    """Parameters (flat) and their views; `forward_ws` runs a workspace's rows.

    Q-values of cube states in their own frame come from `encoding.Policy`, which adds
    the input encoding (and the 2x2x2 orientation relabelling) around this class.
    """

    def __init__(self, layout: Layout, params: np.ndarray | None = None, seed: int = 0,
                 dtype=np.float32, sparse: bool = True):
        self.layout = layout
        self.dtype = np.dtype(dtype)
        self.sparse = sparse
        if params is None:
            self.params = init_params(layout, np.random.default_rng(seed), self.dtype)
        else:  # a copy, in an aligned buffer
            self.params = aligned_zeros(layout.size, self.dtype)
            self.params[:] = np.asarray(params).reshape(-1)
        self.Ws, self.bs = views(self.params, layout)

    def workspace(self, rows: int, groups=None) -> Workspace:
        return Workspace(self.layout, rows, self.dtype, dense_input=not self.sparse, groups=groups)

    def forward_ws(self, ws: Workspace, rows: int, laps=None, halves=False, picks=None):
        """Q-values of the workspace's first `rows` input rows. laps (learner.Laps), if given,
        is told when the first layer and when the GEMM layers are done; halves: rows i and
        i + rows/2 are a state and its successor; picks (P,) int64: rows [0, P) get only
        their value at action picks[i], the other columns are stale (mlp_forward_upper; no
        dueling head, two layers or more)."""
        if picks is None:
            picks = NO_PICKS
        elif len(picks) and (self.layout.dueling or self.layout.n_layers < 2 or len(picks) > rows):
            raise ValueError("picks: a plain head after a hidden layer, at most one per row")
        mlp_forward_first(ws.idx, ws.x, self.sparse, self.Ws, self.bs, ws.acts, rows, ws.panel, ws.groups)
        if laps is not None:
            laps.lap("first layer")
        mlp_forward_upper(self.Ws, self.bs, ws.acts, rows, bool(halves), picks, ws.head_t[0])
        if self.layout.dueling:
            dueling_forward(ws.acts[-1][:rows], ws.q[:rows])
        if laps is not None:
            laps.lap("GEMM layers")
        return ws.q[:rows]


# at the end: where the team already runs, this compiles gather_chunk now, and what it
# calls must be defined by then
share_range_fn(GATHER_SLOT, _gather_chunk_address)
share_range_fn(SCATTER_SLOT, _scatter_chunk_address)
share_range_fn(PANEL_SLOT, _panel_chunk_address, wanted=False)  # Workspace wants it where it has a panel scratch
