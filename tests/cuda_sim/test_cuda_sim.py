"""CUDA kernels vs the CPU kernels, under the numba CUDA simulator (tiny shapes).

Run by tests/test_cuda.py in a subprocess with NUMBA_ENABLE_CUDASIM=1 set before numba is
imported. Tolerances are float32 ones: the simulator computes in numpy float32/float64.
"""
import numpy as np
import pytest
from numba import cuda

from cubedqn.config import Config
from cubedqn.cube import encode_index, get_puzzle
from cubedqn.cuda import nn as K
from cubedqn.cuda.learner import CudaLearner
from cubedqn.encoding import Encoder
from cubedqn.learner import Learner
from cubedqn.nn import dense_backward, dense_forward, loss_full, loss_taken, sparse_backward, sparse_forward
from cubedqn.replay import Batch

P2 = get_puzzle("cube2")
RNG = np.random.default_rng(0)


def f32(*shape):
    return RNG.normal(0, 1, shape).astype(np.float32)


def test_gemm_all_transposes():
    a, b = f32(5, 7), f32(7, 6)
    for ta in (False, True):
        for tb in (False, True):
            A = np.ascontiguousarray(a.T) if ta else a
            B = np.ascontiguousarray(b.T) if tb else b
            C = cuda.device_array((5, 6), np.float32)
            K.gemm(cuda.to_device(A), cuda.to_device(B), C, ta, tb)
            np.testing.assert_allclose(C.copy_to_host(), a @ b, rtol=1e-5, atol=1e-5)


def test_sparse_layer_matches_cpu():
    idx = np.empty((3, 24), np.int32)
    encode_index(RNG.integers(0, 6, (3, 24)).astype(np.uint8), idx)
    W, b = f32(144, 5), f32(5)
    out = np.empty((3, 5), np.float32)
    sparse_forward(idx, W, b, out, True)
    d_out = cuda.device_array((3, 5), np.float32)
    K.sparse_forward(cuda.to_device(idx), cuda.to_device(W), cuda.to_device(b), d_out, True, 3)
    np.testing.assert_allclose(d_out.copy_to_host(), out, rtol=1e-5, atol=1e-5)
    dout = f32(3, 5)
    dW, db = np.empty_like(W), np.empty_like(b)
    sparse_backward(idx, dout, dW, db)
    d_flat = cuda.device_array(144 * 5, np.float32)
    d_db = cuda.device_array(5, np.float32)
    K.sparse_backward(cuda.to_device(idx), cuda.to_device(dout), d_flat, d_flat.reshape(144, 5), d_db, 3)
    np.testing.assert_allclose(d_flat.copy_to_host().reshape(144, 5), dW, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_db.copy_to_host(), db, rtol=1e-5, atol=1e-5)


def test_dense_layer_matches_cpu():
    x, W, b = np.maximum(f32(4, 6), 0), f32(6, 3), f32(3)
    out = np.empty((4, 3), np.float32)
    dense_forward(x, W, b, out, True)
    d_out = cuda.device_array((4, 3), np.float32)
    K.dense_forward(cuda.to_device(x), cuda.to_device(W), cuda.to_device(b), d_out, True, 4)
    np.testing.assert_allclose(d_out.copy_to_host(), out, rtol=1e-5, atol=1e-5)
    dout = f32(4, 3)
    dW, db, dx = np.empty_like(W), np.empty_like(b), np.empty_like(x)
    dense_backward(x, dout, W, dW, db, dx, True)
    g = [cuda.device_array(a.shape, np.float32) for a in (dW, db, dx)]
    K.dense_backward(cuda.to_device(x), cuda.to_device(dout), cuda.to_device(W), g[0], g[1], g[2], 4)
    for dev, host in zip(g, (dW, db, dx)):
        np.testing.assert_allclose(dev.copy_to_host(), host, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [0, 1])
