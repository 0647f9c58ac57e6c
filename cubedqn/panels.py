"""The sparse first layer's float32 kernels on column panels, written in LLVM IR.

What this file is: two functions, compiled for this CPU with llvmlite (the object code is
then kept on disk, like numba's cache) and bound at import as the external symbols
`cubedqn_panel_gather` and `cubedqn_panel_scatter_by_row`, which nn.sparse_forward_panels /
sparse_backward_panels call from njit (cached kernels call them by name, as with blas.py's
sgemm):

  gather   out (B,H) = b + sum_s W[idx[:, s]]  (then ReLU), for the columns [0, hp)
  scatter  dW (in,H): row r = the sum of the dout (B,H) rows of the batch rows that hit r
           (given as lists, see SCATTER_SIG); db = column sums of dout; columns [0, hp)

hp is H rounded down to a multiple of PANEL (32) columns; nn.py does the rest. Both walk
one panel of PANEL columns at a time. The gather first copies W's panel (in x 32 floats:
18 KB for the 2x2x2's 144 sticker rows, 41 KB for the 3x3x3's 324) into a contiguous
scratch buffer, then every batch row sums its S panel rows in vector registers (two batch
rows at once: four 16-float accumulators) and stores its 32 outputs once. Why: the
row-by-row numba kernel re-loads and re-stores each output element once per eight
stickers and reads each W row from L2, and a panel of W read in place is in rows 1 KB or
4 KB apart, which map onto a few L1 sets and evict each other (column chunks without the
copy ran slower, Design notes); the copied panel is contiguous (all of it in the 32 KB
L1 at 144 rows, most of it at 324). The scatter is the gather turned around: it copies
dout's panel (B x 32 floats) into the scratch and, for each W1 row (two at once), sums the
copied rows of its batch rows in registers and stores the dW panel row once. (It first
added every dout row into a dW panel kept in the scratch, a load and a store per
sticker: 1.10-1.21x slower at the 2x2x2's shape, 1.66-1.73x at the 3x3x3's, one-off
prototype timings alternating in one process, not kept.) Every dW element is written,
zeros included (as sparse_backward writes all of dW).

Where a call is big (FAR_FLOATS: the 3x3x3's 324 x 1024 layer at a batch of 256), its
data is not in L2 when a training step gets to it: W1 and dout were last touched a step
or a forward ago, and the output rows are 4 KB apart, a new page each, which the hardware
prefetchers do not follow. Such calls run a copy of both kernels (`*_far`) that prefetches
the next panel's W1 (dout) lines, a share with each pair of batch (W1) rows, and, for
writing, the output (dW) lines of the row AHEAD rows on. In a cube3 step (Zen 4) the
target gather went 616-722 -> 467-476 us, the online one 1,088-1,360 -> 851-889 and the
scatter 624-717 -> 435-480 with the next panel prefetched during the copy of this one;
spread over the rows instead, the gathers (with tables) 403-464 -> 336-351 and 619-688
-> 529-568, the scatter 404-434 -> 395-421 (three alternating pairs). Small calls
keep the plain loops: hot in L2 the hints cost the 2x2x2's 64- and 128-row scatter 10%
(the gather 1-3%) and gained nothing in its step.

Tables: given n_t table rows (encoding.InputGroups: one per joint value of a cubie's stickers,
each the sum of its W1 rows), the gather builds them per panel from W's copied panel
into the scratch after it (zero, then the listed W rows in order), and idx then lists
table rows: a 3x3x3 row sums 26 of them instead of 54 W1 rows. The scatter has no
tables (through them it was no faster in a training step, docs/performance-log.md).

Summation order per output element: bias, then the stickers in index order, one add
each: a row's result does not depend on the other rows of the batch (the target cache
relies on that), and equals a plain sequential float32 sum. The scatter's: zero, then
the batch rows in order, i.e. the sums the sequential scatter-add makes.

Where LLVM cannot compile the IR for this CPU, the symbols are bound to plain Numba loops
with the same arithmetic (`_make_fallbacks`, also the tests' second opinion) and
AVAILABLE is False, so nn.py hands out no panel scratch and keeps its row kernels.

What it is not: float64 (gradient checks use nn.py's numba loops) or wide inputs (the
slot pairs' 9,261-row W1 makes a panel too big for L1: nn.py keeps the row gather).
The caller guarantees contiguous rows, idx within [0, in), and distinct buffers.
"""

