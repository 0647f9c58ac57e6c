"""The bfloat16 matmul precision (tile_bf16.py through blas.set_matmul_precision): the kernel
against its numpy definition bit for bit, the switch, and the config / CLI around it."""
import json

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from cubedqn import blas
from cubedqn.blas import NO_TRANS, ROW_MAJOR, TRANS
from cubedqn.config import Config, ConfigError, validate
from cubedqn.reference import bf16_round, gemm_bf16

needs_bf16 = pytest.mark.skipif(bool(blas.bf16_problem()), reason=f"bfloat16 matmuls: {blas.bf16_problem()}")


@njit(cache=True)
def _gemm_jit(a, b, out):
    blas.gemm(a, b, out)


@njit(cache=True)
def _bias_relu_jit(a, b, bias, out, relu):
    return blas.gemm_bias_relu(a, b, bias, out, relu)


def _operands(rng, m, n, k, ta, tb, pad=3):
    """A and B as the CBLAS call sees them (leading dimensions `pad` wider), and op(A), op(B)."""
    a = rng.standard_normal((m, k + pad) if ta == NO_TRANS else (k, m + pad)).astype(np.float32)
    b = rng.standard_normal((k, n + pad) if tb == NO_TRANS else (n, k + pad)).astype(np.float32)
    op_a = a[:, :k] if ta == NO_TRANS else a[:, :m].T
    op_b = b[:, :n] if tb == NO_TRANS else b[:, :k].T
    return a, b, op_a, op_b


def _tile_call(ta, tb, m, n, k, a, b, rows=None):
    """C = op(A) @ op(B) by the engine's sgemm symbol (tile_gemm's TILE), C with ldc n + 1."""
    rows = m if rows is None else rows
    fn = blas._CTYPES_SIG(blas._TILE_ENGINE.get_function_address(blas.tile_gemm.TILE))
    c = np.full((rows, n + 1), np.nan, np.float32)
    fn(ROW_MAJOR, ta, tb, rows, n, k, 1.0, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], 0.0,
       c.ctypes.data, n + 1)
    return c[:, :n]


def test_bf16_round_is_nearest_even():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 2 ** -7, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -2.5], np.float32)
    want = np.array([1.0, 1.0, 1 + 2 ** -7, 1 + 2 ** -6, 1 + 2 ** -7, -2.5], np.float32)
    np.testing.assert_array_equal(bf16_round(x), want)  # ties to even: 1 + 2^-8 down, 1 + 3 * 2^-8 up
    y = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 1e3
    r = bf16_round(y)
    assert np.all(r.view(np.uint32) & 0xFFFF == 0)  # 8 significand bits left
    assert np.all(np.abs(r - y) <= np.abs(y) * 2.0 ** -8)  # half a bf16 ulp at most


def test_gemm_bf16_reference_is_the_float64_product_of_rounded_operands_within_rounding():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 33)).astype(np.float32), rng.standard_normal((33, 7)).astype(np.float32)
    exact = bf16_round(a).astype(np.float64) @ bf16_round(b).astype(np.float64)
    bound = 33 * np.finfo(np.float32).eps * (np.abs(bf16_round(a)) @ np.abs(bf16_round(b)))
    assert np.all(np.abs(gemm_bf16(a, b) - exact) <= bound)
    assert np.abs(gemm_bf16(a, b) - a.astype(np.float64) @ b).max() > 1e-4  # the rounding is real


def _cases():
    """A and B as is and transposed; 8-row blocks, a one-vector tail's 16-row blocks and
    leftover rows; full panels and tail columns of one and two vectors; K odd, in one block
    and several; more than 256 rows of C (calls per 256 rows)."""
    for ta in (NO_TRANS, TRANS):
        for tb in (NO_TRANS, TRANS):
            for m, n, k in ((1, 1, 1), (7, 12, 5), (9, 16, 64), (17, 33, 255), (33, 57, 256), (16, 64, 257),
                            (64, 256, 256), (8, 40, 600), (300, 20, 33), (260, 48, 513)):
                yield m, n, k, ta, tb


@needs_bf16
@pytest.mark.parametrize("m,n,k,ta,tb", list(_cases()))
def test_bf16_tile_equals_its_definition_bitwise(m, n, k, ta, tb):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a, b, op_a, op_b = _operands(rng, m, n, k, ta, tb)
    with blas.matmul_precision_as("bfloat16"):
        got = _tile_call(ta, tb, m, n, k, a, b)
        first = _tile_call(ta, tb, m, n, k, a, b, rows=1)
    np.testing.assert_array_equal(got, gemm_bf16(op_a, op_b))
    np.testing.assert_array_equal(first, got[:1])  # a row does not depend on the rows beside it


