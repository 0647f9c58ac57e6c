"""The GEMM every njit kernel calls: `gemm(a, b, out)` writes out = a @ b.

What this file is: which BLAS library runs the engine's float32 GEMMs, chosen once at
import. numba's own `np.dot` inside njit always calls scipy's OpenBLAS (through
`scipy.linalg.cython_blas`). numpy's wheels bundle a second, newer OpenBLAS build
(64-bit integers, symbols `scipy_cblas_sgemm64_` etc.; 0.3.31 beside scipy's 0.3.30 here),
which ran the network's 64- and 128-row forward and weight-gradient GEMMs 1.15-1.39x
faster and the rest about as fast, side by side in one process (`python
scripts/bench_blas.py`). So float32 GEMMs call a CBLAS sgemm through the external
symbol `cubedqn_sgemm64`, which this module binds at import:

  "numpy"  numpy's bundled ILP64 OpenBLAS `cblas_sgemm` (the default when it is there and
           passes a check on small products at import);
  "scipy"  a small native fallback (`sgemm_via_np_dot` below) that hands the product to
           numba's np.dot, i.e. scipy's BLAS: used when numpy has no such library (other
           numpy builds: Accelerate, MKL) or when CUBEDQN_BLAS=scipy is set.

On CPUs with AVX-512, or AVX2 and FMA, the symbol is then bound to `tile_gemm.py`'s sgemm
instead, which computes the networks' small products itself (an 8 x 32 register tile, 6 x
16 with AVX2) while the library runs on one thread and calls the library, bound as
`cubedqn_blas_sgemm64`, for the rest; it is checked on small products at import and not
bound if that fails.
`CUBEDQN_TILE_GEMM=0` binds the library alone; `avx2` the AVX2 tile on an AVX-512 CPU too.

Precision: `set_matmul_precision("bfloat16")` (where the CPU has AVX512_BF16 and the tile
is bound; config key `matmul_precision`) sends every product the tile is given, its bias
GEMM's too, to tile_bf16.py's kernel: operands rounded to bfloat16, products summed in
float32, twice the float32 tile's FLOPs per cycle on Zen 4. It is a process-wide switch,
as PyTorch's `torch.set_float32_matmul_precision`; "float32" (the start) turns it back.
The switch is bound and its kernel checked at the first `bf16_problem()` call, not at
import.

Threads: in front of all of that, team.py's wrappers are bound to SYMBOL and BIAS_SYMBOL
(`CUBEDQN_TEAM=0` leaves them out): with `set_team(w)`, w > 0 (threads.limit_threads does
it for --threads w + 1), larger products are split by columns between the caller and w
resident workers, each chunk one call of what the wrapper stands in front of; with w = 0
they only pass the call on. The same workers run RANGE_SYMBOL (`run_range`): a function
over chunks of a range: the optimizer's update over the flat buffer (optim.py), and,
their functions found in a table at run time (range_fn, share_range_fn), the slot-pair
first layer's row gather and lazy backward (nn.py) and the 2x2x2 framing (encoding.py).

The choice lives in the symbol, not in the compiled kernels: a kernel loaded from Numba's
cache calls `cubedqn_sgemm64` by name, so it stays valid when the choice changes. float64
(gradient checks) always uses np.dot. Threads: `threads.limit_threads` limits every
loaded BLAS, numpy's included.

nn.py's kernels inline `gemm`: after editing this file, clear Numba's cache (a change in
another module does not invalidate a cached caller: numba issues #1833, #9483).

What it is not: a GEMM implementation (tile_gemm.py holds the one this project writes).
The contract of `gemm`: 2-D operands, each one either row-contiguous (as a C array or its
row slice) or column-contiguous (a transposed view); anything else goes to np.dot. alpha
1, beta 0. Operands whose numba type already says C or F (contiguous) compile without the
runtime check and the np.dot branch.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import llvmlite.binding as llb
import llvmlite.ir as llir
import numpy as np
from numba import carray, cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import native, team, tile_bf16, tile_gemm

SYMBOL = "cubedqn_sgemm64"
# the bias-and-ReLU GEMM the kernels call (gemm_bias_relu): the team's, the tile's, or one
# that does nothing and returns 0
BIAS_SYMBOL = "cubedqn_sgemm_bias"
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
CHOICES = ("numpy", "scipy")

# void cblas_sgemm(order, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc), ILP64
_i32, _i64, _f32, _fp = types.int32, types.int64, types.float32, types.CPointer(types.float32)
SGEMM_SIG = types.void(_i32, _i32, _i32, _i64, _i64, _i64, _f32, _fp, _i64, _fp, _i64, _f32, _fp, _i64)
_sgemm = types.ExternalFunction(SYMBOL, SGEMM_SIG)
# tile_gemm's C = A @ B + bias (ReLU if relu): 1 when done, 0 when the caller must do it
BIAS_SIG = types.int64(_i64, _i64, _i64, _fp, _i64, _fp, _i64, _fp, _i64, _fp, _i64)
_sgemm_bias = types.ExternalFunction(BIAS_SYMBOL, BIAS_SIG)
# void range(fn, ctx, n, grain): fn(ctx, lo, hi) over [0, n), chunks split over the GEMM
# team's threads where it runs (team.TEAM_RANGE); fn is a void(voidptr, int64, int64) cfunc
RANGE_SYMBOL = "cubedqn_range"
RANGE_SIG = types.void(types.voidptr, types.voidptr, _i64, _i64)
run_range = types.ExternalFunction(RANGE_SYMBOL, RANGE_SIG)
# A table of such functions that kernels look up at run time (range_fn): a cfunc's address
# differs from process to process, so a cached kernel cannot hold it; it holds this
# table's name, bound here at import, and finds 0 in a slot until something fills it
# (share_range_fn: nn.py's and encoding.py's chunk functions, filled when the team first
# starts).
RANGE_FNS_SYMBOL = "cubedqn_range_fns"
RANGE_FN_SLOTS = 8
_RANGE_FNS = (ctypes.c_int64 * RANGE_FN_SLOTS)()
llb.add_symbol(RANGE_FNS_SYMBOL, ctypes.addressof(_RANGE_FNS))
_CTYPES_SIG = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64)


@intrinsic
def voidptr_at(typingctx, address):
    """The voidptr at an integer address (a context's slots, a range_fn)."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))
    return types.voidptr(types.int64), codegen


@intrinsic
def prefetch(typingctx, arr, i):
    """A software prefetch of the cache line holding arr[i] (1D), for reading, into every
    cache level. Unlike a load it puts nothing in a register, so nothing waits for it:
    the instructions after it go on while the line comes in. x86 never faults on one, but
    callers keep i in bounds all the same. (The prioritized replay's descents and the
    optimizer's lazy row updates.)"""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        p = cgutils.get_item_pointer(context, builder, sig.args[0], a, [args[1]], wraparound=False)
        i32 = llir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", [cgutils.voidptr_t], llir.FunctionType(
            llir.VoidType(), [cgutils.voidptr_t, i32, i32, i32]))
        # (address, 0: for a read, 3: keep in all levels, 1: a data cache)
        builder.call(fn, [builder.bitcast(p, cgutils.voidptr_t), llir.Constant(i32, 0), llir.Constant(i32, 3),
                          llir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.none(arr, i), codegen


@intrinsic
def range_fn(typingctx, slot):
    """The address in slot `slot` of the range-function table (0 where none is set)."""
    def codegen(context, builder, sig, args):
        table_t = llir.ArrayType(llir.IntType(64), RANGE_FN_SLOTS)
        table = builder.module.globals.get(RANGE_FNS_SYMBOL)
        if table is None:  # a declaration: the address comes from the symbol bound at import
            table = llir.GlobalVariable(builder.module, table_t, RANGE_FNS_SYMBOL)
        return builder.load(builder.gep(table, [llir.Constant(llir.IntType(32), 0), args[0]]))
    return types.int64(types.int64), codegen


@intrinsic(prefer_literal=True)
def local_slots(typingctx, count):
    """A voidptr to `count` (a constant) int64 slots on the calling kernel's stack, in its
    entry block, so a loop does not grow it: a run_range context that lives as long as the
    call, which waits for every chunk, or a chunk's scratch, with no allocation."""
    if not isinstance(count, types.IntegerLiteral):
        raise TypeError("local_slots needs a constant count")
    size = count.literal_value

    def codegen(context, builder, sig, args):
        slots = cgutils.alloca_once(builder, llir.ArrayType(llir.IntType(64), size))
        return builder.bitcast(slots, context.get_value_type(types.voidptr))
    return types.voidptr(count), codegen


_RANGE_BUILDERS = {}  # slot -> a function that compiles (or loads) its cfunc and returns the address
_RANGE_WANTED = set()  # the slots the team fills when it starts (want_range_fn)


def share_range_fn(slot: int, build, wanted: bool = True):
    """Kernels that split work over the team look up range_fn(slot): build() (compiling a
    cfunc, or loading it from numba's cache) fills that slot when the team first starts, so
    that a run on one thread never compiles it (its kernels find 0 there and work alone),
    or now if it runs already: call this at the end of the module that defines the cfunc.
    wanted=False: only once want_range_fn(slot) says a run uses it (nn's panel halves: a
    run whose workspaces have no panel scratch never compiles them)."""
    _RANGE_BUILDERS[slot] = build
    if wanted:
        want_range_fn(slot)


def want_range_fn(slot: int):
    """The team fills `slot` when it starts (now, where it runs already)."""
    _RANGE_WANTED.add(slot)
    if team_workers() > 0 and not _RANGE_FNS[slot]:
        _RANGE_FNS[slot] = _RANGE_BUILDERS[slot]()


def gemm(a, b, out):
    """out = a @ b for 2-D arrays (called from Python: numpy's own np.dot)."""
    np.dot(a, b, out)


@njit(cache=True, nogil=True)
def _operand(x):
    """(transpose flag, leading dimension) of a 2-D float32 operand, or (0, 0) if it is
    neither row- nor column-contiguous."""
    rows, cols = x.shape
    s0, s1 = x.strides
    if s1 == 4 and s0 >= 4 * max(1, cols) and s0 % 4 == 0:
        return NO_TRANS, s0 // 4
    if s0 == 4 and s1 >= 4 * max(1, rows) and s1 % 4 == 0:
        return TRANS, s1 // 4
    return 0, 0


def gemm_bias_relu(a, b, bias, out, relu, halves=False):
    """out = a @ b + bias, then ReLU if relu, in one pass where the tile GEMM takes the
    product; returns whether it did (if not, nothing was touched). halves: a's row i is
    much like its row i + m/2 (the online forward's s and s'), which tile_sparse.py's lists
    then pair (tile_gemm.TILE_BIAS; the same bits). From Python: False."""
    return False


@overload(gemm_bias_relu, jit_options={"nogil": True})
def _gemm_bias_relu_overload(a, b, bias, out, relu, halves=False):
    if not (a.ndim == b.ndim == out.ndim == 2 and bias.ndim == 1 and
            a.dtype == b.dtype == out.dtype == bias.dtype == types.float32 and
            a.layout == b.layout == out.layout == "C" and bias.layout == "C"):
        def not_here(a, b, bias, out, relu, halves=False):
            return False
        return not_here

    def via_tile(a, b, bias, out, relu, halves=False):
        m, k = a.shape
        n = b.shape[1]
        return _sgemm_bias(m, n, k, a.ctypes, a.strides[0] // 4, b.ctypes, b.strides[0] // 4, out.ctypes,
                           out.strides[0] // 4, bias.ctypes, (1 if relu else 0) | (2 if halves else 0)) != 0
    return via_tile


@overload(gemm, jit_options={"nogil": True})
def _gemm_overload(a, b, out):
    if not (a.ndim == b.ndim == out.ndim == 2 and a.dtype == b.dtype == out.dtype == types.float32):
        def via_np_dot(a, b, out):
            np.dot(a, b, out)
        return via_np_dot

    if a.layout in "CF" and b.layout in "CF" and out.layout == "C":
        # contiguous by type, as at every call in nn.py (C arrays, their leading-row slices
        # and transposes): the storage is known when compiling, so there is no runtime check
        # and no np.dot branch to compile. In a cold start (numba's compile events, two
        # runs each) the gemm's three signatures compiled in 0.7-0.9 s instead of 1.9-2.2 s.
        ta = NO_TRANS if a.layout == "C" else TRANS
        tb = NO_TRANS if b.layout == "C" else TRANS

        def via_symbol_contiguous(a, b, out):
            m, k = a.shape
            n = b.shape[1]
            if m == 0 or n == 0:
                return
            if k == 0:  # an empty sum, as np.dot gives
                for i in range(m):
                    for j in range(n):
                        out[i, j] = 0
                return
            lda = k if ta == NO_TRANS else m
            ldb = n if tb == NO_TRANS else k
            _sgemm(ROW_MAJOR, ta, tb, m, n, k, np.float32(1.0), a.ctypes, lda, b.ctypes, ldb,
                   np.float32(0.0), out.ctypes, n)
        return via_symbol_contiguous

    def via_symbol(a, b, out):
        m, k = a.shape
        n = b.shape[1]
        if m == 0 or n == 0:
            return
        ta, lda = _operand(a)
        tb, ldb = _operand(b)
        if ta == 0 or tb == 0 or k == 0 or out.strides[1] != 4 or out.strides[0] < 4 * n:
            np.dot(a, b, out)
            return
        _sgemm(ROW_MAJOR, ta, tb, m, n, k, np.float32(1.0), a.ctypes, lda, b.ctypes, ldb,
               np.float32(0.0), out.ctypes, out.strides[0] // 4)
    return via_symbol


def _make_fallback():
    """The "scipy" choice: an sgemm with the CBLAS ILP64 signature that runs numba's np.dot
    (scipy's OpenBLAS) on the operands as arrays. Compiled (and cached) only when used."""

    @cfunc(SGEMM_SIG, cache=True, nopython=True)
    def sgemm_via_np_dot(order, ta, tb, m, n, k, alpha, pa, lda, pb, ldb, beta, pc, ldc):
        # gemm()'s contract: row-major, alpha 1, beta 0; leading dimensions may exceed widths
        c = carray(pc, (m - 1) * ldc + n)
        exact = lda == (k if ta == NO_TRANS else m) and ldb == (n if tb == NO_TRANS else k) and ldc == n
        if exact:
            out = carray(pc, (m, n))
            if ta == NO_TRANS and tb == NO_TRANS:
                np.dot(carray(pa, (m, k)), carray(pb, (k, n)), out)
            elif ta == NO_TRANS:
                np.dot(carray(pa, (m, k)), carray(pb, (n, k)).T, out)
            elif tb == NO_TRANS:
                np.dot(carray(pa, (k, m)).T, carray(pb, (k, n)), out)
            else:
                np.dot(carray(pa, (k, m)).T, carray(pb, (n, k)).T, out)
            return
        a = carray(pa, (m - 1) * lda + k if ta == NO_TRANS else (k - 1) * lda + m)
        b = carray(pb, (k - 1) * ldb + n if tb == NO_TRANS else (n - 1) * ldb + k)
        for i in range(m):
            for j in range(n):
                acc = np.float32(0.0)
                for p in range(k):
                    av = a[i * lda + p] if ta == NO_TRANS else a[p * lda + i]
                    bv = b[p * ldb + j] if tb == NO_TRANS else b[j * ldb + p]
                    acc += av * bv
                c[i * ldc + j] = acc

    return sgemm_via_np_dot


def _check(fn) -> bool:
    """Does fn (a ctypes CBLAS sgemm, ILP64) compute small products right, in all four
    transpose cases and with a leading dimension wider than the matrix?"""
    rng = np.random.default_rng(0)
    m, n, k = 5, 3, 4
    a = rng.standard_normal((m, k + 2)).astype(np.float32)[:, :k]
    b = rng.standard_normal((k, n)).astype(np.float32)
    for ta in (NO_TRANS, TRANS):
        for tb in (NO_TRANS, TRANS):
            A = np.ascontiguousarray(a.T).T if ta == TRANS else a
            B = np.ascontiguousarray(b.T).T if tb == TRANS else b
            buf = np.full((m, n + 1), np.nan, np.float32)
            lda = A.strides[0 if ta == NO_TRANS else 1] // 4
            ldb = B.strides[0 if tb == NO_TRANS else 1] // 4
            fn(ROW_MAJOR, ta, tb, m, n, k, 1.0, A.ctypes.data, lda, B.ctypes.data, ldb, 0.0, buf.ctypes.data, n + 1)
            want = a.astype(np.float64) @ b.astype(np.float64)
            if not np.allclose(buf[:, :n], want, rtol=1e-5, atol=1e-5):
                return False
    return True


def _numpy_openblas():
    """(address of numpy's bundled ILP64 cblas_sgemm, its threadpoolctl info), or None."""
    from threadpoolctl import threadpool_info
    for info in threadpool_info():
        path = info.get("filepath") or ""
        if info.get("internal_api") != "openblas" or not any(p.startswith("numpy") for p in Path(path).parts):
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_cblas_sgemm64_", "cblas_sgemm64_"):
            try:
                fn = getattr(lib, name)
            except AttributeError:
                continue
            addr = ctypes.cast(fn, ctypes.c_void_p).value
            if _check(_CTYPES_SIG(addr)):
                return addr, info
    return None


def _check_operands(rng, m, n, k, ta, tb):
    """(A, B, op(A), op(B)) for a check's C = op(A) @ op(B) (m x n, depth k): A and B as the
    CBLAS call sees them, their leading dimensions wider than the matrices."""
    a = rng.standard_normal((m, k + 3) if ta == NO_TRANS else (k, m + 3)).astype(np.float32)
    b = rng.standard_normal((k, n + 2) if tb == NO_TRANS else (n, k + 2)).astype(np.float32)
    return a, b, (a[:, :k] if ta == NO_TRANS else a[:, :m].T), (b[:, :n] if tb == NO_TRANS else b[:, :k].T)


def _product(sgemm, m, n, k, ta, tb, a, b, rows=None):
    """C (m x n + 1, ldc n + 1, NaN where nothing was written) from the CBLAS sgemm on
    check operands (_check_operands), for its first `rows` rows (default all m)."""
    buf = np.full((m, n + 1), np.nan, np.float32)
    sgemm(ROW_MAJOR, ta, tb, m if rows is None else rows, n, k, 1.0, a.ctypes.data, a.shape[1], b.ctypes.data,
          b.shape[1], 0.0, buf.ctypes.data, n + 1)
    return buf


def _all_rows_and_one(sgemm, m, n, k, ta, tb, a, b):
    """[C of all m rows, C of the first row alone] from the CBLAS sgemm (_product's)."""
    return [_product(sgemm, m, n, k, ta, tb, a, b, rows)[:rows, :n] for rows in (m, 1)]


# the checks' deep K: two K blocks of the tile where it takes K past 256 (every tile now: AVX2
# takes K to 1024 since its sparse path), else the longest it takes (so that the tile, not the
# library behind it, computes those products)
DEEP_K = min(300, tile_gemm.K_MAX)


def _check_tile(fn) -> bool:
    """Does fn compute the products its tile takes right (8-row blocks, a leftover row, a
    panel and tail columns, A as is and transposed, B as is and transposed, K in one
    block and in two, leading dimensions wider than the matrices), bitwise the same row by
    row whatever the number of rows?"""
    rng = np.random.default_rng(1)
    # m = 17: a 16-row block of a one-vector tail and a leftover row (AVX2: two 6-row
    # blocks, a 4-row group, a row); 133: two blocks of rows where the tile has ROW_BLOCK
    # k = 7: under one 16-row block of a transposed B; 300: two K blocks, the second 44 deep
    # (DEEP_K: one block where it takes less); n = 40 and 12: a tail of one vector, 57: of two, masked
    for m, ta, tb, k, n in ((17, NO_TRANS, NO_TRANS, 7, 40), (17, TRANS, NO_TRANS, 7, 40),
                            (17, NO_TRANS, NO_TRANS, DEEP_K, 57), (17, NO_TRANS, TRANS, 7, 40),
                            (17, NO_TRANS, TRANS, DEEP_K, 12), (17, NO_TRANS, NO_TRANS, DEEP_K, 12),
                            (133, NO_TRANS, NO_TRANS, 7, 40), (133, TRANS, NO_TRANS, 7, 57)):
        a, b, op_a, op_b = _check_operands(rng, m, n, k, ta, tb)
        want = op_a.astype(np.float64) @ op_b.astype(np.float64)
        outs = _all_rows_and_one(fn, m, n, k, ta, tb, a, b)
        if not (np.allclose(outs[0], want, rtol=1e-5, atol=1e-5) and np.array_equal(outs[1], outs[0][:1])):
            return False
    return True


_GET_THREADS = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                "openblas_get_num_threads")


_KEEP = []  # native callbacks bound as symbols stay alive here


def is_scipy_blas(info) -> bool:
    """Whether a threadpoolctl entry is scipy's BLAS: its copy lives under scipy.libs/
    (wheels) or scipy/; numpy's is also named libscipy_openblas64_*, so the file name alone
    does not tell them apart."""
    return bool({"scipy.libs", "scipy"} & set(Path(info.get("filepath", "")).parts))


def _threads_query():
    """Address of the bound library's `openblas_get_num_threads`, read by the tile at every
    call (it leaves products to a library running on several threads). numba's np.dot (the
    "scipy" choice) runs scipy's OpenBLAS; where neither is found, one thread is assumed."""
    from threadpoolctl import threadpool_info
    if BACKEND == "numpy":
        paths = [BACKEND_INFO["filepath"]]
    else:
        import scipy.linalg.cython_blas  # noqa: F401  (loads scipy's OpenBLAS)
        paths = [i["filepath"] for i in threadpool_info() if i.get("internal_api") == "openblas" and is_scipy_blas(i)]
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _GET_THREADS:
            fn = getattr(lib, name, None)
            if fn is not None:
                return ctypes.cast(fn, ctypes.c_void_p).value

    @cfunc(types.int32(), cache=True)
    def one_thread():
        return 1

    _KEEP.append(one_thread)
    return one_thread.address


_BIAS_CTYPES = ctypes.CFUNCTYPE(ctypes.c_int64, *([ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64] * 3 +
                                                 [ctypes.c_void_p, ctypes.c_int64]))


def _check_bias(fn, sgemm) -> bool:
    """Does fn (TILE_BIAS) give the same bits as sgemm (TILE) followed by dense_forward's
    bias and ReLU pass, with and without the ReLU, K in one block and in two, a tail?"""
    rng = np.random.default_rng(2)
    n = 44
    for m, k, relu in ((17, 7, True), (17, DEEP_K, False), (17, DEEP_K, True), (133, 7, True)):
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        bias = rng.standard_normal(n).astype(np.float32)
        want = np.empty((m, n), np.float32)
        sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, n, 0.0,
              want.ctypes.data, n)
        want += bias
        if relu:
            want = np.where(want > 0, want, np.float32(0))
        got = np.full((m, n), np.nan, np.float32)
        if fn(m, n, k, a.ctypes.data, k, b.ctypes.data, n, got.ctypes.data, n, bias.ctypes.data, int(relu)) != 1 \
                or not np.array_equal(got, want):
            return False
    return True


def _bind_no_bias():
    """BIAS_SYMBOL where the tile is not bound: does nothing, returns 0 (the caller's pass)."""
    @cfunc(BIAS_SIG, cache=True)
    def not_done(m, n, k, a, lda, b, ldb, c, ldc, bias, relu):
        return 0

    _KEEP.append(not_done)
    llb.add_symbol(BIAS_SYMBOL, not_done.address)


def _bind_tile(library_address):
    """Bind SYMBOL to tile_gemm's sgemm (which calls the library for what it leaves), and
    TILE_BIAS to its bias-and-ReLU version, where CUBEDQN_TILE_GEMM allows and the CPU has
    AVX-512 or AVX2 and FMA; returns (engine or None, why not)."""
    llb.add_symbol(tile_gemm.LIBRARY, library_address)
    if not TILE_WANTED:
        _bind_no_bias()
        return None, "off (CUBEDQN_TILE_GEMM=0)"
    llb.add_symbol(tile_gemm.THREADS, _threads_query())
    try:
        engine, _ = tile_gemm.compile_tile()
    except Exception as e:  # no AVX2, or an LLVM that cannot target this CPU
        _bind_no_bias()
        return None, f"not used: {e}"
    address = engine.get_function_address(tile_gemm.TILE)
    bias_address = engine.get_function_address(tile_gemm.TILE_BIAS)
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=1, user_api="blas"):  # so that the check runs the tile, not the library
        ok = (_check(_CTYPES_SIG(address)) and _check_tile(_CTYPES_SIG(address))
              and _check_bias(_BIAS_CTYPES(bias_address), _CTYPES_SIG(address)))
    if not ok:
        _bind_no_bias()
        return None, "not used: it failed the check on small products"
    llb.add_symbol(SYMBOL, address)
    llb.add_symbol(BIAS_SYMBOL, bias_address)
    return engine, None


def _bind():
    """Bind SYMBOL; returns (choice, threadpoolctl info of the library or None, problem)."""
    wanted = os.environ.get("CUBEDQN_BLAS", "").strip().lower() or "numpy"
    problem = None
    if wanted not in CHOICES:
        problem = f"CUBEDQN_BLAS={os.environ['CUBEDQN_BLAS']!r} is not one of: {', '.join(CHOICES)}"
        wanted = "numpy"
    found = _numpy_openblas() if wanted == "numpy" else None
    if found:
        addr, info = found
        llb.add_symbol(SYMBOL, addr)
        return "numpy", info, problem, addr
    addr = _make_fallback().address
    llb.add_symbol(SYMBOL, addr)
    return "scipy", None, problem, addr


# CUBEDQN_TILE_GEMM=0 leaves every product to the library (for side-by-side timings); 1
# (default) lets tile_gemm take the ones it is faster on; avx2 too, with the AVX2 code on
# an AVX-512 CPU (native.tile_avx512). Another value is reported by the CLI (exit 2).
_TILE_ENV = native.tile_gemm_setting()
TILE_PROBLEM = None if _TILE_ENV in ("0", "1", "avx2") else \
    f"CUBEDQN_TILE_GEMM={os.environ['CUBEDQN_TILE_GEMM']!r} is not one of: 0, 1, avx2"
TILE_WANTED = _TILE_ENV != "0"
BACKEND, BACKEND_INFO, CONFIG_PROBLEM, _LIBRARY_ADDRESS = _bind()
_TILE_ENGINE, TILE_STATUS = _bind_tile(_LIBRARY_ADDRESS)
TILE = _TILE_ENGINE is not None  # tile_gemm.py takes the products it is faster on


def _check_sparse(setter, sgemm, bias_gemm) -> bool:
    """Does the tile give the same bits with tile_sparse.py's path on as with it off, on
    products whose A is half zeros (ReLU outputs): as is and transposed, B as is and
    transposed, with the bias and ReLU, K in blocks, an odd number of rows and a row block's
    end?"""
    rng = np.random.default_rng(6)
    for ta, tb, m, n, k in ((NO_TRANS, NO_TRANS, 9, 64, 40), (NO_TRANS, TRANS, 70, 128, 150),
                            (TRANS, NO_TRANS, 67, 64, 33), (NO_TRANS, NO_TRANS, 3, 192, 300)):
        a, b, _, _ = _check_operands(rng, m, n, k, ta, tb)
        a[rng.random(a.shape) < 0.5] = 0
        bias = rng.standard_normal(n).astype(np.float32)
        outs = []
        for on in (0, 1):
            setter(on)
            outs.append(_product(sgemm, m, n, k, ta, tb, a, b))
            if ta == tb == NO_TRANS:
                got = np.full((m, n), np.nan, np.float32)
                bias_gemm(m, n, k, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], got.ctypes.data, n,
                          bias.ctypes.data, 1)
                outs.append(got)
        half = len(outs) // 2
        if not all(np.array_equal(x, y, equal_nan=True) for x, y in zip(outs[:half], outs[half:])):
            return False
    return True


