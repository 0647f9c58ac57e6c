"""A float32 GEMM for the step's small products, as a register tile in LLVM IR (AVX-512, or
AVX2 with FMA).

What this file is: one function, `cubedqn_tile_sgemm64`, with the CBLAS ILP64 sgemm
signature, that blas.py binds as the engine's GEMM symbol (`cubedqn_sgemm64`) on CPUs with
AVX-512 or AVX2 and FMA, and its twin `cubedqn_tile_sgemm_bias` for the forward layers (nn.dense_forward
through blas.gemm_bias_relu), which also adds the bias and applies the ReLU in the last
stores, the same add and comparison per element as dense_forward's own pass, instead of
a second pass over the output (or returns 0 and leaves it all to the caller where the
tile would not take the product). It computes C = op(A) @ op(B) itself where that beats OpenBLAS and hands every
other product to the library sgemm, bound as `cubedqn_blas_sgemm64`:

  taken here  while the library runs on one thread (on two, OpenBLAS splitting a product
              took 0.52-0.94x the tile's time on 13 of the 17 products that
              `scripts/bench_tile_gemm.py --library-threads 2` times): row-major, alpha 1,
              beta 0, N >= 8, B as is or transposed (input gradients: delta @ W^T), and
              either A as is with K <= K_MAX (forward layers: (B, in) @ (in, out);
              K_MAX is 1024) or A transposed with K <= TRANS_A_K_MAX (512 with AVX-512, 256 with AVX2)
              and M <= 256 (with AVX2 any M: TRANS_A_ROWS) or N <= LANES (weight gradients at batch <= 512: acts^T @
              delta; N <= 16, a Q head's, at any M: its 16-row groups read whole lines of
              A, each once). With AVX-512, A transposed, K <= 512 and M > 256 otherwise as above (the 3x3x3's
              1024 x 256 x 512 weight gradient), TILE calls itself on blocks of 256 rows
              of C: each block's A (256 x K) then stays in L2 across B's panels, where
              the whole A, read once per panel, came from L3 and ran 0.8-1.0x OpenBLAS
              (Zen 4, hot: 1024 x 256 x 512 0.99-1.05x, 512 x 256 x 512 1.08x; in the
              cube3 step the backward GEMMs 150-265 us less).
  the library everything else: BLAS threads > 1 (with --threads T the GEMM team,
              team.py, keeps the library on one thread and calls this on column chunks); K > K_MAX; a
              transposed A with K > TRANS_A_K_MAX; N < 8.

How: for each 32 columns of C and each block of up to 256 values of k, it copies that
block of op(B)'s panel (at most 256 x 32 floats, 32 KB; a transposed B's 16 x 16 blocks
turned in registers on the way) into a stack buffer, where it stays in L1 (B's rows read
in place, 1 KB or more apart, evict each other); packing B as is, it prefetches the next
panel's lines of the same rows (in a training step the weights come from L3: the 64-row
target forward took 66-67 us in the step against 61 hot, 63-64 with the prefetch, read
off the fused step's stamps in a one-off script). Where K is one block, B is as is and
M >= 8, a full 32-column panel has no separate copy: the first 8 rows read B's rows
themselves and store them into the panel as they go (Zen 4: 64 x 256 x 256 1.06x, 128 rows 1.01-1.03x).
Then for each 8 rows of C it keeps the 8 x 32 tile in 16 zmm accumulators (from zero in
the first block, from C after it) while it walks the block: per k two loads of the panel
row, eight broadcasts of A, sixteen FMAs. Rows left over (M mod 8) run the same walk one
row at a time. The last N mod 32
columns (all of a 12-action head's) are one or two vectors wide, zero-padded in the
panel and masked in C; one vector wide, 16 rows at a time. OpenBLAS packs both operands
and blocks for caches: at 64 x 256 x 256 its fixed costs are a quarter of the product
(see README, Design notes).

Arithmetic: each element of C is fma(a[k], b[k], acc) over k = 0..K-1 in order from zero
(K fused multiply-adds, one rounding each; a K block's sums go through C unchanged),
whatever M is and whichever 8-row block or single row it falls in: a row's result never
depends on the other rows of the call (the chunked paths and the target cache rely on
that, tests/blas_rows.py).

Zeros in A: the module also holds tile_sparse.py's function and a switch (SET_SPARSE, set
by blas.set_tile_sparse); while it is on, TILE and TILE_BIAS hand every product they take
whose N is whole panels of it (64 columns, 32 with AVX2) to it first, and it leaves out
the terms where A (a ReLU output, in the engine) is zero, with the same bits, or returns
without touching C where A is too full for that to pay (then the loops below run).

CUBEDQN_TILE_GEMM=avx2 builds the AVX2 code on an AVX-512 CPU too (LLVM told to use no
AVX-512 instruction; no bfloat16 kernel): the tests run it there, and its timings there
stand in for an AVX2 CPU's.

bfloat16: on CPUs with AVX512_BF16 the module also holds tile_bf16.py's kernel and a flag
(set by blas.set_matmul_precision through SET_PRECISION); while it is on, TILE and
TILE_BIAS hand every row-major, alpha 1, beta 0 product to that kernel whatever the
shapes, and nothing to the library. Where the library has T > 1 threads (`--threads T`,
the BLAS tuner keeping them), products of SPLIT_MACS multiply-adds or more are split by
rows into up to T shares, each on a pthread started for it and the first on the caller
(the same bits: rows are independent in the kernel); on the 2-vCPU Zen 4 host the 3x3x3
step's GEMM layers ran 1.10-1.42x faster on two threads (README, "bfloat16 matmuls").

AVX2 (no AVX-512: 16 ymm registers): the same code with LANES 8, a 6 x 16 tile (panels of
16 columns, 12 accumulators, two panel loads and a broadcast, as BLIS's Haswell sgemm
kernel) and the rows left over in groups of 4, 3 and 2, then one (M = 64 leaves four;
where 6 at a time would leave one or two rows, the last 7 or 8 go as 4 + 3 or 4 + 4). The sizes
above in 8s, 16s and 32s read as 6s, 8s and 16s there. What it buys on the Zen 3 host
(docs/performance-log.md, stop 39): alone, hot, 0.97-1.11x OpenBLAS's Haswell kernel on
the small step's 256-wide products in quiet windows (0.81-0.92x in slow ones) and
1.04-1.25x on the 12-action heads; in the step the fused bias and ReLU too; and with
`--threads 2` products the GEMM team can split without changing a bit (OpenBLAS's
Haswell kernel gives a column different bits in a call on a block of columns, so the team
refuses to split over it: blas._check_team).

What it is not: a general BLAS (no blocking for L2: K and M are bounded as above). On CPUs
with neither instruction set nothing here is compiled and blas.py binds the library alone.
"""

