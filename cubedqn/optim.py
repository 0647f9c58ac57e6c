"""Fused optimizers over the flat parameter buffer: SGD, momentum, Nesterov, Adam, AdamW.

What this file is: one pass to measure the gradient norm (float32 partial sums of scaled
squares, float64 total: sq_norm) and one fused pass per step that scales by the clip
factor, applies weight decay and updates parameters and optimizer state, with no temporary
arrays; for float32 that pass runs in chunks on the GEMM team's threads where it runs
(update_chunk_*, below). Learning-rate schedules (constant, linear, cosine) are evaluated
once per step in Python.

Conventions follow PyTorch: momentum v = mu*v + g, p -= lr*v (Nesterov: p -= lr*(g + mu*v));
Adam with bias correction; AdamW decays weights by lr*wd before the Adam step; for the
other optimizers weight_decay is L2 added to the gradient.

Clipping: `clip="global"` scales all gradients by min(1, max_grad_norm/||g||) (the seed's
sgdStepClipped). `clip="layer"` clips each layer's (W, b) gradient to max_grad_norm on its
own; it is the rule the LOMO mode uses, because there each layer is updated before the
gradients of the layers below it exist, so the global norm is not yet known.

Kernels use error_model="numpy" (no divide-by-zero branch) and fastmath so they vectorise.
Optimizer state below 1e-30 is flushed to zero: parameters whose gradient is usually zero
(rarely active inputs) otherwise decay their moments geometrically into subnormal floats,
which x86 handles ~9x slower (measured here: Adam 2.2 ms vs 0.25 ms on 106k parameters;
a third of the first moments of a trained 2x2x2 run were subnormal).
"""

from __future__ import annotations

import math

import numpy as np
from numba import carray, cfunc, njit, types
from numba.extending import overload

from . import sums
from .blas import prefetch, run_range, voidptr_at
from .nn import aligned_zeros

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")
SCHEDULES = ("constant", "linear", "cosine")
CLIPS = ("global", "layer", "none")
_CHUNK = 4096


@njit(cache=True, error_model="numpy")
def sq_norm(g):
    """Sum of squares of a 1-D float32 or float64 array (a gradient's squared norm), as a
    float64: sums.py's IR, in blocks of scaled squares in vector lanes, then a float64
    total, in an order it writes down, so that every process gets the same bits (a
    reassociating Numba loop did not: a cached caller's copy summed another way than a
    freshly compiled one, sums.py). On the small net's 106k values, hot, 4.5 us (the
    fast-math loop it replaced: 4.1; runs/perf53/sq_check.txt). A strided array is copied
    first."""
    if not g.flags.c_contiguous:
        g = np.ascontiguousarray(g)
    if g.itemsize == 4:
        return sums.sq_norm_f32(g.ctypes, g.shape[0])
    return sums.sq_norm_f64(g.ctypes, g.shape[0])


@njit(cache=True, fastmath=True, error_model="numpy")
def sgd_update(p, g, scale, lr, wd):
    for i in range(p.shape[0]):
        p[i] -= lr * (g[i] * scale + wd * p[i])


@njit(cache=True, fastmath=True, error_model="numpy")
def momentum_update(p, g, buf, scale, lr, mu, nesterov, wd):
    tiny = buf.dtype.type(1e-30)
    zero = buf.dtype.type(0)
    for i in range(p.shape[0]):
        gi = g[i] * scale + wd * p[i]
        b = mu * buf[i] + gi
        if abs(b) < tiny:
            b = zero
        buf[i] = b
        if nesterov:
            p[i] -= lr * (gi + mu * b)
        else:
            p[i] -= lr * b


@njit(cache=True, fastmath=True, error_model="numpy")
def adam_constants(m, lr, b1, b2, eps, bc1, bc2, scale, wd, decoupled):
    """Adam's per-step constants in the dtype of its moments m. p -= lr / bc1 * m /
    (sqrt(v / bc2) + eps) is computed as step * m / (sqrt(v) + eps_b), with step =
    lr sqrt(bc2) / bc1 and eps_b = eps sqrt(bc2): the same quantity, two multiplies fewer
    per parameter. keep is AdamW's decay factor 1 - lr wd (1 without it); plain says
    whether the step can take adam_plain (scale 1, as clipping leaves most steps, and no
    L2 term in the gradient)."""
    one = m.dtype.type(1)
    root = np.sqrt(bc2)
    keep = one - lr * wd if decoupled else one
    plain = scale == one and (decoupled or wd == 0)
    return lr * root / bc1, eps * root, one - b1, one - b2, keep, plain


