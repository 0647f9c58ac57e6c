"""Engine correctness: gradients vs central finite differences (float64), sparse == dense,
Numba kernels == plain-numpy reference, fused optimizers == reference over 10 steps."""
import os
import subprocess
import sys

import numpy as np
import pytest

from cubedqn import reference as ref
from cubedqn import sums
from cubedqn.cube import encode_index, encode_onehot
from cubedqn.nn import ALIGN, LOSSES, MLP, NO_GROUPS, NO_TAKEN, Layout, aligned_zeros, loss_full, loss_taken, views
from cubedqn.optim import Optimizer, clip_factor, sq_norm, update_rows, update_slice
from blas_rows import same

S = 8  # a tiny "puzzle": 8 stickers, 6 colours


def make(hidden=(7, 5), actions=4, dueling=False, sparse=True, seed=0):
    layout = Layout(in_dim=S * 6, n_active=S, hidden=hidden, n_actions=actions, dueling=dueling)
    net = MLP(layout, seed=seed, dtype=np.float64, sparse=sparse)
    net.params += np.random.default_rng(seed + 1).normal(0, 0.05, net.params.shape)  # nonzero biases
    return net


def batch(n=6, seed=3):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 6, size=(n, S)).astype(np.uint8)


def fill_input(net, ws, states):
    if net.sparse:
        encode_index(states, np.arange(states.shape[1]), ws.idx[:len(states)])
    else:
        encode_onehot(states, ws.x[:len(states)])


def engine_loss_and_grad(net, states, kind, targets, actions=None, weights=None):
    from cubedqn.nn import dueling_backward, mlp_backward_first, mlp_backward_upper
    n = len(states)
    ws = net.workspace(n)
    fill_input(net, ws, states)
    q = net.forward_ws(ws, n)
    w = np.ones(n) if weights is None else weights
    td = np.zeros(n)
    if actions is not None:
        loss = loss_taken(q, actions, targets, w, 1.0 / n, LOSSES[kind], ws.dq, td, n)
    else:
        loss = loss_full(q, targets, w, 1.0 / n, LOSSES[kind], ws.dq, td, n)
    if net.layout.dueling:
        dueling_backward(ws.dq[:n], ws.deltas[-1][:n])
    grad = np.zeros_like(net.params)
    gW, gb = views(grad, net.layout)
    # the head's backward from the taken actions where dq is zero elsewhere (as the learner)
    taken = actions if actions is not None and not net.layout.dueling else NO_TAKEN
    mlp_backward_upper(net.Ws, ws.acts, ws.deltas, gW, gb, n, taken, ws.head_t)
    mlp_backward_first(ws.idx, ws.x, net.sparse, net.Ws, ws.deltas, gW, gb, n, ws.panel)
    return loss, grad, q.copy()


def ref_loss(net, params, states, kind, targets, actions=None, weights=None):
    q, _ = ref.forward(net.layout, params, ref.onehot(states))
    loss, _ = ref.loss_and_dq(q, kind, targets, actions, weights)
    return loss


@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("dueling", [False, True])
@pytest.mark.parametrize("kind", ["huber", "mse"])
@pytest.mark.parametrize("mode", ["taken", "full"])
def test_gradients_match_finite_differences(sparse, dueling, kind, mode):
    net = make(dueling=dueling, sparse=sparse)
    states = batch()
    rng = np.random.default_rng(7)
    n = len(states)
    weights = rng.uniform(0.5, 1.5, n)
    if mode == "taken":
        actions = rng.integers(0, 4, n).astype(np.int64)
        targets = rng.normal(0, 2, n)  # residuals on both sides of the Huber kink
    else:
        actions = None
        targets = rng.normal(0, 2, (n, 4))
    loss, grad, _ = engine_loss_and_grad(net, states, kind, targets, actions, weights)
    assert loss == pytest.approx(ref_loss(net, net.params, states, kind, targets, actions, weights), rel=1e-12)
    eps = 1e-6
    num = np.zeros_like(grad)
    for i in range(len(grad)):
        p = net.params.copy()
        p[i] += eps
        lp = ref_loss(net, p, states, kind, targets, actions, weights)
        p[i] -= 2 * eps
        lm = ref_loss(net, p, states, kind, targets, actions, weights)
        num[i] = (lp - lm) / (2 * eps)
    np.testing.assert_allclose(grad, num, rtol=1e-5, atol=1e-8)


def test_sparse_and_dense_first_layers_agree():
    sparse = make(sparse=True)
    dense = make(sparse=False)
    np.testing.assert_array_equal(sparse.params, dense.params)
    states = batch(9)
    rng = np.random.default_rng(1)
    actions = rng.integers(0, 4, 9).astype(np.int64)
    targets = rng.normal(0, 1, 9)
    ls, gs, qs = engine_loss_and_grad(sparse, states, "huber", targets, actions)
    ld, gd, qd = engine_loss_and_grad(dense, states, "huber", targets, actions)
    np.testing.assert_allclose(qs, qd, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gs, gd, rtol=1e-12, atol=1e-12)
    assert ls == pytest.approx(ld, rel=1e-12)


def plain_policy(net):
    from cubedqn.cube import get_puzzle
    from cubedqn.encoding import Encoder, Policy
    return Policy(net, Encoder(get_puzzle("cube2"), net.layout.n_actions, canonical=False))