from __future__ import annotations

import llvmlite.ir as ir

from . import tile_bf16, tile_sparse
from .native import (bias_gemm_type, counted_loop, declare, flag_with_setter, host_has_avx2_fma,
                     host_has_avx512, load_floats, load_or_compile, prefetch, sgemm_type, store_floats,
                     tail_columns, tile_avx512, transpose_rows, zero_or_loaded)

TILE, LIBRARY = "cubedqn_tile_sgemm64", "cubedqn_blas_sgemm64"
# i64 (M, N, K, A, lda, B, ldb, C, ldc, bias, relu): C = A @ B + bias, then ReLU if relu & 1, as
# TILE does for A and B as they are; returns 1, or 0 (nothing done) where TILE would leave
# the product to the library (then the caller runs the GEMM and its own bias pass). relu & 2:
# a hint for tile_sparse.py, whose lists then pair row i with row i + M/2 (M even), not its
# neighbour: the online forward's rows are s, then s', and a state's rows are alike with its
# successor's (the same bits whichever rows are paired)
TILE_BIAS = "cubedqn_tile_sgemm_bias"
THREADS = "cubedqn_blas_threads"  # int (): the library's thread count now (blas.py binds it)
# void (i32): 1 sends every product TILE and TILE_BIAS are given to tile_bf16.BF16, 0 (the
# start) back to float32; only where the module has BF16 (the CPU has AVX512_BF16)
SET_PRECISION = "cubedqn_tile_set_bf16"
# tile rows, tile columns (one panel), floats per vector register; the rows a smaller group
# takes where fewer than MR are left (before the last ones go one at a time); AVX-512 where
# the CPU has it, unless CUBEDQN_TILE_GEMM=avx2 asks for the AVX2 code (native.tile_avx512)
AVX512 = tile_avx512()
if AVX512:    # 16 zmm accumulators of the 32 registers
    MR, NR, LANES, REST_ROWS = 8, 32, 16, ()
else:         # AVX2: 12 ymm accumulators, 2 rows of the panel and a broadcast of the 16 registers;
    MR, NR, LANES, REST_ROWS = 6, 16, 8, (4, 3, 2)  # M = 64 leaves 4 rows: one 4-row group, not four rows
