"""The tile GEMM's path for a left operand with many exact zeros (a ReLU layer's output),
in LLVM IR (AVX-512, or AVX2 with FMA).

What this file is: `emit(mod)`, which adds to tile_gemm.py's module an internal function
C = op(A) @ op(B) (+ bias, then ReLU if relu), row-major, either operand possibly
transposed (function_type). TILE and TILE_BIAS call it first where N is a multiple of
PANEL (and the tile takes the product: the library on one thread; with the GEMM team, on
each of its chunks). Such products are the layers after the first: the forward's input
is the previous layer's ReLU output (A as is), dW's is it transposed (A^T), dx's is a
delta masked by a ReLU (B^T): about half zeros in a net at initialisation, two thirds
in the 2x2x2 preset's after a minute of training. It returns 1, or 0 without touching C
where A is too full for it to pay (FILL_MAX, below); the tile's dense loops then run.

How: C's rows in pairs, listed in blocks of ROW_BLOCK rows and K_BLOCK values of k. A
pair is two neighbouring rows, or, where the caller says the rows are alike by halves
(TILE_BIAS's relu word, bit 1; A as is, M even), row i and row i + M/2: the online
forward of a double-DQN step runs s, then s', and a state's hidden rows share more of
their zeros with its successor's than with the next sampled state's (unions of 0.66 of K
against 0.73 at initialisation; that product 1.07-1.11x, runs/perf46/pairing_time.txt).
The pairing changes which k a pair lists, never a result. For each pair and block of k,
lists of k (as offsets into B's panel) and of the rows' values there, LANES k at a time:
AVX-512 packs a vector's listed lanes with its compress instruction; AVX2 has none, so
the lane mask (8 bits) picks one of 256 lane orders from a table (8 KB) for a permute of
each vector, and the whole vector is stored at the list's end (the lanes past the count
are overwritten by the next store or never read). Then for each PANEL columns of C (four
vectors: 64, 32 with AVX2), that block of B's panel (K_BLOCK x PANEL floats: 32 KB, 16
KB with AVX2) is copied to the stack as the tile does, and each pair walks its lists,
its two rows' sums in eight chains of registers (with AVX2, 14 of the 16 ymm registers).

Walks: a product takes one of two, chosen before its first lists are made.
- "union": one list a pair, the k where either row's a[k] is nonzero, with both rows'
  values; per entry one panel row of four vectors loaded, each row's value broadcast,
  eight FMAs. Where one row is zero at k, half of them add zeros.
- "own": each row's own nonzeros as 8-byte records (the k's panel offset, the value),
  the two lists walked side by side (entry e of each, at its own k: eight panel vectors
  and eight FMAs a step), then the longer one's rest alone (four and four). No FMA adds a
  zero, but every FMA loads its panel vector: on Zen 4 a step costs ~1.2 union entries,
  an entry of the rest ~0.6 (STEP_COSTS, fitted to the products below). A record is read
  with one 64-bit load (the offset its low half, the value broadcast from its high
  half): with separate arrays of offsets and values, four scalar loads a step waited on
  the panel loads' ports, and a step cost ~1.3 (the four products at half zeros 102-103 /
  54-55 / 55-57 / 52-53 (once 63) us with records against 111-113 / 59-60 / 58-62 / 57-58,
  runs/perf52/final_products.txt).
Which is cheaper follows how alike a pair's rows are: rows drawn independently at half
zeros list unions of 0.75 of K and own lists of ~0.52 (own cheaper); rows alike (dead
units, a very sparse delta) list unions little longer than the longer own list (union
cheaper). The product counts (no lists) its first SAMPLE_PAIRS pairs' lengths in the
first K block and takes the walk STEP_COSTS makes cheaper there. On the Zen 4 host,
alone and hot, medians in us, against unions only (HEAD 582b778), runs/perf52/: the
small step's four products at initialisation (rows independent, half zeros,
final_products.txt) online forward 102.4-103.2 vs 121.2-124.0, target 54.0-54.9 vs
64.3-65.4, dx 55.2-57.3 vs 65.2-67.7, dW 52.4-53.3 vs 61.6-61.9 (one round 62.6); on
trained steps' own operands (dump_operands.py, after 3,000 steps; final_operands_*.txt)
with momentum online 101.7-102.4 vs 104.8-105.9, target 51.8 vs 58.4-58.5 (one round
65.0), dW 52.3-52.8 vs 60.1-60.8, dx 52.2-52.4 vs 55.4-55.6, with Adam online 72.3-74.3
vs 75.4-77.1, target 38.0-39.1 vs 41.4-42.7, dW 39.9-40.9 vs 48.0-48.8, dx (13% nonzero,
unions taken) 21.5-23.1 vs 22.1-22.7; the 3x3x3's after 600 Adam steps target 1,678-1,682
vs 1,892-1,946, dW 756-787 vs 916-933, online 1,498-1,526 vs 1,527-1,569, dx 738-741 vs
719-723.

Twins: a pair whose two rows hold the same bits (in a double-DQN step the online net's
row of a terminal transition's s' holds its s, learner.next_state_rows), or a last row
without a partner, walks as one row: four FMAs an entry instead of eight, the sums stored
to both rows (the same bits the two walks would make). The lists note it as they are made
(an OR of the rows' XORs, one op a vector), K block by K block: a pair walks as one while
its rows have been the same in every block so far (C's two rows are then the same too).
Alone and hot, the online forward's 128 x 256 x 256 product at half zeros, paired by
halves (runs/perf51/twins_product2.txt): 14 twin pairs of 64 107.9-110.1 us against
113.3-113.6 before, 26 of 64 96.9-99.2 against 107.1-107.3; with none, the small step's
four products within their noise of before (products_ab2.txt).

Cost (AVX-512): a union entry's eight FMAs about 1.1x a dense tile FMA each when the
host runs fast, more when it does not (the lists and panel rows are loads the dense tile
does not make), so unions pay while they are under ~0.78 of K (FILL_MAX; on the Zen 4
host, dense over sparse, paired unions: lists of 0.75 K 1.02-1.19x, 0.80 K 0.95-0.98x,
0.84 K 0.87-0.93x, runs/perf45/fill_sweep.txt). Own lists, walked always (the 15
products of runs/perf52/records_fill_sweep.txt, independent zeros): fill 0.60
1.10-1.30x, 0.65 1.05-1.23x, 0.70 0.92-1.12x, 0.75 0.88-1.08x, so own walks pay while
they cost under ~0.86 of K in union entries (FILL_MAX_OWN: about fill 0.70). AVX2's
dense tile (6 x 16: two panel loads and six broadcasts per twelve FMAs) leaves the
unions more room: the AVX2 code on the Zen 4 host (CUBEDQN_TILE_GEMM=avx2), the small
step's four 256-wide products, paired medians: unions of 0.75 K 1.11-1.17x, 0.80 K
1.07-1.12x, 0.84 K 1.03-1.09x, 0.88 K 0.98-1.03x (runs/perf46/fill_sweep_avx2.txt), so
FILL_MAX is 0.82 there; its own lists (records_fill_sweep_avx2.txt) 0.60 1.12-1.42x,
0.70 1.00-1.26x, 0.75 0.94-1.17x, so FILL_MAX_OWN and STEP_COSTS are kept (not measured
on an AVX2-only CPU). An own list per row walked alone (no pairs) ran its FMAs at ~1.6x
the tile's cost (AVX-512, stop 52's prototype, its values and offsets in separate
arrays), no faster at half zeros, slower where rows' zeros are alike (rows of a batch
side by side: lists of 0.40 K at 0.33 nonzeros).

Where the time goes (Zen 4, runs/perf53): an own step alone, hot, takes 9.66 cycles for
its eight FMAs (83% of the FMA ceiling; with no list loads 8.95, a union entry's 8.12),
and whole walks of varying lengths as fast (walk_cap.py: 4.82 cycles an entry). The
rest of a product is its lists, its panel copies, C between K blocks and the loops:
skipping the walks leaves 16-23% of each product (exp_overheads2.txt), the large
products' panel copies the most of it (each block of rows copies all of B again, from
L3). Blocks of 256 rows, not 128, halve those copies: bench_peers' four large products
alone and hot 1.02-1.05x together, a cube3 net's after 600 Adam steps 1.05-1.08x, the
issue's cube3 command (Adam) train step 1.02-1.09x in six alternating pairs
(rb256_*.txt); the small step's products are single blocks either way but its dW (256
rows), 1.04x.

Arithmetic: the dense tile's, bit for bit: each element of C is fma(a[k], b[k], acc)
over k in order from +0 (through C between K blocks), then + bias, then the ReLU, with
k where a[k] is zero left out (own lists: each of the row's; unions: where both rows of
the pair have a zero). Leaving an fma(0, b, acc) out changes nothing for a finite b
unless acc is -0, which only an FMA whose exact result underflows past the smallest
subnormal can make. (Where B holds an inf or a NaN, the dense product makes NaN of 0 *
inf and this does not.)

What it is not: a sparse-matrix format (A is dense and its zeros are found on each call:
a count over A first, then the lists), or used for the columns past N's last whole panel.
"""