def _bind_sparse():
    """(setter of tile_sparse.py's switch, or None, and why not), the switch left as
    CUBEDQN_TILE_SPARSE says (on unless 0)."""
    if _TILE_ENGINE is None:
        return None, f"needs the tile GEMM (tile_gemm.py), which is {TILE_STATUS}"
    setter = ctypes.CFUNCTYPE(None, ctypes.c_int32)(_TILE_ENGINE.get_function_address(tile_gemm.SET_SPARSE))
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=1, user_api="blas"):
        ok = _check_sparse(setter, _CTYPES_SIG(_TILE_ENGINE.get_function_address(tile_gemm.TILE)),
                           _BIAS_CTYPES(_TILE_ENGINE.get_function_address(tile_gemm.TILE_BIAS)))
    setter(1 if ok and _SPARSE_ENV != "0" else 0)
    return (setter, None) if ok else (None, "not used: it failed its check against the dense loops")


# CUBEDQN_TILE_SPARSE=0 starts with tile_sparse.py's path off (every product on the tile's
# dense loops); set_tile_sparse turns it on and off at run time. Another value is reported
# by the CLI (exit 2).
_SPARSE_ENV = os.environ.get("CUBEDQN_TILE_SPARSE", "1").strip()
SPARSE_PROBLEM = None if _SPARSE_ENV in ("0", "1") else \
    f"CUBEDQN_TILE_SPARSE={os.environ['CUBEDQN_TILE_SPARSE']!r} is not one of: 0, 1"
