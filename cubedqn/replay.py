"""Replay: a ring buffer of compact cube transitions, uniform or prioritized sampling.

What this file is: transitions stored as fixed-width uint8 records, one row each:

    [state: S bytes][next state: S bytes][action][done][n][pad][reward: float32]

(56 bytes per 2x2x2 transition, never float one-hot; a record longer than a cache line
is padded to whole lines, see RecordLayout). The environment kernel writes
records directly, so adding a batch is one contiguous copy (two at the wrap-around), and
sampling is one Numba call that draws indices and gathers rows. A proportional sum-tree
(Schaul et al. 2016) gives prioritized replay with importance weights. Save/load to .npz
without pickle.

Randomness comes from a cubedqn.rng state passed in, so a run is reproducible and its
state can be checkpointed.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload, register_jitable

from .blas import prefetch
from .calls import Entry
from .nn import ALIGN, aligned_zeros
from .rng import below, uniform


class RecordLayout:
    """Byte offsets of the fields of one transition record.

    `packed` is the fields' bytes (2S + 8), `width` a row's: a record longer than a cache
    line is padded with zeros to whole lines (the 3x3x3's 116 bytes to 128), so that on a
    line-aligned matrix a row spans two lines, where 116-byte rows spanned two or three
    (2.8 on average). A sample's rows come from memory: 64 from 1M 3x3x3 records, the
    prioritized sample 1.15x and the uniform 1.13x as fast so (runs/perf43/pad_ab.txt,
    11 alternating rounds), for 10% more memory. A 2x2x2 record (56 bytes) stays packed:
    64 bytes gained nothing there (1.02x / 0.97x, pad_ab_cube2.txt). Files hold the packed
    fields only (ReplayBuffer.arrays), so they do not depend on the padding."""

    def __init__(self, n_stickers: int):
        s = n_stickers
        self.n_stickers = s
        self.state, self.next_state = 0, s
        self.action, self.done, self.nsteps = 2 * s, 2 * s + 1, 2 * s + 2
        self.reward = 2 * s + 4
        self.packed = 2 * s + 8
        self.width = self.packed if self.packed <= ALIGN else -(-self.packed // ALIGN) * ALIGN  # ALIGN: a line
        assert self.reward % 4 == 0 and self.width % 4 == 0  # float32-aligned reward

    def views(self, rec: np.ndarray):
        """(states, next_states, actions, dones, nsteps, rewards) views of a record matrix."""
        s = self.n_stickers
        rewards = rec[:, self.reward:self.reward + 4].view(np.float32)[:, 0]
        return (rec[:, :s], rec[:, s:2 * s], rec[:, self.action], rec[:, self.done], rec[:, self.nsteps], rewards)


@njit(cache=True)
def _gather(idx, buf, out, nsteps_col, gamma, discounts):
    """out[k] = buf[idx[k]], discounts[k] = gamma ** its n-step count.

    In two passes: the first copies a byte from each cache line of each row (bytes 0, 64,
    128 and the last: every line of records up to 192 bytes; the 2x2x2's are 56, the
    3x3x3's 116), loads that do not wait on each other, so that the rows' cache misses
    overlap; the second copies the rows from the cache and reads their n-step counts.
    Rows from a 1M-record buffer, 64 a call, in process against one pass (runs/perf34/
    gather_ab.py, 9 alternating rounds, three runs): 1.95-1.97x for 56-byte rows,
    2.42-2.80x for 116; with gamma ** n in the first pass, 1.28-1.49x. gamma ** n is
    computed again only where n changes from the row before (the same expression, so the
    same bits): 64 hot rows took 2.35 us with a power each, 2.05 with none, and now 2.24
    with n at random, 2.13 with one n (runs/perf39/gather_parts.py / .txt)."""
    w = buf.shape[1]
    for k in range(idx.shape[0]):
        src = buf[idx[k]]
        out[k, 0] = src[0]
        if w > 64:
            out[k, 64] = src[64]
        if w > 128:
            out[k, 128] = src[128]
        out[k, w - 1] = src[w - 1]
    n_last = np.uint8(0)  # the records' bytes: a count is a uint8
    discount = gamma ** n_last
    for k in range(idx.shape[0]):
        src = buf[idx[k]]
        dst = out[k]
        for j in range(w):
            dst[j] = src[j]
        n = src[nsteps_col]
        if n != n_last:  # most rows have the run's n-step count: its power once
            n_last, discount = n, gamma ** n
        discounts[k] = discount


@njit(cache=True)
def _sample_uniform(rng, buf, idx, out, nsteps_col, gamma, discounts, size):
    for k in range(idx.shape[0]):
        idx[k] = below(rng, size)
    _gather(idx, buf, out, nsteps_col, gamma, discounts)


# -- sum-tree: tree[1] is the root, leaves at tree[cap2 + i] ------------------------------
# Every node above the leaves holds the sum of its two children, as tree_rebuild computes
# it from the leaves, whatever sequence of adds and updates came before: each change sums
# the changed nodes' ancestors again from their children rather than adding a difference
# up the tree. So a subtree of zero priorities sums to exactly 0 (added differences left
# rounding residue above them, which a descent could follow), the sums do not drift over
# a long run, and a range of new leaves sums its few shared ancestors once each.


@njit(cache=True)
def _sum_up(tree, a, b):
    """Every ancestor of the nodes a .. b (a run on one level) summed again from its two
    children, a level at a time: the run's parents a // 2 .. b // 2, then theirs, to the root."""
    a, b = a // 2, b // 2
    while a >= 1:
        for j in range(a, b + 1):
            tree[j] = tree[2 * j] + tree[2 * j + 1]
        a //= 2
        b //= 2


@njit(cache=True)
def tree_rebuild(tree, cap2):
    """Every node above the leaves as the sum of its two children, bottom up."""
    _sum_up(tree, cap2, 2 * cap2 - 1)


@njit(cache=True)
def tree_set(tree, cap2, idx, values):
    """Leaves idx[k] set to values[k], one after another, each one's ancestors then summed
    again from their children. The one-at-a-time form that _set_priorities (the replay's
    updates) and _fill_ring (its adds) are tested against, bit for bit."""
    for k in range(idx.shape[0]):
        j = idx[k] + cap2
        tree[j] = values[k]
        j //= 2
        while j >= 1:
            tree[j] = tree[2 * j] + tree[2 * j + 1]
            j //= 2


@njit(cache=True)
def _set_priorities(tree, cap2, indices, td_errors, node, value, eps, alpha):
    """tree_set(tree, cap2, indices, (|td| + eps) ** alpha) with the ascents run level by
    level side by side (node, value: scratch of len(indices)), so that one level's loads
    do not wait on each other: the leaves are set in order (a leaf listed twice ends with
    its last priority), then each level's listed nodes are summed from their children,
    which are final by then. Returns the largest |td| + eps. (With added differences
    instead of sums, 64 on a 1M-leaf tree ran 1.75x / 1.84x the method before it in
    process, runs/perf34/priorities_ab.py.)"""
    top = 0.0
    for k in range(indices.shape[0]):  # the powers first: a libm call between loads holds them back
        p = np.float64(abs(td_errors[k])) + eps
        if p > top:
            top = p
        value[k] = p ** alpha
    for k in range(indices.shape[0]):
        j = indices[k] + cap2
        tree[j] = value[k]
        node[k] = j // 2
    width = 1
    while width < cap2:  # every leaf is at the same depth: log2(cap2) levels above them
        width *= 2
        for k in range(indices.shape[0]):
            j = node[k]
            tree[j] = tree[2 * j] + tree[2 * j + 1]
            node[k] = j // 2
    return top


@njit(cache=True)
def _fill_run(tree, cap2, lo, count, value):
    """Leaves lo .. lo + count - 1 set to value, then their ancestors summed again, a level's
    run of them at a time (count leaves share count / 2 parents, count / 4 grandparents...)."""
    for i in range(lo, lo + count):
        tree[cap2 + i] = value
    _sum_up(tree, cap2 + lo, cap2 + lo + count - 1)


@njit(cache=True)
def _fill_ring(tree, cap2, start, count, capacity, value):
    """Leaves start, start + 1, ... (count of them, wrapping at capacity) set to value: the
    same tree as tree_set on them one at a time, in one or two runs."""
    first = min(count, capacity - start)
    _fill_run(tree, cap2, start, first, value)
    if count > first:
        _fill_run(tree, cap2, 0, count - first, value)


def _row_pointers(context, builder, sig, args):
    """(dst row d0's address, src row s0's address, the rows' bytes) as byte pointers, for
    the row copies' codegen (dst, d0, src, s0, n: C-contiguous 2D arrays of one row width)."""
    d, s = (context.make_array(t)(context, builder, a) for t, a in ((sig.args[0], args[0]), (sig.args[2], args[2])))
    row = cgutils.unpack_tuple(builder, d.strides)[0]  # bytes
    dp = builder.gep(builder.bitcast(d.data, cgutils.voidptr_t), [builder.mul(args[1], row)])
    sp = builder.gep(builder.bitcast(s.data, cgutils.voidptr_t), [builder.mul(args[3], row)])
    return dp, sp, row


@intrinsic
def _memcpy_rows(typingctx, dst, d0, src, s0, n):
    """dst[d0:d0 + n] = src[s0:s0 + n] as one memcpy (C-contiguous 2D arrays of one dtype
    and row width: _copy_rows checks)."""
    def codegen(context, builder, sig, args):
        dp, sp, row = _row_pointers(context, builder, sig, args)
        cgutils.raw_memcpy(builder, dp, sp, args[4], row)
        return context.get_dummy_value()
    return types.none(dst, types.int64, src, types.int64, types.int64), codegen


STREAM_BYTES = 1 << 26  # a ring of 64 MB and more (twice this host's L3) takes its rows by streaming stores
STREAM = 32  # bytes a streaming store writes: rows a multiple of it, on its boundaries, can be streamed


@register_jitable
def _streamable(records):
    """Whether adds to this ring (uint8 records) write by streaming stores (_stream_rows): a
    ring of STREAM_BYTES and more whose rows are whole STREAM-byte units on STREAM-byte
    boundaries. Plain Python where ReplayBuffer decides how it adds, compiled into _add_rows."""
    return records.nbytes >= STREAM_BYTES and records.shape[1] % STREAM == 0 and records.ctypes.data % STREAM == 0


@intrinsic
def _stream_rows(typingctx, dst, d0, src, s0, n):
    """dst[d0:d0 + n] = src[s0:s0 + n] by STREAM-byte non-temporal stores, then a fence (the
    stores are weakly ordered). A non-temporal store writes its line to memory without
    reading it into the cache first, as an ordinary store does, and without evicting a
    line the sample is about to read: a ring much larger than the cache is written once
    between visits, so its lines are no use to the cache. The caller checks that the rows
    are STREAM-byte multiples on STREAM-byte boundaries (dst) and C-contiguous (both)."""
    def codegen(context, builder, sig, args):
        dp, sp, row = _row_pointers(context, builder, sig, args)
        i32 = ir.IntType(32)
        vec = ir.VectorType(ir.IntType(64), STREAM // 8)
        nontemporal = builder.module.add_metadata([ir.Constant(i32, 1)])
        size = builder.mul(args[4], row)
        with cgutils.for_range_slice(builder, ir.Constant(size.type, 0), size, ir.Constant(size.type, STREAM)) as (at, _):
            v = builder.load(builder.bitcast(builder.gep(sp, [at]), vec.as_pointer()), align=1)
            store = builder.store(v, builder.bitcast(builder.gep(dp, [at]), vec.as_pointer()), align=STREAM)
            store.set_metadata("nontemporal", nontemporal)
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.none(dst, types.int64, src, types.int64, types.int64), codegen


def _copy_rows(dst, d0, src, s0, n, stream):
    """dst[d0:d0 + n] = src[s0:s0 + n] for 2D arrays of one row width whose rows are there
    (the caller checks: _add_prioritized); by streaming stores where `stream` (the caller
    checks _stream_rows' conditions on dst) and src is C-contiguous."""


@overload(_copy_rows)
def _copy_rows_overload(dst, d0, src, s0, n, stream):
    if src.layout == "C" and dst.layout == "C" and src.dtype == dst.dtype:  # the records the environment writes
        def copy(dst, d0, src, s0, n, stream):
            if stream:
                _stream_rows(dst, d0, src, s0, n)
            else:
                _memcpy_rows(dst, d0, src, s0, n)
    else:
        def copy(dst, d0, src, s0, n, stream):
            for i in range(n):
                for j in range(dst.shape[1]):
                    dst[d0 + i, j] = src[s0 + i, j]
    return copy


@njit(cache=True)
def _add_rows(records, src, pos, count):
    """src's first count rows into the ring (records) at pos, wrapping, by streaming stores
    where the ring allows them (_stream_rows; else a memcpy per run). Returns whether it
    streamed. The uniform buffer's add where its ring is STREAM_BYTES or more: below that,
    numpy's slice copy in ReplayBuffer.add."""
    capacity = records.shape[0]
    if src.shape[1] != records.shape[1] or count > src.shape[0]:
        raise ValueError("records of another width than the buffer's, or fewer than the count")
    if not 0 <= pos < capacity or count > capacity:
        raise ValueError("an add outside the ring")
    first = min(count, capacity - pos)
    stream = _streamable(records)
    _copy_rows(records, pos, src, 0, first, stream)
    if count > first:
        _copy_rows(records, 0, src, first, count - first, stream)
    return stream


@njit(cache=True)
def _add_prioritized(records, src, tree, pos, count, value):
    """A prioritized add in one call: src's first count rows into the ring (records, whose
    rows are its capacity) at pos, wrapping, and their leaves set to value (_fill_ring; the
    tree's leaves are its second half). Rows of another width, or fewer than count, raise
    ValueError before anything is written (as does a count the ring cannot hold or a tree
    too small for it: ReplayBuffer.add says so first, in its own words). Numpy's slice
    copy and a second call took 1.13-1.31x its time (batches of 256 and 64, in process,
    runs/perf36/per_add_call_ab.py). The capacity and the leaves' offset are read from the
    arrays rather than passed, two fewer for the call to unbox (a do-nothing call on 13
    arguments took 1.85 us, on 3 0.69: runs/perf38/costs.txt)."""
    capacity, cap2 = records.shape[0], tree.shape[0] // 2
    if cap2 < capacity:
        raise ValueError("a sum-tree too small for the ring")
    _add_rows(records, src, pos, count)  # checks the rest before it writes
    _fill_ring(tree, cap2, pos, count, capacity, value)


@intrinsic
def _bits(typingctx, x):
    """The int64 whose bits are float64 x's."""
    if not isinstance(x, types.Float) or x.bitwidth != 64:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.int64(x), codegen


@intrinsic
def _from_bits(typingctx, b):
    """The float64 whose bits are int64 b's."""
    if not isinstance(b, types.Integer) or b.bitwidth != 64:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(b), codegen


_MANTISSA, _ONE = (1 << 52) - 1, 1023 << 52  # float64's fraction bits; 1.0's bits
_TWO52, _TWO52_BITS = 4503599627370496.0, 0x4330000000000000  # 2^52 + n's bits are 2^52's + n (0 <= n < 2^52)
_TWO54 = 18014398509481984.0
_F64_TINY = 2.2250738585072014e-308  # the smallest normal float64
_SQRT2 = 1.4142135623730951
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10  # ln 2 = HI + LO; HI * k exact
_INV_LN2 = 1.44269504088896338700e+00


@njit(cache=True, inline="always")
def _pow2(k):
    """2.0 ** k for an integer-valued float64 k in [-1022, 1023], from bits."""
    return _from_bits((_bits(k + (_TWO52 + 1023.0)) - _TWO52_BITS) << 52)


@njit(cache=True, error_model="numpy", fastmath={"contract"})
def positive_powers(x, p):
    """x[k] = x[k] ** p in place where x[k] > 0, and 0 where it is 0 (float64 x, finite,
    >= 0; p finite): within 1.3e-13 of libm's pow, relative, where the result is normal,
    and within 1.3e-13 of float64's smallest normal where it is subnormal; 0 and inf
    where pow underflows or overflows (tested, to 2e-13). For the prioritized sample's
    importance weights, (size * P(i)) ** -beta, 0 for a leaf that cannot be drawn. libm's
    pow is a call per element, 23 ns each here (float32's powf 11); this loop has no call
    and no branch, so the compiler vectorizes it: 64 elements in 0.36-0.37 us against
    1.48-1.49 for pow and 0.73-0.74 for powf (runs/perf39/powers_check.py / .txt, two
    runs; it also prints the errors).

    x = m 2^e with m in [sqrt(1/2), sqrt(2)) (a subnormal x scaled by 2^54 first): log m =
    2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, by its series to s^17 (the next term
    under 1e-15); then y = p log x, clamped to [-746, 710] (beyond them the result is 0 or
    inf), and exp y = 2^k exp(r), k = round(y / ln 2), |r| <= ln 2 / 2, by Taylor's series
    to r^12 (the next term under 2e-16), 2^k applied as two factors so that a subnormal
    result is rounded once."""
    for k in range(x.shape[0]):
        v = x[k]
        sub = v < _F64_TINY
        b = _bits(v * _TWO54 if sub else v)
        e = (_from_bits((b >> 52) | _TWO52_BITS) - _TWO52) - (1077.0 if sub else 1023.0)
        m = _from_bits((b & _MANTISSA) | _ONE)  # [1, 2)
        big = m > _SQRT2
        m = m * 0.5 if big else m
        e = e + 1.0 if big else e
        s = (m - 1.0) / (m + 1.0)
        z = s * s
        # the series by Estrin's scheme: shorter chains of dependent operations than Horner's
        z2 = z * z
        z4 = z2 * z2
        log_m = s * ((2.0 + 2.0 / 3 * z) + (2.0 / 5 + 2.0 / 7 * z) * z2
                     + ((2.0 / 9 + 2.0 / 11 * z) + (2.0 / 13 + 2.0 / 15 * z) * z2) * z4 + 2.0 / 17 * (z4 * z4))
        y = p * (e * _LN2_HI + (e * _LN2_LO + log_m))
        y = min(max(y, -746.0), 710.0)
        kf = np.floor(y * _INV_LN2 + 0.5)
        r = (y - kf * _LN2_HI) - kf * _LN2_LO
        r2 = r * r
        r4 = r2 * r2
        er = (((1.0 + r) + (1.0 / 2 + 1.0 / 6 * r) * r2)
              + ((1.0 / 24 + 1.0 / 120 * r) + (1.0 / 720 + 1.0 / 5040 * r) * r2) * r4
              + (((1.0 / 40320 + 1.0 / 362880 * r) + (1.0 / 3628800 + 1.0 / 39916800 * r) * r2) + 1.0 / 479001600 * r4)
              * (r4 * r4))
        k1 = np.floor(kf * 0.5)
        w = er * _pow2(k1) * _pow2(kf - k1)
        x[k] = w if v > 0.0 else 0.0


CACHED_LEVELS = 14  # the sum-tree's levels above 2^14 nodes (128 KB): one level a step


@intrinsic
def _level_step4(typingctx, tree, out, mass, k):
    """tree_find's level step for the four draws out[k:k + 4] (nodes, int64) and
    mass[k:k + 4] (their remaining masses, float64), as AVX2 vectors: each draw's pair
    tree[2j], tree[2j + 1] loaded as one 16-byte vector, the four pairs turned into the
    left nodes' vector and the right nodes' by shuffles, then the scalar step's compare,
    subtraction (of tl or of 0.0: the same bits) and next node, lane by lane. LLVM compiles
    the scalar loop scalar (a gather per load is not worth it to its cost model). The top
    levels of 64 draws alone (runs/perf43/simd_levels.py / .txt, less the call and the
    draws' uniforms): 1.72x / 2.43x / 1.64x the scalar loop on 50,000 / 1M / 4M leaves;
    two llvm.masked.gather in place of the pair loads, 0.68-0.74x as fast as these; a
    prefetch of each lane's next pair, 0.68-0.78x. So no prefetch: the caller runs it on the
    levels above the last one-level step, which stay in cache or nearly."""
    arrays = ((tree, types.float64), (out, types.int64), (mass, types.float64))
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and a.dtype == d for a, d in arrays):
        return None  # vector loads and stores: contiguous arrays of these types only

    def codegen(context, builder, sig, args):
        t, o, m = (context.make_array(ty)(context, builder, a) for ty, a in zip(sig.args[:3], args[:3]))
        k = args[3]
        f64, i64, i32 = ir.DoubleType(), ir.IntType(64), ir.IntType(32)
        v4d, v4i, v2d = ir.VectorType(f64, 4), ir.VectorType(i64, 4), ir.VectorType(f64, 2)
        at_nodes = builder.bitcast(builder.gep(o.data, [k]), v4i.as_pointer())
        at_mass = builder.bitcast(builder.gep(m.data, [k]), v4d.as_pointer())
        nodes, masses = builder.load(at_nodes, align=8), builder.load(at_mass, align=8)
        left = builder.shl(nodes, ir.Constant(v4i, [1] * 4))
        pairs = [builder.load(builder.bitcast(builder.gep(t.data, [builder.extract_element(left, ir.Constant(i32, q))]),
                                              v2d.as_pointer()), align=8) for q in range(4)]

        def shuffle(a, b, lanes):
            return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, len(lanes)), lanes))
        even, odd = shuffle(pairs[0], pairs[2], [0, 1, 2, 3]), shuffle(pairs[1], pairs[3], [0, 1, 2, 3])
        tl, tr = shuffle(even, odd, [0, 4, 2, 6]), shuffle(even, odd, [1, 5, 3, 7])  # (l0 l1 l2 l3), (r0 .. r3)
        zero = ir.Constant(v4d, [0.0] * 4)
        right = builder.and_(builder.fcmp_ordered(">=", masses, tl), builder.fcmp_ordered(">", tr, zero))
        builder.store(builder.fsub(masses, builder.select(right, tl, zero)), at_mass, align=8)
        builder.store(builder.add(left, builder.zext(right, v4i)), at_nodes, align=8)
        return context.get_dummy_value()
    return types.none(tree, out, mass, k), codegen