@needs_bf16
@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 70), k=st.integers(1, 600), ta=st.sampled_from([NO_TRANS, TRANS]),
       tb=st.sampled_from([NO_TRANS, TRANS]), seed=st.integers(0, 2 ** 16))
def test_bf16_tile_equals_its_definition_on_any_shape(m, n, k, ta, tb, seed):
    a, b, op_a, op_b = _operands(np.random.default_rng(seed), m, n, k, ta, tb, pad=seed % 5)
    with blas.matmul_precision_as("bfloat16"):
        got = _tile_call(ta, tb, m, n, k, a, b)
    np.testing.assert_array_equal(got, gemm_bf16(op_a, op_b))


@needs_bf16
@pytest.mark.parametrize("m,k,n", [(64, 256, 256), (9, 300, 44), (1, 5, 12), (17, 1024, 33)])
@pytest.mark.parametrize("relu", [False, True])
def test_bf16_in_njit_kernels_and_the_bias_epilogue(m, k, n, relu):
    """What nn.dense_forward and dense_backward call (blas.gemm, blas.gemm_bias_relu inside
    njit) goes to the bf16 kernel while the precision is bfloat16, and back after."""
    rng = np.random.default_rng(m + k + n)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    before = np.empty((m, n), np.float32)
    _gemm_jit(a, b, before)
    out, fused = np.empty((m, n), np.float32), np.full((m, n), np.nan, np.float32)
    with blas.matmul_precision_as("bfloat16"):
        assert blas.matmul_precision() == "bfloat16"
        _gemm_jit(a, b, out)
        assert _bias_relu_jit(a, b, bias, fused, relu)
    want = gemm_bf16(a, b)
    np.testing.assert_array_equal(out, want)
    with_bias = want + bias
    np.testing.assert_array_equal(fused, np.maximum(with_bias, np.float32(0)) if relu else with_bias)
    after = np.empty((m, n), np.float32)
    _gemm_jit(a, b, after)
    assert blas.matmul_precision() == "float32"
    np.testing.assert_array_equal(after, before)  # float32 again, bit for bit
    assert np.abs(after - a.astype(np.float64) @ b).max() < 1e-3


@needs_bf16
@pytest.mark.parametrize("m,n,k,ta,tb", [(512, 512, 1024, NO_TRANS, NO_TRANS), (100, 1000, 700, NO_TRANS, NO_TRANS),
                                         (77, 1999, 513, TRANS, NO_TRANS), (1024, 512, 256, TRANS, NO_TRANS),
                                         (259, 1024, 512, NO_TRANS, TRANS), (9, 8192, 1024, NO_TRANS, NO_TRANS)])
def test_bf16_split_over_the_library_threads_changes_no_bit(m, n, k, ta, tb):
    """Products of SPLIT_MACS or more multiply-adds run on shares of C's rows, one thread
    each of the library's (tile_gemm._emit_bf16_split): the same bits with 1, 2 or 3
    threads, and the definition's; the bias epilogue likewise."""
    from cubedqn.threads import limit_threads
    assert m * n * k >= blas.tile_gemm.SPLIT_MACS
    rng = np.random.default_rng(m + n + k)
    a, b, op_a, op_b = _operands(rng, m, n, k, ta, tb)
    want = gemm_bf16(op_a, op_b)
    bias = rng.standard_normal(n).astype(np.float32)
    x, w = np.ascontiguousarray(op_a), np.ascontiguousarray(op_b)
    try:
        for threads in (1, 2, 3):
            limit_threads(threads)
            with blas.matmul_precision_as("bfloat16"):
                np.testing.assert_array_equal(_tile_call(ta, tb, m, n, k, a, b), want)
                fused = np.full((m, n), np.nan, np.float32)
                assert _bias_relu_jit(x, w, bias, fused, True)
            np.testing.assert_array_equal(fused, np.maximum(want + bias, np.float32(0)))
    finally:
        limit_threads(1)