K_BLOCK = 256               # K in blocks of this: the panel is K_BLOCK x NR floats on the stack (32 KB)
N_MIN = 8                   # narrower products stay with the library (a vector would be mostly idle)
# the longest K taken with A as is (or B transposed): four blocks, the 3x3x3 net's 1024 -> 512
# layer, on every CPU, for tile_sparse.py's path, which is tried first and whose fallback
# must be these loops (the same bits either way: the library's would differ).
# Dense, the tile against OpenBLAS at K = 1024: Zen 4 1.02-1.09x alone, 1.03-1.06x the
# whole cube3 step; a Sapphire Rapids-class host 0.92-1.03x (docs/performance-log.md),
# where until stop 54 the library kept it (K_MAX 512 on AVX-512 CPUs other than Zen 4).
# With the sparse path: the cube3 profile command (Adam, its activations thinned
# by training: the products did 31% of the dense multiply-adds) took 7.51-7.53 ms a train
# step on the Zen 4 host against 11.72-11.74 with K_MAX 512 there, the library taking the
# layer (runs/perf47/kmax_ab_adam.txt; not measured on another AVX-512 CPU). AVX2: as
# AVX2 code on the Zen 4 host against OpenBLAS's Haswell kernel, the K = 512 and 1024
# products ran 1.10-1.17x at half zeros, 1.55-1.63x at 0.3, the dense loops 0.93-0.96x
# (alone, hot, runs/perf46/avx2_big_k.txt), and its Adam step 1.22-1.24x
# (avx2_kmax_ab.txt); before the sparse path AVX2 stopped at 256 (at K = 512 the 6 x 16
# tile ran 0.93-0.95x OpenBLAS on the Zen 3 host).
K_MAX = 1024
# a transposed A is taken with this many rows of C unless N <= LANES (the 3x3x3 head's
# gradient, 512 x 256 x 12: 82 against 47 GFLOP/s for the library, Zen 4, hot), and up to
# this K with AVX2 (TRANS_A_K_MAX)
TRANS_A_MAX = 256
# ... in one call: with AVX-512, more rows go in blocks of TRANS_A_MAX (below, _emit); with
# AVX2 any number, for tile_sparse.py's path, tried first (its dense fallback here: the
# 3x3x3's 1024 x 256 x 512 weight gradient 1.17x OpenBLAS's Haswell kernel at half zeros,
# 1.60x at 0.3, the dense loops 0.83x, as AVX2 code on the Zen 4 host,
# runs/perf46/avx2_dw_big.txt; its Adam step 1.04x, avx2_dw_ab.txt)
TRANS_A_ROWS = TRANS_A_MAX if AVX512 else 1 << 40
# the longest K (batch rows) taken with A transposed: with AVX-512 512, for tile_sparse.py's
# path, tried first: the cube3 command at batch 512 (Adam) ran its backward GEMMs in
# 3.84-3.94 ms against 6.61-6.69 with the library taking the 1024 x 512 x 512 weight
# gradient, a train step 15.1-15.4 against 17.9-18.0 ms (runs/perf47/transak_ab_b512.txt),
# where the dense loops ran 0.97-1.09x the library at K = 512 and 0.88x at 1024 (alone,
# hot, transa_dense.txt); as AVX2 code 0.75-0.96x at 512 (transa_dense_avx2.txt), so 256
TRANS_A_K_MAX = 512 if AVX512 else TRANS_A_MAX
# AVX2: a product with more rows of C than this is done a block of them at a time (each a
# call of the tile), so that the block's rows of A (128 x K: 128 KB at K = 256) stay in
# L2 (512 KB a core on Zen 3) across B's panels of 16 columns; with the whole of A read once
# per panel the preset's 1536 x 256 x 256 forward ran 0.91-0.97x OpenBLAS, 1.01-1.03x in
# blocks of 128 (of 64: 0.81-1.01x). None: no such blocks (the 32-column panels read A half
# as often, and Zen 4 has 1 MB of L2)
ROW_BLOCK = None if AVX512 else 128
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
# TILE and TILE_BIAS try tile_sparse.py's path first while its switch is on (the start):
# void (i32) sets it, 0 leaving every product to the dense loops (blas.set_tile_sparse)
SET_SPARSE = "cubedqn_tile_set_sparse"
# bfloat16 products of at least this many multiply-adds (0.7 ms or more on one Zen 4 core)
# are split by rows over the library's threads (a pthread started per share, the caller
# taking the first): on the 2-vCPU host products of 0.35 ms ran 0.52-0.67x on two threads
# (waking the other CPU for each product), those of 1.3 ms and more 1.3-1.8x when it was free
SPLIT_MACS = 1 << 26
MAX_PARTS = 8


def takes(m, n, k, trans_a=False, trans_b=False, bias=False) -> bool:
    """Whether TILE (TILE_BIAS where bias) computes this row-major, alpha 1, beta 0 product
    itself while the library runs on one thread, as _emit's rule decides (rows in blocks
    included): for scripts and tests that say which of the two ran."""
    if n < N_MIN or m < 1 or k < 1 or (trans_b and k > K_MAX):
        return False
    if bias or not trans_a:
        return k <= K_MAX
    return k <= TRANS_A_K_MAX  # more rows: AVX-512 in blocks of them, AVX2 whole (TRANS_A_ROWS)


def has_bf16() -> bool:
    """Whether the module holds tile_bf16.py's kernel: the AVX-512 tile on a CPU with AVX512_BF16."""
    return AVX512 and tile_bf16.host_has_bf16()


def module_ir() -> str:
    mod = ir.Module(name="cubedqn_tile_gemm")
    bf16 = None
    if has_bf16():
        bf16 = (_emit_bf16_split(mod, tile_bf16.emit(mod)),
                flag_with_setter(mod, "cubedqn_tile_bf16_on", SET_PRECISION, 0))
    sparse = (tile_sparse.emit(mod), flag_with_setter(mod, "cubedqn_tile_sparse_on", SET_SPARSE, 1))
    _emit(mod, epilogue=False, bf16=bf16, sparse=sparse)
    _emit(mod, epilogue=True, bf16=bf16, sparse=sparse)
    return str(mod)