_SPARSE_SETTER, SPARSE_STATUS = _bind_sparse()
# asked for (set_tile_sparse, CUBEDQN_TILE_SPARSE) and in effect; while it is on, the GEMM
# team splits the products it could take by rows (team.SET_ROWS), not columns, whose
# chunks would each list all of A's rows again: the step's 128 x 256 x 256 forward at half
# zeros ran 86 us on two threads in column chunks against 76 for the dense loops
# (runs/perf45/team_sparse.py)
_sparse = {"wanted": _SPARSE_ENV != "0", "on": _SPARSE_SETTER is not None and _SPARSE_ENV != "0"}


def _apply_sparse():
    on = _SPARSE_SETTER is not None and _sparse["wanted"]
    if _SPARSE_SETTER is not None:
        _SPARSE_SETTER(1 if on else 0)
    if _TEAM_ROWS is not None:
        _TEAM_ROWS(1 if on else 0)
    _sparse["on"] = on


def set_tile_sparse(on: bool) -> bool:
    """Ask for tile_sparse.py's path (products whose left operand is mostly zeros, on the
    tile, split by rows over the GEMM team) or not, for every kernel in this process; the
    same bits either way. Returns whether it is on now (never where SPARSE_STATUS says
    why not)."""
    _sparse["wanted"] = bool(on)
    _apply_sparse()
    return _sparse["on"]