def test_unknown_precision_and_unavailable_bf16_are_one_line_errors(monkeypatch):
    with pytest.raises(ValueError, match="matmul_precision must be one of: float32, bfloat16, got 'fp16'"):
        blas.set_matmul_precision("fp16")
    with pytest.raises(ConfigError, match="^matmul_precision must be one of: float32, bfloat16, got 'half'$"):
        validate(Config(matmul_precision="half"))
    with pytest.raises(ConfigError, match="needs precision = float32"):
        validate(Config(matmul_precision="bfloat16", precision="float64"))
    with pytest.raises(ConfigError, match="^matmul_precision = bfloat16 is for the CPU"):
        validate(Config(matmul_precision="bfloat16", device="cuda"))
    from cubedqn.cli import UserError, make_trainer  # --device auto that resolved to a GPU: the same words
    with pytest.raises(UserError, match="^matmul_precision = bfloat16 is for the CPU"):
        make_trainer(Config(matmul_precision="bfloat16", device="auto"), "cuda")
    monkeypatch.setattr(blas, "_bf16", (None, "needs a CPU with AVX512_BF16 (this one has none)"))
    with pytest.raises(ValueError, match="^matmul_precision = bfloat16 needs a CPU with AVX512_BF16"):
        blas.set_matmul_precision("bfloat16")
    assert blas.matmul_precision() == "float32"
    r = CliRunner().invoke(__import__("cubedqn.cli", fromlist=["main"]).main,
                           ["train", "--puzzle", "cube2", "--steps", "1", "--matmul-precision", "bfloat16"])
    assert r.exit_code == 2
    assert r.output.strip() == ("cubedqn: error: matmul_precision = bfloat16 needs a CPU with AVX512_BF16 "
                                "(this one has none)")


@needs_bf16
def test_training_in_bfloat16_runs_and_restores_float32(tmp_path):
    from cubedqn.dqn import Trainer
    cfg = validate(Config(puzzle="cube2", hidden=(32, 32), n_envs=8, batch_size=16, learning_starts=32,
                          buffer_size=500, steps=30, log_interval=10, eval_interval=10, curriculum_eval_n=8,
                          matmul_precision="bfloat16", optimizer="momentum"))
    t = Trainer(cfg).run(run_dir=tmp_path)
    assert t.grad_steps == 30 and blas.matmul_precision() == "float32"
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(np.isfinite(r["loss"]) for r in rows)


@needs_bf16
def test_profile_reports_the_precision_and_the_bf16_ceiling():
    from cubedqn.cli import main
    r = CliRunner().invoke(main, ["profile", "--puzzle", "cube2", "--hidden", "64,64", "--batch-size", "16",
                                  "--steps", "20", "--warmup", "5", "--matmul-precision", "bfloat16", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["matmul_precision"] == "bfloat16" and rep["bf16_ceiling_gflops"] > rep["fma_ceiling_gflops"]
    plain = json.loads(CliRunner().invoke(main, ["profile", "--puzzle", "cube2", "--hidden", "64,64",
                                                 "--batch-size", "16", "--steps", "20", "--warmup", "5",
                                                 "--json"]).output)
    assert plain["matmul_precision"] == "float32" and plain["bf16_ceiling_gflops"] is None
    assert plain["bf16_available"] is True
    from cubedqn.profiling import format_report
    assert "--matmul-precision bfloat16" in format_report(plain)
    assert "--matmul-precision bfloat16 runs" not in format_report(rep)


def test_eval_matmul_precision_bad_value_is_a_one_line_error(tmp_path):
    from cubedqn.cli import main
    r = CliRunner().invoke(main, ["eval", "--checkpoint", str(tmp_path), "--matmul-precision", "fp8"])
    assert r.exit_code == 2
    assert r.output.strip() == ("cubedqn: error: --matmul-precision: matmul_precision must be one of: float32, "
                                "bfloat16, got 'fp8'")


@needs_bf16
def test_eval_in_bfloat16_reports_it_and_leaves_float32_after(tmp_path):
    from cubedqn.cli import main
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["train", "--puzzle", "cube2", "--hidden", "32,32", "--n-envs", "8", "--batch-size",
                                  "8", "--learning-starts", "16", "--buffer-size", "500", "--steps", "10",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = {}
    for prec in ("float32", "bfloat16"):
        r = CliRunner().invoke(main, ["eval", "--checkpoint", str(out), "--depths", "1-2", "--n", "20",
                                      "--search", "beam", "--beam-width", "4", "--matmul-precision", prec, "--json"])
        assert r.exit_code == 0, r.output
        res[prec] = json.loads(r.output)
        assert res[prec]["matmul_precision"] == prec and blas.matmul_precision() == "float32"
    assert res["bfloat16"]["n"] == res["float32"]["n"] == 40


def test_the_tile_and_bf16_are_bound_wherever_the_cpu_has_them():
    """A kernel module that stopped compiling falls back quietly (and its tests skip):
    this one says so where the CPU could have run it."""
    from cubedqn.native import host_has_avx512
    from cubedqn.tile_bf16 import host_has_bf16
    if host_has_avx512() and blas.TILE_WANTED:
        assert blas.TILE, blas.TILE_STATUS
        if host_has_bf16() and blas.tile_gemm.AVX512:
            assert blas.bf16_problem() is None
        elif host_has_bf16():  # CUBEDQN_TILE_GEMM=avx2: the AVX2 tile holds no bf16 kernel
            assert blas.bf16_problem().startswith("needs the AVX-512 tile")
    elif not blas.TILE:
        assert blas.bf16_problem().startswith("needs the tile GEMM")