def _emit_bf16_split(mod, bf16_fn):
    """A function with BF16's signature that runs it on shares of C's rows, one per thread of
    the library's (at most MAX_PARTS, whole row groups of MR but the last), where the product has
    SPLIT_MACS multiply-adds or more; else, or with one library thread, calls it as is.
    Rows are independent in BF16 (the same bits whichever call a row falls in), so the
    split changes no result. A thread that cannot be started leaves its share to the caller."""
    i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)
    arg_types = [a.type for a in bf16_fn.args]
    share_t = ir.LiteralStructType(arg_types)
    fn = ir.Function(mod, bf16_fn.function_type, name=tile_bf16.BF16 + "_split")
    fn.linkage = "internal"
    ta, tb, M, N, K, A, lda, B, ldb, C, ldc, bias, epi = fn.args
    library_threads = declare(mod, THREADS, ir.FunctionType(i32, []))
    start_fn_t = ir.FunctionType(i8p, [i8p])
    create = declare(mod, "pthread_create", ir.FunctionType(i32, [i64.as_pointer(), i8p, start_fn_t.as_pointer(), i8p]))
    join = declare(mod, "pthread_join", ir.FunctionType(i32, [i64, i8p.as_pointer()]))

    run = ir.Function(mod, start_fn_t, name=tile_bf16.BF16 + "_share")  # a thread's body: one share
    run.linkage = "internal"
    rb = ir.IRBuilder(run.append_basic_block("entry"))
    share = rb.load(rb.bitcast(run.args[0], share_t.as_pointer()))
    rb.call(bf16_fn, [rb.extract_value(share, i) for i in range(len(arg_types))])
    rb.ret(ir.Constant(i8p, None))

    def c64(v):
        return ir.Constant(i64, v)

    b = ir.IRBuilder(fn.append_basic_block("entry"))
    threads = b.sext(b.call(library_threads, []), i64)
    parts = b.select(b.icmp_signed("<", threads, c64(MAX_PARTS)), threads, c64(MAX_PARTS))
    most = b.sdiv(M, c64(MR))  # no share smaller than one row group
    parts = b.select(b.icmp_signed("<", most, parts), most, parts)
    big = b.icmp_signed(">=", b.mul(b.mul(M, N), K), c64(SPLIT_MACS))
    split_bb, whole_bb = fn.append_basic_block("split"), fn.append_basic_block("whole")
    b.cbranch(b.and_(big, b.icmp_signed(">=", parts, c64(2))), split_bb, whole_bb)
    b.position_at_end(whole_bb)
    b.call(bf16_fn, fn.args)
    b.ret_void()

    b.position_at_end(split_bb)
    shares = b.alloca(share_t, MAX_PARTS)
    tids = b.alloca(i64, MAX_PARTS)
    started = b.alloca(i32, MAX_PARTS)
    # rows per share: ceil(M / parts) rounded up to whole row groups; then as many shares
    # as that takes (none left empty)
    per = b.mul(b.sdiv(b.add(b.sdiv(b.add(M, b.sub(parts, c64(1))), parts), c64(MR - 1)), c64(MR)), c64(MR))
    parts = b.sdiv(b.add(M, b.sub(per, c64(1))), per)
    trans_a = b.icmp_signed("==", ta, ir.Constant(i32, TRANS))

    def share_of(p):
        """BF16's arguments for share p: rows p * per .. of C, and of op(A)."""
        i0 = b.mul(p, per)
        left = b.sub(M, i0)
        rows = b.select(b.icmp_signed("<", left, per), left, per)
        a_at = b.gep(A, [b.select(trans_a, i0, b.mul(i0, lda))])
        return [ta, tb, rows, N, K, a_at, lda, B, ldb, b.gep(C, [b.mul(i0, ldc)]), ldc, bias, epi]

    p, _, close_p = counted_loop(b, c64(1), parts, 1, "start")  # shares 1.. on threads of their own
    args = share_of(p)
    slot = b.gep(shares, [p])
    value = ir.Constant(share_t, ir.Undefined)
    for i, a in enumerate(args):
        value = b.insert_value(value, a, i)
    b.store(value, slot)
    ok = b.icmp_signed("==", b.call(create, [b.gep(tids, [p]), ir.Constant(i8p, None), run, b.bitcast(slot, i8p)]),
                       ir.Constant(i32, 0))
    b.store(b.zext(ok, i32), b.gep(started, [p]))
    with b.if_then(b.not_(ok)):  # no thread: the caller takes this share now
        b.call(bf16_fn, args)
    close_p()
    b.call(bf16_fn, share_of(c64(0)))
    p, _, close_p = counted_loop(b, c64(1), parts, 1, "join")
    with b.if_then(b.icmp_signed("!=", b.load(b.gep(started, [p])), ir.Constant(i32, 0))):
        b.call(join, [b.load(b.gep(tids, [p])), ir.Constant(i8p.as_pointer(), None)])
    close_p()
    b.ret_void()
    return fn


