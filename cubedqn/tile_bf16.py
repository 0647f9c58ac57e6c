"""The GEMMs' bfloat16 mode: products of bf16-rounded operands summed in float32 (AVX512_BF16).

What this file is: the LLVM IR of one function, `cubedqn_tile_bf16`, which tile_gemm.py's
sgemm and bias-GEMM call in place of their float32 paths while the matmul precision is
"bfloat16" (blas.set_matmul_precision; `--matmul-precision bfloat16` on the command line).
It computes

    C = bf16(op(A)) @ bf16(op(B))  [+ bias, then ReLU]

each operand element rounded to bfloat16 (nearest, ties to even) as it is packed, the
products exact in float32 (8-bit by 8-bit significands) and summed in float32 by
VDPBF16PS, which adds two products per lane per instruction: on Zen 4 the instruction
issues as often as a float32 FMA, so the tile does twice the FLOPs per cycle (a register
loop of 16 chains: 231 against 116 GFLOP/s, one core). The weights, gradients and
optimizer state stay float32 (this is the mixed precision of PyTorch's
`torch.set_float32_matmul_precision("medium")`, not a bf16 network).

How (as tile_gemm.py's float32 tile, with pairs of k): K in blocks of 256 values, the
outer loop. For each block, op(A)'s rows (at most A_BLOCK = 256 per call; more rows are
more calls) are first rounded into a stack scratch of bf16 pairs, once, laid out as pair
rows (pair p of every row, then pair p + 1): from A as is, 16 rows' runs of k turned by
16 x 16 transposes of 32-bit pairs in registers; from A transposed (a weight gradient's
acts^T), two rows of A interleaved (converting per row group and panel instead, those
reads, K rows lda apart, evicted each other: 0.63-0.93x the float32 tile at 1024 x 512 x
256, 1.9x after). One layout for both keeps the inner loop's eight A pairs at one base
and constant offsets (1.0-1.07x over a row-major scratch for A as is). Then for each
32 columns of C, op(B)'s block is packed into a stack panel of pair rows (row p holds
(B[2p, j], B[2p+1, j]) for the 32 columns j, 128 bytes: two zmm of sixteen pairs); B
transposed (input gradients, delta @ W^T), whose pairs are adjacent in memory, goes
through 16 x 16 transposes of 32-bit pairs in registers. Each group of 8 rows of C (16
in a one-vector tail, then single rows) keeps its 8 x 32 tile in 16 zmm accumulators
(from zero in the first block, from C after it) while it walks the pairs: per pair two
loads of the panel row, eight broadcasts of an A pair, sixteen VDPBF16PS. An odd K's
last pair has a zero second half; the last N mod 32 columns are masked as in
tile_gemm.py. A row's result never depends on the other rows of the call (the same
packed values and the same instruction sequence per element, whichever group it falls
in). Zen 4, one core, against the float32 tile (`scripts/bench_tile_gemm.py --bf16`, three
runs): the small net's products 1.65-1.95x, the large net's 1.49-1.94x; the 12-wide Q
head's 0.85-1.0x (there converting A costs as much as the 16-column product).

Arithmetic, per element: over the K pairs in order from zero (a K block's sums go through
C unchanged), acc += a[2p+1] b[2p+1], then acc += a[2p] b[2p] (Intel's definition of the
instruction; denormal inputs and results are flushed to zero). tests/test_tile_bf16.py
checks the kernel bit for bit against that, emulated in numpy (reference.gemm_bf16).

What it is not: a float32 GEMM (every product it takes is rounded), or compiled where the
CPU lacks AVX512_BF16 (then blas.py refuses the bf16 precision with a one-line reason).
"""

from __future__ import annotations

import llvmlite.ir as ir

from .native import (counted_loop, declare, host_features, lane_mask, load_floats, store_floats,
                     tail_columns, transpose_rows, zero_or_loaded)

BF16 = "cubedqn_tile_bf16"
TRANS = 112                 # CBLAS's value for a transposed operand (blas.TRANS)
MR, NR, LANES = 8, 32, 16   # tile rows, tile columns (one panel), float32 lanes per zmm
K_BLOCK = 256               # k values per block; the panel holds K_BLOCK // 2 pair rows (16 KB)
PAIRS = K_BLOCK // 2
A_BLOCK = 256               # rows of C per call (op(A)'s pairs over a K block: 128 KB on the stack)
# epilogue: what the last K block's stores add
EPI_NONE, EPI_BIAS, EPI_BIAS_RELU = 0, 1, 2


def host_has_bf16() -> bool:
    return "+avx512bf16" in host_features().split(",")