from __future__ import annotations

import llvmlite.binding as llb
import llvmlite.ir as ir
from numba import types

from .native import counted_loop, load_or_compile, prefetch

PANEL = 32          # columns per panel
LANES = 16          # floats per vector (two 256-bit registers where there is no AVX-512)
ROWS = 2            # batch rows summed at once
# Calls whose (W1 rows + batch rows) x columns reach this many floats (512 KB, half an L2)
# prefetch ahead: in a training step their W1, dout and output lines come from memory,
# not L2 (see the docstring); smaller calls run the same loops without the hints, which
# cost more than they save where the data is in L2.
FAR_FLOATS = 1 << 17
AHEAD = 8           # rows ahead of the one being written whose lines are prefetched
TABLE_UNROLLED = 3  # table rows of up to this many W rows are summed without a loop
GATHER, SCATTER = "cubedqn_panel_gather", "cubedqn_panel_scatter_by_row"

_f32p, _i32p, _i64 = types.CPointer(types.float32), types.CPointer(types.int32), types.int64
# Both return the columns done: hp, or 0 (nothing touched) when `width`, the panel width
# the caller was compiled with, is not PANEL. A cached caller keeps the PANEL it was
# compiled with (numba does not see a change in another module), so a mismatch must not
# run with the wrong scratch size: the caller then falls back to its row kernels.
# gather(out, ldo, W, ldw, idx, lds, n, s, hp, bias, relu, panel, n_in, width, n_t, t_order,
# t_starts): with n_t > 0, idx indexes n_t table rows, table row t being the sum (from zero,
# in list order) of W's rows t_order[t_starts[t]:t_starts[t + 1]] (see "Tables" above)
GATHER_SIG = types.int64(_f32p, _i64, _f32p, _i64, _i32p, _i64, _i64, _i64, _i64, _f32p, _i64, _f32p, _i64, _i64,
                         _i64, _i32p, _i32p)
# scatter(dout, ldd, dW, ldw, order, starts, n, hp, db, panel, n_in, width): order/starts
# list, for each W1 row r, the batch rows that hit it: order[starts[r]:starts[r + 1]]
# (ascending; a row hit twice is listed twice), as nn.py's counting sort builds them
SCATTER_SIG = types.int64(_f32p, _i64, _f32p, _i64, _i32p, _i32p, _i64, _i64, _f32p, _f32p, _i64, _i64)
gather_panels = types.ExternalFunction(GATHER, GATHER_SIG)
scatter_panels = types.ExternalFunction(SCATTER, SCATTER_SIG)