def _emit(mod, epilogue, sparse, bf16=None):
    """TILE (epilogue False) or TILE_BIAS into mod; sparse: (tile_sparse's function, its on
    flag), which both try first while the flag is set on the products the tile takes whose
    columns are whole panels of it; bf16: (the function that runs tile_bf16.BF16, split over
    threads where it pays, and its on flag) where the module has them."""
    i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    vec = ir.VectorType(f32, LANES)
    library = declare(mod, LIBRARY, sgemm_type())
    library_threads = declare(mod, THREADS, ir.FunctionType(i32, []))
    fma = declare(mod, f"llvm.fma.v{LANES}f32", ir.FunctionType(vec, [vec, vec, vec]))

    def c64(v):
        return ir.Constant(i64, v)

    def c32(v):
        return ir.Constant(i32, v)

    # --- which calls the tile takes (the module docstring's rule): conds, and with A as
    # given (TILE only) a_rule, the bounds on K and M for A as is or transposed
    a_rule = None
    if epilogue:
        fn = ir.Function(mod, bias_gemm_type(), name=TILE_BIAS)
        M, N, K, A, lda, B, ldb, C, ldc, bias, relu_word = fn.args
        ta = tb = c32(NO_TRANS)
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        # the relu word (bias_gemm_type): bit 0 the ReLU, bit 1 the sparse path's pairing hint
        relu, halves = b.and_(relu_word, c64(1)), b.and_(b.lshr(relu_word, c64(1)), c64(1))
        trans = b_trans = ir.Constant(ir.IntType(1), 0)
        conds = [b.icmp_signed("<=", b.call(library_threads, []), c32(1)), b.icmp_signed(">=", K, c64(1)),
                 b.icmp_signed("<=", K, c64(K_MAX)), b.icmp_signed(">=", N, c64(N_MIN)), b.icmp_signed(">=", M, c64(1))]
    else:
        fn = ir.Function(mod, sgemm_type(), name=TILE)
        order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        trans, b_trans = b.icmp_signed("==", ta, c32(TRANS)), b.icmp_signed("==", tb, c32(TRANS))
        conds = [b.icmp_signed("<=", b.call(library_threads, []), c32(1)), b.icmp_signed("==", order, c32(ROW_MAJOR)),
                 b.fcmp_ordered("==", alpha, ir.Constant(f32, 1.0)), b.fcmp_ordered("==", beta, ir.Constant(f32, 0.0)),
                 b.icmp_signed(">=", K, c64(1)), b.icmp_signed(">=", N, c64(N_MIN)), b.icmp_signed(">=", M, c64(1)),
                 b.or_(b.icmp_signed("==", tb, c32(NO_TRANS)), b.and_(b_trans, b.icmp_signed("<=", K, c64(K_MAX))))]
        a_rule = b.or_(b.and_(b.icmp_signed("==", ta, c32(NO_TRANS)), b.icmp_signed("<=", K, c64(K_MAX))),
                       b.and_(trans, b.and_(b.or_(b.icmp_signed("<=", M, c64(TRANS_A_ROWS)),
                                                  b.icmp_signed("<=", N, c64(LANES))),
                                            b.icmp_signed("<=", K, c64(TRANS_A_K_MAX)))))
    if bf16 is not None:  # the bf16 precision is on: every product the engine makes goes to BF16
        bf16_fn, flag = bf16
        on = b.and_(b.icmp_signed("!=", b.load(flag), c32(0)),
                    b.and_(b.icmp_signed(">=", M, c64(1)), b.and_(b.icmp_signed(">=", N, c64(1)),
                                                                  b.icmp_signed(">=", K, c64(1)))))
        if not epilogue:
            on = b.and_(on, b.and_(b.icmp_signed("==", order, c32(ROW_MAJOR)),
                                   b.and_(b.fcmp_ordered("==", alpha, ir.Constant(f32, 1.0)),
                                          b.fcmp_ordered("==", beta, ir.Constant(f32, 0.0)))))
        bf_bb, f32_bb = fn.append_basic_block("bf16"), fn.append_basic_block("float32")
        b.cbranch(on, bf_bb, f32_bb)
        b.position_at_end(bf_bb)
        if epilogue:
            kind = b.select(b.icmp_signed("!=", relu, c64(0)), c64(tile_bf16.EPI_BIAS_RELU), c64(tile_bf16.EPI_BIAS))
            b.call(bf16_fn, [ta, tb, M, N, K, A, lda, B, ldb, C, ldc, bias, kind])
            b.ret(c64(1))
        else:
            b.call(bf16_fn, [ta, tb, M, N, K, A, lda, B, ldb, C, ldc,
                             ir.Constant(f32.as_pointer(), None), c64(tile_bf16.EPI_NONE)])
            b.ret_void()
        b.position_at_end(f32_bb)
    fits = conds[0]
    for cond in conds[1:]:
        fits = b.and_(fits, cond)
    take = fits if a_rule is None else b.and_(fits, a_rule)
    row_step = b.select(trans, c64(1), lda)  # A's element (i, k) is at i * row_step + k * k_step

    def in_row_blocks(size, a_step):
        """Emit: this function on rows [i0, i0 + size) of C (and of op(A), whose rows are
        a_step apart) for i0 = 0, size, ..., the last block shorter; then return (1 from
        TILE_BIAS: the product is done)."""
        i0, _, close_i0 = counted_loop(b, c64(0), b.add(M, c64(size - 1)), size, f"rows.block{size}")
        left = b.sub(M, i0)
        m = b.select(b.icmp_signed("<", left, c64(size)), left, c64(size))
        a_i0, c_i0 = b.gep(A, [b.mul(i0, a_step)]), b.gep(C, [b.mul(i0, ldc)])
        if epilogue:
            b.call(fn, [m, N, K, a_i0, lda, B, ldb, c_i0, ldc, bias, relu_word])
        else:
            b.call(fn, [order, ta, tb, m, N, K, alpha, a_i0, lda, B, ldb, beta, c_i0, ldc])
        close_i0()
        b.ret(c64(1)) if epilogue else b.ret_void()

    tile_bb, lib_bb = fn.append_basic_block("tile"), fn.append_basic_block("library")
    b.cbranch(take, tile_bb, lib_bb)
    b.position_at_end(lib_bb)
    if epilogue:
        b.ret(c64(0))  # not taken: the caller runs the library and its own bias pass
    else:
        # A transposed with more rows than the tile takes (a weight gradient of a layer
        # wider than 256), everything else as the tile wants it: TRANS_A_MAX rows of C at
        # a time, each a call of this function, so that each call's A (256 x K) stays in
        # L2 across B's panels (AVX-512 only: with AVX2 such blocks ran 0.71-0.84x OpenBLAS
        # on the Zen 3 host)
        if AVX512:
            blocks = b.and_(fits, b.and_(trans, b.and_(b.icmp_signed(">", M, c64(TRANS_A_MAX)),
                                                       b.icmp_signed("<=", K, c64(TRANS_A_K_MAX)))))
            blocks_bb, whole_bb = fn.append_basic_block("rows.blocks"), fn.append_basic_block("library.whole")
            b.cbranch(blocks, blocks_bb, whole_bb)
            b.position_at_end(blocks_bb)
            in_row_blocks(TRANS_A_MAX, c64(1))
            b.position_at_end(whole_bb)
        b.call(library, fn.args)
        b.ret_void()

    b.position_at_end(tile_bb)
    # A with enough zeros (a ReLU's output): tile_sparse.py, else on here
    sparse_fn, sparse_on = sparse
    try_bb, dense_bb = fn.append_basic_block("sparse.try"), fn.append_basic_block("dense")
    b.cbranch(b.and_(b.icmp_signed("!=", b.load(sparse_on), c32(0)),
                     b.icmp_signed("==", b.srem(N, c64(tile_sparse.PANEL)), c64(0))), try_bb, dense_bb)
    b.position_at_end(try_bb)
    done_bb = fn.append_basic_block("sparse.done")
    if epilogue:
        args = list(fn.args[:-1]) + [relu, c64(0), c64(0), halves]
    else:
        args = [M, N, K, A, lda, B, ldb, C, ldc, ir.Constant(f32.as_pointer(), None), c64(0), b.zext(trans, i64),
                b.zext(b_trans, i64), c64(0)]
    b.cbranch(b.icmp_signed("!=", b.call(sparse_fn, args), c64(0)), done_bb, dense_bb)
    b.position_at_end(done_bb)
    b.ret(c64(1)) if epilogue else b.ret_void()
    b.position_at_end(dense_bb)
    if ROW_BLOCK:
        blocks_bb, one_bb = fn.append_basic_block("rows.l2"), fn.append_basic_block("rows.one")
        b.cbranch(b.icmp_signed(">", M, c64(ROW_BLOCK)), blocks_bb, one_bb)
        b.position_at_end(blocks_bb)
        in_row_blocks(ROW_BLOCK, row_step)
        b.position_at_end(one_bb)
    panel = b.alloca(ir.ArrayType(f32, K_BLOCK * NR))
    panel.align = 64
    panel = b.bitcast(panel, f32.as_pointer())
    k_step = b.select(trans, lda, c64(1))
    n_tiled = b.sub(N, b.srem(N, c64(NR)))

    def loop(start, stop, step, name, carried=()):
        return counted_loop(b, start, stop, step, name, carried)

    def vptr(ptr, off):
        return b.bitcast(b.gep(ptr, [off]), vec.as_pointer())

    zero = ir.Constant(vec, [0.0] * LANES)
    lane0 = ir.Constant(i32, 0)
    splat = ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)
    undef = ir.Constant(vec, ir.Undefined)

    def vload(ptr, off, mask):
        return load_floats(b, ptr, off, LANES, mask)

    def columns(j0, nvec, masks, mr, width):
        """C[:, j0:j0+width], width = nvec * LANES columns (all of them where masks is None,
        else the lanes the masks set), mr rows at a time: K in blocks of K_BLOCK rows of
        op(B), each block's panel, then every row of C from where the previous block left
        it (so each element is still one chain of FMAs over k in order)."""
        n_blocks = b.sdiv(b.add(K, c64(K_BLOCK - 1)), c64(K_BLOCK))
        kb, _, close_kb = loop(c64(0), n_blocks, 1, f"kb{nvec}")
        k0 = b.mul(kb, c64(K_BLOCK))
        rest = b.sub(K, k0)
        kn = b.select(b.icmp_signed("<", rest, c64(K_BLOCK)), rest, c64(K_BLOCK))
        first = b.icmp_signed("==", kb, c64(0))
        if epilogue:  # the bias (and ReLU) go on with the last block's store
            last = b.icmp_signed("==", kb, b.sub(n_blocks, c64(1)))
            clip = b.and_(last, b.icmp_signed("!=", relu, c64(0)))
            bias_v = [vload(bias, b.add(j0, c64(v * LANES)), masks and masks[v]) for v in range(nvec)]

        def prefetch_next_panel(k):
            """The next panel's two lines of B's row k0+k, towards L2 while this one computes."""
            for v in range(nvec):
                prefetch(b, b.gep(B, [b.add(b.mul(b.add(k0, k), ldb), b.add(j0, c64(NR + v * LANES)))]))

        def panel_row(k):
            return [b.load(vptr(panel, b.add(b.mul(k, c64(NR)), c64(v * LANES))), align=64) for v in range(nvec)]

        def b_row_packed(k):
            """Row k of this block of B (as is), read from B: stored into the panel for the
            groups after this one, and the next panel's lines of it prefetched."""
            row = [vload(B, b.add(b.mul(b.add(k0, k), ldb), b.add(j0, c64(v * LANES))), None) for v in range(nvec)]
            for v in range(nvec):
                b.store(row[v], vptr(panel, b.add(b.mul(k, c64(NR)), c64(v * LANES))), align=64)
            prefetch_next_panel(k)
            return row

        def group(i0, mr, b_row, name):
            """C rows i0 .. i0+mr-1 of these columns over this K block, op(B)'s row k from b_row(k)."""
            def load_c():
                return [vload(C, b.add(b.add(b.mul(b.add(i0, c64(r)), ldc), j0), c64(v * LANES)), masks and masks[v])
                        for r in range(mr) for v in range(nvec)]

            def step(k, accs):
                bv = b_row(k)
                a_k = b.mul(b.add(k0, k), k_step)
                new = []
                for r in range(mr):
                    a = b.load(b.gep(A, [b.add(b.mul(b.add(i0, c64(r)), row_step), a_k)]))
                    av = b.shuffle_vector(b.insert_element(undef, a, lane0), undef, splat)
                    new += [b.call(fma, [av, bv[v], accs[r * nvec + v]]) for v in range(nvec)]
                return new

            init = zero_or_loaded(b, first, load_c, zero, name)  # zero in the first K block, C after it
            k, accs, close_k = loop(c64(0), kn, 1, name, init)
            sums = close_k(step(k, accs))
            for r in range(mr):
                base = b.add(b.mul(b.add(i0, c64(r)), ldc), j0)
                for v in range(nvec):
                    out = sums[r * nvec + v]
                    if epilogue:  # as nn.dense_forward's pass: v = sum + b; v if v > 0 else 0
                        out = b.select(last, b.fadd(out, bias_v[v]), out)
                        out = b.select(clip, b.select(b.fcmp_ordered(">", out, zero), out, zero), out)
                    store_floats(b, out, C, b.add(base, c64(v * LANES)), masks and masks[v])

        def rows_from(start, mr, tag="", stop=M):
            """C rows [start, stop) mr at a time (fewer left over stay for the next call);
            returns the first row not done."""
            i0, _, close_i = loop(start, stop, mr, f"i{nvec}.{mr}{tag}")
            group(i0, mr, panel_row, f"k{nvec}.{mr}{tag}")
            close_i()
            return i0

        def all_rows(start, mr, tag=""):
            """C rows [start, M): mr at a time, then the smaller groups, then one at a time.
            With smaller groups (AVX2), where mr at a time would leave one or two rows
            (a 2-row group runs at about half the tile's rate, a single row at a quarter:
            128 rows are 21 x 6 + 2), the last mr + 1 or mr + 2 rows go to them instead
            (7 = 4 + 3, 8 = 4 + 4)."""
            stop = M
            if REST_ROWS:
                left = b.sub(M, start)
                r = b.srem(left, c64(mr))
                back = b.and_(b.and_(b.icmp_signed(">=", r, c64(1)), b.icmp_signed("<=", r, c64(2))),
                              b.icmp_signed(">", left, c64(mr)))
                stop = b.select(back, b.sub(M, c64(mr)), M)
            start = rows_from(start, mr, tag, stop)
            for rest in REST_ROWS:
                if rest < mr:
                    start = rows_from(start, rest, tag)
            rows_from(start, 1, tag)

        # op(B)[k0:k0+kn, j0:j0+width] -> panel (kn rows NR apart, contiguous; zero past N).
        # B as is, full panels, M >= mr and K in one block: the first row group reads B
        # itself and fills the panel as it goes, its loads overlapping its FMAs (64 x 256 x
        # 256: 1.06x; with K in blocks, where B comes from L3, the group waited on it and
        # the copy loop was faster); otherwise the copy loop first.
        pack_t, pack_n, packed = (fn.append_basic_block(f"{x}{nvec}") for x in ("pack.t", "pack.n", "packed"))
        if masks is None:
            fused = fn.append_basic_block(f"pack.fused{nvec}")
            b.cbranch(b_trans, pack_t, fused)
            b.position_at_end(fused)
            fused_go = fn.append_basic_block(f"pack.fused.go{nvec}")
            b.cbranch(b.and_(b.icmp_signed(">=", M, c64(mr)), b.icmp_signed("<=", K, c64(K_BLOCK))), fused_go, pack_n)
            b.position_at_end(fused_go)
            group(c64(0), mr, b_row_packed, f"kf{nvec}.{mr}")
            all_rows(c64(mr), mr, "f")  # own copies: the other paths' loops stay as they were
            fused_end = b.block
        else:
            b.cbranch(b_trans, pack_t, pack_n)
        b.position_at_end(pack_n)  # B as is: its rows' columns, one after another
        k, _, close_pack = loop(c64(0), kn, 1, f"pack{nvec}")
        for v in range(nvec):
            row = vload(B, b.add(b.mul(b.add(k0, k), ldb), b.add(j0, c64(v * LANES))), masks and masks[v])
            b.store(row, vptr(panel, b.add(b.mul(k, c64(NR)), c64(v * LANES))), align=64)
        if masks is None:
            prefetch_next_panel(k)
        close_pack()
        b.branch(packed)
        b.position_at_end(pack_t)  # B transposed (N x K)
        if masks is None:  # 16 x 16 blocks turned in registers, the last kn mod 16 rows one by one
            for g in range(nvec):
                kc, _, close_kc = loop(c64(0), kn, LANES, f"packt{g}")
                cols = [b.load(vptr(B, b.add(b.mul(b.add(j0, c64(g * LANES + r)), ldb), b.add(k0, kc))), align=4)
                        for r in range(LANES)]
                for c_, row in enumerate(transpose_rows(b, cols)):
                    b.store(row, vptr(panel, b.add(b.mul(b.add(kc, c64(c_)), c64(NR)), c64(g * LANES))), align=64)
                close_kc()
                kc_end = kc  # the loop's counter where it stopped: the first row not done
            k, _, close_k1 = loop(kc_end, kn, 1, "packt.rest")
            for jj in range(width):
                x = b.load(b.gep(B, [b.add(b.mul(b.add(j0, c64(jj)), ldb), b.add(k0, k))]))
                b.store(x, b.gep(panel, [b.add(b.mul(k, c64(NR)), c64(jj))]))
            close_k1()
        else:  # the tail: element by element, zeros past N
            k, _, close_k1 = loop(c64(0), kn, 1, f"packt.tail{nvec}")
            for v in range(nvec):
                b.store(zero, vptr(panel, b.add(b.mul(k, c64(NR)), c64(v * LANES))), align=64)
            jj, _, close_jj = loop(c64(0), b.sub(N, j0), 1, f"packt.tail{nvec}.j")
            x = b.load(b.gep(B, [b.add(b.mul(b.add(j0, jj), ldb), b.add(k0, k))]))
            b.store(x, b.gep(panel, [b.add(b.mul(k, c64(NR)), jj)]))
            close_jj()
            close_k1()
        b.branch(packed)
        b.position_at_end(packed)
        all_rows(c64(0), mr)
        if masks is None:
            block_done = fn.append_basic_block(f"block.done{nvec}")
            b.branch(block_done)
            b.position_at_end(fused_end)
            b.branch(block_done)
            b.position_at_end(block_done)

        close_kb()

    j0, _, close_j = loop(c64(0), n_tiled, NR, "j")
    columns(j0, NR // LANES, None, MR, NR)
    close_j()
    # the columns past the last full panel (N mod 32 of them): one or two vectors wide,
    # masked; with one, 16 rows at a time (16 accumulators, as many as a full tile's)
    tail_columns(b, b.sub(N, n_tiled), LANES, lambda masks: columns(n_tiled, 1, masks, 2 * MR, LANES),
                 lambda masks: columns(n_tiled, 2, masks, MR, NR))
    if epilogue:
        b.ret(c64(1))
    else:
        b.ret_void()


def compile_tile():
    """(engine, "cache" or "compiled") with TILE bound; LIBRARY and THREADS must be bound before.
    Raises where the CPU has neither AVX-512 nor AVX2 with FMA, or LLVM cannot compile the IR."""
    if not (AVX512 or host_has_avx2_fma()):
        raise RuntimeError("needs AVX2 and FMA (6 x 16 tile) or AVX-512 (8 x 32)")
    symbols = (TILE, TILE_BIAS) + ((SET_PRECISION,) if has_bf16() else ())
    symbols += (SET_SPARSE,)
    # LLVM's default for the AVX-512 CPUs is 256-bit vectors; that tile is written for 512.
    # The AVX2 code on an AVX-512 CPU: no AVX-512 instruction either (as on an AVX2 CPU)
    features = ",-prefer-256-bit" if AVX512 else ",-avx512f" if host_has_avx512() else ""
    return load_or_compile("tile-gemm", (__file__, tile_bf16.__file__, tile_sparse.__file__), module_ir, symbols,
                           features)