class BFloatType(ir.Type):
    """LLVM's bfloat, which llvmlite.ir does not name."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, BFloatType)

    def __hash__(self):
        return hash("bfloat")


def signature():
    """(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, bias, epilogue) -> void; row-major, C = op(A) @ op(B)."""
    i32, i64, fp = ir.IntType(32), ir.IntType(64), ir.FloatType().as_pointer()
    return ir.FunctionType(ir.VoidType(), [i32, i32, i64, i64, i64, fp, i64, fp, i64, fp, i64, fp, i64])


def emit(mod):
    """Adds BF16 to mod and returns it."""
    i1, i16, i32, i64, f32 = ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
    bf = BFloatType()
    vec, ivec = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES)
    bvec = ir.VectorType(bf, 2 * LANES)  # 16 pairs: one zmm
    fn = ir.Function(mod, signature(), name=BF16)
    ta, tb, M, N, K, A, lda, B, ldb, C, ldc, bias, epi = fn.args
    dot = declare(mod, "llvm.x86.avx512bf16.dpbf16ps.512", ir.FunctionType(vec, [vec, bvec, bvec]))

    def c64(v):
        return ir.Constant(i64, v)

    def c32(v):
        return ir.Constant(i32, v)

    b = ir.IRBuilder(fn.append_basic_block("entry"))
    a_trans, b_trans = b.icmp_signed("==", ta, c32(TRANS)), b.icmp_signed("==", tb, c32(TRANS))
    # more than A_BLOCK rows of C: a call per A_BLOCK rows (each call's op(A) block is
    # converted once into a stack scratch of A_BLOCK rows)
    blocks_bb, body_bb = fn.append_basic_block("rows.blocks"), fn.append_basic_block("body")
    b.cbranch(b.icmp_signed(">", M, c64(A_BLOCK)), blocks_bb, body_bb)
    b.position_at_end(blocks_bb)
    i0, _, close_i0 = counted_loop(b, c64(0), b.add(M, c64(A_BLOCK - 1)), A_BLOCK, "rows.block")
    left = b.sub(M, i0)
    a_at = b.select(a_trans, i0, b.mul(i0, lda))
    b.call(fn, [ta, tb, b.select(b.icmp_signed("<", left, c64(A_BLOCK)), left, c64(A_BLOCK)), N, K,
                b.gep(A, [a_at]), lda, B, ldb, b.gep(C, [b.mul(i0, ldc)]), ldc, bias, epi])
    close_i0()
    b.ret_void()
    b.position_at_end(body_bb)
    panel = b.alloca(ir.ArrayType(i16, PAIRS * 2 * NR))
    panel.align = 64
    panel = b.bitcast(panel, i16.as_pointer())
    pairs_a = b.alloca(ir.ArrayType(i32, PAIRS * A_BLOCK))  # op(A)'s pairs over a K block, 128 KB
    pairs_a.align = 64
    pairs_a = b.bitcast(pairs_a, i32.as_pointer())
    has_bias = b.icmp_signed("!=", epi, c64(EPI_NONE))
    relu = b.icmp_signed("==", epi, c64(EPI_BIAS_RELU))
    n_tiled = b.sub(N, b.srem(N, c64(NR)))
    zero = ir.Constant(vec, [0.0] * LANES)
    undef_i = ir.Constant(ivec, ir.Undefined)
    splat0 = ir.Constant(ivec, [0] * LANES)
    # pair p of op(A)'s row i is at pairs_a[p * A_BLOCK + i], for A as is and transposed:
    # the inner loop's eight A pairs are one base and constant offsets

    def loop(start, stop, step, name, carried=()):
        return counted_loop(b, start, stop, step, name, carried)

    def ptr(base, off, t):
        return b.bitcast(b.gep(base, [off]), t.as_pointer())

    def interleave(x, y):
        """(x0, y0, x1, y1, ...) of two vectors of the same width."""
        w = x.type.count
        return b.shuffle_vector(x, y, ir.Constant(ir.VectorType(i32, 2 * w), [h // 2 + (h % 2) * w
                                                                                for h in range(2 * w)]))

    def to_bf16_pairs(x):
        """float vector of 2w lanes (pairs adjacent) -> <w x i32>, each a pair of bf16 (RNE)."""
        w = x.type.count
        return b.bitcast(b.fptrunc(x, ir.VectorType(bf, w)), ir.VectorType(i32, w // 2))

    n_blocks = b.sdiv(b.add(K, c64(K_BLOCK - 1)), c64(K_BLOCK))
    kb, _, close_kb = loop(c64(0), n_blocks, 1, "kb")
    k0 = b.mul(kb, c64(K_BLOCK))
    rest = b.sub(K, k0)
    kn = b.select(b.icmp_signed("<", rest, c64(K_BLOCK)), rest, c64(K_BLOCK))
    kp = b.sdiv(b.add(kn, c64(1)), c64(2))  # pairs in this block (the last one may be half)
    first = b.icmp_signed("==", kb, c64(0))
    last = b.icmp_signed("==", kb, b.sub(n_blocks, c64(1)))
    add_bias = b.and_(last, has_bias)
    clip = b.and_(last, relu)

    # op(A)[:, k0:k0+kn] -> pairs_a, once per K block (converting it per row group and
    # panel instead, a transposed A's 32-byte reads from K rows lda apart evicted each other
    # at lda = 1024: 0.63-0.93x the float32 tile at 1024 x 512 x 256, 1.88x after)
    cvt_t, cvt_n, cvt_done = (fn.append_basic_block(x) for x in ("cvt.t", "cvt.n", "cvt.done"))
    b.cbranch(a_trans, cvt_t, cvt_n)
    b.position_at_end(cvt_n)  # A as is: 16 rows' runs of 32 k values, their pairs turned to pair rows
    ic, _, close_ic = loop(c64(0), b.add(M, c64(LANES - 1)), LANES, "cvtn.i")
    q, _, close_q = loop(c64(0), b.sdiv(b.add(kp, c64(LANES - 1)), c64(LANES)), 1, "cvtn.q")
    kq = b.mul(q, c64(2 * LANES))
    kmask = lane_mask(b, 2 * LANES, b.sub(kn, kq))
    none = ir.Constant(ir.VectorType(i1, 2 * LANES), [0] * (2 * LANES))
    rows = []
    for c in range(LANES):  # row ic + c's 16 pairs (nothing read past M)
        i = b.add(ic, c64(c))
        mask = b.select(b.icmp_signed("<", i, M), kmask, none)
        rows.append(to_bf16_pairs(load_floats(b, A, b.add(b.mul(i, lda), b.add(k0, kq)), 2 * LANES, mask)))
    for t, row in enumerate(transpose_rows(b, rows)):  # pair q * 16 + t of the 16 rows
        at = b.add(b.mul(b.add(b.mul(q, c64(LANES)), c64(t)), c64(A_BLOCK)), ic)
        b.store(row, ptr(pairs_a, at, ivec), align=4)
    close_q()
    close_ic()
    b.branch(cvt_done)
    b.position_at_end(cvt_t)  # A transposed (K x M): rows k and k+1 of A interleaved, 16 columns at a time
    q, _, close_q = loop(c64(0), kp, 1, "cvtt.p")
    k = b.add(k0, b.mul(q, c64(2)))
    has1 = b.icmp_signed("<", b.add(k, c64(1)), K)
    k1 = b.select(has1, b.add(k, c64(1)), k)
    ic, _, close_ic = loop(c64(0), b.add(M, c64(LANES - 1)), LANES, "cvtt.i")
    mask = lane_mask(b, LANES, b.sub(M, ic))
    x0 = load_floats(b, A, b.add(b.mul(k, lda), ic), LANES, mask)
    x1 = b.select(has1, load_floats(b, A, b.add(b.mul(k1, lda), ic), LANES, mask), zero)
    b.store(to_bf16_pairs(interleave(x0, x1)), ptr(pairs_a, b.add(b.mul(q, c64(A_BLOCK)), ic), ivec), align=4)
    close_ic()
    close_q()
    b.branch(cvt_done)
    b.position_at_end(cvt_done)

    def columns(j0, nvec, masks, mr):
        """C[:, j0:j0 + 16 nvec] (the lanes masks set, where given) over this K block."""
        bias_v = []
        for v in range(nvec):  # read only where there is a bias (the pointer may be null)
            before = b.block
            with_bias, got = fn.append_basic_block(f"bias{nvec}.{v}"), fn.append_basic_block(f"bias{nvec}.{v}.got")
            b.cbranch(has_bias, with_bias, got)
            b.position_at_end(with_bias)
            loaded = load_floats(b, bias, b.add(j0, c64(v * LANES)), LANES, masks and masks[v])
            after = b.block
            b.branch(got)
            b.position_at_end(got)
            ph = b.phi(vec)
            ph.add_incoming(zero, before)
            ph.add_incoming(loaded, after)
            bias_v.append(ph)

        # op(B)[k0:k0+kn, j0:j0+16 nvec] -> panel, pair row p = (row 2p, row 2p+1) interleaved
        pack_t, pack_n, packed = (fn.append_basic_block(f"{x}{nvec}") for x in ("pack.t", "pack.n", "packed"))
        b.cbranch(b_trans, pack_t, pack_n)
        b.position_at_end(pack_n)  # B as is: two rows of B, interleaved
        p, _, close_p = loop(c64(0), kp, 1, f"packn{nvec}")
        k = b.add(k0, b.mul(p, c64(2)))
        has1 = b.icmp_signed("<", b.add(k, c64(1)), K)
        k1 = b.select(has1, b.add(k, c64(1)), k)
        for v in range(nvec):
            col = b.add(j0, c64(v * LANES))
            r0 = load_floats(b, B, b.add(b.mul(k, ldb), col), LANES, masks and masks[v])
            r1 = load_floats(b, B, b.add(b.mul(k1, ldb), col), LANES, masks and masks[v])
            r1 = b.select(has1, r1, zero)
            b.store(to_bf16_pairs(interleave(r0, r1)), ptr(panel, b.add(b.mul(p, c64(2 * NR)), c64(2 * LANES * v)),
                                                           ivec), align=64)
        close_p()
        b.branch(packed)
        b.position_at_end(pack_t)  # B transposed (N x K): a column's pairs are adjacent in memory
        pc, _, close_pc = loop(c64(0), b.sdiv(b.add(kp, c64(LANES - 1)), c64(LANES)), 1, f"packt{nvec}")
        kk = b.mul(pc, c64(2 * LANES))
        kmask = lane_mask(b, 2 * LANES, b.sub(kn, kk))
        none = ir.Constant(ir.VectorType(i1, 2 * LANES), [0] * (2 * LANES))
        for g in range(nvec):
            rows = []
            for c in range(LANES):
                j = b.add(j0, c64(g * LANES + c))
                mask = kmask if masks is None else b.select(b.icmp_signed("<", j, N), kmask, none)
                rows.append(to_bf16_pairs(load_floats(b, B, b.add(b.mul(j, ldb), b.add(k0, kk)), 2 * LANES, mask)))
            for t, row in enumerate(transpose_rows(b, rows)):  # column pairs -> pair rows of 16 columns
                at = b.add(b.mul(b.add(b.mul(pc, c64(LANES)), c64(t)), c64(2 * NR)), c64(2 * LANES * g))
                b.store(row, ptr(panel, at, ivec), align=64)
        close_pc()
        b.branch(packed)
        b.position_at_end(packed)

        def group(i0, mr, name):
            """Rows i0 .. i0+mr-1 of these columns over this K block."""
            def load_c():
                return [load_floats(b, C, b.add(b.add(b.mul(b.add(i0, c64(r)), ldc), j0), c64(v * LANES)), LANES,
                                    masks and masks[v]) for r in range(mr) for v in range(nvec)]

            init = zero_or_loaded(b, first, load_c, zero, name)
            row_at = b.gep(pairs_a, [i0])
            p, accs, close_k = loop(c64(0), kp, 1, name, init)
            bv = [b.load(ptr(panel, b.add(b.mul(p, c64(2 * NR)), c64(2 * LANES * v)), bvec), align=64)
                  for v in range(nvec)]
            new = []
            for r in range(mr):
                a = b.load(b.gep(row_at, [b.add(b.mul(p, c64(A_BLOCK)), c64(r))]), align=4)
                av = b.bitcast(b.shuffle_vector(b.insert_element(undef_i, a, c32(0)), undef_i, splat0), bvec)
                new += [b.call(dot, [accs[r * nvec + v], av, bv[v]]) for v in range(nvec)]
            sums = close_k(new)
            for r in range(mr):
                base = b.add(b.mul(b.add(i0, c64(r)), ldc), j0)
                for v in range(nvec):
                    out = sums[r * nvec + v]
                    out = b.select(add_bias, b.fadd(out, bias_v[v]), out)
                    out = b.select(clip, b.select(b.fcmp_ordered(">", out, zero), out, zero), out)
                    store_floats(b, out, C, b.add(base, c64(v * LANES)), masks and masks[v])

        def rows_from(start, mr):
            i0, _, close_i = loop(start, M, mr, f"i{nvec}.{mr}")
            group(i0, mr, f"k{nvec}.{mr}")
            close_i()
            return i0

        rows_from(rows_from(c64(0), mr), 1)

    j0, _, close_j = loop(c64(0), n_tiled, NR, "j")
    columns(j0, NR // LANES, None, MR)
    close_j()
    tail_columns(b, b.sub(N, n_tiled), LANES, lambda masks: columns(n_tiled, 1, masks, 2 * MR),
                 lambda masks: columns(n_tiled, 2, masks, MR))
    close_kb()
    b.ret_void()
    return fn