def test_float32_forward_and_backward_match_reference():
    layout = Layout(in_dim=24 * 6, n_active=24, hidden=(64, 32), n_actions=12)
    net = MLP(layout, seed=5)
    states = np.random.default_rng(2).integers(0, 6, (33, 24)).astype(np.uint8)
    q = plain_policy(net).q_values(states)
    q_ref, acts = ref.forward(layout, net.params.astype(np.float64), ref.onehot(states))
    np.testing.assert_allclose(q, q_ref, rtol=1e-4, atol=1e-4)
    actions = np.random.default_rng(3).integers(0, 12, 33)
    targets = np.random.default_rng(4).normal(0, 1, 33)
    _, dq = ref.loss_and_dq(q_ref, "huber", targets, actions)
    g_ref = ref.backward(layout, net.params.astype(np.float64), ref.onehot(states), acts, dq)
    net64 = MLP(layout, params=net.params.astype(np.float64), dtype=np.float64)
    _, g, _ = engine_loss_and_grad(net64, states, "huber", targets, actions)
    np.testing.assert_allclose(g, g_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("n,h,a", [(64, 256, 12), (5, 37, 12), (1, 16, 8), (9, 24, 4), (33, 64, 13)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_head_backward_from_taken_actions_equals_dense_backward(n, h, a, dtype):
    """The Q head's backward from the taken actions alone gives dense_backward's dW, db and
    dx for a dq that is zero elsewhere (a zero at a taken action too, post-ReLU inputs
    with zeros, outputs full of garbage before): the same bits where the tile GEMM takes
    both products (float32, N >= 8, one BLAS thread), else to rounding; and numpy's."""
    from cubedqn import blas
    from cubedqn.nn import dense_backward, head_backward_taken
    from cubedqn.threads import limit_threads
    rng = np.random.default_rng(n * 1000 + h)
    x = np.maximum(rng.standard_normal((n, h)), 0).astype(dtype)
    W = rng.standard_normal((h, a)).astype(dtype)
    taken = rng.integers(0, a, n).astype(np.int64)
    dq = np.zeros((n, a), dtype)
    dq[np.arange(n), taken] = rng.standard_normal(n) * 0.1
    dq[n // 2, taken[n // 2]] = 0
    outs = []
    with limit_threads(1):
        for fast in (False, True):
            dW, db, dx = np.full((h, a), 7, dtype), np.full(a, 7, dtype), np.full((n, h), 7, dtype)
            if fast:
                head_backward_taken(x, dq, taken, W, dW, db, dx, np.full((2, a, h), 5, dtype))
            else:
                dense_backward(x, dq, W, dW, db, dx, True)
            outs.append((dW, db, dx))
    bitwise = dtype == np.float32 and blas.TILE and min(a, h) >= 8
    for dense, fast in zip(*outs):
        if bitwise:
            assert np.array_equal(dense, fast)
        np.testing.assert_allclose(fast, dense, rtol=1e-5, atol=1e-6)
    x64, dq64 = x.astype(np.float64), dq.astype(np.float64)
    refs = (x64.T @ dq64, dq64.sum(axis=0), (dq64 @ W.astype(np.float64).T) * (x64 > 0))
    for fast, want in zip(outs[1], refs):
        np.testing.assert_allclose(fast, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,h,a", [(64, 256, 12), (5, 37, 12), (1, 16, 8), (33, 64, 13), (7, 4, 12)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_head_forward_at_picked_actions_is_the_head_there(n, h, a, dtype):
    """head_forward_picked: q[i, picks[i]] is the head's value at that action (numpy's, to
    rounding: its sums run in vector lanes), q's other columns keep what they held, and
    the scratch ends up holding W transposed, then b (what Learner.last_mean_q reads)."""
    from cubedqn.nn import head_forward_picked
    rng = np.random.default_rng(n * 1000 + h)
    x = np.maximum(rng.standard_normal((n, h)), 0).astype(dtype)
    W = rng.standard_normal((h, a)).astype(dtype)
    b = rng.standard_normal(a).astype(dtype)
    picks = rng.integers(0, a, n).astype(np.int64)
    q = np.full((n, a), 7, dtype)
    wt = np.full((a + 1, max(h, a)), 5, dtype)
    head_forward_picked(x, W, b, picks, wt, q)
    rows = np.arange(n)
    want = x.astype(np.float64) @ W.astype(np.float64) + b
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(q[rows, picks], want[rows, picks], **tol)
    others = np.ones((n, a), bool)
    others[rows, picks] = False
    assert (q[others] == 7).all()
    assert np.array_equal(wt[:a, :h], W.T) and np.array_equal(wt[a, :a], b)


@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("sparse", [True, False])
def test_forward_with_picks_changes_only_the_picked_values(halves, sparse):
    """MLP.forward_ws with picks for its first P rows (as a sampled-targets step runs the
    online rows of s): their values at the picks are the full forward's to rounding, the
    rows after them and every hidden layer are the full forward's bits; picks it cannot
    give (a dueling head, more than the rows) are refused."""
    layout = Layout(in_dim=S * 6, n_active=S, hidden=(64, 48), n_actions=12)
    net = MLP(layout, seed=4, dtype=np.float32, sparse=sparse)
    states = batch(40, seed=8)
    picks = np.random.default_rng(9).integers(0, 12, 20).astype(np.int64)
    full, part = net.workspace(40), net.workspace(40)
    for ws in (full, part):
        fill_input(net, ws, states)
    q_full = net.forward_ws(full, 40, halves=halves).copy()
    q_part = net.forward_ws(part, 40, halves=halves, picks=picks)
    rows = np.arange(20)
    np.testing.assert_allclose(q_part[rows, picks], q_full[rows, picks], rtol=1e-5, atol=1e-6)
    assert np.array_equal(q_part[20:], q_full[20:])
    for a_full, a_part in zip(full.acts[:-1], part.acts[:-1]):
        assert np.array_equal(a_full, a_part)
    with pytest.raises(ValueError, match="picks"):
        net.forward_ws(part, 10, picks=picks)
    duel = MLP(Layout(in_dim=S * 6, n_active=S, hidden=(16,), n_actions=12, dueling=True), seed=1)
    ws = duel.workspace(20)
    fill_input(duel, ws, states[:20])
    with pytest.raises(ValueError, match="picks"):
        duel.forward_ws(ws, 20, picks=picks)


def test_q_values_chunks_equal_one_pass():
    layout = Layout(in_dim=24 * 6, n_active=24, hidden=(16,), n_actions=12)
    net = MLP(layout, seed=1)
    states = np.random.default_rng(2).integers(0, 6, (50, 24)).astype(np.uint8)
    pol = plain_policy(net)
    q64 = pol.q_values(states)
    pol.chunk = 7
    same(pol.q_values(states), q64)


def layer_slices(layout):
    return [(off, boff + fo) for off, fi, fo, boff in layout.tensors]


@pytest.mark.parametrize("kind", ["sgd", "momentum", "nesterov", "adam", "adamw"])
@pytest.mark.parametrize("clip", ["none", "global", "layer"])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_fused_optimizers_match_reference_over_10_steps(kind, clip, wd):
    """(Adam's two loops: clip "none" with no L2 term, AdamW's decay included, takes the
    plain one; clipping that bites, or Adam's L2 term, the scaled one.)"""
    layout = Layout(in_dim=S * 6, n_active=S, hidden=(7, 5), n_actions=4)
    rng = np.random.default_rng(0)
    p = rng.normal(0, 1, layout.size)
    p_ref = p.copy()
    slices = layer_slices(layout)
    kw = dict(lr=0.01, momentum=0.9, weight_decay=wd, max_grad_norm=2.0)
    opt = Optimizer(kind, layout.size, np.float64, slices, clip=clip, **kw)
    opt_ref = ref.ReferenceOptimizer(kind, layout.size, slices, clip=clip, **kw)
    for _ in range(10):
        g = rng.normal(0, 3, layout.size)  # big enough that clipping bites
        opt.step(p, g)
        opt_ref.step(p_ref, g)
    np.testing.assert_allclose(p, p_ref, rtol=1e-10, atol=1e-12)
    if kind in ("adam", "adamw"):
        np.testing.assert_allclose(opt.m, opt_ref.m, rtol=1e-10, atol=1e-15)
        np.testing.assert_allclose(opt.v, opt_ref.v, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_float32_adam_matches_reference(kind, max_grad_norm, wd):
    """The float32 loops (vectorised, fastmath) against the float64 reference, every path;
    the gradients are mixed in size so that the moments' flush of values below 1e-30
    stays out of it."""
    n = 1003  # not a multiple of any vector width: the loops' tails run too
    rng = np.random.default_rng(5)
    p0 = rng.normal(0, 1, n).astype(np.float32)
    p, p_ref = p0.copy(), p0.astype(np.float64)
    kw = dict(lr=0.01, weight_decay=wd, max_grad_norm=max_grad_norm)
    opt = Optimizer(kind, n, np.float32, [(0, n)], **kw)
    opt_ref = ref.ReferenceOptimizer(kind, n, [(0, n)], **kw)
    for _ in range(6):
        g = (rng.normal(0, 1, n) * np.exp(rng.uniform(-5, 0, n))).astype(np.float32)
        opt.step(p, g)
        opt_ref.step(p_ref, g.astype(np.float64))
    assert np.abs(p_ref - p0).max() > 0.03  # six steps of about lr each
    assert max_grad_norm == 0 or opt.last_norm > max_grad_norm  # the clipped case does clip
    np.testing.assert_allclose(p, p_ref, rtol=0, atol=2e-6)
    np.testing.assert_allclose(opt.v, opt_ref.v, rtol=2e-5, atol=1e-12)


def test_sq_norm_matches_numpy():
    g = np.random.default_rng(0).normal(0, 1, 10007).astype(np.float32)
    assert sq_norm(g) == pytest.approx(float((g.astype(np.float64) ** 2).sum()), rel=1e-5)


@pytest.mark.parametrize("n", [1, 255, 256, 257, 5000, 106_000])
def test_sq_norm_by_scaled_float32_blocks_stays_close_to_float64(n):
    """sq_norm squares float32 values times 2^48 in float32 blocks: within float32 rounding
    of the float64 sum over magnitudes from 1e-33 (whose unscaled squares are subnormal or
    zero) to 1e4; float64 arrays stay float64 throughout."""
    rng = np.random.default_rng(n)
    g = (rng.normal(0, 1, n) * 10.0 ** rng.uniform(-33, 4, n)).astype(np.float32)
    exact = float((g.astype(np.float64) ** 2).sum())
    assert sq_norm(g) == pytest.approx(exact, rel=1e-6)
    assert ref.sq_norm_exact(g) == pytest.approx(exact, rel=1e-12)
    assert sq_norm(g.astype(np.float64)) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 1024, 5000, 106_000])
def test_sq_norm_adds_in_the_order_it_writes_down(n, dtype):
    """sums.py's IR (and its Numba fallback, bound where the IR cannot compile) against
    reference.sq_norm, its order in numpy: the same bits, over magnitudes whose float32
    squares are subnormal or overflow (the float64 redo), with a NaN, and strided."""
    rng = np.random.default_rng(n + 7)
    g = (rng.normal(0, 1, n) * 10.0 ** rng.uniform(-33, 4, n)).astype(dtype)
    fallbacks = dict(zip((np.float32, np.float64), sums._make_fallbacks()))
    cases = [g, g * dtype(1e6), g[::2]]
    if n:
        nan = g.copy()
        nan[n // 2] = np.nan
        cases.append(nan)
    for x in cases:
        want, flat = ref.sq_norm(x), np.ascontiguousarray(x)  # (flat: alive through the call)
        for got in (sq_norm(x), fallbacks[dtype].ctypes(flat.ctypes.data, len(flat))):
            assert got == want or (np.isnan(got) and np.isnan(want)), (n, dtype, got, want)


_CALLER = """
import sys
import numpy as np
from numba import njit
from cubedqn.optim import sq_norm

@njit(cache=True)
def caller(a, b):
    return np.sqrt(sq_norm(a) + sq_norm(b))

rng = np.random.default_rng(1)
a = (rng.standard_normal(1676 * 256) * 3e-3).astype(np.float32)
b = (rng.standard_normal(70000) * 2e-2).astype(np.float32)
print(repr(caller(a, b)), repr(float(np.sqrt(sq_norm(a) + sq_norm(b)))))
"""


def test_sq_norm_has_the_same_bits_in_a_cached_caller_as_compiled_afresh(tmp_path):
    """A cached njit caller holds its own copy of sq_norm, compiled apart from the one a
    fresh process links to: with a reassociating sum the two added differently, and the
    same seed trained another net on a cold cache than on a warm one (sums.py). Two
    processes on one new cache (the caller compiled, then loaded), each against a direct
    call."""
    (tmp_path / "sq_caller.py").write_text(_CALLER)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    outs = [subprocess.run([sys.executable, str(tmp_path / "sq_caller.py")], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    for r in outs:
        assert r.returncode == 0, r.stderr[-2000:]
    values = [r.stdout.split() for r in outs]
    assert values[0][0] == values[0][1] == values[1][0] == values[1][1], values


@pytest.mark.parametrize("where", [0, 300, 999])
def test_sq_norm_redoes_in_float64_where_a_scaled_square_overflows(where):
    """|g| above 65536 overflows its square times 2^96 in float32: the sum is then made in
    float64 (the same value as reference.sq_norm_exact), and an inf or a NaN comes out as one."""
    g = np.full(1000, 0.5, np.float32)
    for big in (1e5, -3e38):
        g[where] = big
        assert sq_norm(g) == ref.sq_norm_exact(g) == pytest.approx(float(g[where]) ** 2 + 999 * 0.25, rel=1e-12)
    g[where] = np.inf
    assert sq_norm(g) == np.inf
    g[where] = np.nan
    assert np.isnan(sq_norm(g))


def test_torch_autograd_agrees_if_installed():
    torch = pytest.importorskip("torch")
    net = make(hidden=(9, 6), dueling=False)
    states = batch(5)
    rng = np.random.default_rng(9)
    actions = rng.integers(0, 4, 5).astype(np.int64)
    targets = rng.normal(0, 2, 5)
    loss, grad, q = engine_loss_and_grad(net, states, "huber", targets, actions)
    Ws, bs = views(net.params, net.layout)
    tW = [torch.tensor(W, requires_grad=True) for W in Ws]
    tb = [torch.tensor(b, requires_grad=True) for b in bs]
    h = torch.tensor(ref.onehot(states))
    for l in range(len(tW)):
        h = h @ tW[l] + tb[l]
        if l < len(tW) - 1:
            h = torch.relu(h)
    tq = h.gather(1, torch.tensor(actions)[:, None])[:, 0]
    tl = torch.nn.functional.smooth_l1_loss(tq, torch.tensor(targets))
    tl.backward()
    np.testing.assert_allclose(q, h.detach().numpy(), rtol=1e-12)
    assert loss == pytest.approx(tl.item(), rel=1e-12)
    tgrad = np.concatenate([np.concatenate([w.grad.numpy().ravel(), b.grad.numpy()]) for w, b in zip(tW, tb)])
    np.testing.assert_allclose(grad, tgrad, rtol=1e-10, atol=1e-12)


def test_lr_schedules():
    from cubedqn.optim import schedule_lr
    assert schedule_lr("constant", 0.1, 0.0, 50, 101) == 0.1
    assert schedule_lr("linear", 0.1, 0.0, 0, 101) == pytest.approx(0.1)
    assert schedule_lr("linear", 0.1, 0.0, 50, 101) == pytest.approx(0.05)
    assert schedule_lr("linear", 0.1, 0.0, 100, 101) == pytest.approx(0.0)
    assert schedule_lr("cosine", 0.1, 0.0, 0, 101) == pytest.approx(0.1)
    assert schedule_lr("cosine", 0.1, 0.0, 50, 101) == pytest.approx(0.05)
    assert schedule_lr("cosine", 0.1, 0.01, 100, 101) == pytest.approx(0.01)
    assert schedule_lr("cosine", 0.1, 0.01, 500, 101) == pytest.approx(0.01)  # past the end: final value
    # an explicit progress (a run cut by the clock) overrides the step count
    assert schedule_lr("cosine", 0.1, 0.0, 3, 101, progress=0.5) == pytest.approx(0.05)
    assert schedule_lr("linear", 0.1, 0.0, 3, 101, progress=1.0) == pytest.approx(0.0)
    assert schedule_lr("constant", 0.1, 0.0, 3, 101, progress=0.7) == 0.1


def test_sparse_backward_compact_matches_dense_scatter_and_lists_rows():
    """Compact rows equal the dense scatter's rows bitwise (same order of adds; a row's
    first term is stored as 0 + d, so a lone -0.0 comes out +0.0 as there), the rows are
    listed distinct and ascending, and nothing is left behind between calls."""
    from cubedqn.nn import sparse_backward, sparse_backward_compact
    rng = np.random.default_rng(0)
    in_dim, h = 50, 6
    G, db = np.full((8 * 3, h), np.nan), np.zeros(h)  # stale rows must not leak in
    mark, slot, touched = np.zeros(in_dim, np.uint8), np.zeros(in_dim, np.int32), np.zeros(8 * 3, np.int64)
    starts, terms = np.zeros(8 * 3 + 2, np.int32), np.zeros(8 * 3, np.int32)
    for trial in range(4):
        idx = rng.integers(0, in_dim, (8, 3)).astype(np.int32)
        if trial == 3:
            idx[:] = 7  # one row hit by every sticker of every batch row
        dout = rng.normal(size=(8, h))
        dout[rng.random((8, h)) < 0.2] = -0.0
        n = sparse_backward_compact(idx, dout, G, db, mark, slot, touched, starts, terms)
        dW_ref, db_ref = np.zeros((in_dim, h)), np.zeros(h)
        sparse_backward(idx, dout, dW_ref, db_ref)
        assert touched[:n].tolist() == sorted(set(idx.ravel().tolist()))  # distinct, ascending
        np.testing.assert_array_equal(G[:n].view(np.uint64), dW_ref[touched[:n]].view(np.uint64))
        assert not np.signbit(G[:n][G[:n] == 0]).any()  # as zero + -0.0 in the reference
        np.testing.assert_array_equal(db, db_ref)
        assert not mark.any()
        assert not np.delete(dW_ref, touched[:n], axis=0).any()  # the rows not listed have no gradient


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam", "adamw"])
def test_row_sparse_update_is_lazy_version_of_dense(kind):
    """Rows with no gradient are left alone (params and moments); touched rows and the
    dense tail get exactly the dense update. For SGD without decay that is the dense step."""
    layout = Layout(in_dim=40, n_active=3, hidden=(5,), n_actions=4)
    rng = np.random.default_rng(1)
    width, dense_from = 5, 40 * 5
    p = rng.normal(size=layout.size)
    p_dense = p.copy()
    wd = 0.0 if kind == "sgd" else 0.01
    kw = dict(lr=0.05, weight_decay=wd, max_grad_norm=1.0)
    opt = Optimizer(kind, layout.size, np.float64, layer_slices(layout), **kw)
    opt_dense = Optimizer(kind, layout.size, np.float64, layer_slices(layout), **kw)
    for _ in range(4):
        rows = np.unique(rng.integers(0, 40, 6))
        g = np.zeros(layout.size)
        for r in rows:
            g[r * width:(r + 1) * width] = rng.normal(0, 2, width)
        g[dense_from:] = rng.normal(0, 2, layout.size - dense_from)
        before, m_before = p.copy(), opt.m.copy()
        compact = np.concatenate([g[r * width:(r + 1) * width] for r in rows] + [np.full(width, np.nan)])
        norm = opt.step_rows(p, compact, rows.astype(np.int64), len(rows), width, g[dense_from:])
        assert norm == pytest.approx(np.sqrt((g ** 2).sum()), rel=1e-12)  # clipping sees the full norm
        if kind == "sgd":
            opt_dense.step(p_dense, g)
            np.testing.assert_allclose(p, p_dense, rtol=1e-13, atol=1e-15)
        # untouched rows keep their parameters and moments
        untouched = np.setdiff1d(np.arange(40), rows)
        for r in untouched:
            sl = slice(r * width, (r + 1) * width)
            assert np.array_equal(p[sl], before[sl]) and np.array_equal(opt.m[sl], m_before[sl])
        assert not np.array_equal(p[dense_from:], before[dense_from:])
    with pytest.raises(ValueError, match="layer"):
        Optimizer("sgd", layout.size, np.float64, layer_slices(layout), clip="layer").step_rows(
            p, compact, rows.astype(np.int64), len(rows), width, g[dense_from:])


@pytest.mark.parametrize("kind", ["sgd", "momentum", "nesterov", "adam", "adamw"])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_lazy_rows_get_the_dense_update(kind, max_grad_norm):
    """With the same rows touched every step, the lazy update's touched rows (and the
    dense tail) take the dense float32 update's values, moments included (to rounding: the
    two sum the gradient's norm in different orders), through each family's cfunc and each
    of Adam's loops (max_grad_norm 0: scale 1, the plain loop; 1.0: clipped, the scaled one)."""
    layout = Layout(in_dim=40, n_active=3, hidden=(37,), n_actions=4)  # rows of 37: vector tails
    rng = np.random.default_rng(2)
    width, dense_from = 37, 40 * 37
    p = rng.normal(size=layout.size).astype(np.float32)
    p0, p_dense = p.copy(), p.copy()
    kw = dict(lr=0.05, weight_decay=0.01 if kind == "adamw" else 0.0, max_grad_norm=max_grad_norm)
    opt = Optimizer(kind, layout.size, np.float32, layer_slices(layout), **kw)
    opt_dense = Optimizer(kind, layout.size, np.float32, layer_slices(layout), **kw)
    rows = np.array([1, 7, 8, 30], np.int64)
    mine = np.concatenate([np.arange(r * width, (r + 1) * width) for r in rows] + [np.arange(dense_from, layout.size)])
    for _ in range(4):
        g = np.zeros(layout.size, np.float32)
        g[mine] = rng.normal(0, 2, len(mine))
        compact = np.concatenate([g[r * width:(r + 1) * width] for r in rows])
        opt.step_rows(p, compact, rows, len(rows), width, g[dense_from:])
        opt_dense.step(p_dense, g)
    assert max_grad_norm == 0 or opt.last_norm > max_grad_norm
    assert np.abs(p[mine] - p0[mine]).min() > 0  # every touched parameter moved
    for mine_arr, dense_arr in ((p, p_dense), (opt.m, opt_dense.m), (opt.v, opt_dense.v)):
        if len(dense_arr):  # (state the kind keeps)
            # atol: an ulp or two of the steps' sizes (lr 0.05: 3.7e-9 an ulp), where a parameter
            # ends near zero
            np.testing.assert_allclose(mine_arr[mine], dense_arr[mine], rtol=2e-6, atol=1e-8)


@pytest.mark.parametrize("kind", ["sgd", "momentum", "nesterov", "adam", "adamw"])
@pytest.mark.parametrize("clip, max_grad_norm", [("global", 0.5), ("global", 1e6), ("none", 0.5)])
def test_lazy_step_is_its_kernels_one_after_another_bitwise(kind, clip, max_grad_norm):
    """step_rows (one call: clipped_step_rows) gives the bits of its parts run one by one
    from Python: the two norms, the clip factor, the rows' update (update_rows, the code
    the cfunc chunks run) and the tail's (update_slice), with clipping that binds, that
    does not, and clipping off. Rows of 37: vector tails."""
    layout = Layout(in_dim=40, n_active=3, hidden=(37,), n_actions=4)
    rng = np.random.default_rng(9)
    width, dense_from = 37, 40 * 37
    kw = dict(lr=0.05, weight_decay=0.01, max_grad_norm=max_grad_norm, clip=clip)
    opt = Optimizer(kind, layout.size, np.float32, layer_slices(layout), **kw)
    twin = Optimizer(kind, layout.size, np.float32, layer_slices(layout), **kw)
    p = rng.normal(size=layout.size).astype(np.float32)
    p2 = p.copy()
    for _ in range(3):
        rows = np.unique(rng.integers(0, 40, 9)).astype(np.int64)
        n = len(rows)
        compact = rng.normal(0, 2, (n + 2) * width).astype(np.float32)  # two spare rows, not read
        tail = rng.normal(0, 2, layout.size - dense_from).astype(np.float32)
        norm = opt.step_rows(p, compact, rows, n, width, tail)
        twin.begin_step()
        kc, _, max_norm, _, _, m, v, _, lr, mu, b1, b2, eps, bc1, bc2, wd, _ = twin.step_args(p2, compact)
        norm2 = np.sqrt(sq_norm(compact[:n * width]) + sq_norm(tail))
        scale = np.float32(clip_factor(norm2, max_norm) if clip == "global" else 1.0)
        update_rows(kc, p2, compact, m, v, rows, n, width, scale, lr, mu, b1, b2, eps, bc1, bc2, wd)
        update_slice(kc, p2[dense_from:], tail, m[dense_from:], v[dense_from:], scale, lr, mu, b1, b2, eps, bc1, bc2,
                     wd)
        assert norm == norm2 and opt.last_norm == norm
        assert (scale < 1) == (clip == "global" and max_grad_norm < 1)  # binds where meant to
        for a, b in ((p, p2), (opt.m, twin.m), (opt.v, twin.v)):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("kind", ["sgd", "momentum", "nesterov"])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_float32_sgd_and_momentum_match_reference(kind, max_grad_norm):
    """The float32 update (the family's cfunc, vectorised, fastmath) against the float64
    reference; Adam's float32 loops have their own test above. Long enough for the range
    to split into chunks where the team runs."""
    n = 40_003
    rng = np.random.default_rng(6)
    p0 = rng.normal(0, 1, n).astype(np.float32)
    p, p_ref = p0.copy(), p0.astype(np.float64)
    kw = dict(lr=0.01, momentum=0.9, weight_decay=0.01, max_grad_norm=max_grad_norm)
    opt = Optimizer(kind, n, np.float32, [(0, n)], **kw)
    opt_ref = ref.ReferenceOptimizer(kind, n, [(0, n)], **kw)
    for _ in range(6):
        g = rng.normal(0, 0.05, n).astype(np.float32)
        opt.step(p, g)
        opt_ref.step(p_ref, g.astype(np.float64))
    assert max_grad_norm == 0 or opt.last_norm > max_grad_norm  # the clipped case does clip
    np.testing.assert_allclose(p, p_ref, rtol=0, atol=2e-6)
    if kind != "sgd":
        np.testing.assert_allclose(opt.m, opt_ref.m, rtol=1e-5, atol=1e-7)


def test_views_of_a_buffer_that_starts_at_the_first_bias():
    """The lazy first layer's gradient buffer holds b1 onwards: its views are the full
    buffer's views from b1 on (W1 an empty view); no other start is accepted."""
    layout = Layout(in_dim=40, n_active=3, hidden=(5, 4), n_actions=3)
    full = np.arange(layout.size, dtype=np.float64)
    start = layout.tensors[0][3]
    Ws, bs = views(full, layout)
    tWs, tbs = views(full[start:].copy(), layout, start)
    assert tWs[0].shape == (0, 5)
    for a, b in zip(Ws[1:] + bs, tWs[1:] + tbs):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="bias"):
        views(full[start + 1:], layout, start + 1)


def test_learner_sparse_update_equals_dense_for_sgd():
    from cubedqn.config import Config
    from cubedqn.dqn import Trainer
    base = dict(hidden=(16, 8), n_envs=8, batch_size=8, learning_starts=16, buffer_size=500, steps=6,
                optimizer="sgd", learning_rate=0.05, targets="all-actions", input_encoding="pairs", seed=3)
    runs = [Trainer(Config(**base, sparse_update=flag)) for flag in (False, True)]
    for tr in runs:
        tr.run()
    assert runs[1].learner.updates == 6
    np.testing.assert_allclose(runs[1].learner.online.params, runs[0].learner.online.params,
                               rtol=1e-6, atol=1e-7)


# -- the panel kernels (panels.py) behind the float32 sparse first layer ----------------------

def sequential_gather(idx, W, b, relu):
    """float32, one add at a time: bias, then the stickers in order (the panels' order)."""
    out = np.repeat(b[None, :], len(idx), 0)
    for k in range(idx.shape[1]):
        out += W[idx[:, k]]
    return np.maximum(out, 0) if relu else out


def sequential_scatter(idx, dout, n_in):
    dW = np.zeros((n_in, dout.shape[1]), dout.dtype)
    db = np.zeros(dout.shape[1], dout.dtype)
    for i in range(len(idx)):
        db += dout[i]
        for k in range(idx.shape[1]):
            dW[idx[i, k]] += dout[i]
    return dW, db


def first_layer_case(seed, n_in, s, h, rows, constant=0):
    """float32 W (in,H), b, sticker indices (rows,S) (sticker k's one-hot rows are
    k*per .. k*per+per-1, per = in // S; the first `constant` stickers the same in every
    row, as the 3x3x3's centres) and an output gradient (rows,H)."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((n_in, h)).astype(np.float32)
    b = rng.standard_normal(h).astype(np.float32)
    per = n_in // s
    idx = (np.arange(s)[None, :] * per + rng.integers(0, per, (rows, s))).astype(np.int32)
    idx[:, :constant] = idx[0, :constant]
    dout = rng.standard_normal((rows, h)).astype(np.float32)
    return W, b, idx, dout


def check_panel_kernels_against_sequential_sums(n_in, s, h, rows, relu, constant=0, idx=None):
    """Both panel kernels on a first_layer_case (or on the given idx): the plain sequential
    float32 sums exactly, every output element written. Returns (W, b, idx, out)."""
    from cubedqn.nn import panel_scratch_size, sparse_backward_panels, sparse_forward_panels
    W, b, case_idx, dout = first_layer_case(n_in + h + rows, n_in, s, h, rows, constant)
    idx = case_idx if idx is None else idx
    panel = np.zeros(panel_scratch_size(n_in, rows, s, h, 0, 0), np.float32)
    out = np.full((rows, h), np.nan, np.float32)
    sparse_forward_panels(idx, W, b, out, relu, panel, NO_GROUPS)
    np.testing.assert_array_equal(out, sequential_gather(idx, W, b, relu))
    dW = np.full((n_in, h), np.nan, np.float32)
    db = np.full(h, np.nan, np.float32)
    sparse_backward_panels(idx, dout, dW, db, panel)
    dW_ref, db_ref = sequential_scatter(idx, dout, n_in)
    np.testing.assert_array_equal(dW, dW_ref)
    np.testing.assert_array_equal(db, db_ref)
    return W, b, idx, out


@pytest.mark.parametrize("n_in,s,h,rows", [(144, 24, 256, 64), (144, 24, 256, 37), (324, 54, 96, 20),
                                           (30, 5, 80, 7), (12, 2, 32, 1)])
@pytest.mark.parametrize("relu", [True, False])
def test_panel_kernels_equal_sequential_float32_sums_bitwise(n_in, s, h, rows, relu):
    """Odd row counts (the two-rows-at-once tail), widths that are not a multiple of the
    panel (the columns left to nn.py), one panel; results are the plain sequential
    float32 sums exactly, and every output element is written."""
    W, b, idx, out = check_panel_kernels_against_sequential_sums(n_in, s, h, rows, relu)
    # and against float64 sums, the row kernels' reference
    W64 = W.astype(np.float64)
    want = b + W64[idx].sum(1)
    np.testing.assert_allclose(out, np.maximum(want, 0) if relu else want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_in,s,h,rows", [(324, 54, 1024, 256), (324, 54, 1000, 75), (144, 24, 256, 512)])
def test_panel_kernels_prefetching_variant_equals_sequential_sums_bitwise(n_in, s, h, rows):
    """Calls big enough to come from memory run the variant that prefetches W1's next panel
    and the rows ahead of the one it writes (clamped to the last row: odd counts, the last
    rows of the call); the sums are the same sequential float32 sums."""
    from cubedqn import panels
    assert (n_in + rows) * (h // panels.PANEL * panels.PANEL) >= panels.FAR_FLOATS  # the far variant runs
    check_panel_kernels_against_sequential_sums(n_in, s, h, rows, True)


@pytest.mark.parametrize("n_in,s,h,rows,constant", [(324, 54, 1024, 256, 6), (324, 54, 96, 20, 6),
                                                    (144, 24, 256, 64, 3), (30, 5, 80, 7, 5), (30, 5, 80, 1, 0)])
def test_constant_columns_are_folded_into_the_bias_with_the_same_bits(n_in, s, h, rows, constant):
    """Columns that hold the same W1 row in every row of the batch (the 3x3x3's centres,
    listed first by encode_index) are added to the bias once, in column order: the same
    sequential sums bit for bit, forward and backward (their dW rows are db's sum). All
    columns constant (one row too), the far variant, a tail past the last panel."""
    from cubedqn.nn import NO_GROUPS, _constant_prefix, _fold_constant_columns, _lists_end, panel_scratch_size
    W, b, idx, _ = check_panel_kernels_against_sequential_sums(n_in, s, h, rows, True, constant)
    folded = s if rows == 1 else constant
    assert _constant_prefix(idx) == folded
    f, c = _fold_constant_columns(idx, W, b, h // 32 * 32, np.zeros(panel_scratch_size(n_in, rows, s, h, 0, 0),
                                                                      np.float32), _lists_end(n_in, rows, s, 0, 0),
                                  False, NO_GROUPS)
    assert f == folded and (f == 0 or not np.shares_memory(c, b))


def test_constant_columns_that_share_a_w1_row_with_another_column_are_summed_in_place():
    """Where a constant column's W1 row is also hit by another column (or two constant
    columns name one row), its dW row is not db: the scatter sums it with the rest (the
    sequential sums exactly)."""
    n_in, s, h, rows = 30, 5, 64, 9
    _, _, idx, _ = first_layer_case(1, n_in, s, h, rows, constant=2)
    hit = idx.copy()
    hit[4, 3] = hit[0, 0]                # a varying column lands on a constant column's row
    check_panel_kernels_against_sequential_sums(n_in, s, h, rows, True, idx=hit)
    twice = idx.copy()
    twice[:, 1] = twice[0, 0]            # two constant columns, one W1 row
    check_panel_kernels_against_sequential_sums(n_in, s, h, rows, False, idx=twice)


def test_panel_kernels_rows_of_wider_buffers_and_fallbacks():
    """Row slices of wider arrays (row stride > width) give the same sums; where panels
    cover nothing (a too-small scratch, float64, fewer than PANEL columns) the result is
    the row kernels' exactly."""
    from cubedqn.nn import (_lists_end, panel_scratch_size, sparse_backward, sparse_backward_panels,
                            sparse_forward, sparse_forward_panels)
    from cubedqn.panels import PANEL
    n_in, s, h, rows = 48, 8, 64, 9
    W, b, idx, dout = first_layer_case(7, n_in, s, h, rows)
    want = sequential_gather(idx, W, b, True)
    dW_want, db_want = sequential_scatter(idx, dout, n_in)
    wide_W = np.zeros((n_in, h + 16), np.float32)
    wide_W[:, :h] = W
    wide_out = np.zeros((rows, h + 8), np.float32)
    idx_wide = np.zeros((rows, s + 3), np.int32)
    idx_wide[:, :s] = idx
    scratch = np.zeros(panel_scratch_size(n_in, rows, s, h, 0, 0), np.float32)
    sparse_forward_panels(idx_wide[:, :s], wide_W[:, :h], b, wide_out[:, :h], True, scratch, NO_GROUPS)
    np.testing.assert_array_equal(wide_out[:, :h], want)
    dW = np.full((n_in, h + 16), np.nan, np.float32)
    db = np.zeros(h, np.float32)
    sparse_backward_panels(idx, dout, dW[:, :h], db, scratch)
    np.testing.assert_array_equal(dW[:, :h], dW_want)
    assert np.isnan(dW[:, h:]).all()
    np.testing.assert_array_equal(db, db_want)
    # too small a scratch (for the gather; for the scatter's lists only: the gather still
    # runs panels), float64, H < PANEL
    full, lists = panel_scratch_size(n_in, rows, s, h, 0, 0), _lists_end(n_in, rows, s, 0, 0)
    for dtype, width, panel_size in ((np.float32, h, n_in * PANEL - 1), (np.float32, h, lists - 16),
                                     (np.float64, h, full), (np.float32, PANEL // 2, full)):
        Wd, bd, dd = W[:, :width].astype(dtype), b[:width].astype(dtype), dout[:, :width].astype(dtype)
        got, want = np.zeros((rows, width), dtype), np.zeros((rows, width), dtype)
        sparse_forward_panels(idx, Wd, bd, got, True, np.zeros(panel_size, dtype), NO_GROUPS)
        sparse_forward(idx, Wd, bd, want, True)
        if panel_size == lists - 16:
            want = sequential_gather(idx, Wd, bd, True)
            assert not np.array_equal(want, np.zeros_like(want))
        np.testing.assert_array_equal(got, want)
        got_dW, got_db = np.full((n_in, width), np.nan, dtype), np.full(width, np.nan, dtype)
        want_dW, want_db = np.zeros((n_in, width), dtype), np.zeros(width, dtype)
        sparse_backward_panels(idx, dd, got_dW, got_db, np.zeros(panel_size, dtype))
        sparse_backward(idx, dd, want_dW, want_db)
        np.testing.assert_array_equal(got_dW, want_dW)
        np.testing.assert_array_equal(got_db, want_db)


def test_network_uses_panels_where_they_pay_and_agrees_with_row_gather():
    """float32 workspaces of narrow sparse inputs get a panel scratch (not float64, dense
    or slot-pair inputs); a step's forward and gradients with and without it agree. A
    layout none of whose workspaces could have one gets None (the kernels then compile
    without the panel code); one that could, an empty scratch where the rows are too few."""
    from cubedqn.nn import Workspace, mlp_backward_first, mlp_backward_upper, panel_scratch_size
    from cubedqn.panels import PANEL
    cube3 = Layout(in_dim=324, n_active=54, hidden=(64, 32), n_actions=12)
    assert Workspace(cube3, 48).panel.size == panel_scratch_size(324, 48, 54, 64, 0, 0) >= 324 * PANEL + 48 * 54 + 64
    assert Workspace(cube3, 47).panel.size == 0      # too few rows to pay for copying W1
    assert Workspace(cube3, 48, np.float64).panel is None
    assert Workspace(cube3, 48, dense_input=True).panel is None
    assert Workspace(Layout(9261, 28, (256,), 12), 4096).panel is None
    assert Workspace(Layout(324, 54, (100,), 12), 48).panel is None   # not a multiple of PANEL
    net = MLP(cube3, seed=2)
    rng = np.random.default_rng(3)
    rows = 64
    idx = (np.arange(54)[None, :] * 6 + rng.integers(0, 6, (rows, 54))).astype(np.int32)
    dq = rng.standard_normal((rows, 12)).astype(np.float32)
    results = []
    for panel in ("scratch", "empty", None):
        ws = net.workspace(rows)
        if panel != "scratch":
            ws.panel = np.zeros(0, np.float32) if panel == "empty" else None
        ws.idx[:] = idx
        q = net.forward_ws(ws, rows).copy()
        ws.deltas[-1][:] = dq
        grad = np.zeros_like(net.params)
        gW, gb = views(grad, cube3)
        mlp_backward_upper(net.Ws, ws.acts, ws.deltas, gW, gb, rows, NO_TAKEN, ws.head_t)
        mlp_backward_first(ws.idx, ws.x, True, net.Ws, ws.deltas, gW, gb, rows, ws.panel)
        results.append((q, grad))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    same(results[1][0], results[2][0])  # both the row gather: the same bits
    same(results[1][1], results[2][1])
    ws = net.workspace(rows)
    ws.idx[:] = idx
    few = net.forward_ws(ws, 5).copy()  # a few rows through the same workspace: the same bits
    same(few, results[0][0][:5])
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-5, atol=1e-5)
    assert not np.array_equal(results[0][1], np.zeros_like(net.params))


@pytest.mark.parametrize("shape,dtype", [((3, 5), np.float32), (7, np.float64), ((2, 0), np.int32),
                                         ((4, 3, 2), np.uint8)])
def test_aligned_zeros_start_on_a_cache_line(shape, dtype):
    bufs = [aligned_zeros(shape, dtype) for _ in range(4)]
    for a in bufs:
        assert a.shape == np.zeros(shape).shape and a.dtype == dtype and a.flags.c_contiguous
        assert not a.any() and (a.size == 0 or a.ctypes.data % ALIGN == 0)
    if bufs[0].size:
        bufs[0][...] = 1  # separate buffers
        assert not bufs[1].any()


def test_network_buffers_are_aligned_and_loaded_parameters_are_copied():
    layout = Layout(144, 24, (64, 32), 12)
    net = MLP(layout, seed=1)
    ws = net.workspace(64)
    given = np.zeros(layout.size + 1, np.float32)[1:]  # 4 bytes past numpy's own start
    given[:] = net.params
    loaded = MLP(layout, params=given)
    assert np.array_equal(loaded.params, given) and not np.shares_memory(loaded.params, given)
    for a in (net.params, loaded.params, *net.Ws, *loaded.Ws, *ws.acts, *ws.deltas, ws.idx, ws.panel):
        assert a.ctypes.data % ALIGN == 0


def test_panel_ir_equals_its_plain_loop_fallback_bitwise():
    """panels.py binds plain Numba loops instead of the IR where LLVM cannot compile it;
    both compute the same sums in the same order (the gather with tables, InputGroups, and
    without). Called here through their addresses."""
    import ctypes

    from cubedqn import panels
    assert panels.AVAILABLE, panels.PROBLEM
    gather_loops, scatter_loops = panels._make_fallbacks()
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    gproto = ctypes.CFUNCTYPE(i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, i64, i64, ptr,
                              ptr)
    sproto = ctypes.CFUNCTYPE(i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64, ptr, ptr, i64, i64)
    import llvmlite.binding as llb

    from cubedqn.nn import _rows_by_w1_row
    ir_gather = gproto(llb.address_of_symbol(panels.GATHER))
    ir_scatter = sproto(llb.address_of_symbol(panels.SCATTER))
    # 61 W1 rows: an odd count (the scatter does rows in pairs) whose last row nobody hits
    n_in, s, h, rows = 61, 10, 64, 9
    W, b, idx, dout = first_layer_case(11, n_in, s, h, rows)
    idx[0, 1] = idx[0, 0]  # a batch row that hits one W1 row twice adds its gradient twice
    panel = np.zeros((n_in + 23) * panels.PANEL, np.float32)
    order, starts, cursor = np.zeros(rows * s, np.int32), np.zeros(n_in + 1, np.int32), np.zeros(n_in, np.int32)
    _rows_by_w1_row(idx, n_in, order, starts, cursor)
    assert starts[-1] == rows * s and starts[-2] == starts[-1]
    # 23 table rows of 1-3 W1 rows each (one listing a row twice), one of none and one of
    # five (the loop past the unrolled lengths); 4 a batch row
    rng = np.random.default_rng(12)
    members = [list(rng.integers(0, n_in, 1 + t % 3)) for t in range(23)]
    members[4], members[9], members[16] = [7, 7], [], list(rng.integers(0, n_in, 5))
    t_order = np.array([r for m in members for r in m], np.int32)
    t_starts = np.cumsum([0] + [len(m) for m in members]).astype(np.int32)
    codes = rng.integers(0, 23, (rows, 4)).astype(np.int32)
    table = np.zeros((23, h), np.float32)  # the sums the tables stand for: from zero, in list order
    for t, m in enumerate(members):
        for r in m:
            table[t] += W[r]
    for n_t, rows_idx, want in ((0, idx, sequential_gather(idx, W, b, True)),
                                (23, codes, sequential_gather(codes, table, b, True))):
        outs = []
        for g in (ir_gather, gproto(gather_loops.address)):
            out = np.full((rows, h), np.nan, np.float32)
            k = rows_idx.shape[1]
            args = [out.ctypes.data, h, W.ctypes.data, h, rows_idx.ctypes.data, k, rows, k, h, b.ctypes.data, 1,
                    panel.ctypes.data, n_in]
            tables = [n_t, t_order.ctypes.data, t_starts.ctypes.data]
            # a caller compiled with another panel width gets 0 columns done and nothing written
            assert g(*args, panels.PANEL // 2, *tables) == 0 and np.isnan(out).all()
            assert g(*args, panels.PANEL, *tables) == h
            outs.append(out)
        np.testing.assert_array_equal(outs[0], outs[1])
        np.testing.assert_array_equal(outs[0], want)
    grads = []
    for sc in (ir_scatter, sproto(scatter_loops.address)):
        dW, db = np.full((n_in, h), np.nan, np.float32), np.full(h, np.nan, np.float32)
        args = [dout.ctypes.data, h, dW.ctypes.data, h, order.ctypes.data, starts.ctypes.data, rows, h,
                db.ctypes.data, panel.ctypes.data, n_in]
        assert sc(*args, panels.PANEL * 2) == 0 and np.isnan(dW).all() and np.isnan(db).all()
        assert sc(*args, panels.PANEL) == h
        grads.append((dW, db))
    dW_ref, db_ref = sequential_scatter(idx, dout, n_in)
    for dW, db in grads:
        np.testing.assert_array_equal(dW, dW_ref)
        np.testing.assert_array_equal(db, db_ref)


def test_panels_fall_back_to_plain_loops_when_the_ir_does_not_compile():
    """If LLVM cannot compile the IR, the symbols are bound to the plain loops (correct,
    slow) and workspaces get no panel scratch. A fresh process, so the binding is new."""
    import subprocess
    import sys
    code = """
import numpy as np
import cubedqn.panels as p
def fail():
    raise RuntimeError("no target")
p._compile = fail
engine, problem = p._bind()
assert engine is None and problem == "RuntimeError: no target", problem
import llvmlite.binding as llb
assert llb.address_of_symbol(p.GATHER) == p._FALLBACKS[0].address
from cubedqn.nn import NO_GROUPS, sparse_forward_panels
rng = np.random.default_rng(0)
W = rng.standard_normal((30, 64)).astype(np.float32); b = rng.standard_normal(64).astype(np.float32)
idx = (np.arange(5)[None, :] * 6 + rng.integers(0, 6, (7, 5))).astype(np.int32)
out = np.zeros((7, 64), np.float32)
sparse_forward_panels(idx, W, b, out, False, np.zeros(30 * p.PANEL, np.float32), NO_GROUPS)
want = b.copy()[None].repeat(7, 0)
for k in range(5):
    want += W[idx[:, k]]
assert np.array_equal(out, want)
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


PANEL_CACHE_RUN = """
import ctypes, sys
import numpy as np
import llvmlite.binding as llb
import cubedqn.panels as p
i64, ptr = ctypes.c_int64, ctypes.c_void_p
gather = ctypes.CFUNCTYPE(i64, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, i64, i64, ptr, ptr)(
    llb.address_of_symbol(p.GATHER))
rng = np.random.default_rng(3)
W = rng.standard_normal((30, 64)).astype(np.float32); b = rng.standard_normal(64).astype(np.float32)
idx = (np.arange(5)[None, :] * 6 + rng.integers(0, 6, (7, 5))).astype(np.int32)
out, panel = np.zeros((7, 64), np.float32), np.zeros(30 * p.PANEL, np.float32)
assert gather(out.ctypes.data, 64, W.ctypes.data, 64, idx.ctypes.data, 5, 7, 5, 64, b.ctypes.data, 0,
              panel.ctypes.data, 30, p.PANEL, 0, None, None) == 64
want = b.copy()[None].repeat(7, 0)
for k in range(5):
    want += W[idx[:, k]]
assert np.array_equal(out, want)
print(p.SOURCE, p.AVAILABLE)
"""


def test_panel_object_code_is_cached_and_a_damaged_cache_is_recompiled(tmp_path):
    """The IR's machine code is kept in NUMBA_CACHE_DIR/cubedqn: the next process loads it
    instead of compiling; a file whose digest does not match is compiled afresh and
    replaced. Each run checks the gather's sums (fresh processes: the binding is new)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))

    def run():
        r = subprocess.run([sys.executable, "-c", PANEL_CACHE_RUN], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.strip()

    assert run() == "compiled True"
    (cached,) = (tmp_path / "cubedqn").glob("panels-*.o")
    good = cached.read_bytes()
    assert run() == "cache True"
    for damaged in (good[:-1] + bytes([good[-1] ^ 1]), good[: len(good) // 2], b""):
        cached.write_bytes(damaged)
        assert run() == "compiled True"
        assert cached.read_bytes() == good  # rewritten: the same code for the same source and CPU
    assert [f.name for f in (tmp_path / "cubedqn").iterdir()] == [cached.name]  # no temp files left


@pytest.mark.parametrize("name", ["CUBEDQN_PANELS", "CUBEDQN_FUSED", "CUBEDQN_TILE_GEMM", "CUBEDQN_TEAM"])
def test_unknown_kernel_setting_is_a_one_line_error(name):
    import os
    import subprocess
    import sys
    env = dict(os.environ, **{name: "yes"})
    r = subprocess.run([sys.executable, "-m", "cubedqn.cli", "scramble", "--moves", "R U"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    allowed = "0, 1, avx2" if name == "CUBEDQN_TILE_GEMM" else "0, 1"
    assert r.stderr.strip() == f"cubedqn: error: {name}='yes' is not one of: {allowed}"
    env[name] = "0"
    assert subprocess.run([sys.executable, "-m", "cubedqn.cli", "scramble", "--moves", "R U"], env=env,
                          capture_output=True, text=True, timeout=300).returncode == 0