@njit(cache=True, fastmath=True, error_model="numpy")
def adam_moments(m, v, i, gi, b1, b2, c1, c2):
    """Both Adam loops' moment update of element i from its gradient gi; returns the new
    (m, v). Moments below 1e-30 are flushed to zero: they would decay into subnormals."""
    # every constant in the buffer's dtype: a float64 one would turn the float32 loop into
    # mixed-precision arithmetic and halve its vector width
    tiny = m.dtype.type(1e-30)
    zero = m.dtype.type(0)
    mi = b1 * m[i] + c1 * gi
    vi = b2 * v[i] + c2 * (gi * gi)
    mi = zero if abs(mi) < tiny else mi
    vi = zero if vi < tiny else vi
    m[i] = mi
    v[i] = vi
    return mi, vi


@njit(cache=True, fastmath=True, error_model="numpy")
def adam_plain(p, g, m, v, b1, b2, c1, c2, step, eps_b, keep):
    """The Adam loop of a step with scale 1 and no L2 term (keep: AdamW's decay, else 1;
    a second loop without that multiply would save 4% of this one's time and cost compile
    time in every kernel that holds it)."""
    for i in range(p.shape[0]):
        mi, vi = adam_moments(m, v, i, g[i], b1, b2, c1, c2)
        p[i] = keep * p[i] - step * mi / (np.sqrt(vi) + eps_b)


@njit(cache=True, fastmath=True, error_model="numpy")
def adam_scaled(p, g, m, v, scale, b1, b2, c1, c2, step, eps_b, keep, wd, decoupled):
    """The Adam loop of any step: the gradient scaled, L2 decay added (decoupled=False) or
    the parameter decayed by `keep` first (AdamW)."""
    for i in range(p.shape[0]):
        gi = g[i] * scale
        if decoupled:
            p[i] *= keep
        else:
            gi += wd * p[i]
        mi, vi = adam_moments(m, v, i, gi, b1, b2, c1, c2)
        p[i] -= step * mi / (np.sqrt(vi) + eps_b)


@njit(cache=True, fastmath=True, error_model="numpy")
def adam_update(p, g, m, v, scale, lr, b1, b2, eps, bc1, bc2, wd, decoupled):
    """Adam (decoupled=False: L2 wd into g) / AdamW (decoupled=True). bc1/bc2 = 1 - beta^t.
    Against the single loop these two replaced, on 106k float32 parameters: the plain loop
    1.23-1.26x (AdamW 1.13-1.93x), the scaled one 1.10x (docs/performance-log.md, stop 30)."""
    step, eps_b, c1, c2, keep, plain = adam_constants(m, lr, b1, b2, eps, bc1, bc2, scale, wd, decoupled)
    if plain:
        adam_plain(p, g, m, v, b1, b2, c1, c2, step, eps_b, keep)
    else:
        adam_scaled(p, g, m, v, scale, b1, b2, c1, c2, step, eps_b, keep, wd, decoupled)


# The whole step as kernels: what Optimizer.step runs, and the learner's fused step with it.
KIND_CODES = {"sgd": 0, "momentum": 1, "nesterov": 2, "adam": 3, "adamw": 4}
CLIP_CODES = {"global": 0, "layer": 1, "none": 2}
KIND_NESTEROV, KIND_ADAMW = KIND_CODES["nesterov"], KIND_CODES["adamw"]  # as njit code reads them


@njit(cache=True, error_model="numpy")
def update_slice(kind, p, g, m, v, scale, lr, mu, b1, b2, eps, bc1, bc2, wd):
    """The update of one slice (kind: KIND_CODES); m and v are the slice's state (empty
    where the kind keeps none); scalars in the parameters' dtype."""
    if kind == 0:
        sgd_update(p, g, scale, lr, wd)
    elif kind <= 2:
        momentum_update(p, g, m, scale, lr, mu, kind == 2, wd)
    else:
        adam_update(p, g, m, v, scale, lr, b1, b2, eps, bc1, bc2, wd, kind == 4)


