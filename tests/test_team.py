"""The GEMM team (team.py): products split by columns over resident workers give the inner
GEMM's bits, the workers take chunks, callers on threads of their own stay correct, the
--threads knob sets the team and the library as documented (threads.py), and ranges
(TEAM_RANGE, the optimizer's update) are split into whole grains that give one thread's bits."""
import ctypes
import threading
import time

import numpy as np
import pytest
from numba import carray, cfunc, njit, types

from cubedqn import blas, team
from cubedqn.threads import gemm_threads, limit_threads, one_gemm_thread, set_gemm_threads
from blas_rows import COLUMNS_EXACT

needs_team = pytest.mark.skipif(blas.team_problem() is not None, reason=str(blas.team_problem()))
NO_TRANS, TRANS = blas.NO_TRANS, blas.TRANS


def _team_or_skip():
    """Start the team (its first use checks split products against the inner GEMM) or skip
    where this host cannot have it."""
    blas.set_team(1)
    blas.set_team(0)
    if blas.team_problem():
        pytest.skip(blas.team_problem())


@pytest.fixture
def one_worker():
    """The team on with one worker, the library on one thread (as limit_threads(2) leaves
    them); everything back to one thread after."""
    _team_or_skip()
    limits = limit_threads(2)
    assert blas.team_workers() == 1
    try:
        yield
    finally:
        limits.restore()
        limit_threads(1)


def _sgemm(address):
    return blas._CTYPES_SIG(address)


def _call(fn, ta, tb, m, n, k, a, b):
    """C (m x n, one spare column of NaN) from a CBLAS sgemm on the check operands."""
    return blas._product(fn, m, n, k, ta, tb, a, b)


# (m, n, k, ta, tb): the step's products (forward, input and weight gradients), a last chunk
# wider than the others (n not a multiple of the chunk), B transposed, A transposed (rows in
# blocks past 256), K in two blocks, one row, and products too small or narrow to split
SHAPES = [(64, 256, 256, NO_TRANS, NO_TRANS), (64, 256, 256, NO_TRANS, TRANS), (256, 256, 64, TRANS, NO_TRANS),
          (17, 100, 300, NO_TRANS, NO_TRANS), (9, 260, 64, NO_TRANS, TRANS), (40, 129, 64, TRANS, NO_TRANS),
          (1024, 512, 256, TRANS, NO_TRANS), (256, 512, 1024, NO_TRANS, NO_TRANS), (1, 4096, 64, NO_TRANS, NO_TRANS),
          (64, 12, 256, NO_TRANS, NO_TRANS), (8, 64, 8, NO_TRANS, NO_TRANS)]


@needs_team
@pytest.mark.parametrize("m,n,k,ta,tb", SHAPES)
def test_split_products_give_the_inner_gemms_bits(one_worker, m, n, k, ta, tb):
    rng = np.random.default_rng(m * n + k)
    a, b, op_a, op_b = blas._check_operands(rng, m, n, k, ta, tb)
    before = blas.team_stats()["split"]
    got = _call(_sgemm(blas.llb.address_of_symbol(blas.SYMBOL)), ta, tb, m, n, k, a, b)
    splits = blas.team_stats()["split"] - before
    want = _call(_sgemm(blas.llb.address_of_symbol(team.INNER_SGEMM)), ta, tb, m, n, k, a, b)
    if COLUMNS_EXACT or (blas.TILE and blas.tile_gemm.takes(m, n, k, ta == TRANS, tb == TRANS)):
        np.testing.assert_array_equal(got, want)  # the spare column untouched (NaN) in both
    else:  # the tile leaves it to a library whose columns depend on the call's (tests/blas_rows.py)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k), equal_nan=True)
    np.testing.assert_allclose(got[:, :n], op_a.astype(np.float64) @ op_b, rtol=1e-4, atol=1e-4)
    # split exactly where the rule says (the caller was the only one splitting here)
    assert splits == int(m * n * k >= team.SPLIT_MACS and n >= 2 * team.CHUNK_MIN)