from __future__ import annotations

import llvmlite.ir as ir

from .native import (counted_loop, declare, lane_mask, load_floats, prefetch, splat, tile_avx512, transpose_rows,
                     zero_or_loaded)

LANES = 16 if tile_avx512() else 8  # floats a vector: zmm, or ymm (AVX2)
NV = 4                  # vectors a row of the panel: with two rows, 8 accumulators (+ 4 + 2 of 16 ymm)
PANEL = NV * LANES      # columns of C a walk of the lists fills: 64, 32 with AVX2
K_BLOCK = 128       # k values a list covers: B's panel, K_BLOCK x PANEL floats, is L1's 32 KB (AVX2: half)
# rows listed at a time: their pairs' lists, ROW_BLOCK / 2 x ROW_SLOTS x 16 bytes (295 KB; AVX2 278), on
# the stack; each block of rows copies every panel of B again, from L3 where B is a large
# layer's weights (2 MB at 1024 x 512): 256 rows, not 128, halve those copies ("Cost")
ROW_BLOCK = 256
ROW_SLOTS = K_BLOCK + LANES  # a pair's list room: each append stores a whole vector past the list's end
# the most the walks may cost, in union entries as a fraction of K (see the docstring): with
# AVX2, whose dense tile does fewer FMAs a load than the AVX-512 one, they pay longer
FILL_MAX = 0.78 if LANES == 16 else 0.82
FILL_MAX_OWN = 0.86  # the same where the product walks its rows' own lists (AVX-512 and AVX2)
# what an entry of each walk costs, in tenths of a union entry ("Walks"): a step of the two
# rows' own lists side by side (two entries), an entry of the longer one's rest alone
STEP_COSTS = {"union": 10, "own": 12, "rest": 6}
SAMPLE_PAIRS = 16  # the pairs whose lists' costs choose a product's walk
NAME = "cubedqn_tile_sparse"