@njit(cache=True, inline="always")
def _level_step(tree, out, mass, k):
    """tree_find's step for draw k (node out[k], remaining mass mass[k]), without a branch:
    which way a draw goes is a coin toss, and a mispredicted branch threw away the loads
    issued after it. Indices as uint64: numba adds a wraparound select to every load at a
    signed index. Returns the node reached (uint64)."""
    one = np.uint64(1)
    left = np.uint64(out[k]) << one
    m, tl = mass[k], tree[left]
    right = (m >= tl) & (tree[left + one] > 0.0)
    mass[k] = m - tl * np.float64(right)  # m - 0.0 going left: the same bits as no subtraction
    node = left + np.uint64(right)
    out[k] = np.int64(node)
    return node


@njit(cache=True, inline="always")
def _prefetch_row(flat, i, row):
    """Every line of the record row at flat[i:i + row]: a byte in each 64, and its last."""
    for b in range(0, row - 1, 64):
        prefetch(flat, i + b)
    prefetch(flat, i + row - 1)


@njit(cache=True)
def tree_find(tree, cap2, mass):
    """Leaf index i such that the prefix sum of leaves before i <= mass < prefix incl. i.
    One descent: the form _prioritized_indices' side-by-side descents follow step for
    step; the tests hold them to it."""
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
def _prioritized_indices(rng, tree, cap2, size, beta, out, weights, mass, records):
    """Stratified proportional sampling; weights = (size * P(i))^-beta / max weight.
    records: the buffer's record matrix (C order), whose drawn rows are prefetched for the
    gather that follows (_sample_prioritized).

    The n descents of the sum-tree are tree_find's, step for step, but run level by level
    side by side (out holds each one's node, mass its remaining mass: float64 scratch), so
    that one level's n loads do not wait on each other: below the levels that stay in
    cache each load is a miss, and one descent at a time took them one after another.
    64 draws from a 1M-leaf tree, in process against one descent at a time (runs/perf34/
    per_ab.py, 9 alternating rounds, two runs): 1.57x, 1.59x. The level step has no branch:
    against it with one (runs/perf35/per_sample_ab.py, 9 alternating rounds, two runs) the
    draws ran 1.51x / 1.55x on a 50,000-leaf tree (the 2x2x2 presets' buffer, in cache), and
    1.14x / 1.09x on 1M leaves, where the misses below the cached levels dominate. Each
    step prefetches the pair its draw reads at the next level, a level's loop ahead of the
    loads: a load that misses holds up what comes after it until its line arrives, a
    prefetch does not, so more misses are in flight. The whole sample (draws, weights and
    gather), in process against the same without it (runs/perf38/per_sample_ab.py, 11
    alternating rounds, the same bits, three runs): 1.75-1.81x on 1M leaves, 1.22-1.24x on
    50,000; ReplayBuffer.sample against b250167's (per_commit_ab.py, 15 rounds): 1.65x and
    1.13x. Prefetching further ahead instead (the line of the node's four, eight or sixteen
    descendants two, three or four levels down) was slower than one level ahead on 1M
    leaves: 0.78x, 0.77x, 0.74x (medians against it in the same run, per_sample_ab.txt).

    At the last level each step prefetches its draw's record row instead, so that the
    gather's misses overlap the weights' powers. On 1M / 50,000 records, called directly,
    medians against the same kernel without it (runs/perf38/per_more_ab.txt): 1.03x /
    1.08x. The powers are positive_powers', float64's within about 1e-13, and the weights
    are normalised from them (mass, free by then) before they are rounded to the batch's
    dtype: a weight above float32's range, as a drawn leaf under 1e-96 of the mean priority
    has at beta 0.4, would otherwise be stored as inf (tested). ReplayBuffer.sample with
    them against 668bd7d's float32 powf (runs/perf39/sample_ab.txt, with the gather's
    change, two runs, 15 alternating rounds each): 1.04x / 1.02x on 1M records, 1.12x /
    1.07x on 50,000.

    Below the top CACHED_LEVELS levels a step takes three levels at once, from the one
    cache line that holds the node's eight descendants three levels down (8j .. 8j + 7;
    the tree starts on a line's boundary): a draw then misses on a line every three levels
    instead of every level. The top levels stay one at a time: from cache, the three-level
    step's seven adds cost more than the three loads it saves (all the levels in such steps
    on a 50,000-leaf tree: 0.85x of one at a time). 64 draws alone, in process, the same
    picks (runs/perf43/descent_variants3.txt, 9 alternating rounds), against one level at a
    time at signed indices: 1.33x / 1.36x on 1M / 4M leaves, and 1.05-1.11x at 50,000 and
    1M from the unsigned indices alone.

    The one-level steps but the last (which prefetches the next step's line or the drawn
    row) take four draws a vector step (_level_step4). ReplayBuffer.sample in process
    against bb5f436's scalar steps, the same bits, 15 alternating rounds, two runs
    (runs/perf43/simd_ab_v20.txt, simd_ab_v20b.txt): 1.19x / 1.20x on 1M cube2 records,
    1.19x / 1.15x on 1M cube3 records, 1.14x / 1.18x on 50,000. With the vector steps on
    the top 12 levels only and the scalar, prefetching step below them: 1.04x, 1.08x,
    1.15x (simd_ab.txt)."""
    total = tree[1]
    n = out.shape[0]
    seg = total / n
    flat = records.reshape(-1)
    row = records.shape[1]
    for k in range(n):
        mass[k] = (k + uniform(rng)) * seg
        out[k] = 1
    levels = 0
    while (1 << levels) < cap2:
        levels += 1
    steps = max(0, levels - CACHED_LEVELS) // 3  # three-level steps at the bottom
    top = levels - 3 * steps  # levels taken one at a time
    one, two, four, eight = np.uint64(1), np.uint64(2), np.uint64(4), np.uint64(8)  # unsigned: _level_step
    vector = max(0, top - 1)  # four draws a vector step; the last one-level step prefetches what follows
    for _ in range(vector):
        for k in range(0, n - 3, 4):
            _level_step4(tree, out, mass, k)
        for k in range(n - n % 4, n):  # the draws past the last four
            _level_step(tree, out, mass, k)
    for lv in range(vector, top):
        for k in range(n):
            node = _level_step(tree, out, mass, k)
            if lv + 1 < top:
                prefetch(tree, np.int64(node << one))  # the pair this draw reads at the next level
            elif steps > 0:
                prefetch(tree, np.int64(node << np.uint64(3)))  # the line of its first three-level step
            else:
                _prefetch_row(flat, min(np.int64(node) - cap2, size - 1) * row, row)
    for s in range(steps):
        for k in range(n):
            base = eight * np.uint64(out[k])  # node j's descendants three levels down: 8j .. 8j + 7
            m = mass[k]
            # tree_find's three steps from this one line: each level's two nodes are the sums
            # of their descendants in it, added as the tree adds them, so the same bits as
            # the nodes stored above the line
            tl = (tree[base] + tree[base + one]) + (tree[base + two] + tree[base + np.uint64(3)])
            tr = (tree[base + four] + tree[base + np.uint64(5)]) + (tree[base + np.uint64(6)]
                                                                   + tree[base + np.uint64(7)])
            right = (m >= tl) & (tr > 0.0)
            m -= tl * np.float64(right)
            base += four * np.uint64(right)
            tl = tree[base] + tree[base + one]
            tr = tree[base + two] + tree[base + np.uint64(3)]
            right = (m >= tl) & (tr > 0.0)
            m -= tl * np.float64(right)
            base += two * np.uint64(right)
            tl = tree[base]
            right = (m >= tl) & (tree[base + one] > 0.0)
            mass[k] = m - tl * np.float64(right)
            node = base + np.uint64(right)
            out[k] = np.int64(node)
            if s + 1 < steps:
                prefetch(tree, np.int64(eight * node))  # the line this draw reads at its next step
            else:
                _prefetch_row(flat, min(np.int64(node) - cap2, size - 1) * row, row)
    for k in range(n):
        i = out[k] - cap2
        if i >= size:
            i = size - 1
        out[k] = i
        mass[k] = size * (tree[cap2 + i] / total)  # size * P(i)
    positive_powers(mass, -beta)  # unnormalised in float64: a float32 batch would hold a weight > 3e38 as inf
    wmax = 0.0
    for k in range(n):
        if mass[k] > wmax:
            wmax = mass[k]
    for k in range(n):
        weights[k] = mass[k] / wmax if wmax > 0 else 0.0