def tile_sparse_on() -> bool:
    return _sparse["on"]


@contextmanager
def tile_sparse_as(on: bool):
    """set_tile_sparse(on) for the block, what was asked for before restored after."""
    before = _sparse["wanted"]
    set_tile_sparse(on)
    try:
        yield
    finally:
        set_tile_sparse(before)


def _bind_team():
    """Put team.py's wrappers in front of whatever SYMBOL and BIAS_SYMBOL are bound to now
    (the tile, or the library and a bias that leaves it to the caller); returns (engine or
    None, why not). CUBEDQN_TEAM=0 leaves them as they are."""
    if not TEAM_WANTED:
        return None, "off (CUBEDQN_TEAM=0)"
    if sys.platform not in ("linux", "darwin"):  # its workers are pthreads
        return None, f"not built on {sys.platform} (its workers are pthreads)"
    llb.add_symbol(team.INNER_SGEMM, llb.address_of_symbol(SYMBOL))
    llb.add_symbol(team.INNER_BIAS, llb.address_of_symbol(BIAS_SYMBOL))
    try:
        engine, _ = team.compile_team()
    except Exception as e:  # an LLVM that cannot target this CPU
        return None, f"not used: {e}"
    llb.add_symbol(SYMBOL, engine.get_function_address(team.TEAM_SGEMM))
    llb.add_symbol(BIAS_SYMBOL, engine.get_function_address(team.TEAM_BIAS))
    # never disposed, not even while the interpreter shuts down: the workers run in its code
    # until the process ends
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(engine))
    forked = ctypes.CFUNCTYPE(None)(engine.get_function_address(team.TEAM_FORKED))
    _KEEP.append(forked)
    os.register_at_fork(after_in_child=forked)  # a forked child has none of the workers
    return engine, None


