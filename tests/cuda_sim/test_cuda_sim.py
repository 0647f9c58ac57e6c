"""CUDA kernels vs the CPU kernels: under the numba CUDA simulator (tiny shapes) and, on a
real GPU, at the shapes users train too.

Run by tests/test_cuda.py in a subprocess, with NUMBA_ENABLE_CUDASIM=1 set before numba is
imported, or with CUBEDQN_CUDA_TESTS=gpu where a GPU is present. Tolerances are float32
ones (the simulator computes in numpy float32/float64; the GPU sums in another order, with
fused multiply-adds); the real-GPU comparisons use the relative error of the whole array.
"""
import os

import numpy as np
import pytest
from numba import cuda

from cubedqn.cube import encode_index, get_puzzle
from cubedqn.cuda import nn as K
from cubedqn.cuda.learner import CudaLearner
from cubedqn.encoding import Encoder
from cubedqn.learner import Learner
from cubedqn.nn import dense_backward, dense_forward, loss_taken, sparse_backward, sparse_forward
from cubedqn.replay import Batch

P2 = get_puzzle("cube2")
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
# Simulated threads are Python threads: the users' shapes take minutes there, not ms.
gpu_only = pytest.mark.skipif(SIM, reason="users' shapes run on a real GPU only (too slow in the simulator)")
RNG = np.random.default_rng(0)


def f32(*shape):
    return RNG.normal(0, 1, shape).astype(np.float32)


def dev(a):
    return cuda.to_device(np.ascontiguousarray(a))


def poisoned(shape):
    """A device array full of NaN: every element a kernel should write must be written."""
    return cuda.to_device(np.full(shape, np.nan, np.float32))


def test_gemm_all_transposes():
    """13 x 10 @ 10 x 11: two tiles each way and a partial K slab, in the simulator's tiling too."""
    a, b = f32(13, 10), f32(10, 11)
    for ta in (False, True):
        for tb in (False, True):
            C = poisoned((13, 11))
            K.gemm_launch(dev(a.T) if ta else dev(a), dev(b.T) if tb else dev(b), C, ta, tb)()
            np.testing.assert_allclose(C.copy_to_host(), a @ b, rtol=1e-5, atol=1e-5)