def test_losses_match_cpu(kind):
    q, y, w = f32(4, 3) * 2, f32(4), np.abs(f32(4))
    a = np.array([0, 2, 1, 2])
    dq, td = np.empty_like(q), np.empty(4, np.float32)
    loss = loss_taken(q, a, y, w, 0.25, kind, dq, td, 4)
    d_dq, d_td, d_loss = (cuda.device_array(s, np.float32) for s in ((4, 3), 4, 1))
    K.loss_taken(cuda.to_device(q), cuda.to_device(a), cuda.to_device(y), cuda.to_device(w), np.float32(0.25),
                 kind, d_dq, d_td, d_loss, 4)
    assert d_loss.copy_to_host()[0] == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(d_dq.copy_to_host(), dq, rtol=1e-5, atol=1e-6)
    Y = f32(4, 3)
    loss = loss_full(q, Y, w, 0.25, kind, dq, td, 4)
    K.loss_full(cuda.to_device(q), cuda.to_device(Y), cuda.to_device(w), np.float32(0.25), kind, d_dq, d_td,
                d_loss, 4)
    assert d_loss.copy_to_host()[0] == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(d_dq.copy_to_host(), dq, rtol=1e-5, atol=1e-6)


def batch(n, seed):
    rng = np.random.default_rng(seed)
    b = Batch(n, 24, np.float32)
    b.states[:] = rng.integers(0, 6, (n, 24))
    b.next_states[:] = rng.integers(0, 6, (n, 24))
    b.actions[:] = rng.integers(0, 12, n)
    b.rewards[:] = -1
    b.dones[:] = rng.integers(0, 2, n)
    b.discounts[:] = 0.99
    return b


@pytest.mark.parametrize("targets, opt, lazy", [("double", "momentum", False), ("all-actions", "adam", False),
                                               ("dqn", "sgd", False), ("all-actions", "adam", True),
                                               ("double", "momentum", True)])
def test_three_training_steps_equal_cpu(targets, opt, lazy):
    from cubedqn.nn import Layout
    layout = Layout(144, 24, (8,), 12)
    moves = np.ascontiguousarray(P2.moves[:12])
    kw = dict(targets=targets, optimizer=opt, lr=0.05, max_grad_norm=0.5, seed=3, target_update_interval=2,
              sparse_update=lazy)
    cpu = Learner(layout, moves, 4, Encoder(P2, 12), **kw)
    gpu = CudaLearner(layout, moves, 4, Encoder(P2, 12), **kw)
    for k in range(3):
        b = batch(4, k)
        lc = cpu.train_step(b)
        lg = gpu.train_step(b)
        assert lg == pytest.approx(lc, rel=1e-4, abs=1e-6)
        assert gpu.last_mean_q == pytest.approx(cpu.last_mean_q, rel=1e-4, abs=1e-6) and cpu.last_mean_q != 0
    gpu.sync_host()
    np.testing.assert_allclose(gpu.online.params, cpu.online.params, rtol=1e-4, atol=1e-5)
    assert cpu.opt.t == gpu.opt.t == 3
    gpu.d_opt.to_host()
    np.testing.assert_allclose(gpu.opt.m, cpu.opt.m, rtol=1e-4, atol=1e-6)  # untouched rows: still zero if lazy
    if lazy:
        assert (cpu.opt.m[:144 * 8] == 0).any() and (cpu.opt.m[:144 * 8] != 0).any()


def test_profile_device_cuda_runs_under_the_simulator():
    from click.testing import CliRunner
    from cubedqn.cli import main
    import json
    r = CliRunner().invoke(main, ["profile", "--profile", "cube2-quick", "--no-sparse-update", "--input-encoding", "cubies", "--hidden", "8",
                                  "--batch-size", "4", "--targets", "double", "--steps", "2", "--warmup", "1",
                                  "--device", "cuda", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["device"] == "cuda" and d["train_step_ms"] > 0