# The update over chunks of the flat buffer. With the GEMM team on (--threads 2 and up), the
# caller alone updating the weights whose lines the worker had read in the GEMMs took the
# small net's optimizer phase from 0.028 ms a step on one thread to 0.064-0.067 (each such
# line must leave the other core's cache first; docs/performance-log.md, stops 35 and 36).
# So the float32 update goes through blas.run_range: chunks of whole RANGE_GRAIN elements,
# shared by the team's threads where it runs, or one call of the whole range. Every call,
# one thread or several, runs the same compiled update_chunk_* (a cfunc) on element ranges
# that start at multiples of RANGE_GRAIN, so each element takes the same code path (the
# vector loop or its tail) whichever thread runs it: the same bits on any thread count.
# The same for the row-sparse update (update_rows_flat): chunks of whole rows of the touched
# list. The context: a CTX_LEN-slot int64 array, the update's arrays and scalars (floats in
# the float64 slots of the same buffer, read as such); CTX_WIDTH 0 for the dense update.
CTX_FN, CTX_KIND, CTX_P, CTX_G, CTX_M, CTX_V, CTX_M_LEN, CTX_V_LEN = range(8)  # int64 slots
CTX_P_LEN, CTX_ROWS, CTX_WIDTH = range(8, 11)
CTX_SCALE, CTX_LR, CTX_MU, CTX_B1, CTX_B2, CTX_EPS, CTX_BC1, CTX_BC2, CTX_WD = range(11, 20)  # float64 slots
CTX_LEN = 20
RANGE_GRAIN = 1024  # elements: a whole number of every vector loop's steps (16 floats x unroll)


@njit(cache=True, error_model="numpy")
def chunk_buffers(ctx, hi):
    """What an update_chunk_* reads from the context: (kind, width, p, g[:hi], m, v,
    (scale, lr, mu, b1, b2, eps, bc1, bc2, wd)), float32 arrays and scalars."""
    c = carray(ctx, CTX_LEN, np.int64)
    f = carray(ctx, CTX_LEN, np.float64)
    p = carray(voidptr_at(c[CTX_P]), c[CTX_P_LEN], np.float32)
    m = carray(voidptr_at(c[CTX_M]), c[CTX_M_LEN], np.float32)  # empty where the kind keeps none
    v = carray(voidptr_at(c[CTX_V]), c[CTX_V_LEN], np.float32)
    g = carray(voidptr_at(c[CTX_G]), hi, np.float32)
    f32 = np.float32
    scalars = (f32(f[CTX_SCALE]), f32(f[CTX_LR]), f32(f[CTX_MU]), f32(f[CTX_B1]), f32(f[CTX_B2]), f32(f[CTX_EPS]),
               f32(f[CTX_BC1]), f32(f[CTX_BC2]), f32(f[CTX_WD]))
    return c[CTX_KIND], c[CTX_WIDTH], p, g, m, v, scalars


@njit(cache=True, error_model="numpy")
def chunk_rows(ctx, lo, hi, width):
    """The touched rows [r0, r1) of a row-sparse chunk [lo, hi) and the touched list."""
    r0, r1 = lo // width, hi // width
    return r0, r1, carray(voidptr_at(carray(ctx, CTX_LEN, np.int64)[CTX_ROWS]), r1, np.int64)


# One cfunc per family, so that a run compiles only its optimizer's updates (one cfunc
# for all five added 0.8 s to a cold start, docs/performance-log.md, stop 36): each runs
# the family's dense update on elements [lo, hi) (CTX_WIDTH 0), or its row-sparse update
# on the touched rows [lo / width, hi / width).
def update_chunk_sgd(ctx, lo, hi):
    kind, width, p, g, m, v, (scale, lr, mu, b1, b2, eps, bc1, bc2, wd) = chunk_buffers(ctx, hi)
    if width == 0:
        sgd_update(p[lo:hi], g[lo:hi], scale, lr, wd)
    else:
        r0, r1, touched = chunk_rows(ctx, lo, hi, width)
        sgd_update_rows(p, g[r0 * width:], touched[r0:], r1 - r0, width, scale, lr, wd)