def test_gemm_epilogues():
    a, b, bias = f32(5, 7), f32(7, 6), f32(6)
    C = poisoned((5, 6))
    K.gemm_launch(dev(a), dev(b), C, vec=dev(bias), epilogue=K.EPI_BIAS, relu=True)()
    np.testing.assert_allclose(C.copy_to_host(), np.maximum(a @ b + bias, 0), rtol=1e-5, atol=1e-5)
    mask = np.maximum(f32(5, 6), 0)
    K.gemm_launch(dev(a), dev(b), C, mask=dev(mask), epilogue=K.EPI_MASK)()
    np.testing.assert_allclose(C.copy_to_host(), (a @ b) * (mask > 0), rtol=1e-5, atol=1e-5)
    x, d = f32(10, 9), f32(10, 11)  # dW = x.T @ d, db = column sums of d (the ones row opens a tile)
    C, db = poisoned((9, 11)), poisoned(11)
    K.gemm_launch(dev(x), dev(d), C, trans_a=True, vec=db, epilogue=K.EPI_COLSUM)()
    np.testing.assert_allclose(C.copy_to_host(), x.T @ d, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db.copy_to_host(), d.sum(0), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gemm shapes"):
        K.gemm_launch(dev(a), dev(b), poisoned((5, 5)))


def test_sparse_layer_matches_cpu():
    idx = np.empty((3, 24), np.int32)
    encode_index(RNG.integers(0, 6, (3, 24)).astype(np.uint8), np.arange(24), idx)
    idx[1, 5] = idx[1, 4]  # a repeated row inside one sample: the scatter must add both
    W, b = f32(144, 5), f32(5)
    out = np.empty((3, 5), np.float32)
    sparse_forward(idx, W, b, out, True)
    d_out = poisoned((3, 5))
    K.sparse_forward_launch(dev(idx), dev(W), dev(b), d_out, True)()
    np.testing.assert_allclose(d_out.copy_to_host(), out, rtol=1e-5, atol=1e-5)
    dout = f32(3, 5)
    dW, db = np.empty_like(W), np.empty_like(b)
    sparse_backward(idx, dout, dW, db)
    d_flat = poisoned(144 * 5 + 5)  # dW then db, as in the layout
    for launch in K.sparse_backward_launches(dev(idx), dev(dout), d_flat, d_flat[:720].reshape(144, 5), d_flat[720:]):
        launch()
    np.testing.assert_allclose(d_flat.copy_to_host()[:720].reshape(144, 5), dW, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d_flat.copy_to_host()[720:], db, rtol=1e-5, atol=1e-5)


def test_dense_layer_matches_cpu():
    x, W, b = np.maximum(f32(4, 6), 0), f32(6, 3), f32(3)
    out = np.empty((4, 3), np.float32)
    dense_forward(x, W, b, out, True, False)
    d_out = poisoned((4, 3))
    K.dense_forward_launch(dev(x), dev(W), dev(b), d_out, True)()
    np.testing.assert_allclose(d_out.copy_to_host(), out, rtol=1e-5, atol=1e-5)
    dout = f32(4, 3)
    dW, db, dx = np.empty_like(W), np.empty_like(b), np.empty_like(x)
    dense_backward(x, dout, W, dW, db, dx, True)
    g = [poisoned(a.shape) for a in (dW, db, dx)]
    for launch in K.dense_backward_launches(dev(x), dev(dout), dev(W), g[0], g[1], g[2]):
        launch()
    for d, host in zip(g, (dW, db, dx)):
        np.testing.assert_allclose(d.copy_to_host(), host, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, double", [(0, True), (1, False)])
def test_sampled_loss_matches_cpu(kind, double):
    from cubedqn import reference as ref
    n = 11  # more rows than the simulator's loss block: the row loop and the block sum both run
    q, q_on, q_t = f32(n, 3) * 2, f32(n, 3), f32(n, 3)
    a = RNG.integers(0, 3, n)
    f = np.stack([np.abs(f32(n)), f32(n), (RNG.random(n) < 0.3).astype(np.float32),
                  np.full(n, 0.9, np.float32)])
    y = np.empty(n, np.float32)
    y[:] = ref.double_dqn_targets(f[1], f[2], f[3], q_on, q_t) if double else ref.dqn_targets(f[1], f[2], f[3], q_t)
    dq, td = np.empty_like(q), np.empty(n, np.float32)
    loss = loss_taken(q, a, y, f[0], 0.25, kind, dq, td, n)
    d_dq, out = poisoned((n, 3)), poisoned(2 + n)
    K.sampled_loss_launch(dev(q), dev(q_on), dev(q_t), dev(a.astype(np.int32)), dev(f), double, kind, 0.25, d_dq,
                          out)()
    h = out.copy_to_host()
    assert h[0] == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(h[2:], td, rtol=1e-5, atol=1e-6)
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


@pytest.mark.parametrize("targets, opt, lazy, tau, per", [
    ("double", "momentum", False, 1.0, False), ("all-actions", "adam", False, 1.0, True),
    ("dqn", "sgd", False, 0.5, False), ("all-actions", "adamw", True, 1.0, False),
    ("double", "nesterov", True, 0.5, True)])
def test_three_training_steps_equal_cpu(targets, opt, lazy, tau, per):
    """Batch 9: more rows than the simulator's loss block, so its row loop runs twice."""
    from cubedqn.nn import Layout
    layout = Layout(144, 24, (8,), 12)
    moves = np.ascontiguousarray(P2.moves[:12])
    kw = dict(targets=targets, optimizer=opt, lr=0.05, max_grad_norm=0.5, seed=3, target_update_interval=2,
              sparse_update=lazy, tau=tau, weight_decay=0.01 if opt in ("sgd", "adamw") else 0.0)
    n = 9
    cpu = Learner(layout, moves, n, Encoder(P2, 12), **kw)
    gpu = CudaLearner(layout, moves, n, Encoder(P2, 12), **kw)
    # the host's backward takes the head's gradient from the taken actions (sampled
    # targets); the device runs its GEMMs, which the profile's FLOPs then count
    assert len(cpu.head_taken) == (0 if targets == "all-actions" else n) and len(gpu.head_taken) == 0
    for k in range(3):
        b = batch(n, k)
        b.weights[:] = np.random.default_rng(k).uniform(0.2, 1.0, n)
        lc = cpu.train_step(b, use_weights=per)
        lg = gpu.train_step(b, use_weights=per)
        assert lg == pytest.approx(lc, rel=1e-4, abs=1e-6)
        np.testing.assert_allclose(gpu.td[:n], cpu.td[:n], rtol=1e-4, atol=1e-5)
        assert gpu.opt.last_norm == pytest.approx(cpu.opt.last_norm, rel=1e-4)
        assert gpu.last_mean_q == pytest.approx(cpu.last_mean_q, rel=1e-4, abs=1e-6) and cpu.last_mean_q != 0
    gpu.sync_host()
    np.testing.assert_allclose(gpu.online.params, cpu.online.params, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gpu.arrays()["target_params"], cpu.target.params, rtol=1e-4, atol=1e-5)
    assert cpu.opt.t == gpu.opt.t == 3
    np.testing.assert_allclose(gpu.opt.m, cpu.opt.m, rtol=1e-4, atol=1e-6)  # untouched rows: still zero if lazy
    if lazy:
        assert (cpu.opt.m[:144 * 8] == 0).any() and (cpu.opt.m[:144 * 8] != 0).any()
    check_device_acting(gpu, batch(n, 7).states)


def test_child_cache_stages_the_same_step():
    """The CUDA step's host encoding with the child cache (children's codes by the parent's
    position, children.py) stages the same inputs and solved flags as framing every child,
    so the two device steps are equal; valid positions, a few moves deep, so that parents
    and solved children repeat, and a 2-set table, so that entries are evicted."""
    from cubedqn.children import ChildCodes
    from cubedqn.cube import scramble_into
    from cubedqn.nn import Layout
    from cubedqn.rng import make_rng
    enc = Encoder(P2, 12, inputs="pairs", symmetry=48)
    layout = Layout(enc.in_dim, enc.n_active, (8,), 12)
    moves = np.ascontiguousarray(P2.moves[:12])
    kw = dict(targets="all-actions", optimizer="adam", lr=0.05, seed=3, target_update_interval=2)
    on, off = (CudaLearner(layout, moves, 9, enc, child_cache=c, **kw) for c in (True, False))
    assert on.child_codes is not None and off.child_codes is None
    on.child_codes = ChildCodes(enc, moves, 9, sets=2)
    rng = make_rng(4)
    for k in range(3):
        b = batch(9, k)
        st = np.repeat(P2.solved[None], 9, axis=0)
        scramble_into(st, np.arange(9) % 4, moves, 12, rng, True, np.empty((9, 0), np.int8))
        b.states[:] = st
        assert on.train_step(b) == off.train_step(b)
        np.testing.assert_array_equal(on.st.h["idx"], off.st.h["idx"])
        np.testing.assert_array_equal(on.st.h["solved"], off.st.h["solved"])
        assert off.st.h["solved"].any()
    on.sync_host(), off.sync_host()
    np.testing.assert_array_equal(on.online.params, off.online.params)
    assert 0 < on.child_codes.hits < on.child_codes.lookups


def check_device_acting(gpu, states):
    """Acting on the device (CudaLearner.device_q) = the host network with the synced
    parameters, frames included; a second call (a graph replay on a GPU) = the first."""
    states = np.ascontiguousarray(states)
    n = len(states)
    rot = np.full(n, -1, np.int64)  # an encoder without frames leaves it as it is
    q_dev = gpu.device_q(states, gpu.encoder, rot).copy()
    gpu.sync_host()
    ws, rot_host = gpu.online.workspace(n), np.full(n, -1, np.int64)
    gpu.encoder.encode(states, ws, 0, rot_host, want_codes=False)
    np.testing.assert_array_equal(rot, rot_host)
    np.testing.assert_allclose(q_dev, gpu.online.forward_ws(ws, n), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(gpu.device_q(states, gpu.encoder, rot), q_dev)


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
    assert d["act_scored_fraction"] == 1.0  # the device actor scores every state (one graph per size)
    assert d["cuda_launch"].startswith("graphs" if not SIM else "direct")
    from cubedqn.profiling import format_report
    text = format_report(d)  # no ratio of the GPU's rate to the host's sgemm peak
    assert "CUDA step: " in text and "peak sgemm" not in text


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@gpu_only
@pytest.mark.parametrize("m, k, n", [(70, 53, 45), (64, 256, 256), (512, 1024, 512), (1, 17, 33)])
def test_gemm_many_tiles(m, k, n):
    """Edges of several tiles in every dimension (TILE is 16 on a GPU; the tiny shapes above fit in one)."""
    a, b = f32(m, k), f32(k, n)
    ref = a.astype(np.float64) @ b
    for ta in (False, True):
        for tb in (False, True):
            A = np.ascontiguousarray(a.T) if ta else a
            B = np.ascontiguousarray(b.T) if tb else b
            C = poisoned((m, n))
            K.gemm_launch(cuda.to_device(A), cuda.to_device(B), C, ta, tb)()
            assert rel_err(C.copy_to_host(), ref) < 1e-6


def states_batch(puzzle, n, seed):
    """Scrambled positions and their real successors (plain numpy moves: new[j] = old[perm[j]])."""
    from cubedqn.cube import solved_states
    rng = np.random.default_rng(seed)
    rows = np.arange(n)[:, None]
    s = solved_states(puzzle, n)
    for _ in range(12):
        s = s[rows, puzzle.moves[rng.integers(0, 12, n)]]
    b = Batch(n, puzzle.n_stickers, np.float32)
    b.states[:] = s
    b.actions[:] = rng.integers(0, 12, n)
    b.next_states[:] = s[rows, puzzle.moves[b.actions]]
    b.rewards[:] = -1
    b.dones[:] = rng.random(n) < 0.1
    b.discounts[:] = 0.99
    return b


@gpu_only
@pytest.mark.parametrize("puzzle, hidden, bsz, targets, opt, lazy", [
    ("cube2", (256, 256), 64, "double", "momentum", False),
    ("cube2", (256, 256), 64, "all-actions", "adam", True),
    ("cube2", (256, 256), 64, "dqn", "nesterov", False),
    ("cube3", (1024, 512), 256, "double", "momentum", False),
    ("cube3", (1024, 512), 256, "all-actions", "adamw", False)])
def test_training_steps_equal_cpu_at_users_shapes(puzzle, hidden, bsz, targets, opt, lazy):
    """Five steps at the benchmark shapes (144-256-256-12 B=64, 324-1024-512-12 B=256):
    the GPU's parameters, optimizer moments and losses follow the CPU path's."""
    from cubedqn.nn import Layout
    p = get_puzzle(puzzle)
    layout = Layout(p.n_stickers * 6, p.n_stickers, hidden, 12)
    moves = np.ascontiguousarray(p.moves[:12])
    kw = dict(targets=targets, optimizer=opt, lr=1e-3, max_grad_norm=1.0, seed=5, target_update_interval=3,
              sparse_update=lazy, weight_decay=1e-4 if opt == "adamw" else 0.0)
    canonical = puzzle == "cube2"  # the 2x2x2 presets' frame; the 3x3x3 has none
    cpu = Learner(layout, moves, bsz, Encoder(p, 12, canonical=canonical), **kw)
    gpu = CudaLearner(layout, moves, bsz, Encoder(p, 12, canonical=canonical), **kw)
    start = cpu.online.params.copy()
    for k in range(5):
        b = states_batch(p, bsz, k)
        lc = cpu.train_step(b)
        lg = gpu.train_step(b)
        assert lg == pytest.approx(lc, rel=1e-3)
        np.testing.assert_allclose(gpu.td[:bsz], cpu.td[:bsz], rtol=1e-3, atol=1e-4)
    gpu.sync_host()
    moved = cpu.online.params - start
    assert np.linalg.norm(moved) > 0
    # the update, not just the parameters (which barely move in five steps), must agree
    assert rel_err(gpu.online.params - start, moved) < 1e-3
    gpu.d_opt.to_host()
    assert rel_err(gpu.opt.m, cpu.opt.m) < 1e-3
    assert gpu.opt.last_norm == pytest.approx(cpu.opt.last_norm, rel=1e-3)
    assert gpu.launch_mode == "graphs"  # steps 2-5 replayed the captured graphs
    check_device_acting(gpu, states_batch(p, bsz, 9).states)
    assert gpu.actors[bsz].plan.mode == "graphs"