def function_type():
    """i64 (M, N, K, A, lda, B, ldb, C, ldc, bias, relu, a_trans, b_trans, halves): C =
    op(A) @ op(B) (+ bias, then ReLU if relu, where bias is not null), row-major, op(X) =
    X^T where its flag is nonzero; halves nonzero (A as is, M even): row i listed with row
    i + M/2, not with its neighbour (the same bits either way); 1 when done, 0 (C untouched)
    where the lists would be too long."""
    i64, fp = ir.IntType(64), ir.FloatType().as_pointer()
    return ir.FunctionType(i64, [i64, i64, i64, fp, i64, fp, i64, fp, i64, fp, i64, i64, i64, i64])


def emit(mod):
    """The function NAME (internal, of function_type()) into mod; returns it."""
    i1, i8, i32, i64, f32 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
    vec, ivec, mvec = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES), ir.VectorType(i1, LANES)
    fma = declare(mod, f"llvm.fma.v{LANES}f32", ir.FunctionType(vec, [vec, vec, vec]))
    bits = ir.IntType(LANES)  # a lane mask as an integer
    popcount = declare(mod, f"llvm.ctpop.i{LANES}", ir.FunctionType(bits, [bits]))
    if LANES == 16:
        compress_f = declare(mod, "llvm.x86.avx512.mask.compress.v16f32", ir.FunctionType(vec, [vec, vec, mvec]))
        compress_i = declare(mod, "llvm.x86.avx512.mask.compress.v16i32", ir.FunctionType(ivec, [ivec, ivec, mvec]))
    else:  # AVX2 has no compress: a table of the 256 masks' lane orders and a permute
        permute_f = declare(mod, "llvm.x86.avx2.permps", ir.FunctionType(vec, [vec, ivec]))
        permute_i = declare(mod, "llvm.x86.avx2.permd", ir.FunctionType(ivec, [ivec, ivec]))
        orders = ir.GlobalVariable(mod, ir.ArrayType(ivec, 1 << LANES), f"{NAME}_orders")
        orders.linkage, orders.global_constant, orders.align = "internal", True, 32
        orders.initializer = ir.Constant(ir.ArrayType(ivec, 1 << LANES), [
            ir.Constant(ivec, [j for j in range(LANES) if m >> j & 1] + [0] * (LANES - bin(m).count("1")))
            for m in range(1 << LANES)])
    fn = ir.Function(mod, function_type(), name=NAME)
    fn.linkage = "internal"
    M, N, K, A, lda, B, ldb, C, ldc, bias, relu, a_trans, b_trans, halves = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))

    def c64(v):
        return ir.Constant(i64, v)

    def vptr(ptr, off, t=vec):
        return b.bitcast(b.gep(ptr, [off]), t.as_pointer())

    def loop(start, stop, step, name, carried=()):
        return counted_loop(b, start, stop, step, name, carried)

    def smin(x, y):
        return b.select(b.icmp_signed("<", x, y), x, y)

    def branches(cond, name, then, otherwise, carried_types=()):
        """if cond: then() else: otherwise(), each returning values of carried_types; the
        merged values (phis) after."""
        t_bb, f_bb, done = (fn.append_basic_block(f"{name}.{x}") for x in ("then", "else", "done"))
        b.cbranch(cond, t_bb, f_bb)
        outs = []
        for bb, emit_ in ((t_bb, then), (f_bb, otherwise)):
            b.position_at_end(bb)
            vals = emit_()
            outs.append((vals, b.block))
            b.branch(done)
        b.position_at_end(done)
        phis = []
        for i, t in enumerate(carried_types):
            ph = b.phi(t)
            for vals, bb in outs:
                ph.add_incoming(vals[i], bb)
            phis.append(ph)
        return phis

    zero, izero = ir.Constant(vec, [0.0] * LANES), ir.Constant(ivec, [0] * LANES)
    no_lanes = ir.Constant(mvec, [0] * LANES)
    iota = ir.Constant(ivec, [j * PANEL for j in range(LANES)])
    # the stack: B's panel, then each pair of rows' lists ("Walks" in the docstring above) and
    # their lengths: a union (k offsets, both rows' values) or each row's own list, records
    # of (k offset, value) in 8 bytes (the walk reads each with one load); a product makes
    # one kind, so the union's arrays lie in the records' room
    panel = b.alloca(ir.ArrayType(f32, K_BLOCK * PANEL))
    panel.align = 64
    panel = b.bitcast(panel, f32.as_pointer())
    slots = ROW_BLOCK // 2 * ROW_SLOTS
    records = [b.bitcast(b.alloca(ir.ArrayType(i64, slots)), i64.as_pointer()) for _ in range(2)]
    union_offsets = b.bitcast(records[0], i32.as_pointer())
    union_values = [b.gep(b.bitcast(records[0], f32.as_pointer()), [c64(slots)]),
                    b.bitcast(records[1], f32.as_pointer())]
    lengths = [b.bitcast(b.alloca(ir.ArrayType(i64, ROW_BLOCK // 2)), i64.as_pointer()) for _ in range(2)]
    # per pair: whether it walks as one row ("Twins" in the docstring above): 1 or 0
    solo = b.bitcast(b.alloca(ir.ArrayType(i8, ROW_BLOCK // 2)), i8.as_pointer())
    a_t, b_t = b.icmp_signed("!=", a_trans, c64(0)), b.icmp_signed("!=", b_trans, c64(0))
    has_bias = b.icmp_unsigned("!=", b.ptrtoint(bias, i64), c64(0))
    relu_on = b.and_(has_bias, b.icmp_signed("!=", relu, c64(0)))
    # pair g's rows: g * step and g * step + dist, the second only where it is below M
    # (neighbours: step 2, dist 1; halves: step 1, dist M / 2)
    by_halves = b.and_(b.icmp_signed("!=", halves, c64(0)),
                       b.and_(b.not_(a_t), b.icmp_signed("==", b.srem(M, c64(2)), c64(0))))
    step = b.select(by_halves, c64(1), c64(2))
    dist = b.select(by_halves, b.sdiv(M, c64(2)), c64(1))
    n_pairs = b.sdiv(b.add(M, c64(1)), c64(2))

    def pair_rows(g):
        """(first row, second row or the first where there is none, whether there is one)."""
        r0 = b.mul(g, step)
        r1 = b.add(r0, dist)
        second = b.icmp_signed("<", r1, M)
        return r0, b.select(second, r1, r0), second

    def nonzero(v):
        return b.fcmp_unordered("!=", v, zero)  # a NaN counts: the dense product would carry it

    interleave = ir.Constant(ir.VectorType(i32, 2 * LANES), [x for j in range(LANES) for x in (j, LANES + j)])

    def put(p, k, m, vs, lst, pos):
        """Append to pair p's list, at its position pos, the k in [k, k + LANES) in the lane
        mask m (as offsets into B's panel) and the values vs there: row lst's own list (vs =
        [v], as records) or the union (vs = [v0, v1], lst 0); returns the position after."""
        at = b.add(b.mul(p, c64(ROW_SLOTS)), pos)
        ks = b.add(iota, splat(b, b.trunc(b.mul(k, c64(PANEL)), i32), LANES))
        if LANES == 16:
            packed = [b.call(compress_f, [v, zero, m]) for v in vs] + [b.call(compress_i, [ks, izero, m])]
        else:
            order = b.load(b.gep(orders, [c64(0), b.zext(b.bitcast(m, bits), i64)]), align=32)
            packed = [b.call(permute_f, [v, order]) for v in vs] + [b.call(permute_i, [ks, order])]
        if len(vs) == 1:  # records: the offsets and values interleaved
            pairs_ = b.shuffle_vector(b.bitcast(packed[1], vec), packed[0], interleave)
            b.store(pairs_, b.bitcast(b.gep(records[lst], [at]), pairs_.type.as_pointer()), align=4)
        else:
            for t in range(2):
                b.store(packed[t], vptr(union_values[t], at), align=4)
            b.store(packed[2], vptr(union_offsets, at, ivec), align=4)
        return b.add(pos, b.zext(b.call(popcount, [b.bitcast(m, bits)]), i64))

    def put_pair(own, p, k, v0, v1, pos):
        """A pair's appends for its values v0, v1 at [k, k + LANES): own lists (own: pos the
        two rows' positions) or the union (pos[0]; pos[1] passed through)."""
        m0, m1 = nonzero(v0), nonzero(v1)
        if own:
            return [put(p, k, m0, [v0], 0, pos[0]), put(p, k, m1, [v1], 1, pos[1])]
        return [put(p, k, b.or_(m0, m1), [v0, v1], 0, pos[0]), pos[1]]

    def note_lengths(own, p, pos):
        """Stores pair p's list lengths; returns the cost of its walk (STEP_COSTS)."""
        for t in range(2):
            b.store(pos[t], b.gep(lengths[t], [p]))
        if own:
            return own_cost(pos[0], pos[1])
        return b.mul(pos[0], c64(STEP_COSTS["union"]))

    def smax(x, y):
        return b.select(b.icmp_signed(">", x, y), x, y)

    def own_cost(n0, n1):
        """The own lists' walk of lengths n0, n1 (STEP_COSTS)."""
        shorter = smin(n0, n1)
        return b.add(b.mul(shorter, c64(STEP_COSTS["own"])),
                     b.mul(b.sub(smax(n0, n1), shorter), c64(STEP_COSTS["rest"])))

    wide = ir.IntType(32 * LANES)

    def differing(v0, v1, diff):
        """diff | (v0's bits ^ v1's bits): zero while two rows' vectors hold the same bits
        (one ternary-logic op a vector, where a compare and a mask test were three)."""
        return b.or_(diff, b.xor(b.bitcast(v0, ivec), b.bitcast(v1, ivec)))

    def over_vectors(kn, name, step, init, types):
        """step(k, mask, carried) -> carried for k = 0, LANES, ... below kn, the last vector
        masked (mask None for whole ones); returns the carried values after."""
        k, c, close_k = loop(c64(0), kn, LANES, name, init)
        c = close_k(step(k, None, c))
        tail = b.srem(kn, c64(LANES))
        k_last = b.sub(kn, tail)
        return branches(b.icmp_signed(">", tail, c64(0)), f"{name}.tail",
                        lambda: step(k_last, lane_mask(b, LANES, tail), c), lambda: list(c), types)

    def list_rows(own, g0, pairs, k0, kn, first):
        """Pair p's list (p < pairs) of op(A)'s rows pair_rows(g0 + p) (a missing second row
        reads as zero) over k in [k0, k0 + kn); returns the sum of the lists' lengths.
        A as is: each pair's two rows, LANES k at a time (the last vector masked). Sets
        solo[p] (first: the first K block) where the pair walks as one row ("Twins")."""
        p, (total,), close_p = loop(c64(0), pairs, 1, "list", [c64(0)])
        r0, r1, second = pair_rows(b.add(g0, p))

        def loads(k, mask):
            v0 = load_floats(b, A, b.add(b.mul(r0, lda), b.add(k0, k)), LANES, mask)
            v1 = load_floats(b, A, b.add(b.mul(r1, lda), b.add(k0, k)), LANES, mask)
            return v0, b.select(second, v1, zero)

        def put_noting(k, mask, c):
            v0, v1 = loads(k, mask)
            return put_pair(own, p, k, v0, v1, c[:2]) + [differing(v0, v1, c[2])]

        pos0, pos1, diff = over_vectors(kn, "list.k", put_noting, [c64(0), c64(0), izero], [i64, i64, ivec])
        cost = note_lengths(own, p, [pos0, pos1])
        # twins so far (every K block's values the same bits: C's rows too), or no second row
        same = b.icmp_unsigned("==", b.bitcast(diff, wide), ir.Constant(wide, 0))
        at_solo = b.gep(solo, [p])
        before = b.select(first, ir.Constant(i1, 1), b.icmp_unsigned("!=", b.load(at_solo), ir.Constant(i8, 0)))
        b.store(b.zext(b.or_(b.not_(second), b.and_(same, before)), i8), at_solo)
        return close_p([b.add(total, cost)])[0]

    def list_columns(own, i0, rb, k0, kn):
        """list_rows for A transposed: op(A)'s rows are A's columns. LANES of them at a time,
        LANES k at a time: a LANES x LANES block of A (its rows k, columns i) turned in
        registers, then LANES / 2 pairs' values at once."""
        groups = b.sdiv(b.add(rb, c64(LANES - 1)), c64(LANES))
        g, (total,), close_g = loop(c64(0), groups, 1, "listt", [c64(0)])
        u0 = b.add(i0, b.mul(g, c64(LANES)))
        cols = lane_mask(b, LANES, b.sub(b.add(i0, rb), u0))  # columns of A in this block

        def step(k, pos, rows_left):
            block = []
            for r in range(LANES):
                row = b.add(k0, b.add(k, c64(r)))
                m = b.select(b.icmp_signed("<", c64(r), rows_left), cols, no_lanes)  # rows past kn: none
                block.append(load_floats(b, A, b.add(b.mul(row, lda), u0), LANES, m))
            turned = transpose_rows(b, block)  # turned[u]: column u0 + u of A, rows k .. k + 15
            out = []
            for q in range(LANES // 2):
                out += put_pair(own, b.add(b.mul(g, c64(LANES // 2)), c64(q)), k, turned[2 * q], turned[2 * q + 1],
                                pos[2 * q:2 * q + 2])
            return out

        k, pos, close_k = loop(c64(0), kn, LANES, "listt.k", [c64(0)] * LANES)
        pos = close_k(step(k, pos, c64(LANES)))
        tail = b.srem(kn, c64(LANES))
        k_last = b.sub(kn, tail)
        pos = branches(b.icmp_signed(">", tail, c64(0)), "listt.tail", lambda: step(k_last, pos, tail),
                       lambda: list(pos), [i64] * LANES)
        for q in range(LANES // 2):
            at_q = b.add(b.mul(g, c64(LANES // 2)), c64(q))
            total = b.add(total, note_lengths(own, at_q, pos[2 * q:2 * q + 2]))
            b.store(ir.Constant(i8, 0), b.gep(solo, [at_q]))
        return close_g([total])[0]

    def prefetch_at(ptr, off):
        prefetch(b, b.gep(ptr, [off]))

    def copy_panel(j0, k0, kn):
        """op(B)[k0:k0+kn, j0:j0+PANEL] -> the panel (kn rows of PANEL floats); the same
        lines of the next panel (the next PANEL columns, else the next K block's first, else
        this block of rows' first again, for the next) prefetched towards L2 as it goes: B is
        a layer's weights, which a training step last touched a layer ago (L3)."""
        more_j = b.icmp_signed("<", b.add(j0, c64(PANEL)), N)
        nj = b.select(more_j, b.add(j0, c64(PANEL)), c64(0))
        nk = b.select(more_j, k0, b.add(k0, c64(K_BLOCK)))
        nk = b.select(b.icmp_signed("<", nk, K), nk, c64(0))

        def as_is():
            k, _, close_k = loop(c64(0), kn, 1, "copy")
            for v in range(NV):
                row = b.load(vptr(B, b.add(b.mul(b.add(k0, k), ldb), b.add(j0, c64(v * LANES)))), align=4)
                b.store(row, vptr(panel, b.add(b.mul(k, c64(PANEL)), c64(v * LANES))), align=64)
            for line in range(0, PANEL, 16):
                prefetch_at(B, b.add(b.mul(b.add(nk, k), ldb), b.add(nj, c64(line))))
            close_k()
            return []

        def transposed():  # B is (N x K): LANES x LANES blocks turned in registers, the last kn mod LANES rows one by one
            kc, _, close_kc = loop(c64(0), kn, LANES, "copyt")
            for g in range(NV):
                rows = [b.load(vptr(B, b.add(b.mul(b.add(j0, c64(g * LANES + r)), ldb), b.add(k0, kc))), align=4)
                        for r in range(LANES)]
                for r in range(LANES):
                    prefetch_at(B, b.add(b.mul(b.add(nj, c64(g * LANES + r)), ldb), b.add(nk, kc)))
                for c_, row in enumerate(transpose_rows(b, rows)):
                    b.store(row, vptr(panel, b.add(b.mul(b.add(kc, c64(c_)), c64(PANEL)), c64(g * LANES))), align=64)
            close_kc()
            k, _, close_k = loop(b.sub(kn, b.srem(kn, c64(LANES))), kn, 1, "copyt.rest")
            for jj in range(PANEL):
                x = b.load(b.gep(B, [b.add(b.mul(b.add(j0, c64(jj)), ldb), b.add(k0, k))]))
                b.store(x, b.gep(panel, [b.add(b.mul(k, c64(PANEL)), c64(jj))]))
            close_k()
            return []

        branches(b_t, "copy", transposed, as_is)

    def sample_mode():
        """Whether the product's pairs walk their rows' own lists (else their unions, see
        "Walks"): the cheaper by STEP_COSTS, over the first SAMPLE_PAIRS pairs in the first K block,
        counted (no lists made)."""
        kn0 = smin(K, c64(K_BLOCK))

        def rows_as_is():
            p, (su, sm), close_p = loop(c64(0), smin(n_pairs, c64(SAMPLE_PAIRS)), 1, "sample", [c64(0), c64(0)])
            r0, r1, second = pair_rows(p)

            def count(k, mask, c):
                v0 = load_floats(b, A, b.add(b.mul(r0, lda), k), LANES, mask)
                v1 = b.select(second, load_floats(b, A, b.add(b.mul(r1, lda), k), LANES, mask), zero)
                m0, m1 = nonzero(v0), nonzero(v1)
                return [b.add(x, b.zext(b.call(popcount, [b.bitcast(m, bits)]), i64))
                        for x, m in zip(c, (m0, m1, b.or_(m0, m1)))]

            c = over_vectors(kn0, "sample.k", count, [c64(0)] * 3, [i64] * 3)
            return close_p([b.add(su, c[2]), b.add(sm, own_cost(c[0], c[1]))])

        def rows_transposed():  # op(A)'s rows are A's columns: per lane (column) counts over k
            swap = ir.Constant(ivec, [u ^ 1 for u in range(LANES)])
            g, (su, sm), close_g = loop(c64(0), b.sdiv(b.add(smin(M, c64(2 * SAMPLE_PAIRS)), c64(LANES - 1)),
                                                        c64(LANES)), 1, "samplet", [c64(0), c64(0)])
            u0 = b.mul(g, c64(LANES))
            cols = lane_mask(b, LANES, b.sub(M, u0))
            k, (cnt, uni), close_k = loop(c64(0), kn0, 1, "samplet.k", [izero, izero])
            nz = b.zext(nonzero(load_floats(b, A, b.add(b.mul(k, lda), u0), LANES, cols)), ivec)
            cnt, uni = close_k([b.add(cnt, nz), b.add(uni, b.or_(nz, b.shuffle_vector(nz, nz, swap)))])
            for u in range(0, LANES, 2):
                su = b.add(su, b.sext(b.extract_element(uni, ir.Constant(i32, u)), i64))
                sm = b.add(sm, own_cost(*(b.sext(b.extract_element(cnt, ir.Constant(i32, u + t)), i64)
                                          for t in range(2))))
            return close_g([su, sm])

        su, sm = branches(a_t, "sample", rows_transposed, rows_as_is, [i64, i64])
        return b.icmp_signed("<", sm, b.mul(su, c64(STEP_COSTS["union"])))

    own = sample_mode()
    n_kb = b.sdiv(b.add(K, c64(K_BLOCK - 1)), c64(K_BLOCK))
    g0, _, close_g0 = loop(c64(0), b.add(n_pairs, c64(ROW_BLOCK // 2 - 1)), ROW_BLOCK // 2, "pairs")
    pairs = smin(b.sub(n_pairs, g0), c64(ROW_BLOCK // 2))
    i0 = b.mul(g0, c64(2))  # A transposed: always neighbours, the block's rows from i0
    rb = smin(b.sub(M, i0), c64(ROW_BLOCK))
    kb, _, close_kb = loop(c64(0), n_kb, 1, "kb")
    k0 = b.mul(kb, c64(K_BLOCK))
    kn = smin(b.sub(K, k0), c64(K_BLOCK))
    first, last = b.icmp_signed("==", kb, c64(0)), b.icmp_signed("==", kb, b.sub(n_kb, c64(1)))

    def lists(transposed, own_lists):
        if transposed:
            return lambda: [list_columns(own_lists, i0, rb, k0, kn)]
        return lambda: [list_rows(own_lists, g0, pairs, k0, kn, first)]

    (listed,) = branches(a_t, "lists",
                         lambda: branches(own, "listst", lists(True, True), lists(True, False), [i64]),
                         lambda: branches(own, "listsr", lists(False, True), lists(False, False), [i64]), [i64])
    # the first block of rows and of k decides, before C is touched: walks that cost more
    # than union lists of FILL_MAX of k (listed: in STEP_COSTS' units) leave the product to
    # the dense tile
    fill_max = b.select(own, ir.Constant(ir.DoubleType(), FILL_MAX_OWN * STEP_COSTS["union"]),
                        ir.Constant(ir.DoubleType(), FILL_MAX * STEP_COSTS["union"]))
    too_long = b.icmp_signed(">", listed, b.fptosi(b.fmul(b.sitofp(b.mul(pairs, kn), ir.DoubleType()), fill_max), i64))
    give_up, go_on = fn.append_basic_block("dense"), fn.append_basic_block("sparse")
    b.cbranch(b.and_(b.icmp_signed("==", g0, c64(0)), b.and_(first, too_long)), give_up, go_on)
    b.position_at_end(give_up)
    b.ret(c64(0))
    b.position_at_end(go_on)

    # --- for each panel of op(B): copy it, then each pair of rows walks its list
    j0, _, close_j = loop(c64(0), N, PANEL, "cols")
    copy_panel(j0, k0, kn)
    bias_at = b.select(has_bias, bias, panel)  # without a bias, loads that go unused
    bias_v = [b.load(vptr(bias_at, b.add(j0, c64(v * LANES))), align=4) for v in range(NV)]
    p, _, close_p = loop(c64(0), pairs, 1, "pair")
    at = b.mul(p, c64(ROW_SLOTS))
    r0, r1, second = pair_rows(b.add(g0, p))
    rows = [r0, r1]  # a missing second row: the first's (read, never stored)
    add_bias, clip = b.and_(last, has_bias), b.and_(last, relu_on)

    def walk(kind):
        """The pair's walk ("Walks" in the docstring above), then its stores: "one" (twins, or
        no second row) walks list 0 with the first row's values and stores its sums to both
        rows; "own" walks the two rows' own lists side by side, then the longer one's rest;
        "union" walks the union, both rows' values at each k."""
        n_rows = 1 if kind == "one" else 2

        def load_c():
            out = []
            for t in range(n_rows):
                out += [b.load(vptr(C, b.add(b.add(b.mul(rows[t], ldc), j0), c64(v * LANES))), align=4)
                        for v in range(NV)]
            return out

        init = zero_or_loaded(b, first, load_c, zero, f"acc.{kind}")

        def panel_row(off):
            return [b.load(vptr(panel, b.add(off, c64(v * LANES))), align=64) for v in range(NV)]

        def fmas(row, a, accs):
            av = splat(b, a, LANES)
            return [b.call(fma, [av, row[v], accs[v]]) for v in range(NV)]

        def own_fmas(t, e, accs):
            """Row t's own list's entry e into accs: one 8-byte load, the offset its low half."""
            rec = b.load(b.gep(records[t], [b.add(at, e)]))
            a = b.bitcast(b.trunc(b.lshr(rec, c64(32)), i32), f32)
            return fmas(panel_row(b.sext(b.trunc(rec, i32), i64)), a, accs)

        def union_entry(e):
            """The union's entry e: its panel row and the two rows' values."""
            row = panel_row(b.sext(b.load(b.gep(union_offsets, [b.add(at, e)])), i64))
            return row, [b.load(b.gep(union_values[t], [b.add(at, e)])) for t in range(2)]

        lens = [b.load(b.gep(lengths[t], [p])) for t in range(2)]
        if kind == "one":  # list 0, whichever kind
            def one(own_lists):
                e, accs, close_e = loop(c64(0), lens[0], 1, f"walk.one{int(own_lists)}", init)
                if own_lists:
                    return close_e(own_fmas(0, e, accs))
                row, a = union_entry(e)
                return close_e(fmas(row, a[0], accs))
            sums = branches(own, "walk.one", lambda: one(True), lambda: one(False), [vec] * NV)
        elif kind == "own":
            both = smin(lens[0], lens[1])
            e, accs, close_e = loop(c64(0), both, 1, "walk.own", init)
            accs = close_e(own_fmas(0, e, accs[:NV]) + own_fmas(1, e, accs[NV:]))
            for t in range(2):
                e, part, close_e = loop(both, lens[t], 1, f"walk.rest{t}", accs[t * NV:(t + 1) * NV])
                accs = accs[:t * NV] + close_e(own_fmas(t, e, part)) + accs[(t + 1) * NV:]
            sums = accs
        else:
            e, accs, close_e = loop(c64(0), lens[0], 1, "walk.union", init)
            row, a = union_entry(e)
            sums = close_e(fmas(row, a[0], accs[:NV]) + fmas(row, a[1], accs[NV:]))
        for t in range(2):
            def store(t=t):
                for v in range(NV):
                    out = sums[(t if n_rows == 2 else 0) * NV + v]
                    out = b.select(add_bias, b.fadd(out, bias_v[v]), out)  # as nn.dense_forward: v = sum + b; v if v > 0 else 0
                    out = b.select(clip, b.select(b.fcmp_ordered(">", out, zero), out, zero), out)
                    b.store(out, vptr(C, b.add(b.add(b.mul(rows[t], ldc), j0), c64(v * LANES))), align=4)
            if t == 0:
                store()
            else:
                with b.if_then(second):
                    store()
        return []

    branches(b.icmp_unsigned("!=", b.load(b.gep(solo, [p])), ir.Constant(i8, 0)), "solo", lambda: walk("one"),
             lambda: branches(own, "mode", lambda: walk("own"), lambda: walk("union")))
    close_p()
    close_j()
    close_kb()
    close_g0()
    b.ret(c64(1))
    return fn