def update_chunk_momentum(ctx, lo, hi):
    kind, width, p, g, m, v, (scale, lr, mu, b1, b2, eps, bc1, bc2, wd) = chunk_buffers(ctx, hi)
    nesterov = kind == KIND_NESTEROV
    if width == 0:
        momentum_update(p[lo:hi], g[lo:hi], m[lo:hi], scale, lr, mu, nesterov, wd)
    else:
        r0, r1, touched = chunk_rows(ctx, lo, hi, width)
        momentum_update_rows(p, g[r0 * width:], m, touched[r0:], r1 - r0, width, scale, lr, mu, nesterov, wd)


def update_chunk_adam(ctx, lo, hi):
    kind, width, p, g, m, v, (scale, lr, mu, b1, b2, eps, bc1, bc2, wd) = chunk_buffers(ctx, hi)
    decoupled = kind == KIND_ADAMW
    if width == 0:
        adam_update(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], scale, lr, b1, b2, eps, bc1, bc2, wd, decoupled)
    else:
        r0, r1, touched = chunk_rows(ctx, lo, hi, width)
        adam_update_rows(p, g[r0 * width:], m, v, touched[r0:], r1 - r0, width, scale, lr, b1, b2, eps, bc1, bc2,
                         wd, decoupled)


CHUNK_FAMILIES = {"sgd": update_chunk_sgd, "momentum": update_chunk_momentum, "nesterov": update_chunk_momentum,
                  "adam": update_chunk_adam, "adamw": update_chunk_adam}
_CHUNK_CFUNCS = {}  # family function -> its cfunc, compiled (or loaded from numba's cache) at first use


def update_chunk_address(kind: str) -> int:
    """Address of the optimizer kind's update_chunk_* as a void(voidptr, int64, int64) cfunc."""
    fn = CHUNK_FAMILIES[kind]
    if fn not in _CHUNK_CFUNCS:
        _CHUNK_CFUNCS[fn] = cfunc(types.void(types.voidptr, types.int64, types.int64), cache=True,
                                  error_model="numpy")(fn)
    return _CHUNK_CFUNCS[fn].address


def update_flat(ctx, kind, p, g, m, v, scale, lr, mu, b1, b2, eps, bc1, bc2, wd):
    """update_slice over whole flat buffers: float32 ones through the context ctx (see
    above), others (float64: gradient checks) in place."""


@overload(update_flat, jit_options={"nogil": True})
def _update_flat_overload(ctx, kind, p, g, m, v, scale, lr, mu, b1, b2, eps, bc1, bc2, wd):
    if p.dtype != types.float32:
        def in_place(ctx, kind, p, g, m, v, scale, lr, mu, b1, b2, eps, bc1, bc2, wd):
            update_slice(kind, p, g, m, v, scale, lr, mu, b1, b2, eps, bc1, bc2, wd)
        return in_place

    def via_range(ctx, kind, p, g, m, v, scale, lr, mu, b1, b2, eps, bc1, bc2, wd):
        fill_context(ctx, kind, p, g, m, v, np.int64(0), np.int64(0), scale, lr, mu, b1, b2, eps, bc1, bc2, wd)
        run_range(voidptr_at(ctx[CTX_FN]), voidptr_at(ctx.ctypes.data), p.shape[0], RANGE_GRAIN)
    return via_range


@njit(cache=True, error_model="numpy")
def fill_context(ctx, kind, p, g, m, v, rows, width, scale, lr, mu, b1, b2, eps, bc1, bc2, wd):
    """update_chunk_*'s context for this update (the function slot is set once, by the Optimizer)."""
    f = ctx.view(np.float64)
    ctx[CTX_KIND] = kind
    ctx[CTX_P], ctx[CTX_G], ctx[CTX_M], ctx[CTX_V] = p.ctypes.data, g.ctypes.data, m.ctypes.data, v.ctypes.data
    ctx[CTX_P_LEN], ctx[CTX_M_LEN], ctx[CTX_V_LEN] = p.shape[0], m.shape[0], v.shape[0]
    ctx[CTX_ROWS], ctx[CTX_WIDTH] = rows, width
    f[CTX_SCALE], f[CTX_LR], f[CTX_MU], f[CTX_B1], f[CTX_B2] = scale, lr, mu, b1, b2
    f[CTX_EPS], f[CTX_BC1], f[CTX_BC2], f[CTX_WD] = eps, bc1, bc2, wd


