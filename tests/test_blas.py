"""blas.gemm: the kernels' GEMM against a float64 reference, on both libraries it can bind.

The default process binds numpy's bundled OpenBLAS where there is one; the "scipy" choice
(a native sgemm that runs numba's np.dot) is tested here through ctypes, and once in a
subprocess with CUBEDQN_BLAS=scipy, where the same cached kernels must give the same rows.
"""
import os
import subprocess
import sys

import llvmlite.binding as llb
import numpy as np
import pytest
from numba import njit

from cubedqn import blas
from cubedqn.blas import NO_TRANS, ROW_MAJOR, TRANS, gemm
from cubedqn.tile_gemm import K_MAX

DEEP = blas.DEEP_K  # K in two blocks of the tile where it takes K past 256, else its longest

# operands typed as non-contiguous compile np.dot's copying branch too, which numba warns about
pytestmark = pytest.mark.filterwarnings("ignore::numba.core.errors.NumbaPerformanceWarning")


@njit(cache=True)
def _gemm_jit(a, b, out):
    gemm(a, b, out)


def _operands(rng, m, n, k, dtype):
    """op(A) (m,k) and op(B) (k,n) in every storage gemm meets: C arrays, transposed views,
    row slices of taller arrays and transposed column blocks of wider ones."""
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    a_tall = np.vstack([a, rng.standard_normal((3, k)).astype(dtype)])[:m]
    b_wide_t = np.ascontiguousarray(np.hstack([b.T.copy(), np.zeros((n, 2), dtype)]))[:, :k].T
    return [(a, b), (np.ascontiguousarray(a.T).T, b), (a, np.ascontiguousarray(b.T).T),
            (np.ascontiguousarray(a.T).T, np.ascontiguousarray(b.T).T), (a_tall, b_wide_t)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("m,n,k", [(64, 256, 256), (5, 3, 4), (1, 12, 1), (7, 1, 9), (3, 4, 0), (0, 3, 4)])
def test_gemm_matches_float64_reference(dtype, m, n, k):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    tol = 1e-4 if dtype == np.float32 else 1e-12
    for A, B in _operands(rng, m, n, k, dtype):
        want = A.astype(np.float64) @ B.astype(np.float64)
        out = np.full((m, n), np.nan, dtype)
        _gemm_jit(A, B, out)
        np.testing.assert_allclose(out, want, rtol=tol, atol=tol * max(1, k))
        out_rows = np.full((m + 2, n), np.nan, dtype)  # a row slice as out
        _gemm_jit(A, B, out_rows[:m])
        np.testing.assert_allclose(out_rows[:m], want, rtol=tol, atol=tol * max(1, k))


def test_gemm_falls_back_to_np_dot_for_strided_operands():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((6, 10)).astype(np.float32)[:, ::2]  # neither row- nor column-contiguous
    b = rng.standard_normal((5, 4)).astype(np.float32)
    out = np.zeros((6, 4), np.float32)
    _gemm_jit(a, b, out)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def _call(fn, A, B, out, ldc=None):
    """Call a ctypes CBLAS sgemm (ILP64, row-major) on float32 arrays as gemm would."""
    m, k = A.shape
    n = B.shape[1]
    ta, lda = (NO_TRANS, A.strides[0] // 4) if A.strides[1] == 4 else (TRANS, A.strides[1] // 4)
    tb, ldb = (NO_TRANS, B.strides[0] // 4) if B.strides[1] == 4 else (TRANS, B.strides[1] // 4)
    fn(ROW_MAJOR, ta, tb, m, n, k, 1.0, A.ctypes.data, lda, B.ctypes.data, ldb, 0.0, out.ctypes.data,
       ldc or out.strides[0] // 4)


def test_scipy_fallback_sgemm_matches_reference():
    """The native sgemm bound when numpy has no OpenBLAS: np.dot for exact leading
    dimensions, its own loop for wider ones (row slices of wider arrays)."""
    fallback = blas._CTYPES_SIG(blas._make_fallback().address)
    rng = np.random.default_rng(3)
    for A, B in _operands(rng, 9, 6, 5, np.float32):
        want = A.astype(np.float64) @ B.astype(np.float64)
        out = np.full((9, 6), np.nan, np.float32)
        _call(fallback, A, B, out)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        wide = np.full((9, 8), np.nan, np.float32)  # ldc 8 > n 6: the loop path
        _call(fallback, A, B, wide)
        np.testing.assert_allclose(wide[:, :6], want, rtol=1e-5, atol=1e-5)
        assert np.isnan(wide[:, 6:]).all()
    assert blas._check(fallback)


def test_check_rejects_a_wrong_sgemm():
    noop = blas._CTYPES_SIG(lambda *args: None)  # leaves C untouched (NaN)
    assert not blas._check(noop)


def test_the_bound_library_passes_the_check_and_is_named():
    assert blas.BACKEND in blas.CHOICES
    if blas.BACKEND == "numpy":
        assert "numpy" in blas.BACKEND_INFO["filepath"]
    from cubedqn.profiling import blas_info
    info = blas_info()
    assert info["source"] == blas.BACKEND


def test_blas_info_names_scipys_openblas_when_scipy_is_bound(monkeypatch):
    """numpy's wheel ships libscipy_openblas64_*.so too; with the "scipy" choice the
    library named must be scipy's, with "numpy" the one blas.py bound."""
    import threadpoolctl
    from cubedqn.profiling import blas_info
    numpy_lib = {"user_api": "blas", "internal_api": "openblas", "version": "numpy's", "architecture": "X",
                 "num_threads": 1, "filepath": "/v/site-packages/numpy.libs/libscipy_openblas64_-1.so"}
    scipy_lib = {"user_api": "blas", "internal_api": "openblas", "version": "scipy's", "architecture": "X",
                 "num_threads": 1, "filepath": "/v/site-packages/scipy.libs/libscipy_openblas-2.so"}
    monkeypatch.setattr(threadpoolctl, "threadpool_info", lambda: [numpy_lib, scipy_lib])
    monkeypatch.setattr(blas, "BACKEND", "scipy")
    assert blas_info()["version"] == "scipy's"
    monkeypatch.setattr(blas, "BACKEND", "numpy")
    monkeypatch.setattr(blas, "BACKEND_INFO", numpy_lib)
    assert blas_info()["version"] == "numpy's"


_NETWORK_ROWS = """
import llvmlite.binding as llb
import numpy as np
from cubedqn import blas
from cubedqn.nn import Layout, MLP
net = MLP(Layout(144, 24, (64, 32), 12), seed=1)
ws = net.workspace(16)
ws.idx[:] = 6 * np.arange(24) + np.random.default_rng(2).integers(0, 6, (16, 24))
print(blas.BACKEND, ' '.join(repr(float(v)) for v in net.forward_ws(ws, 16).ravel()))
"""


def test_scipy_choice_gives_the_same_network_rows():
    """The same (cached) kernels, with the GEMM symbol bound to the other library."""
    rows = {}
    for choice in blas.CHOICES:
        env = dict(os.environ, CUBEDQN_BLAS=choice)
        out = subprocess.run([sys.executable, "-c", _NETWORK_ROWS], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        rows[out[0]] = np.array([float(v) for v in out[1:]])
    assert "scipy" in rows and len(rows["scipy"]) == 16 * 12
    for got in rows.values():
        np.testing.assert_allclose(got, rows["scipy"], rtol=1e-5, atol=1e-5)


def test_unknown_choice_is_a_one_line_error():
    env = dict(os.environ, CUBEDQN_BLAS="mkl")
    r = subprocess.run([sys.executable, "-m", "cubedqn.cli", "scramble", "--moves", "3"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "cubedqn: error: CUBEDQN_BLAS='mkl' is not one of: numpy, scipy"


# --- tile_gemm.py: the register tile blas.py binds as the GEMM symbol on AVX-512 and AVX2 CPUs

needs_tile = pytest.mark.skipif(not blas.TILE, reason=f"tile GEMM not bound here: {blas.TILE_STATUS}")


@pytest.fixture
def one_blas_thread():
    """The tile takes products only while the library runs on one thread."""
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _tile():
    return blas._CTYPES_SIG(blas._TILE_ENGINE.get_function_address(blas.tile_gemm.TILE))


def _tile_cases():
    """(m, n, k, transposed A, transposed B): the 8-row blocks and leftover rows, full
    panels and tail columns, K in one block and in two, at and past the tile's bounds, a
    transposed B's 16-row blocks and the rows past them, and the shapes the library keeps."""
    for m in (1, 7, 8, 9, 16, 17, 64, 67):
        for n in (7, 8, 12, 17, 32, 40, 57, 256):  # 7: too narrow; 12, 17, 40, 57: masked tails
            for k in sorted({1, 5, 256, 257, 512, 513, K_MAX, K_MAX + 1}):
                yield m, n, k, False, False
    for n, k in ((40, 7), (256, 256), (12, 100)):  # AVX2: three blocks of rows (tile_gemm.ROW_BLOCK)
        yield 300, n, k, False, False
    for m, n, k in ((256, 256, 64), (257, 64, 8), (9, 40, 7), (1, 33, 3), (64, 64, 256), (64, 64, 257),
                    (256, 12, 64), (33, 20, 9), (512, 12, 256), (300, 16, 100), (520, 17, 64), (300, 12, 257),
                    (600, 40, 256), (64, 64, 512), (64, 64, 513), (600, 40, 512), (300, 17, 513)):
        yield m, n, k, True, False  # K 512 / 513: at and past TRANS_A_K_MAX with AVX-512
    for m in (1, 9, 64):
        for n in (12, 32, 40, 57, 96):
            for k in sorted({1, 15, 16, 33, 256, 300, 512, 513, K_MAX, K_MAX + 1}):
                yield m, n, k, False, True
    yield 9, 40, 7, True, True  # both transposed: the library


@needs_tile
@pytest.mark.parametrize("m,n,k,trans_a,trans_b", list(_tile_cases()))
def test_tile_sgemm_matches_float64_reference(m, n, k, trans_a, trans_b, one_blas_thread):
    """Through the bound symbol's ctypes face, leading dimensions wider than the matrices,
    C's padding left untouched; products the tile leaves go to the library, same result."""
    rng = np.random.default_rng(m * 10007 + n * 101 + k)
    a = rng.standard_normal((k, m + 3) if trans_a else (m, k + 3)).astype(np.float32)
    op_a = a[:, :m].T if trans_a else a[:, :k]
    b = rng.standard_normal((n, k + 5) if trans_b else (k, n + 5)).astype(np.float32)
    op_b = b[:, :k].T if trans_b else b[:, :n]
    want = op_a.astype(np.float64) @ op_b.astype(np.float64)
    out = np.full((m, n + 2), np.nan, np.float32)
    _tile()(ROW_MAJOR, TRANS if trans_a else NO_TRANS, TRANS if trans_b else NO_TRANS, m, n, k, 1.0, a.ctypes.data,
            a.shape[1], b.ctypes.data, b.shape[1], 0.0, out.ctypes.data, n + 2)
    np.testing.assert_allclose(out[:, :n], want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    assert np.isnan(out[:, n:]).all()


@needs_tile
def test_tile_rows_do_not_depend_on_the_rows_beside_them(one_blas_thread):
    """Bitwise: a row computed alone, in an 8-row block or as a leftover row (AVX2: 6-row
    blocks, a 4-row group, blocks of 128 rows) is the same K fused multiply-adds in the same
    order (the engine's chunked paths rely on it), with K in one block and in two (where the
    tile takes K past 256), B as is and transposed (the input gradients' delta @ W^T)."""
    rng = np.random.default_rng(5)
    for k, n, b_transposed in ((256, 96, False), (DEEP, 96, False), (256, 96, True), (DEEP, 96, True),
                               (256, 12, False), (DEEP, 44, False), (256, 57, True)):
        a = rng.standard_normal((300, k)).astype(np.float32)
        b = rng.standard_normal((n, k)).astype(np.float32).T if b_transposed else \
            rng.standard_normal((k, n)).astype(np.float32)
        full = np.empty((300, n), np.float32)
        _gemm_jit(a, b, full)
        # (AVX2: 6-row blocks, a 4-row group and single rows; blocks of 128 rows past 128)
        for lo, hi in ((0, 1), (3, 11), (60, 67), (8, 16), (64, 67), (16, 33), (0, 67), (120, 140), (250, 300)):
            part = np.empty((hi - lo, n), np.float32)
            _gemm_jit(a[lo:hi], b, part)
            np.testing.assert_array_equal(part, full[lo:hi])


@needs_tile
def test_tile_passes_its_check_and_a_wrong_one_does_not(one_blas_thread):
    assert blas._check(_tile()) and blas._check_tile(_tile())
    noop = blas._CTYPES_SIG(lambda *args: None)
    assert not blas._check_tile(noop)
    bias = blas._BIAS_CTYPES(blas._TILE_ENGINE.get_function_address(blas.tile_gemm.TILE_BIAS))
    assert blas._check_bias(bias, _tile())
    assert not blas._check_bias(blas._BIAS_CTYPES(lambda *args: 1), _tile())  # says done, did nothing


def test_tile_off_gives_the_same_network_rows():
    """CUBEDQN_TILE_GEMM=0 binds the library alone; the network's rows agree to float32
    rounding (the library sums in another order)."""
    rows = {}
    for flag in ("0", "1"):
        env = dict(os.environ, CUBEDQN_TILE_GEMM=flag)
        code = "from cubedqn.threads import limit_threads\nlimit_threads(1)\n" + \
            _NETWORK_ROWS.replace("print(blas.BACKEND,", "print(blas.TILE,")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        rows[flag] = (out[0], np.array([float(v) for v in out[1:]]))
    assert rows["0"][0] == "False" and rows["1"][0] == str(blas.TILE)
    np.testing.assert_allclose(rows["1"][1], rows["0"][1], rtol=1e-5, atol=1e-5)


@needs_tile
def test_tile_leaves_everything_to_a_library_on_two_threads():
    """With the library on two threads the tile symbol runs the library itself (OpenBLAS
    splits the product between the threads): the same bits as calling the library."""
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(7)
    library = blas._CTYPES_SIG(blas._LIBRARY_ADDRESS)
    with threadpool_limits(limits=2, user_api="blas"):
        for m, n, k, tb in ((64, 256, 256, NO_TRANS), (128, 256, 512, NO_TRANS), (64, 256, 256, TRANS),
                            (1536, 12, 256, NO_TRANS)):
            a = rng.standard_normal((m, k)).astype(np.float32)
            b = rng.standard_normal((k, n) if tb == NO_TRANS else (n, k)).astype(np.float32)
            outs = []
            for fn in (library, _tile()):
                out = np.empty((m, n), np.float32)
                fn(ROW_MAJOR, NO_TRANS, tb, m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, b.shape[1], 0.0,
                   out.ctypes.data, n)
                outs.append(out)
            np.testing.assert_array_equal(outs[1], outs[0])


@njit(cache=True)
def _bias_relu_jit(a, b, bias, out, relu):
    return blas.gemm_bias_relu(a, b, bias, out, relu)


def _gemm_then_pass(a, b, bias, relu):
    """What nn.dense_forward does without the tile: the GEMM, then v = o + b, v if v > 0 else 0."""
    out = np.empty((a.shape[0], b.shape[1]), np.float32)
    _gemm_jit(a, b, out)
    out += bias
    return np.where(out > 0, out, np.float32(0)) if relu else out


@needs_tile
@pytest.mark.parametrize("m,k,n", sorted({(64, 256, 256), (9, DEEP, 44), (1, 5, 12), (17, min(512, K_MAX), 33),
                                          (17, K_MAX, 33), (300, 64, 40)}))
@pytest.mark.parametrize("relu", [False, True])
def test_tile_bias_relu_equals_the_gemm_and_the_pass(m, k, n, relu, one_blas_thread):
    """Bitwise: the bias and ReLU applied in the tile's last stores are the same one add
    and one comparison per element as dense_forward's own pass after the GEMM."""
    rng = np.random.default_rng(m + k + n)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    out = np.full((m, n), np.nan, np.float32)
    assert _bias_relu_jit(a, b, bias, out, relu)
    np.testing.assert_array_equal(out, _gemm_then_pass(a, b, bias, relu))


@needs_tile
def test_takes_says_which_bias_products_the_tile_computes(one_blas_thread):
    """tile_gemm.takes (what scripts and tests read) against the bias GEMM's own answer,
    which returns 0 where it leaves the product to the caller: K at and past K_MAX, N at
    and below N_MIN, rows past the AVX2 row blocks."""
    from cubedqn import tile_gemm
    for m in (1, 7, 133):
        for n in (tile_gemm.N_MIN - 1, tile_gemm.N_MIN, 40):
            for k in (1, 256, K_MAX, K_MAX + 1):
                a, b = np.ones((m, k), np.float32), np.ones((k, n), np.float32)
                out = np.empty((m, n), np.float32)
                done = _bias_relu_jit(a, b, np.zeros(n, np.float32), out, False)
                assert done == tile_gemm.takes(m, n, k, bias=True), (m, n, k)


def test_bias_relu_is_left_to_the_caller_where_the_tile_does_not_take_it():
    """Two library threads, K past the tile's bound, float64 or a transposed operand: it
    returns False and leaves out alone (dense_forward then runs the GEMM and its pass)."""
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 32)).astype(np.float32)
    bias = np.zeros(32, np.float32)
    out = np.full((8, 32), np.nan, np.float32)
    with threadpool_limits(limits=2, user_api="blas"):
        assert not _bias_relu_jit(a, b, bias, out, True)
    with threadpool_limits(limits=1, user_api="blas"):  # where the tile would take (8, 16) @ (16, 32)
        a_long, b_long = np.ones((8, K_MAX + 1), np.float32), np.ones((K_MAX + 1, 32), np.float32)
        assert not _bias_relu_jit(a_long, b_long, bias, out, True)
        if blas.TILE:  # the longest K it takes (four blocks on Zen 4) it takes
            assert _bias_relu_jit(np.ones((8, K_MAX), np.float32), np.ones((K_MAX, 32), np.float32), bias,
                                  np.empty((8, 32), np.float32), True)
        assert not _bias_relu_jit(a.astype(np.float64), b.astype(np.float64), bias.astype(np.float64),
                                  out.astype(np.float64), True)
        assert not _bias_relu_jit(np.ascontiguousarray(a.T).T, b, bias, out, True)
        assert np.isnan(out).all()
        assert _bias_relu_jit(a, b, bias, out, True) == blas.TILE  # this one it takes where it is bound


# --- tile_sparse.py: the tile's path for a left operand with many zeros (AVX-512 or AVX2)

needs_sparse = pytest.mark.skipif(blas.SPARSE_STATUS is not None, reason=f"tile_sparse: {blas.SPARSE_STATUS}")


@needs_tile
def test_sparse_path_passes_its_own_check_where_the_tile_is_bound():
    """blas checks tile_sparse.py's path against the dense loops at import and leaves it off
    where the bits differ, and the tests marked needs_sparse then skip: where the tile is
    bound, the path must have passed."""
    assert blas.SPARSE_STATUS is None


def _bias_tile():
    return blas._BIAS_CTYPES(blas._TILE_ENGINE.get_function_address(blas.tile_gemm.TILE_BIAS))


def _bias_product(m, n, k, a, b, bias, word, pad=np.nan):
    """C (m x n) = a @ b + bias (then ReLU: the relu word, see bias_gemm_type) through
    TILE_BIAS, which must take it; a's and b's rows as far apart as their arrays' (a may be
    wider than k, b than n). C is (m x n + 1, ldc n + 1), its last column `pad` where
    nothing wrote."""
    got = np.full((m, n + 1), pad, np.float32)
    assert _bias_tile()(m, n, k, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], got.ctypes.data, n + 1,
                        bias.ctypes.data, word) == 1
    return got


def _sparse_row_block():
    return blas.tile_gemm.tile_sparse.ROW_BLOCK


def _sparse_cases():
    """(m, n, k, transposed A, transposed B): pairs and an odd row, blocks of ROW_BLOCK rows
    (tile_sparse.py: 256) and a short last one, K in blocks of 128 and a 16-wide tail, one
    panel and several."""
    rows = _sparse_row_block()
    for m in (1, 2, 3, 17, 64, 65, 130, rows + 2):
        for k in (1, 5, 16, 17, 128, 129, 300):
            yield m, 64, k, False, False
    for m, n, k in ((64, 256, 256), (9, 192, 1024), (128, 128, 64), (200, 64, 40), (rows + 72, 128, 40)):
        yield m, n, k, False, False
    for m, n, k in ((64, 256, 256), (9, 64, 129), (3, 128, 17), (70, 64, 7)):
        yield m, n, k, False, True
    for m, n, k in ((256, 256, 64), (67, 64, 33), (1, 64, 16), (300, 128, 128), (130, 64, 5), (40, 64, 512),
                    (600, 64, 384)):
        yield m, n, k, True, False
    for m, n, k in ((9, 64, 40), (40, 128, 17)):  # both transposed (where the tile takes them)
        yield m, n, k, True, True


@needs_sparse
@pytest.mark.parametrize("alike", [False, True])
@pytest.mark.parametrize("fill", [0.0, 0.3, 0.5])
@pytest.mark.parametrize("m,n,k,trans_a,trans_b", list(_sparse_cases()))
def test_sparse_path_gives_the_dense_loops_bits(m, n, k, trans_a, trans_b, fill, alike, one_blas_thread):
    """Bitwise, through the bound symbols: the tile with tile_sparse.py's path on and off,
    op(A) with that fraction of nonzeros (ReLU-like: zeros, positive values; one row all
    zero, one all nonzero), with and without the bias and ReLU; C's padding untouched. The
    zeros drawn for each element (the rows walk their own lists) or, alike, for each k,
    the same in every row of op(A) (the pairs walk their unions)."""
    rng = np.random.default_rng(m * 7919 + n * 31 + k)
    ta, tb = (TRANS if trans_a else NO_TRANS), (TRANS if trans_b else NO_TRANS)
    a, b, op_a, _ = blas._check_operands(rng, m, n, k, ta, tb)
    op_a[:] = np.abs(op_a) * (rng.random((1, k) if alike else op_a.shape) < fill)
    op_a[0] = 0
    op_a[-1] = 1 + np.abs(op_a[-1])
    bias = rng.standard_normal(n).astype(np.float32)
    outs = {}
    for on in (False, True):
        with blas.tile_sparse_as(on):
            outs[on] = [blas._product(_tile(), m, n, k, ta, tb, a, b)]
            if not (trans_a or trans_b) and blas.tile_gemm.takes(m, n, k, bias=True):  # AVX2: K <= 256
                for relu in (0, 1):
                    outs[on].append(_bias_product(m, n, k, a, b, bias, relu))
    for dense, sparse in zip(outs[False], outs[True]):
        np.testing.assert_array_equal(sparse, dense)


@needs_sparse
def test_sparse_path_takes_mostly_zero_products_and_leaves_full_ones(one_blas_thread):
    """Which path ran shows where B has an inf in a row that every row of A multiplies by
    zero: the dense loops make NaN of 0 * inf, the sparse path never reads that row. Lists
    of about a third of K (a pair's union at 0.2 nonzeros) take it; past FILL_MAX (0.95
    nonzeros) the dense loops run; N not a whole number of panels (64 columns, 32 with
    AVX2), or the switch off, likewise."""
    rng = np.random.default_rng(8)
    part = 128 + blas.tile_gemm.tile_sparse.PANEL // 2
    for fill, n, on, sparse in ((0.2, 128, True, True), (0.95, 128, True, False), (0.2, part, True, False),
                                (0.2, 128, False, False)):
        a = (rng.random((64, 100)) < fill).astype(np.float32)
        a[:, 7] = 0
        b = rng.standard_normal((100, n)).astype(np.float32)
        b[7, 3] = np.inf
        with blas.tile_sparse_as(on):
            out = blas._product(_tile(), 64, n, 100, NO_TRANS, NO_TRANS, a, b)[:, :n]
        assert np.isfinite(out[:, 3]).all() == sparse, (fill, n, on)
        assert np.isnan(out[:, 3]).all() == (not sparse), (fill, n, on)


@needs_sparse
@pytest.mark.parametrize("m,n,k", [(64, 256, 256), (128, 64, 40), (2, 64, 17), (65, 128, 130), (300, 64, 33)])
def test_sparse_path_pairing_rows_by_halves_gives_the_dense_loops_bits(m, n, k, one_blas_thread):
    """The relu word's bit 1 (rows i and i + m/2 listed together, where m is even; an odd
    m keeps neighbours): with and without the ReLU, the bits of the dense loops."""
    rng = np.random.default_rng(m + 7 * k)
    a = np.abs(rng.standard_normal((m, k))).astype(np.float32) * (rng.random((m, k)) < 0.4)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    for relu in (0, 1):
        outs = []
        for on, word in ((False, relu), (True, relu | 2)):
            with blas.tile_sparse_as(on):
                outs.append(_bias_product(m, n, k, a, b, bias, word))
        np.testing.assert_array_equal(outs[1], outs[0])


def _inf_in_column_7(rng, alike):
    """(a, b, bias) for m, n, k = 64, 64, 100: B's row 7 holds an inf at column 3, A's column 7
    is zero in the even rows and 1 in the odd; A's other columns at 0.2 nonzeros, each
    column's zeros the same in every row (alike: the product walks the pairs' unions) or
    drawn for each row (their own lists, tile_sparse.py's "Walks")."""
    m, n, k = 64, 64, 100
    zeros = rng.random((1, k) if alike else (m, k)) < 0.8
    a = np.where(zeros, 0, 1 + rng.random((m, k))).astype(np.float32)
    a[0::2, 7], a[1::2, 7] = 0, 1
    b = rng.standard_normal((k, n)).astype(np.float32)
    b[7, 3] = np.inf
    return a, b, np.zeros(n, np.float32)


@needs_sparse
def test_sparse_path_pairs_row_i_with_row_i_plus_half_when_told(one_blas_thread):
    """Which rows were paired shows, where the pairs walk their unions (rows alike), in the
    column of an inf in B's row 7, A's column 7 zero in the even rows: a union lists k = 7
    where either row is nonzero, and then 0 * inf makes the even row's column NaN.
    Neighbours (2p, 2p + 1): every even row NaN; halves (i, i + 32, both even or both
    odd): none."""
    a, b, bias = _inf_in_column_7(np.random.default_rng(11), alike=True)
    m, k = a.shape
    n = b.shape[1]
    for word, even_nan in ((0, True), (2, False)):
        got = np.zeros((m, n), np.float32)
        assert _bias_tile()(m, n, k, a.ctypes.data, k, b.ctypes.data, n, got.ctypes.data, n, bias.ctypes.data,
                            word) == 1
        assert np.isnan(got[0::2, 3]).all() == even_nan and np.isfinite(got[0::2, 3]).all() == (not even_nan)
        assert np.isinf(got[1::2, 3]).all()  # the odd rows multiply the inf by 1


@needs_sparse
def test_sparse_path_walks_rows_own_lists_where_their_zeros_differ(one_blas_thread):
    """Where rows' zeros differ (drawn for each row), each row walks its own nonzeros: an
    even row never multiplies the inf in B's row 7 by its zero there, however it is paired."""
    a, b, bias = _inf_in_column_7(np.random.default_rng(12), alike=False)
    m, k = a.shape
    n = b.shape[1]
    for word in (0, 2):
        got = np.zeros((m, n), np.float32)
        assert _bias_tile()(m, n, k, a.ctypes.data, k, b.ctypes.data, n, got.ctypes.data, n, bias.ctypes.data,
                            word) == 1
        assert np.isfinite(got[0::2, 3]).all() and np.isinf(got[1::2, 3]).all()


@needs_sparse
@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("m,n,k", [(64, 256, 256), (130, 64, 300), (20, 128, 17), (2, 64, 128), (9, 64, 129),
                                   (_sparse_row_block() + 40, 64, 300)])
def test_sparse_path_walks_twin_rows_once_with_the_dense_loops_bits(m, n, k, halves, one_blas_thread):
    """Pairs whose two rows hold the same bits (a double-DQN step's terminal transitions:
    the online net's row of s' holds s) walk as one row, stored to both: the dense loops'
    bits, with and without the ReLU, for twins over all of K, twins in one K block of 128
    and not in the other (either way round), rows equal but for the sign of a zero (not
    twins), twins holding a NaN, and a last row without a partner (odd m)."""
    rng = np.random.default_rng(m * 3 + k + halves)
    a = np.abs(rng.standard_normal((m, k))).astype(np.float32) * (rng.random((m, k)) < 0.4)
    pairs = ([(i, i + m // 2) for i in range(m // 2)] if halves and m % 2 == 0
             else [(2 * i, 2 * i + 1) for i in range(m // 2)])
    for p, (r0, r1) in enumerate(pairs):
        kind = p % 6
        if kind in (0, 1, 2, 3, 4):
            a[r1] = a[r0]
        if kind == 1 and k > 128:
            a[r1, k - 1] += 1  # the same in the first K block only
        if kind == 2:
            a[r1, 0] += 1  # the same but in the first K block
        if kind == 3:
            a[r0, 1], a[r1, 1] = -0.0, 0.0  # the same but for a zero's sign
        if kind == 4:
            a[r0, k // 2] = a[r1, k // 2] = np.nan
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    for relu in (0, 1):
        outs = []
        for on in (False, True):
            with blas.tile_sparse_as(on):
                outs.append(_bias_product(m, n, k, a, b, bias, relu | (2 if halves else 0), pad=np.inf))
        np.testing.assert_array_equal(outs[1], outs[0])
        assert np.isinf(outs[1][:, n]).all()  # C's padding untouched
    # and without the bias: the plain product
    outs = []
    for on in (False, True):
        with blas.tile_sparse_as(on):
            outs.append(blas._product(_tile(), m, n, k, NO_TRANS, NO_TRANS, a, b))
    np.testing.assert_array_equal(outs[1], outs[0])


@needs_sparse
def test_sparse_path_carries_a_nan_in_a_as_the_dense_loops_do(one_blas_thread):
    rng = np.random.default_rng(9)
    a = np.abs(rng.standard_normal((10, 64))).astype(np.float32) * (rng.random((10, 64)) < 0.3)
    a[4, 9] = np.nan
    b = rng.standard_normal((64, 64)).astype(np.float32)
    outs = []
    for on in (False, True):
        with blas.tile_sparse_as(on):
            outs.append(blas._product(_tile(), 10, 64, 64, NO_TRANS, NO_TRANS, a, b))
    np.testing.assert_array_equal(outs[1], outs[0])
    assert np.isnan(outs[1][4, :64]).all() and np.isfinite(np.delete(outs[1][:, :64], 4, axis=0)).all()


def test_sparse_switch_is_a_one_line_cli_error_when_unknown(tmp_path):
    env = dict(os.environ, CUBEDQN_TILE_SPARSE="yes")
    r = subprocess.run([sys.executable, "-m", "cubedqn.cli", "scramble", "--puzzle", "cube2"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["cubedqn: error: CUBEDQN_TILE_SPARSE='yes' is not one of: 0, 1"]


@needs_sparse
@pytest.mark.parametrize("by_rows", [True, False])
def test_team_splits_sparse_products_by_rows_with_the_same_bits(by_rows):
    """While the sparse path is on, the GEMM team splits the products of whole
    panels by rows (each chunk lists only its own rows), with it off by columns; either way
    the bits of one thread's product (forward with bias and ReLU, dW with A transposed, dx
    with B transposed; an odd row count), and the team did split them."""
    from cubedqn.threads import limit_threads
    if blas.team_problem():
        pytest.skip(blas.team_problem())
    team_sgemm = blas._CTYPES_SIG(llb.address_of_symbol(blas.SYMBOL))
    team_bias = blas._BIAS_CTYPES(llb.address_of_symbol(blas.BIAS_SYMBOL))
    rng = np.random.default_rng(10)
    cases = [(NO_TRANS, NO_TRANS, 131, 256, 256), (TRANS, NO_TRANS, 256, 256, 64), (NO_TRANS, TRANS, 64, 256, 256)]
    operands = []
    for ta, tb, m, n, k in cases:
        a, b, _, _ = blas._check_operands(rng, m, n, k, ta, tb)
        a[:] = np.abs(a) * (rng.random(a.shape) < 0.4)
        operands.append((a, b, rng.standard_normal(n).astype(np.float32)))

    def products():
        out = []
        for (ta, tb, m, n, k), (a, b, bias) in zip(cases, operands):
            out.append(blas._product(team_sgemm, m, n, k, ta, tb, a, b))
            if ta == tb == NO_TRANS:
                got = np.full((m, n), np.nan, np.float32)
                assert team_bias(m, n, k, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], got.ctypes.data, n,
                                 bias.ctypes.data, 1) == 1
                out.append(got)
        return out

    with blas.tile_sparse_as(by_rows):
        try:
            limit_threads(1)
            alone = products()
            limit_threads(2)
            assert blas.team_workers() == 1 and blas.tile_sparse_on() == by_rows
            split0 = blas.team_stats()["split"]
            shared = products()
            assert blas.team_stats()["split"] - split0 == len(alone)
        finally:
            limit_threads(1)
    for x, y in zip(shared, alone):
        np.testing.assert_array_equal(x, y)


@pytest.mark.skipif(not (blas.TILE and blas.tile_gemm.AVX512),
                    reason="the AVX2 tile is this CPU's own (or there is no tile): the tests above ran it")
def test_avx2_tile_and_its_sparse_path_pass_these_tests_on_an_avx512_cpu():
    """CUBEDQN_TILE_GEMM=avx2 builds the AVX2 code (the 6 x 16 tile, tile_sparse.py's
    8-lane lists of 32-column panels) where the CPU has AVX-512, as on most laptops' CPUs:
    in a process of its own, profile's BLAS line names it, and this file's tests and the
    team's pass with it (this one skipping itself there)."""
    env = dict(os.environ, CUBEDQN_TILE_GEMM="avx2")
    probe = ("from cubedqn import blas, tile_sparse\nfrom cubedqn.profiling import blas_info, describe_tile\n"
             "print(blas.tile_gemm.LANES, tile_sparse.LANES, tile_sparse.PANEL, blas.SPARSE_STATUS, "
             "describe_tile(blas_info()))")
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["8", "8", "32", "None", "on", "(AVX2)"]
    tests = os.path.dirname(__file__)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                        os.path.join(tests, "test_team.py")], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:]
    assert " passed" in r.stdout.splitlines()[-1]