class _Builder:
    """An IRBuilder with counted loops whose carried values are SSA phis (registers)."""

    def __init__(self, fn):
        self.b = ir.IRBuilder(fn.append_basic_block("entry"))
        self.i64 = ir.IntType(64)
        self.vec = ir.VectorType(ir.FloatType(), LANES)

    def const(self, v):
        return ir.Constant(self.i64, v)

    def loop(self, start, stop, step, name, carried=()):
        """native.counted_loop at this builder: returns (i, phis, close)."""
        return counted_loop(self.b, start, stop, step, name, carried)

    def at(self, ptr, *terms):
        """ptr + sum of terms (i64 values or ints), as a vector pointer."""
        b = self.b
        off = self.const(0)
        for t in terms:
            off = b.add(off, t if isinstance(t, ir.Value) else self.const(t))
        return b.bitcast(b.gep(ptr, [off]), self.vec.as_pointer())

    def vload(self, ptr, *terms):
        return self.b.load(self.at(ptr, *terms), align=4)

    def vstore(self, v, ptr, *terms):
        self.b.store(v, self.at(ptr, *terms), align=4)


    def prefetch(self, ptr, for_write, *terms):
        """A hint to bring the line at ptr + sum of terms into the cache (for writing: into
        this core's L1, owned; for reading: into L2). Never faults, whatever the address."""
        prefetch(self.b, self.at(ptr, *terms), for_write)

    def share(self, total, steps):
        """ceil(total / max(steps, 1)): rows per step to spread `total` rows over `steps`."""
        b = self.b
        steps = b.select(b.icmp_signed(">", steps, self.const(0)), steps, self.const(1))
        return b.sdiv(b.add(total, b.sub(steps, self.const(1))), steps)

    def prefetch_share(self, ptr, ld, col, step, per, rows):
        """Prefetch for reading the lines at column col of rows [step * per, step * per +
        per) (those below `rows`): one step's share of the next panel."""
        b = self.b
        lo = b.mul(step, per)
        hi = b.add(lo, per)
        r, _, close = self.loop(lo, b.select(b.icmp_signed("<", hi, rows), hi, rows), 1, "share")
        for v in range(PANEL // LANES):
            self.prefetch(ptr, False, b.mul(r, ld), col, v * LANES)
        close()

    def prefetch_row_ahead(self, ptr, row, rows, ld, col):
        """Prefetch for writing the panel's lines of row min(row + AHEAD, rows - 1)."""
        b = self.b
        last = b.sub(rows, self.const(1))
        ahead = b.add(row, self.const(AHEAD))
        ahead = b.select(b.icmp_signed("<", ahead, last), ahead, last)
        for v in range(PANEL // LANES):
            self.prefetch(ptr, True, b.mul(ahead, ld), col, v * LANES)


def _copy_panel(B, src, ld_src, dst, ld_dst, n_in, c_src, c_dst):
    """dst[r*ld_dst + c_dst + j] = src[r*ld_src + c_src + j] for r < n_in, j < PANEL."""
    b = B.b
    r, _, close = B.loop(B.const(0), n_in, 1, "copy")
    for v in range(PANEL // LANES):
        B.vstore(B.vload(src, b.mul(r, ld_src), c_src, v * LANES), dst, b.mul(r, ld_dst), c_dst, v * LANES)
    close()


def _if(B, fn, cond, emit_then, name):
    """if cond: emit_then(), as basic blocks at B."""
    b = B.b
    then_bb, done_bb = fn.append_basic_block(f"{name}.then"), fn.append_basic_block(f"{name}.done")
    b.cbranch(cond, then_bb, done_bb)
    b.position_at_end(then_bb)
    emit_then()
    b.branch(done_bb)
    b.position_at_end(done_bb)


def _list_reading(B, src, order):
    """(at, add_listed) for summing listed panel rows: at(ptr, k) is the int32 ptr[k] as
    i64; add_listed(accs, e) is accs + the src panel row order[e], vector by vector."""
    b = B.b

    def at(ptr, k):
        return b.sext(b.load(b.gep(ptr, [k])), B.i64)

    def add_listed(accs, e):
        base = b.mul(at(order, e), B.const(PANEL))
        return [b.fadd(acc, B.vload(src, base, v * LANES)) for v, acc in enumerate(accs)]

    return at, add_listed


def _listed_sums(B, src, order, starts, n_dst, store, ahead=None, each_pair=None):
    """For each r < n_dst: store(zero + the src panel rows order[starts[r]:starts[r + 1]],
    in list order, r); two rows r at a time (four chains of adds in flight). ahead =
    (ptr, ld, column): prefetch for writing the lines of the row AHEAD rows on there;
    each_pair(r): more code for each pair (the scatter's share of the next panel)."""
    b, nv = B.b, PANEL // LANES
    zero = ir.Constant(B.vec, [0.0] * LANES)
    at, add_listed = _list_reading(B, src, order)

    r, _, close_r = B.loop(B.const(0), n_dst, 2, "r2")
    r1 = b.add(r, B.const(1))
    if ahead is not None:
        for rr in (r, r1):
            B.prefetch_row_ahead(ahead[0], rr, n_dst, ahead[1], ahead[2])
    if each_pair is not None:
        each_pair(r)
    lo0, lo1, hi1 = at(starts, r), at(starts, r1), at(starts, b.add(r, B.const(2)))
    n0, n1 = b.sub(lo1, lo0), b.sub(hi1, lo1)
    both = b.select(b.icmp_signed("<", n0, n1), n0, n1)
    e, accs, close_e = B.loop(B.const(0), both, 1, "both", [zero] * (2 * nv))
    accs = close_e(add_listed(accs[:nv], b.add(lo0, e)) + add_listed(accs[nv:], b.add(lo1, e)))
    e, acc0, close_e = B.loop(both, n0, 1, "rest0", accs[:nv])
    store(close_e(add_listed(acc0, b.add(lo0, e))), r)
    e, acc1, close_e = B.loop(both, n1, 1, "rest1", accs[nv:])
    store(close_e(add_listed(acc1, b.add(lo1, e))), r1)
    close_r()
    r, _, close_r = B.loop(b.mul(b.sdiv(n_dst, B.const(2)), B.const(2)), n_dst, 1, "last")  # n_dst odd
    e, acc, close_e = B.loop(at(starts, r), at(starts, b.add(r, B.const(1))), 1, "e", [zero] * nv)
    store(close_e(add_listed(acc, e)), r)
    close_r()


def _table_rows(B, fn, src, order, starts, n_dst, dst):
    """dst row t = zero + the src panel rows order[starts[t]:starts[t + 1]], in order, for
    t < n_dst, as _listed_sums; one row at a time, lists of 1 to TABLE_UNROLLED rows (a
    cubie's stickers) without a loop: the length is the same over long runs of rows, so
    the branch on it predicts, where the pairs' loops of 1 to 3 trips did not."""
    b, nv, i64 = B.b, PANEL // LANES, B.i64
    zero = ir.Constant(B.vec, [0.0] * LANES)
    at, add_row = _list_reading(B, src, order)

    def put(accs, t):
        for v in range(nv):
            B.vstore(accs[v], dst, b.mul(t, B.const(PANEL)), v * LANES)

    t, _, close_t = B.loop(B.const(0), n_dst, 1, "t")
    lo = at(starts, t)
    count = b.sub(at(starts, b.add(t, B.const(1))), lo)
    done = fn.append_basic_block("t.stored")
    other = fn.append_basic_block("t.listed")
    switch = b.switch(count, other)
    for k in range(1, TABLE_UNROLLED + 1):
        case = fn.append_basic_block(f"t.rows{k}")
        switch.add_case(ir.Constant(i64, k), case)
        b.position_at_end(case)
        accs = [zero] * nv
        for j in range(k):
            accs = add_row(accs, b.add(lo, B.const(j)))
        put(accs, t)
        b.branch(done)
    b.position_at_end(other)
    e, accs, close_e = B.loop(lo, b.add(lo, count), 1, "t.e", [zero] * nv)
    put(close_e(add_row(accs, e)), t)
    b.branch(done)
    b.position_at_end(done)
    close_t()


def _far_or_near(B, fn, far, far_fn, n_in, n, hp, emit):
    """The body of fn, the near or the far variant (emit() writes its panel loop): the
    far variant prefetches ahead, for calls whose rows are many enough that their data
    comes from memory rather than L2 (FAR_FLOATS); the near one, the entry point, hands
    those calls to far_fn (its own function, so that the near loops' code is as it was:
    sharing one function moved them and cost the small scatter ~10%)."""
    b = B.b
    if not far:
        go_far, near_bb = fn.append_basic_block("go.far"), fn.append_basic_block("near")
        b.cbranch(b.icmp_signed(">=", b.mul(b.add(n_in, n), hp), B.const(FAR_FLOATS)), go_far, near_bb)
        b.position_at_end(go_far)
        b.ret(b.call(far_fn, fn.args))
        b.position_at_end(near_bb)
    else:
        fn.linkage = "internal"
    emit()
    b.ret(hp)


def _next_column(B, c, hp):
    """The next panel's first column, or c itself for the last panel."""
    b = B.b
    nxt = b.add(c, B.const(PANEL))
    return b.select(b.icmp_signed("<", nxt, hp), nxt, c)


def _return_unless_width(B, fn, width):
    """Return 0 at once unless the caller's panel width is PANEL."""
    ok, mismatch = fn.append_basic_block("width.ok"), fn.append_basic_block("width.mismatch")
    B.b.cbranch(B.b.icmp_signed("==", width, B.const(PANEL)), ok, mismatch)
    B.b.position_at_end(mismatch)
    B.b.ret(B.const(0))
    B.b.position_at_end(ok)


def _build_gather(mod, far=False, far_fn=None):
    f32p, i32p = ir.FloatType().as_pointer(), ir.IntType(32).as_pointer()
    i64 = ir.IntType(64)
    fn = ir.Function(mod, ir.FunctionType(i64, [f32p, i64, f32p, i64, i32p, i64, i64, i64, i64, f32p,
                                                i64, f32p, i64, i64, i64, i32p, i32p]), name=GATHER + "_far" * far)
    out, ldo, W, ldw, idx, lds, n, s, hp, bias, relu, panel, n_in, width, n_t, t_order, t_starts = fn.args
    for p in (out, W, idx, bias, panel, t_order, t_starts):
        p.add_attribute("noalias")
    B = _Builder(fn)
    b, nv = B.b, PANEL // LANES
    _return_unless_width(B, fn, width)
    zero = ir.Constant(B.vec, [0.0] * LANES)
    relu_on = b.icmp_signed("!=", relu, B.const(0))

    tables = b.icmp_signed(">", n_t, B.const(0))
    table = b.gep(panel, [b.mul(n_in, B.const(PANEL))])  # the table panel, after W's
    src = b.select(tables, table, panel)                   # the rows the batch sums
    per_pair = B.share(n_in, b.sdiv(n, B.const(ROWS)))  # W rows of the next panel prefetched per row pair

    def emit():
        c, _, close_c = B.loop(B.const(0), hp, PANEL, "c")
        nxt = _next_column(B, c, hp)
        _copy_panel(B, W, ldw, panel, B.const(PANEL), n_in, c, 0)
        _if(B, fn, tables, lambda: _table_rows(B, fn, panel, t_order, t_starts, n_t, table), "table")
        init = [B.vload(bias, c, v * LANES) for v in range(nv)]

        def rows_from(start, rp):
            """Batch rows [start, n) rp at a time (rows left over stay for the next call);
            returns the row after the last one done."""
            i, _, close_i = B.loop(start, n, rp, f"i{rp}")
            if far:  # the output rows a few iterations on: their lines are owned by the time they are stored
                for r in range(rp):
                    B.prefetch_row_ahead(out, b.add(i, B.const(r)), n, ldo, c)
            if far and rp == ROWS:  # and the next panel's W rows, a few per row pair
                B.prefetch_share(W, ldw, nxt, b.sdiv(i, B.const(ROWS)), per_pair, n_in)
            k, accs, close_k = B.loop(B.const(0), s, 1, f"k{rp}", init * rp)
            new = []
            for r in range(rp):
                row = b.sext(b.load(b.gep(idx, [b.add(b.mul(b.add(i, B.const(r)), lds), k)])), i64)
                base = b.mul(row, B.const(PANEL))
                new += [b.fadd(accs[r * nv + v], B.vload(src, base, v * LANES)) for v in range(nv)]
            sums = close_k(new)
            for r in range(rp):
                obase = b.mul(b.add(i, B.const(r)), ldo)
                for v in range(nv):
                    a = sums[r * nv + v]
                    clipped = b.select(b.fcmp_ordered("<", a, zero), zero, a)
                    B.vstore(b.select(relu_on, clipped, a), out, obase, c, v * LANES)
            close_i()
            return i

        rows_from(rows_from(B.const(0), ROWS), 1)
        close_c()

    _far_or_near(B, fn, far, far_fn, n_in, n, hp, emit)
    return fn


def _build_scatter(mod, far=False, far_fn=None):
    f32p, i32p = ir.FloatType().as_pointer(), ir.IntType(32).as_pointer()
    i64 = ir.IntType(64)
    fn = ir.Function(mod, ir.FunctionType(i64, [f32p, i64, f32p, i64, i32p, i32p, i64, i64, f32p, f32p, i64,
                                                i64]), name=SCATTER + "_far" * far)
    dout, ldd, dW, ldw, order, starts, n, hp, db, panel, n_in, width = fn.args
    for p in (dout, dW, order, starts, db, panel):
        p.add_attribute("noalias")
    B = _Builder(fn)
    b, nv = B.b, PANEL // LANES
    _return_unless_width(B, fn, width)
    zero = ir.Constant(B.vec, [0.0] * LANES)

    per_pair = B.share(n, b.sdiv(n_in, B.const(2)))  # dout rows of the next panel prefetched per W1 row pair

    def emit():
        c, _, close_c = B.loop(B.const(0), hp, PANEL, "c")
        nxt = _next_column(B, c, hp)
        _copy_panel(B, dout, ldd, panel, B.const(PANEL), n, c, 0)
        i, dbs, close_i = B.loop(B.const(0), n, 1, "i", [zero] * nv)
        sums = close_i([b.fadd(dbs[v], B.vload(panel, b.mul(i, B.const(PANEL)), v * LANES)) for v in range(nv)])
        for v in range(nv):
            B.vstore(sums[v], db, c, v * LANES)

        def store(sums, r):
            for v in range(nv):
                B.vstore(sums[v], dW, b.mul(r, ldw), c, v * LANES)

        # W1 rows two at a time, each summing its own list of dout rows in order
        _listed_sums(B, panel, order, starts, n_in, store, (dW, ldw, c) if far else None,
                     (lambda r: B.prefetch_share(dout, ldd, nxt, b.sdiv(r, B.const(2)), per_pair, n)) if far else None)
        close_c()

    _far_or_near(B, fn, far, far_fn, n_in, n, hp, emit)
    return fn


def module_ir() -> str:
    mod = ir.Module(name="cubedqn_panels")
    _build_gather(mod, False, _build_gather(mod, True))
    _build_scatter(mod, False, _build_scatter(mod, True))
    return str(mod)


def _make_fallbacks():
    """Plain Numba versions of both functions (same arithmetic, same order, no registers
    kept across stickers): bound instead when the IR cannot be compiled here, and the
    tests' second opinion on the IR. Compiled (and cached) only when used."""
    import numpy as np
    from numba import carray, cfunc, njit

    @njit(cache=True)
    def rows_of(p, rows, ld, width):
        """The flat buffer behind `rows` rows of `width` values, `ld` apart, at p."""
        return carray(p, (rows - 1) * ld + width if rows > 0 else 0)

    @njit(cache=True)
    def listed_sums(src, ld_src, order_p, starts_p, n_dst, dst, ld_dst, hp):
        """dst row r = zero + src's rows order[starts[r]:starts[r + 1]], in order."""
        starts = carray(starts_p, n_dst + 1)
        order = carray(order_p, starts[n_dst])
        for r in range(n_dst):
            for j in range(hp):
                v = np.float32(0)
                for e in range(starts[r], starts[r + 1]):
                    v += src[order[e] * ld_src + j]
                dst[r * ld_dst + j] = v

    @cfunc(GATHER_SIG, cache=True, nopython=True)
    def gather_loops(out_p, ldo, w_p, ldw, idx_p, lds, n, s, hp, bias_p, relu, panel_p, n_in, width, n_t, to_p,
                     ts_p):
        if width != PANEL:
            return 0
        out, w, idx = rows_of(out_p, n, ldo, hp), rows_of(w_p, n_in, ldw, hp), rows_of(idx_p, n, lds, s)
        bias = carray(bias_p, hp)
        ld = ldw
        if n_t > 0:  # the table rows, then the batch rows sum those
            table = np.empty(n_t * hp, np.float32)
            listed_sums(w, ldw, to_p, ts_p, n_t, table, hp, hp)
            w, ld = table, hp
        for i in range(n):
            for j in range(hp):
                v = bias[j]
                for k in range(s):
                    v += w[idx[i * lds + k] * ld + j]
                out[i * ldo + j] = 0 if (relu != 0 and v < 0) else v
        return hp

    @cfunc(SCATTER_SIG, cache=True, nopython=True)
    def scatter_loops(dout_p, ldd, dw_p, ldw, order_p, starts_p, n, hp, db_p, panel_p, n_in, width):
        if width != PANEL:
            return 0
        dout, dw = rows_of(dout_p, n, ldd, hp), rows_of(dw_p, n_in, ldw, hp)
        db = carray(db_p, hp)
        for j in range(hp):
            db[j] = 0
        for i in range(n):
            for j in range(hp):
                db[j] += dout[i * ldd + j]
        listed_sums(dout, ldd, order_p, starts_p, n_in, dw, ldw, hp)
        return hp

    return gather_loops, scatter_loops


def _compile():
    """Load the object code compiled for this CPU before, or compile it (native.py); returns
    the engine (which owns the code) after binding both symbols. Sets SOURCE."""
    global SOURCE
    engine, SOURCE = load_or_compile("panels", __file__, module_ir, (GATHER, SCATTER))
    return engine


def _bind():
    """(engine or None, problem): the IR when it compiles, else the loops above."""
    global _FALLBACKS, SOURCE
    try:
        return _compile(), None
    except Exception as e:  # an LLVM that cannot target this CPU: stay correct, be slow
        SOURCE = "fallback"
        _FALLBACKS = _make_fallbacks()
        for name, fn in zip((GATHER, SCATTER), _FALLBACKS):
            llb.add_symbol(name, fn.address)
        return None, f"{type(e).__name__}: {e}"


_FALLBACKS = ()
SOURCE = ""  # where the bound code came from: "compiled", "cache" (object file) or "fallback"


_ENGINE, PROBLEM = _bind()
AVAILABLE = _ENGINE is not None  # nn.Workspace gives out panel scratch only then