def update_rows_flat(ctx, kind, p, g, m, v, touched, n, width, scale, lr, mu, b1, b2, eps, bc1, bc2, wd):
    """update_rows over rows touched[:n]: float32 buffers (int64 rows) through the context (chunks of
    whole rows, shared by the team's threads where it runs; a row's update is the same code
    whichever thread runs it: the same bits), others in place."""


@overload(update_rows_flat, jit_options={"nogil": True})
def _update_rows_flat_overload(ctx, kind, p, g, m, v, touched, n, width, scale, lr, mu, b1, b2, eps, bc1, bc2, wd):
    if p.dtype != types.float32 or touched.dtype != types.int64:
        def in_place(ctx, kind, p, g, m, v, touched, n, width, scale, lr, mu, b1, b2, eps, bc1, bc2, wd):
            update_rows(kind, p, g, m, v, touched, n, width, scale, lr, mu, b1, b2, eps, bc1, bc2, wd)
        return in_place

    def via_range(ctx, kind, p, g, m, v, touched, n, width, scale, lr, mu, b1, b2, eps, bc1, bc2, wd):
        fill_context(ctx, kind, p, g, m, v, np.int64(touched.ctypes.data), width, scale, lr, mu, b1, b2, eps, bc1,
                     bc2, wd)
        run_range(voidptr_at(ctx[CTX_FN]), voidptr_at(ctx.ctypes.data), n * width, width)
    return via_range


@njit(cache=True, error_model="numpy")
def clip_factor(norm, max_norm):
    """The factor clipping to max_norm applies to a gradient of this norm (1 = no clip; a
    max_norm of 0 or less turns clipping off)."""
    return max_norm / (norm + 1e-6) if max_norm > 0 and norm > max_norm else 1.0


@njit(cache=True, error_model="numpy")
def clipped_slice(kind, clip_on, max_norm, p, g, m, v, lr, mu, b1, b2, eps, bc1, bc2, wd):
    """Clip g on its own norm (if clip_on) and update the slice p (state m, v); returns g's
    squared norm. Per-layer clipping (clipped_step) and LOMO's layer-by-layer updates."""
    sq = sq_norm(g)
    scale = clip_factor(np.sqrt(sq), max_norm) if clip_on else 1.0
    update_slice(kind, p, g, m, v, p.dtype.type(scale), lr, mu, b1, b2, eps, bc1, bc2, wd)
    return sq


@njit(cache=True, error_model="numpy")
def clipped_step(kind, clip, max_norm, params, grads, m, v, slices, lr, mu, b1, b2, eps, bc1, bc2, wd, ctx):
    """Clip grads (clip: CLIP_CODES; `slices` (L, 2) are the layers' [lo, hi) for "layer")
    and update params and state in place (ctx: update_flat's context); returns the global
    norm before clipping."""
    if clip == 1:
        total = 0.0
        for l in range(slices.shape[0]):
            lo, hi = slices[l, 0], slices[l, 1]
            # (m and v are empty where the kind keeps no such state: their slices stay empty)
            total += clipped_slice(kind, np.bool_(True), max_norm, params[lo:hi], grads[lo:hi], m[lo:hi], v[lo:hi],
                                   lr, mu, b1, b2, eps, bc1, bc2, wd)
        return np.sqrt(total)
    norm = np.sqrt(sq_norm(grads))
    scale = clip_factor(norm, max_norm) if clip == 0 else 1.0
    update_flat(ctx, kind, params, grads, m, v, params.dtype.type(scale), lr, mu, b1, b2, eps, bc1, bc2, wd)
    return norm