def _bind_range():
    """Bind RANGE_SYMBOL (fn(ctx, lo, hi) over [0, n), optim.py's flat updates): the team's
    TEAM_RANGE, which splits long ranges over the workers the GEMMs use, or where there is
    no team a native function that calls fn(ctx, 0, n). Returns its address."""
    if _TEAM_ENGINE is not None:
        address = _TEAM_ENGINE.get_function_address(team.TEAM_RANGE)
    else:
        engine, _ = team.compile_serial_range()
        _KEEP.append(engine)
        address = engine.get_function_address(team.SERIAL_RANGE)
    llb.add_symbol(RANGE_SYMBOL, address)
    return address


# CUBEDQN_TEAM=0 leaves the GEMMs to the library's own threads with --threads T (side-by-side
# timings); 1 (default) binds the team. Another value is reported by the CLI (exit 2).
_TEAM_ENV = os.environ.get("CUBEDQN_TEAM", "1").strip()
TEAM_PROBLEM = None if _TEAM_ENV in ("0", "1") else f"CUBEDQN_TEAM={os.environ['CUBEDQN_TEAM']!r} is not one of: 0, 1"
TEAM_WANTED = _TEAM_ENV != "0"
_TEAM_ENGINE, TEAM_STATUS = _bind_team()
# team.SET_ROWS: the team's row split follows the sparse path's switch (_apply_sparse)
_TEAM_ROWS = (ctypes.CFUNCTYPE(None, ctypes.c_int32)(_TEAM_ENGINE.get_function_address(team.SET_ROWS))
              if _TEAM_ENGINE is not None else None)