@needs_team
@pytest.mark.parametrize("m,n,k,relu", [(64, 256, 256, True), (33, 200, 300, False), (128, 1000, 144, True),
                                        (5, 64, 4096, True)])
def test_split_bias_products_give_the_inner_bits_and_answer(one_worker, m, n, k, relu):
    """The bias-and-ReLU GEMM split by columns: the same bits and the same answer as the
    inner one, which may leave the product to the caller (returns 0, C untouched)."""
    rng = np.random.default_rng(k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    outs = []
    for name in (blas.BIAS_SYMBOL, team.INNER_BIAS):
        fn = blas._BIAS_CTYPES(blas.llb.address_of_symbol(name))
        c = np.full((m, n), np.nan, np.float32)
        outs.append((fn(m, n, k, a.ctypes.data, k, b.ctypes.data, n, c.ctypes.data, n, bias.ctypes.data, int(relu)),
                     c))
    assert outs[0][0] == outs[1][0]
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    if outs[0][0]:
        want = a.astype(np.float64) @ b + bias
        np.testing.assert_allclose(outs[0][1], np.maximum(want, 0) if relu else want, rtol=1e-4, atol=1e-4)
    else:  # left to the caller: nothing written
        assert np.isnan(outs[0][1]).all()


@njit(nogil=True)
def _products(a, b, c, reps):
    for _ in range(reps):
        blas.gemm(a, b, c)


@needs_team
def test_workers_take_chunks_and_the_team_goes_quiet_when_off(one_worker):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 256)).astype(np.float32)
    b = rng.standard_normal((256, 256)).astype(np.float32)
    c = np.empty((64, 256), np.float32)
    want = (a.astype(np.float64) @ b)
    start, deadline = blas.team_stats(), time.perf_counter() + 20
    while blas.team_stats()["taken"] == start["taken"] and time.perf_counter() < deadline:
        _products(a, b, c, 200)  # a worker that naps wakes within IDLE_US and then keeps up
    stats = blas.team_stats()
    assert stats["taken"] > start["taken"] and stats["split"] > start["split"]
    np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-4)
    blas.set_team(0)
    off = blas.team_stats()
    _products(a, b, c, 50)
    assert blas.team_stats()["split"] == off["split"] and blas.team_workers() == 0