@njit(cache=True, error_model="numpy")
def clipped_step_rows(kind, clip, max_norm, params, row_grads, m, v, touched, n, width, tail_grads, lr, mu, b1, b2,
                      eps, bc1, bc2, wd, ctx):
    """clipped_step with a row-sparse head (Optimizer.step_rows; clip: CLIP_CODES, global or
    none): the global norm of the compact rows row_grads[:n * width] and of tail_grads,
    then rows touched[:n] of params updated from the compact rows (update_rows_flat) and
    the tail, params[len(params) - len(tail_grads):], from tail_grads (update_flat).
    Returns the norm before clipping. One call where step_rows made four from Python (two
    norms, two updates)."""
    norm = np.sqrt(sq_norm(row_grads[:n * width]) + sq_norm(tail_grads))
    scale = params.dtype.type(clip_factor(norm, max_norm) if clip == 0 else 1.0)
    update_rows_flat(ctx, kind, params, row_grads, m, v, touched, n, width, scale, lr, mu, b1, b2, eps, bc1, bc2, wd)
    lo = params.shape[0] - tail_grads.shape[0]
    update_flat(ctx, kind, params[lo:], tail_grads, m[lo:], v[lo:], scale, lr, mu, b1, b2, eps, bc1, bc2, wd)
    return norm


# Row-sparse ("lazy") versions for the sparse first layer: only the rows a batch touched
# (touched[:n], each `width` long, starting at offset 0 of the flat buffer) are read and
# updated, from the compact gradient g whose row k (g[k*width:(k+1)*width]) belongs to
# row touched[k] (nn.sparse_backward_compact). For SGD without weight decay this equals
# the dense update exactly (other rows have zero gradient); momentum and Adam leave
# untouched rows and their moments alone (TensorFlow's LazyAdam, PyTorch's SparseAdam).

# Each row update first prefetches the first line of the parameter row (and of its moments'
# rows) ROWS_AHEAD touched rows on: the touched rows are scattered over the layer (at the
# cube2 preset's shape 1,662 of 9,261 rows of 1 KB), so every row starts new streams for
# the hardware prefetcher, and the lazy Adam ran the same rows 2.1x slower than as many
# contiguous ones (runs/perf42/bandwidth.txt, bandwidth2.txt). See docs/performance-log.md, stop 49, for
# what it buys.
ROWS_AHEAD = 8


@njit(cache=True, fastmath=True, error_model="numpy")
def sgd_update_rows(p, g, touched, n, width, scale, lr, wd):
    for k in range(n):
        if k + ROWS_AHEAD < n:
            prefetch(p, touched[k + ROWS_AHEAD] * width)
        lo = touched[k] * width
        sgd_update(p[lo:lo + width], g[k * width:(k + 1) * width], scale, lr, wd)


@njit(cache=True, fastmath=True, error_model="numpy")
def momentum_update_rows(p, g, buf, touched, n, width, scale, lr, mu, nesterov, wd):
    for k in range(n):
        if k + ROWS_AHEAD < n:
            ahead = touched[k + ROWS_AHEAD] * width
            prefetch(p, ahead)
            prefetch(buf, ahead)
        lo = touched[k] * width
        momentum_update(p[lo:lo + width], g[k * width:(k + 1) * width], buf[lo:lo + width], scale, lr, mu,
                        nesterov, wd)


@njit(cache=True, fastmath=True, error_model="numpy")
def adam_update_rows(p, g, m, v, touched, n, width, scale, lr, b1, b2, eps, bc1, bc2, wd, decoupled):
    step, eps_b, c1, c2, keep, plain = adam_constants(m, lr, b1, b2, eps, bc1, bc2, scale, wd, decoupled)
    for k in range(n):
        if k + ROWS_AHEAD < n:
            ahead = touched[k + ROWS_AHEAD] * width
            prefetch(p, ahead)
            prefetch(m, ahead)
            prefetch(v, ahead)
        lo, hi, glo = touched[k] * width, (touched[k] + 1) * width, k * width
        if plain:
            adam_plain(p[lo:hi], g[glo:glo + width], m[lo:hi], v[lo:hi], b1, b2, c1, c2, step, eps_b, keep)
        else:
            adam_scaled(p[lo:hi], g[glo:glo + width], m[lo:hi], v[lo:hi], scale, b1, b2, c1, c2, step, eps_b, keep,
                        wd, decoupled)