@njit(cache=True)
def _sample_prioritized(rng, tree, cap2, buf, idx, weights, mass, out, nsteps_col, gamma, discounts, size,
                        beta):
    """A prioritized sample in one call: _prioritized_indices, then _gather. Against the
    two called from Python one after the other (ReplayBuffer.sample in process against
    d7e8d54's, the same bits, 15 alternating rounds, two runs: runs/perf38/
    per_onecall_ab.txt): 1.05x / 1.04x on 1M leaves, 1.04x / 1.04x on 50,000."""
    _prioritized_indices(rng, tree, cap2, size, beta, idx, weights, mass, buf)
    _gather(idx, buf, out, nsteps_col, gamma, discounts)


class Batch:
    """Preallocated sample arrays (reused every step); field views into one record matrix."""

    def __init__(self, n, n_stickers, dtype):
        self.layout = RecordLayout(n_stickers)
        self.records = aligned_zeros((n, self.layout.width), np.uint8)
        (self.states, self.next_states, self.actions, self.dones, self.nsteps,
         self.rewards) = self.layout.views(self.records)
        self.discounts = np.zeros(n, dtype)
        self.weights = np.ones(n, dtype)
        self.indices = np.zeros(n, np.int64)
        self.masses = np.zeros(n, np.float64)  # the prioritized sampler's scratch

    def __setattr__(self, name, value):
        # the arrays are made once: ReplayBuffer.sample keeps its kernel's entry point for
        # them (calls.py), which reads its arguments as the types they had
        if name in self.__dict__:
            raise AttributeError(f"a Batch's arrays are fixed: write into batch.{name}[...] instead")
        object.__setattr__(self, name, value)