@needs_team
def test_callers_on_threads_of_their_own_share_the_team_correctly(one_worker):
    """Several threads calling the GEMM at once while the team is on: one splits at a time
    (the others run their products whole), every result is right."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 64, 256)).astype(np.float32)
    b = rng.standard_normal((4, 256, 256)).astype(np.float32)
    want = [_call(_sgemm(blas.llb.address_of_symbol(team.INNER_SGEMM)), NO_TRANS, NO_TRANS, 64, 256, 256,
                  a[i], b[i])[:, :256] for i in range(4)]
    outs = [np.empty((64, 256), np.float32) for _ in range(4)]
    bad = []

    def work(i):
        for _ in range(50):
            _products(a[i], b[i], outs[i], 5)
            if not np.array_equal(outs[i], want[i]):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


@needs_team
def test_thread_knob_sets_the_team_and_the_library():
    from threadpoolctl import threadpool_info

    def library_threads():
        return max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")

    _team_or_skip()
    limit_threads(1)
    try:
        assert gemm_threads() == 1 and blas.team_workers() == 0
        with limit_threads(3):
            assert blas.team_workers() == 2 and gemm_threads() == 3 and library_threads() == 1
            set_gemm_threads(1)  # the tuner's switch
            assert blas.team_workers() == 0 and gemm_threads() == 1
            set_gemm_threads(3)
            assert blas.team_workers() == 2
            with one_gemm_thread():  # eval --threads: every thread's products whole
                assert blas.team_workers() == 0 and library_threads() == 1
            assert blas.team_workers() == 2
        assert blas.team_workers() == 0 and gemm_threads() == 1  # as before the block
        assert blas.set_team(-3) == 0
        with limit_threads(team.MAX_WORKERS + 5):  # more than the team has: all of it, not the BLAS's threads
            assert blas.team_workers() == team.MAX_WORKERS and library_threads() == 1
        assert blas.team_workers() == 0
    finally:
        limit_threads(1)


def test_a_team_that_cannot_be_had_leaves_the_library_its_threads(monkeypatch):
    from threadpoolctl import threadpool_info
    monkeypatch.setattr(blas, "team_problem", lambda: "the GEMM team (team.py) is off (CUBEDQN_TEAM=0)")
    try:
        limit_threads(2)
        assert blas.team_workers() == 0 and gemm_threads() == 2
        assert max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas") == 2
    finally:
        limit_threads(1)


def test_team_off_by_environment_is_reported():
    import subprocess
    import sys
    code = ("from cubedqn import blas; from cubedqn.threads import limit_threads, gemm_threads; "
            "limit_threads(2); print(blas.team_problem(), blas.team_workers(), gemm_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "CUBEDQN_TEAM": "0"}).stdout.strip()
    assert out == "the GEMM team (team.py) is off (CUBEDQN_TEAM=0) 0 2"



@needs_team
@pytest.mark.filterwarnings("ignore:os.fork():RuntimeWarning")  # JAX's, where another test imported it
def test_a_forked_child_starts_its_own_workers(one_worker):
    """After fork the child has none of the parent's workers (and the team's mutex may
    have been held by one): the team forgets them, and the child's own set_team starts a
    worker that takes chunks. Without the reset the child kept `started` from the parent,
    started no worker, and every chunk fell to its caller."""
    import os
    rng = np.random.default_rng(2)
    a = rng.standard_normal((64, 256)).astype(np.float32)
    b = rng.standard_normal((256, 256)).astype(np.float32)
    c = np.empty((64, 256), np.float32)
    _products(a, b, c, 20)  # compiled and run in the parent first
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when its own worker took chunks and C is right
        code = 1
        try:
            ok = blas.team_workers() == 0 and blas.set_team(1) == 1
            start, deadline = blas.team_stats()["taken"], time.perf_counter() + 20
            while ok and blas.team_stats()["taken"] == start and time.perf_counter() < deadline:
                _products(a, b, c, 200)
            ok = ok and blas.team_stats()["taken"] > start
            ok = ok and np.allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
            code = 0 if ok else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# --- TEAM_RANGE: fn(ctx, lo, hi) over chunks of [0, n) -----------------------------------
# the test's fn: rec = [n, grain, counts (n), chunk ends (one slot per grain)]: adds 1 to the
# count of every element of its range and writes hi into the slot of the grain lo starts
@cfunc(types.void(types.voidptr, types.int64, types.int64))
def _mark_range(ctx, lo, hi):
    head = carray(ctx, 2, np.int64)
    n, grain = head[0], head[1]
    rec = carray(ctx, 2 + n + n // grain + 1, np.int64)
    for i in range(lo, hi):
        rec[2 + i] += 1
    rec[2 + n + lo // grain] = hi if lo % grain == 0 else -1  # -1: a chunk off the grain


_RANGE_CTYPES = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


def _run_range(n, grain):
    """The chunks run_range made of [0, n): [(lo, hi)], after checking each element was
    in exactly one."""
    g = max(grain, 1)
    rec = np.zeros(2 + n + n // g + 1, np.int64)
    rec[:2] = n, g
    _RANGE_CTYPES(blas.RANGE_ADDRESS)(_mark_range.address, rec.ctypes.data, n, grain)
    np.testing.assert_array_equal(rec[2:2 + n], 1)
    ends = rec[2 + n:]
    assert (ends >= 0).all()
    return [(k * g, int(hi)) for k, hi in enumerate(ends) if hi > 0]


@needs_team
@pytest.mark.parametrize("n,grain", [(team.RANGE_MIN, 1024), (team.RANGE_MIN + 517, 1024), (105996, 1024),
                                     (3 * team.RANGE_MIN + 1, 1000), (team.RANGE_MIN, 0), (team.RANGE_MIN - 1, 1024),
                                     (5, 1024)])
def test_ranges_are_split_into_whole_grains_each_element_once(one_worker, n, grain):
    before = blas.team_stats()["split"]
    chunks = _run_range(n, grain)
    split = blas.team_stats()["split"] - before
    assert split == int(n >= team.RANGE_MIN)
    if split:  # two chunks per thread, each a whole number of grains but the last
        assert len(chunks) == 4 and all((hi - lo) % max(grain, 1) == 0 for lo, hi in chunks[:-1])
        start, deadline = blas.team_stats()["taken"], time.perf_counter() + 20
        while blas.team_stats()["taken"] == start and time.perf_counter() < deadline:
            assert _run_range(n, grain) == chunks  # and the same when the worker takes some
        assert blas.team_stats()["taken"] > start
    else:
        assert chunks == [(0, n)]


@needs_team
def test_ranges_run_whole_with_the_team_off():
    _team_or_skip()
    before = blas.team_stats()["split"]
    assert _run_range(105996, 1024) == [(0, 105996)]
    assert blas.team_stats()["split"] == before


@needs_team
@pytest.mark.parametrize("kind", ["sgd", "momentum", "nesterov", "adam", "adamw"])
def test_optimizer_steps_split_over_the_team_give_the_same_bits(kind):
    """The update of the flat buffer (optim.update_flat) split into chunks over the team:
    the same parameters and moments as on one thread, on a length that is not a whole
    number of grains, with clipping on some steps and weight decay, dense and row-sparse."""
    from cubedqn.optim import Optimizer
    _team_or_skip()
    n, width, rows = 105996 + 37, 256, 300  # the row-sparse head: 300 rows of 256, 150 touched (split)
    out = {}
    for workers in (0, 1):
        limits = limit_threads(workers + 1)
        try:
            before = blas.team_stats()["split"]
            rng = np.random.default_rng(5)
            p = rng.standard_normal(n).astype(np.float32)
            opt = Optimizer(kind, n, np.float32, [(0, n)], lr=1e-2, weight_decay=1e-3, max_grad_norm=5.0)
            for step in range(6):
                g = (rng.standard_normal(n) * (0.1 if step % 2 else 1e-3)).astype(np.float32)
                if step < 4:
                    opt.step(p, g)
                else:
                    touched = np.sort(rng.choice(rows, 150, replace=False)).astype(np.int64)
                    opt.step_rows(p, g[:150 * width], touched, 150, width, g[rows * width:])
            out[workers] = (p, opt.m, opt.v, opt.t)
            assert (blas.team_stats()["split"] > before) == (workers > 0)
        finally:
            limits.restore()
            limit_threads(1)
    for a, b in zip(out[0][:3], out[1][:3]):
        np.testing.assert_array_equal(a, b)


@needs_team
@pytest.mark.parametrize("rows,active,relu", [(448, 21, True), (129, 21, False), (12, 21, True), (300, 7, True)])
def test_row_gather_shared_over_the_team_gives_one_threads_bits(one_worker, rows, active, relu):
    """nn.sparse_forward_shared (the first layer's row gather where W1 is too big for the
    panels) split into chunks of whole rows: sparse_forward's bits on every row, split where
    the rows are enough work (the first two shapes) and whole where they are not; the
    workspace's path (sparse_forward_panels without a panel scratch) takes it."""
    from cubedqn.nn import sparse_forward, sparse_forward_panels, sparse_forward_shared
    rng = np.random.default_rng(rows)
    W = rng.standard_normal((9261, 256)).astype(np.float32)
    b = rng.standard_normal(256).astype(np.float32)
    idx = rng.integers(0, 9261, (rows, active)).astype(np.int32)
    want = np.full((rows, 256), np.nan, np.float32)
    sparse_forward(idx, W, b, want, relu)
    big = rows * (256 * active // 8) >= team.RANGE_MIN
    for fn, extra in ((njit(lambda *a: sparse_forward_shared(*a)), ()), (sparse_forward_panels, (None, None))):
        got = np.full((rows, 256), np.nan, np.float32)
        before = blas.team_stats()["split"]
        fn(idx, W, b, got, relu, *extra)
        assert blas.team_stats()["split"] - before == int(big)
        np.testing.assert_array_equal(got, want)


@needs_team
def test_row_gather_runs_alone_with_the_team_off():
    from cubedqn.nn import sparse_forward, sparse_forward_shared
    _team_or_skip()
    rng = np.random.default_rng(1)
    W = rng.standard_normal((500, 64)).astype(np.float32)
    b = np.zeros(64, np.float32)
    idx = rng.integers(0, 500, (4096, 9)).astype(np.int32)
    want, got = np.empty((4096, 64), np.float32), np.empty((4096, 64), np.float32)
    sparse_forward(idx, W, b, want, True)
    before = blas.team_stats()["split"]
    njit(lambda *a: sparse_forward_shared(*a))(idx, W, b, got, True)
    assert blas.team_stats()["split"] == before
    np.testing.assert_array_equal(got, want)


@needs_team
@pytest.mark.parametrize("symmetry", [1, 6, 48])
def test_framing_shared_over_the_team_gives_one_threads_frames_and_codes(one_worker, symmetry):
    """Encoder.frames (encoding.frame_states) with the team: states in chunks, each chunk
    with its own scratch, the frames and corner codes of the plain find_rotations and
    choose_frame on every state; split when there are enough states, whole when there are
    few or the states are not in C order."""
    from cubedqn.cube import apply_moves, get_puzzle
    from cubedqn.encoding import Encoder, choose_frame, find_rotations
    p2 = get_puzzle("cube2")
    enc = Encoder(p2, 12, inputs="pairs", symmetry=symmetry)
    rng = np.random.default_rng(symmetry)
    states = np.ascontiguousarray([apply_moves(p2, p2.solved, rng.integers(0, 12, d))[p2.rotations[r]]
                                   for d, r in zip(rng.integers(0, 14, 301), rng.integers(0, 24, 301))])
    n = len(states)
    want_frame, want_codes = np.zeros(n, np.int64), np.zeros((n, 8), np.int64)
    find_rotations(states, enc.home_facelets, enc.colours, want_frame)
    choose_frame(states, enc.search_rotations, enc._identity_cmap, enc.corner_facelets, enc.corner_lookup, enc.n_view,
                 enc.xcubie, enc.rot_of, enc.view_src, enc.view_code, enc.k_src, enc.k_code, enc.n_rr, enc.n_sym,
                 np.zeros(8, np.int64), np.zeros(8, np.int64), np.zeros(8, np.int64), want_codes, want_frame)
    wide = np.zeros((n, 2 * states.shape[1]), np.uint8)
    wide[:, ::2] = states  # the same states, not in C order
    for rows, given, split in ((n, states, True), (20, states, False), (n, wide[:, ::2], False)):
        frame, codes = np.full(rows, -1, np.int64), np.full((rows, 8), -1, np.int64)
        before = blas.team_stats()["split"]
        enc.frames(given[:rows], frame, codes)
        assert (blas.team_stats()["split"] > before) == split
        np.testing.assert_array_equal(frame, want_frame[:rows])
        np.testing.assert_array_equal(codes, want_codes[:rows])


@needs_team
def test_range_functions_fill_when_the_team_runs_before_their_modules_load():
    """A process that starts the team before importing nn and encoding: share_range_fn
    builds their chunk functions at import (it runs at the end of each module, where what
    they call is defined), so the gathers, the scatters and the framing find their slots
    filled; the panel halves' only once a workspace with a panel scratch wants it (a run
    without one never compiles it)."""
    import subprocess
    import sys
    _team_or_skip()  # needs_team alone passes a host whose check has not run yet (and fails)
    code = ("from cubedqn import blas; from cubedqn.threads import limit_threads; limit_threads(2); "
            "assert blas.team_workers() == 1; import cubedqn.encoding as e, cubedqn.nn as n; "
            "print(all(blas._RANGE_FNS[k] != 0 for k in (n.GATHER_SLOT, n.SCATTER_SLOT, e.FRAME_SLOT))); "
            "print(blas._RANGE_FNS[n.PANEL_SLOT] == 0); "
            "n.Workspace(n.Layout(144, 24, (256, 256), 12), 8); print(blas._RANGE_FNS[n.PANEL_SLOT] == 0); "
            "n.Workspace(n.Layout(144, 24, (256, 256), 12), 64); print(blas._RANGE_FNS[n.PANEL_SLOT] != 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True"] * 4


@needs_team
@pytest.mark.parametrize("rows,active", [(128, 21), (64, 7), (3, 21)])
def test_lazy_backward_shared_over_the_team_gives_one_threads_bits(one_worker, rows, active):
    """nn.sparse_backward_compact with the team: the touched rows' sums (nn.compact_sums
    on chunks of whole rows, each from its rows' lists of terms) and db are the one-pass
    loop's bits (sparse_backward's rows); split where there are enough touched rows (the
    first two shapes), whole where not."""
    from cubedqn.nn import aligned_zeros, sparse_backward, sparse_backward_compact
    rng = np.random.default_rng(rows)
    n_in, h = 9261, 256
    idx = rng.integers(0, n_in, (rows, active)).astype(np.int32)
    idx[1] = idx[0]  # rows touched more than once
    dout = rng.standard_normal((rows, h)).astype(np.float32)
    dout[rng.random((rows, h)) < 0.1] = -0.0  # a row's lone -0.0 term sums to +0.0 (zero first)
    dW, db_want = np.zeros((n_in, h), np.float32), np.zeros(h, np.float32)
    sparse_backward(idx, dout, dW, db_want)
    mark, slot = np.zeros(n_in, np.uint8), np.zeros(n_in, np.int32)
    touched = np.zeros(rows * active, np.int64)
    G, db = aligned_zeros((rows * active, h), np.float32), aligned_zeros(h, np.float32)
    G[:], db[:] = np.nan, np.nan
    before = blas.team_stats()["split"]
    starts, terms = np.zeros(rows * active + 2, np.int32), np.zeros(rows * active, np.int32)
    k = sparse_backward_compact(idx, dout, G, db, mark, slot, touched, starts, terms)
    assert (blas.team_stats()["split"] > before) == (k * h >= team.RANGE_MIN)
    assert (k * h >= team.RANGE_MIN) == (rows > 3)
    np.testing.assert_array_equal(touched[:k], np.unique(idx))
    np.testing.assert_array_equal(G[:k].view(np.uint32), dW[touched[:k]].view(np.uint32))
    np.testing.assert_array_equal(db, db_want)
    assert not mark.any()


@needs_team
@pytest.mark.parametrize("n_in,s,h,rows,constant", [(144, 24, 256, 64, 0), (324, 54, 1024, 256, 6),
                                                    (144, 24, 100, 128, 0), (144, 24, 256, 4, 0)])
def test_panel_first_layer_shared_over_the_team_gives_one_threads_bits(one_worker, n_in, s, h, rows, constant):
    """The panel gather and scatter (nn.sparse_forward_panels / sparse_backward_panels) in
    two halves of whole panels over the team, the second working in its own area at the
    scratch's end: the sequential float32 sums bit for bit, as with the team off (one
    call). Split where a call is enough work (the 2x2x2's shape; the 3x3x3's, far
    kernels, its centres folded into the bias; three panels and a four-column tail),
    whole where it is not (four rows)."""
    from test_nn import first_layer_case, sequential_gather, sequential_scatter

    from cubedqn.nn import NO_GROUPS, PANEL_SLOT, panel_scratch_size, sparse_backward_panels, sparse_forward_panels
    blas.want_range_fn(PANEL_SLOT)  # as a Workspace with a panel scratch does
    W, b, idx, dout = first_layer_case(rows, n_in, s, h, rows, constant)
    want = sequential_gather(idx, W, b, True)
    dW_want, db_want = sequential_scatter(idx, dout, n_in)
    scratch = np.zeros(panel_scratch_size(n_in, rows, s, h, 0, 0), np.float32)
    try:
        for workers in (1, 0):
            blas.set_team(workers)
            out, dW, db = np.full((rows, h), np.nan, np.float32), np.full((n_in, h), np.nan, np.float32), \
                np.full(h, np.nan, np.float32)
            before = blas.team_stats()["split"]
            sparse_forward_panels(idx, W, b, out, True, scratch, NO_GROUPS)
            sparse_backward_panels(idx, dout, dW, db, scratch)
            assert blas.team_stats()["split"] - before == (2 if workers and rows > 4 else 0)
            np.testing.assert_array_equal(out, want)
            np.testing.assert_array_equal(dW, dW_want)
            np.testing.assert_array_equal(db, db_want)
    finally:
        blas.set_team(1)


@needs_team
def test_panel_gather_through_tables_shared_over_the_team_gives_one_threads_bits(one_worker):
    """The 3x3x3's first layer through its cubie tables (encoding.InputGroups, built per
    panel in each half's own area) in a workspace's forward: the sequential sums of the
    table rows bit for bit, and the same Q-values, with the team splitting the gather and
    with the team off."""
    from cubedqn.cube import apply_moves, get_puzzle
    from cubedqn.encoding import Encoder
    from cubedqn.nn import MLP, Layout, Workspace, _table_codes
    p = get_puzzle("cube3")
    enc = Encoder(p, 12, canonical=False)
    layout = Layout(enc.in_dim, enc.n_active, (256, 64), 12)
    net = MLP(layout, seed=5)
    rows = 320
    ws = Workspace(layout, rows, groups=enc.input_groups)
    assert ws.groups[5].size - 1 == enc.input_groups.n_tables  # the tables pay at these rows
    rng = np.random.default_rng(3)
    states = np.ascontiguousarray([apply_moves(p, p.solved, rng.integers(0, 12, 20)) for _ in range(rows)])
    enc.encode(states, ws, 0, np.zeros(rows, np.int64))
    qs = []
    try:
        for workers in (1, 0):
            blas.set_team(workers)
            ws.acts[0][:] = np.nan
            before = blas.team_stats()["split"]
            qs.append((net.forward_ws(ws, rows).copy(), ws.acts[0].copy()))
            assert (blas.team_stats()["split"] - before >= 1) == (workers == 1)
    finally:
        blas.set_team(1)
    codes = np.zeros((rows, 26), np.int32)
    assert _table_codes(ws.idx, enc.input_groups.tables, codes)
    t_order, t_starts = enc.input_groups.tables[4], enc.input_groups.tables[5]
    W, b = net.Ws[0], net.bs[0]
    table = np.zeros((len(t_starts) - 1, W.shape[1]), np.float32)  # from zero, in list order
    for t in range(len(table)):
        for r in t_order[t_starts[t]:t_starts[t + 1]]:
            table[t] += W[r]
    want = np.repeat(b[None], rows, 0)
    for k in range(codes.shape[1]):
        want += table[codes[:, k]]
    for q, first in qs:
        np.testing.assert_array_equal(first[:rows], np.maximum(want, 0))
    np.testing.assert_array_equal(qs[0][0], qs[1][0])