_apply_sparse()
RANGE_ADDRESS = _bind_range()
_TEAM_LOCK = threading.Lock()
_team_checked = None  # None: not yet; then whether the split products came out right


def _check_team() -> bool:
    """With the workers on: do products the team splits (column chunks, the last one wider,
    B as is and transposed, A transposed, two K blocks where the tile takes K past 256; row
    chunks, the last one longer, as while tile_sparse.py's path is on) give the inner
    function's bits, and the bias version its bits and its answer?"""
    split = _CTYPES_SIG(_TEAM_ENGINE.get_function_address(team.TEAM_SGEMM))
    inner = _CTYPES_SIG(llb.address_of_symbol(team.INNER_SGEMM))
    rng = np.random.default_rng(4)
    deep = DEEP_K if TILE else 300  # products the inner computes (not the library behind the tile)
    split_bias = _BIAS_CTYPES(_TEAM_ENGINE.get_function_address(team.TEAM_BIAS))
    inner_bias = _BIAS_CTYPES(llb.address_of_symbol(team.INNER_BIAS))
    try:
        for by_rows in (0, 1) if _SPARSE_SETTER is not None else (0,):  # rows only where the sparse path sets them
            _TEAM_ROWS(by_rows)
            for ta, tb, m, n, k in ((NO_TRANS, NO_TRANS, 17, 100, deep), (NO_TRANS, TRANS, 9, 260, 64),
                                    (TRANS, NO_TRANS, 40, 129, 64), (NO_TRANS, NO_TRANS, 64, 256, 256),
                                    (NO_TRANS, NO_TRANS, 70, 128, 100), (TRANS, NO_TRANS, 99, 64, 64),
                                    (NO_TRANS, TRANS, 50, 192, 80)):
                a, b, _, _ = _check_operands(rng, m, n, k, ta, tb)
                a[rng.random(a.shape) < 0.5] = 0  # as a ReLU's output (tile_sparse.py's path, where it is on)
                if not np.array_equal(_product(split, m, n, k, ta, tb, a, b), _product(inner, m, n, k, ta, tb, a, b),
                                      equal_nan=True):
                    return False
            for m, n, k in ((33, 200, deep), (45, 192, deep)):  # columns either way; rows where set
                a = rng.standard_normal((m, k)).astype(np.float32)
                a[rng.random(a.shape) < 0.5] = 0
                b = rng.standard_normal((k, n)).astype(np.float32)
                bias = rng.standard_normal(n).astype(np.float32)
                outs = []
                for fn in (split_bias, inner_bias):
                    buf = np.full((m, n), np.nan, np.float32)
                    outs.append((fn(m, n, k, a.ctypes.data, k, b.ctypes.data, n, buf.ctypes.data, n,
                                    bias.ctypes.data, 1), buf))
                if outs[0][0] != outs[1][0] or not np.array_equal(outs[0][1], outs[1][1], equal_nan=True):
                    return False
    finally:
        _TEAM_ROWS(1 if _sparse["on"] else 0)
    return True