class ReplayBuffer:
    """Ring buffer of transition records; optional proportional prioritization."""

    def __init__(self, capacity: int, n_stickers: int, gamma: float, prioritized=False,
                 alpha=0.6, eps=1e-3):
        if capacity <= 0:
            raise ValueError("buffer_size must be positive")
        self.capacity, self.n_stickers, self._gamma = capacity, n_stickers, gamma
        self._gamma_dtype = self._gamma_cast = None  # gamma in the last sampled batch's dtype
        # the kernels' entry points while they are called on the same arrays (calls.Entry)
        self._sample_entry = Entry(_sample_prioritized if prioritized else _sample_uniform)
        self._add_entry = Entry(_add_prioritized if prioritized else _add_rows)
        self._priorities_entry = Entry(_set_priorities)
        self.layout = RecordLayout(n_stickers)
        self.records = aligned_zeros((capacity, self.layout.width), np.uint8)  # rows on lines' boundaries
        # the uniform add's rows by streaming stores (through _add_rows, which decides by the same _streamable)
        self._streams = _streamable(self.records)
        (self.states, self.next_states, self.actions, self.dones, self.nsteps,
         self.rewards) = self.layout.views(self.records)
        self.pos = 0
        self.size = 0
        # floats, whatever numbers are given: the kernels' entry points are found for float64 (calls.py)
        self.prioritized, self.alpha, self.eps = prioritized, float(alpha), float(eps)
        self.cap2 = 1 << max(0, (capacity - 1).bit_length())
        # on a cache line's boundary: the sampler's descents read eight nodes 8j .. 8j + 7 as one line
        self.tree = aligned_zeros(2 * self.cap2 if prioritized else 0, np.float64)
        self._ascents = (np.zeros(0, np.int64), np.zeros(0, np.float64))  # update_priorities' scratch
        self.max_priority = 1.0

    @property
    def gamma(self):
        """The discount factor, fixed at construction (sample caches it in the batch's dtype)."""
        return self._gamma

    @property
    def nbytes_per_transition(self):
        return self.layout.width

    @property
    def nbytes(self):
        return self.records.nbytes + self.tree.nbytes

    def add(self, records: np.ndarray, count=None):
        """Append the first `count` rows of a record matrix (one or two contiguous copies).
        Called once per env iteration with a few dozen rows, so its Python is kept short:
        64 rows 1.27-1.37x faster than before stop 41 (2.33-2.46 us a call; one slice copy
        takes 1.36), runs/perf34/replay_add_ab.txt. A ring of STREAM_BYTES and more whose
        rows allow it takes them by streaming stores (_add_rows): 1M 3x3x3 records, adds of
        64 1.17x (uniform) and 1.13x (prioritized) as fast as a3ba4ec's copies of unpadded
        rows, where the padding alone had made them 0.89-0.97x (runs/perf43/
        pad_stream_ab2.txt, pad_commit_ab*.txt)."""
        n = len(records)
        count = n if count is None else count
        if count == 0:
            return
        cap, pos = self.capacity, self.pos
        if count > cap:
            raise ValueError("cannot add more transitions at once than the buffer holds")
        end = pos + count
        # new prioritized transitions get the highest priority seen so far
        if self.prioritized:
            e, value = self._add_entry, self.max_priority ** self.alpha
            k = e.keys  # the kernel's entry point while the arrays are the same objects (calls.Entry)
            if k and k[0] is records and k[1] is self.records and k[2] is self.tree:
                e.call(pos, count, value)
            else:
                _add_prioritized(self.records, records, self.tree, pos, count, value)
                m = e.missed
                if m and m[0] is records and m[1] is self.records and m[2] is self.tree:
                    e.bind(m, (self.records, records, self.tree), (0, 0, 0.0))
                else:
                    e.keys, e.missed = (), (records, self.records, self.tree)
        elif self._streams:  # the rows by streaming stores (_add_rows), its entry point as above
            e = self._add_entry
            k = e.keys
            if k and k[0] is records and k[1] is self.records:
                e.call(pos, count)
            else:
                _add_rows(self.records, records, pos, count)
                m = e.missed
                if m and m[0] is records and m[1] is self.records:
                    e.bind(m, (self.records, records), (0, 0))
                else:
                    e.keys, e.missed = (), (records, self.records)
        else:
            if end <= cap:
                self.records[pos:end] = records if count == n else records[:count]
            else:  # wraps: the tail of the ring, then its head
                first = cap - pos
                self.records[pos:] = records[:first]
                self.records[:count - first] = records[first:count]
        self.pos = end % cap
        size = self.size + count
        self.size = size if size < cap else cap

    def sample(self, rng: np.ndarray, batch: Batch, beta: float = 0.4):
        if self.size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        # the kernel's entry point while rng, batch and the buffer's arrays are the objects
        # it was found for (a Batch's arrays are fixed: Batch.__setattr__), else the
        # dispatcher (calls.Entry)
        e = self._sample_entry
        k = e.keys
        if k and k[0] is rng and k[1] is batch and k[2] is self.records and k[3] is self.tree:
            if self.prioritized:
                e.call(self.size, beta)
            else:
                e.call(self.size)
            return batch
        dtype = batch.discounts.dtype
        if dtype is not self._gamma_dtype:  # a numpy scalar takes 0.5-0.7 us to make: once per dtype
            self._gamma_dtype, self._gamma_cast = dtype, dtype.type(self._gamma)
        gamma = self._gamma_cast
        if self.prioritized:
            fixed = (rng, self.tree, self.cap2, self.records, batch.indices, batch.weights, batch.masses,
                     batch.records, self.layout.nsteps, gamma, batch.discounts)
            _sample_prioritized(*fixed, self.size, beta)
            typed = (0, 0.0)  # size, beta
        else:
            fixed = (rng, self.records, batch.indices, batch.records, self.layout.nsteps, gamma, batch.discounts)
            _sample_uniform(*fixed, self.size)
            typed = (0,)      # size
        m = e.missed
        if m and m[0] is rng and m[1] is batch and m[2] is self.records and m[3] is self.tree:
            e.bind(m, fixed, typed)
        else:
            e.keys, e.missed = (), (rng, batch, self.records, self.tree)
        return batch

    def update_priorities(self, indices, td_errors):
        """Priority of each sampled transition becomes (|td| + eps)^alpha."""
        n = len(indices)
        if len(self._ascents[0]) != n:  # scratch, made once per batch size
            self._ascents = (np.zeros(n, np.int64), np.zeros(n, np.float64))
        e = self._priorities_entry  # its entry point while the arrays are the same objects (calls.Entry)
        k = e.keys
        ascents = self._ascents
        if k and k[0] is indices and k[1] is td_errors and k[2] is self.tree and k[3] is ascents:
            top = float(e.call(self.eps, self.alpha))
        else:
            top = float(_set_priorities(self.tree, self.cap2, indices, td_errors, *ascents, self.eps, self.alpha))
            m = e.missed
            if m and m[0] is indices and m[1] is td_errors and m[2] is self.tree and m[3] is ascents:
                e.bind(m, (self.tree, self.cap2, indices, td_errors) + ascents, (0.0, 0.0))  # eps, alpha
            else:
                e.keys, e.missed = (), (indices, td_errors, self.tree, ascents)
        if top > self.max_priority:  # not max(): 0.24 us a call in CPython 3.11 (runs/perf38/costs.txt)
            self.max_priority = top

    # -- persistence --------------------------------------------------------------------
    def arrays(self):
        # the packed fields (a copy where rows are padded): files do not depend on the padding
        out = {"replay_records": self.records[:self.size, :self.layout.packed],
               "replay_meta": np.array([self.pos, self.size, self.capacity], np.int64)}
        if self.prioritized:
            out["replay_tree"] = self.tree
            out["replay_max_priority"] = np.array([self.max_priority])
        return out

    def load_arrays(self, data):
        pos, size, cap = (int(v) for v in data["replay_meta"])
        if cap != self.capacity:
            raise ValueError(f"saved replay buffer holds {cap} transitions, config says {self.capacity}")
        src = data["replay_records"]
        if src.shape != (size, self.layout.packed):
            raise ValueError(f"saved replay records have shape {src.shape}, expected {(size, self.layout.packed)}")
        self.records[:size, :self.layout.packed] = src
        self.pos, self.size = pos, size
        if self.prioritized:
            if "replay_tree" not in data:
                raise ValueError("saved replay buffer has no priorities but prioritized replay is on")
            tree = data["replay_tree"]
            if tree.shape != self.tree.shape:
                raise ValueError(f"saved replay priorities have shape {tree.shape}, expected {self.tree.shape}")
            self.tree[:] = tree
            tree_rebuild(self.tree, self.cap2)  # the sums from the leaves (files before stop 42 added differences)
            self.max_priority = float(data["replay_max_priority"][0])

    def save(self, path):
        from .checkpoint import atomic_savez
        atomic_savez(path, self.arrays())

    def load(self, path):
        with np.load(path, allow_pickle=False) as data:
            self.load_arrays(data)
