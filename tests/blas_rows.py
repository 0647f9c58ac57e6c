"""Does this process's BLAS give each row of a product the same bits whatever the number of
rows in the call (and however its threads split them, and, at K <= 256, whether the tile
GEMM, which takes products only while the library runs on one thread, or the library computed
them)?

OpenBLAS's SkylakeX and Zen kernels did on the hosts this was developed on, so several tests
assert that two code paths which call sgemm on different row blocks (chunked acting, the
target cache, one BLAS thread against two, the panel first layer) give the same bits. The
Haswell kernel that OPENBLAS_CORETYPE=Haswell forces did not on an AMD EPYC host: rows of a
7-row product differed in the last bit from the same rows of a 50-row one. There those tests
compare to float32 rounding instead (`same`), and say so when they fail.
"""
import numpy as np

from cubedqn.profiling import _gemm  # the engine's own sgemm call (numpy's OpenBLAS, from njit)


def _probe() -> bool:
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(0)
    for k, n in ((16, 12), (144, 16), (256, 256), (1024, 512), (64, 256)):
        a = rng.standard_normal((64, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        fulls = []
        for threads in (1, 2):  # one: the tile (tile_gemm.py) where it is bound; two: the library alone
            with threadpool_limits(limits=threads, user_api="blas"):
                full = np.empty((64, n), np.float32)
                _gemm(a, b, full)
                for m in (2, 3, 5, 7, 16, 33):
                    part = np.empty((m, n), np.float32)
                    _gemm(a[:m], b, part)
                    if not np.array_equal(part, full[:m]):
                        return False
            fulls.append(full)
        # past K = 256 the tile sums K as one chain and OpenBLAS in blocks; no test compares the two there
        if k <= 256 and not np.array_equal(fulls[0], fulls[1]):
            return False
    return True


ROWS_EXACT = _probe()


def _columns_probe() -> bool:
    """Does the library behind the tile (blas._LIBRARY_ADDRESS) give a block of a product's
    columns, computed alone, the bits it gives them in the whole product? The GEMM team
    (team.py) splits products by columns: where the library does not, the products the
    tile leaves to it come out of a split equal to float32 rounding, not bit for bit."""
    from cubedqn import blas
    from threadpoolctl import threadpool_limits
    lib = blas._CTYPES_SIG(blas._LIBRARY_ADDRESS)
    rng = np.random.default_rng(1)
    with threadpool_limits(limits=1, user_api="blas"):
        for m, n, k in ((64, 256, 300), (17, 100, 1024)):
            a, b, _, _ = blas._check_operands(rng, m, n, k, blas.NO_TRANS, blas.NO_TRANS)
            whole = blas._product(lib, m, n, k, blas.NO_TRANS, blas.NO_TRANS, a, b)[:, :n]
            for j0 in (32, 64):
                part = np.ascontiguousarray(b[:, j0:n])
                c = np.full((m, n - j0), np.nan, np.float32)
                lib(blas.ROW_MAJOR, blas.NO_TRANS, blas.NO_TRANS, m, n - j0, k, 1.0, a.ctypes.data, a.shape[1],
                    part.ctypes.data, n - j0, 0.0, c.ctypes.data, n - j0)
                if not np.array_equal(c, whole[:, j0:]):
                    return False
    return True


COLUMNS_EXACT = _columns_probe()


def same(actual, desired, rtol=1e-4, atol=1e-6):
    """Bitwise equal where the BLAS is row-exact, else equal to float32 rounding (the paths
    sum in one order per row but the BLAS does not)."""
    if ROWS_EXACT:
        np.testing.assert_array_equal(actual, desired)
    else:
        np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol,
                                   err_msg="(this BLAS is not row-exact: compared to float32 rounding)")