def team_problem():
    """None where set_team can split products over workers, else why not (one line)."""
    if _TEAM_ENGINE is None:
        return f"the GEMM team (team.py) is {TEAM_STATUS}"
    if _team_checked is False:
        return "the GEMM team (team.py) is not used: it failed the check on split products"
    return None


def set_team(workers: int) -> int:
    """Split the engine's larger products over `workers` resident threads besides the
    caller (0: none); returns how many are in use (0 where team_problem() says why). The
    first call with workers > 0 starts them and checks the split products (a few ms)."""
    global _team_checked
    if team_problem():
        return 0
    setter = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int32)(_TEAM_ENGINE.get_function_address(team.SET_TEAM))
    with _TEAM_LOCK:  # SET_TEAM starts workers; ctypes lets go of the GIL around the call
        if workers > 0 and _team_checked is None:
            from threadpoolctl import threadpool_limits
            setter(1)
            with threadpool_limits(limits=1, user_api="blas"):  # as in the team mode (threads.limit_threads)
                _team_checked = _check_team()
            if not _team_checked:
                setter(0)
                return 0
        if workers > 0:
            for slot in sorted(_RANGE_WANTED):
                if not _RANGE_FNS[slot]:
                    _RANGE_FNS[slot] = _RANGE_BUILDERS[slot]()
        return int(setter(max(0, int(workers))))