@njit(cache=True, error_model="numpy")
def update_rows(kind, p, g, m, v, touched, n, width, scale, lr, mu, b1, b2, eps, bc1, bc2, wd):
    """The row-sparse update of one step (kind: KIND_CODES), update_slice's counterpart."""
    if kind == 0:
        sgd_update_rows(p, g, touched, n, width, scale, lr, wd)
    elif kind <= 2:
        momentum_update_rows(p, g, m, touched, n, width, scale, lr, mu, kind == 2, wd)
    else:
        adam_update_rows(p, g, m, v, touched, n, width, scale, lr, b1, b2, eps, bc1, bc2, wd, kind == 4)


@njit(cache=True, fastmath=True, error_model="numpy")
def polyak_update(target, online, tau):
    """target = (1 - tau) * target + tau * online."""
    for i in range(target.shape[0]):
        target[i] += tau * (online[i] - target[i])


@njit(cache=True, fastmath=True, error_model="numpy")
def add_into(dst, src):
    for i in range(dst.shape[0]):
        dst[i] += src[i]


@njit(cache=True, error_model="numpy")
def all_finite(x):
    for i in range(x.shape[0]):
        if not np.isfinite(x[i]):
            return False
    return True


def schedule_lr(kind: str, lr: float, lr_final: float, t: int, total: int, progress=None) -> float:
    """Learning rate at step t (0-based) of `total` steps, or at `progress` in [0, 1] if given."""
    if kind == "constant" or (progress is None and total <= 1):
        return lr
    frac = t / (total - 1) if progress is None else progress
    frac = min(max(frac, 0.0), 1.0)
    if kind == "linear":
        return lr + (lr_final - lr) * frac
    if kind == "cosine":
        return lr_final + 0.5 * (lr - lr_final) * (1 + math.cos(math.pi * frac))
    raise ValueError(f"unknown lr schedule '{kind}'")