def team_workers() -> int:
    """Workers the team uses now (0 where it is off or absent)."""
    return team_stats()["workers"]


def team_stats() -> dict:
    """{"workers": in use now, "split": products split, "taken": chunks workers took}; the
    counts since the process started."""
    if _TEAM_ENGINE is None:
        return {"workers": 0, "split": 0, "taken": 0}
    out = (ctypes.c_int64 * 3)()
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_TEAM_ENGINE.get_function_address(team.TEAM_STATS))(ctypes.addressof(out))
    return {"workers": int(out[2]), "split": int(out[0]), "taken": int(out[1])}


def _check_bf16(sgemm, bias_gemm) -> bool:
    """With the bf16 switch on: does TILE give reference.gemm_bf16 within float32 rounding
    (bit for bit on Zen 4, tests/test_tile_bf16.py; the check allows another CPU's order
    of the two products in a lane) (A and B as is and transposed, K odd, in one block and in two; 8-row blocks, 16-row
    blocks of a one-vector tail, a leftover row, tail columns), the same bits row by row
    whatever the number of rows, and TILE_BIAS the same plus the bias and ReLU?"""
    from .reference import bf16_round, gemm_bf16
    rng = np.random.default_rng(3)
    m = 17
    for ta, tb, k, n in ((NO_TRANS, NO_TRANS, 7, 40), (TRANS, NO_TRANS, 7, 40), (NO_TRANS, TRANS, 301, 57),
                         (TRANS, TRANS, 300, 12), (NO_TRANS, NO_TRANS, 300, 12), (TRANS, NO_TRANS, 301, 64)):
        a, b, op_a, op_b = _check_operands(rng, m, n, k, ta, tb)
        want = gemm_bf16(op_a, op_b)
        # float32 sums of K exact products: within K roundings of the float64 sum's scale
        tol = 2.0 * k * np.finfo(np.float32).eps * (np.abs(bf16_round(op_a)) @ np.abs(bf16_round(op_b)))
        outs = _all_rows_and_one(sgemm, m, n, k, ta, tb, a, b)
        if not (np.all(np.abs(outs[0] - want) <= tol) and np.array_equal(outs[1], outs[0][:1])):
            return False
        if ta == tb == NO_TRANS:
            bias = rng.standard_normal(n).astype(np.float32)
            got = np.full((m, n), np.nan, np.float32)
            if bias_gemm(m, n, k, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], got.ctypes.data, n,
                         bias.ctypes.data, 1) != 1 or \
                    not np.array_equal(got, np.maximum(outs[0] + bias, np.float32(0))):
                return False
    return True


def _bind_bf16():
    """(setter of the bf16 switch, or None, and why not)."""
    if _TILE_ENGINE is None:
        return None, f"needs the tile GEMM (tile_gemm.py), which is {TILE_STATUS}"
    if not tile_bf16.host_has_bf16():
        return None, "needs a CPU with AVX512_BF16 (this one has none)"
    if not tile_gemm.has_bf16():
        return None, "needs the AVX-512 tile (CUBEDQN_TILE_GEMM=avx2 builds the AVX2 one)"
    setter = ctypes.CFUNCTYPE(None, ctypes.c_int32)(_TILE_ENGINE.get_function_address(tile_gemm.SET_PRECISION))
    setter(1)
    try:
        ok = _check_bf16(_CTYPES_SIG(_TILE_ENGINE.get_function_address(tile_gemm.TILE)),
                         _BIAS_CTYPES(_TILE_ENGINE.get_function_address(tile_gemm.TILE_BIAS)))
    finally:
        setter(0)
    return (setter, None) if ok else (None, "not used: its kernel failed the check on small products")


_bf16 = None  # (setter or None, why not), bound and checked at the first bf16_problem()


def bf16_problem():
    """None where set_matmul_precision("bfloat16") can be had, else why not (one line). The
    first call binds the switch and checks the kernel (a few ms), so that processes that
    never ask for bfloat16 pay nothing."""
    global _bf16
    if _bf16 is None:
        _bf16 = _bind_bf16()
    return _bf16[1]


MATMUL_PRECISIONS = ("float32", "bfloat16")
_precision = "float32"


def matmul_precision_problem(name: str):
    """None where set_matmul_precision(name) would take name, else why not (one line)."""
    if name not in MATMUL_PRECISIONS:
        return f"matmul_precision must be one of: {', '.join(MATMUL_PRECISIONS)}, got '{name}'"
    if name == "bfloat16" and bf16_problem():
        return f"matmul_precision = bfloat16 {bf16_problem()}"
    return None


def set_matmul_precision(name: str) -> None:
    """"float32" or "bfloat16" for every GEMM the engine's kernels make from now on, in this
    process. ValueError (one line, saying why) for another name or a bfloat16 this CPU or
    build cannot give."""
    global _precision
    problem = matmul_precision_problem(name)
    if problem:
        raise ValueError(problem)
    if _bf16 is not None and _bf16[0] is not None:
        _bf16[0](1 if name == "bfloat16" else 0)
    _precision = name


def matmul_precision() -> str:
    return _precision


@contextmanager
def matmul_precision_as(name: str):
    """set_matmul_precision(name) for the block, the precision before it restored after."""
    before = _precision
    set_matmul_precision(name)
    try:
        yield
    finally:
        set_matmul_precision(before)