class Optimizer:
    """Optimizer state in the flat layout plus the fused step.

    `layer_slices` [(lo, hi)] groups each layer's W and b (contiguous in the layout); it is
    needed for clip="layer" and for LOMO updates of one layer at a time.
    """

    def __init__(self, kind, size, dtype, layer_slices, lr=1e-3, momentum=0.9, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.0, max_grad_norm=10.0, clip="global",
                 schedule="constant", lr_final=None, total_steps=1):
        if kind not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer '{kind}' (expected one of: {', '.join(OPTIMIZERS)})")
        if clip not in CLIPS:
            raise ValueError(f"unknown clip mode '{clip}' (expected one of: {', '.join(CLIPS)})")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown lr schedule '{schedule}' (expected one of: {', '.join(SCHEDULES)})")
        self.kind, self.dtype = kind, np.dtype(dtype)
        self.layer_slices = list(layer_slices)
        self.slices = np.array(self.layer_slices, np.int64).reshape(-1, 2)
        self.lr0, self.momentum, self.betas, self.eps = lr, momentum, betas, eps
        self.weight_decay, self.max_grad_norm, self.clip = weight_decay, max_grad_norm, clip
        self.schedule, self.total_steps = schedule, total_steps
        self.lr_final = lr if lr_final is None else lr_final
        self.t = 0
        self.progress = None  # set by a caller whose run ends on a budget other than steps
        self.m = aligned_zeros(size if kind != "sgd" else 0, self.dtype)
        self.v = aligned_zeros(size if kind in ("adam", "adamw") else 0, self.dtype)
        self.last_norm = 0.0
        self.lr = lr
        # the kernels' arguments that stay fixed, as the kernels take them: step_args made
        # them every step, 1.7-3.5 us of a 481 us step, now 0.9 (runs/perf23/callsplit-ab.txt)
        f = self.dtype.type
        self._fixed = (KIND_CODES[kind], CLIP_CODES[clip], float(max_grad_norm), f(momentum), f(betas[0]),
                       f(betas[1]), f(eps), f(weight_decay))
        # update_flat's context (its function slot set once, at the first step: a cold start
        # then compiles the update where it runs, see precompile.py; float64 buffers update
        # in place)
        self.ctx = aligned_zeros(CTX_LEN, np.int64)
        self._ctx_fn_set = self.dtype != np.float32

    # -- one fused step over the whole buffer -------------------------------------------
    def step(self, params: np.ndarray, grads: np.ndarray) -> float:
        """Clip and apply grads to params; returns the (pre-clip) global gradient norm."""
        self.begin_step()
        self.last_norm = float(clipped_step(*self.step_args(params, grads)))
        return self.last_norm

    @property
    def constants(self):
        """The update's numbers that stay fixed, as the kernels take them: (kind code,
        clip code, max_norm, momentum, beta1, beta2, eps, weight_decay)."""
        return self._fixed

    def step_args(self, params, grads):
        """clipped_step's arguments for this step (after begin_step): the learner's fused
        step passes the same ones (those that change from step to step as step_scalars)."""
        f, (kind, clip, max_norm, mu, b1, b2, eps, wd) = self.dtype.type, self._fixed
        lr, bc1, bc2 = self.step_scalars()
        return (kind, clip, max_norm, params, grads, self.m, self.v, self.slices, f(lr), mu, b1, b2, eps, f(bc1),
                f(bc2), wd, self.ctx)

    def step_scalars(self):
        """This step's learning rate and Adam's bias corrections 1 - beta ** t, as Python
        floats (after begin_step): the update's numbers that change from step to step. The
        kernels take them in the buffer's dtype (step_args; the learner's one-call step
        stores them into an array of that dtype, the same rounding)."""
        t, (beta1, beta2) = self.t, self.betas
        return self.lr, 1 - beta1 ** t, 1 - beta2 ** t

    def step_rows(self, params: np.ndarray, row_grads: np.ndarray, touched, n, width, tail_grads) -> float:
        """step() with a row-sparse head: rows touched[:n] of the head params[:dense_from]
        (rows of `width` values; dense_from = len(params) - len(tail_grads)) get the
        compact gradient rows row_grads[k*width:(k+1)*width]; params[dense_from:] is
        updated densely from tail_grads. Other head rows and their moments are not touched.

        The global norm is exact because the other rows' gradients are zero (see
        nn.sparse_backward_compact). Per-layer clipping is not supported here.
        """
        if self.clip == "layer":
            raise ValueError("row-sparse updates support clip = global or none, not layer")
        self.begin_step()
        kind, clip, max_norm, _, _, m, v, _, lr, mu, b1, b2, eps, bc1, bc2, wd, ctx = self.step_args(params, row_grads)
        norm = float(clipped_step_rows(kind, clip, max_norm, params, row_grads, m, v, touched, n, width, tail_grads,
                                       lr, mu, b1, b2, eps, bc1, bc2, wd, ctx))
        self.last_norm = norm
        return norm

    def begin_step(self):
        if not self._ctx_fn_set:
            self.ctx[CTX_FN] = update_chunk_address(self.kind)
            self._ctx_fn_set = True
        self.lr = schedule_lr(self.schedule, self.lr0, self.lr_final, self.t, self.total_steps, self.progress)
        self.t += 1

    def apply(self, params, grad_slice, lo, hi) -> float:
        """Update params[lo:hi] from grad_slice with per-layer clipping; returns its squared norm.

        Call begin_step() once per step before the first apply (LOMO does this).
        """
        kind, _, max_norm, _, _, m, v, _, lr, mu, b1, b2, eps, bc1, bc2, wd, _ = self.step_args(params, grad_slice)
        return float(clipped_slice(kind, self.clip != "none", max_norm, params[lo:hi], grad_slice, m[lo:hi],
                                   v[lo:hi], lr, mu, b1, b2, eps, bc1, bc2, wd))

    def state_arrays(self):
        return {"opt_m": self.m, "opt_v": self.v}

    def load_state(self, arrays, t):
        for name, arr in self.state_arrays().items():
            src = arrays[name]
            if src.shape != arr.shape:
                raise ValueError(f"optimizer state '{name}' has shape {src.shape}, expected {arr.shape}")
            arr[:] = src
        self.t = int(t)

    @property
    def nbytes(self):
        return self.m.nbytes + self.v.nbytes
