"""Trainer pieces: replay, sum-tree, n-step returns, target rules, accumulation, LOMO,
exact resume, checkpoint errors, and a short 2x2x2 run that must learn depth <= 3."""
import json

import numpy as np
import pytest
from numba import njit

from cubedqn import blas, reference as ref
from cubedqn.checkpoint import CheckpointError
from cubedqn.config import Config
from cubedqn.cube import expand_children, get_puzzle, solved_batch
from cubedqn.dqn import Trainer, load_policy
from cubedqn.env import VecEnv, draw_explorers, greedy_actions, select_actions
from cubedqn.encoding import Encoder, Policy, q_to_world
from cubedqn.learner import Learner, all_action_targets, best_actions, bootstrapped_rows, live_targets, row_max
from cubedqn.nn import ALIGN, MLP, Layout
from cubedqn.replay import Batch, RecordLayout, ReplayBuffer, _fill_ring, tree_find, tree_rebuild, tree_set
from cubedqn.rng import make_rng
from ahead_stand_in import AheadStandIn
from blas_rows import same

P2 = get_puzzle("cube2")


def fill(buf, n, rng):
    """Add n random transitions; returns their records (one uint8 row each)."""
    rec = np.zeros((n, buf.layout.width), np.uint8)
    s, nx, a, d, k, r = buf.layout.views(rec)
    s[:] = rng.integers(0, 6, (n, 24))
    nx[:] = rng.integers(0, 6, (n, 24))
    a[:] = rng.integers(0, 12, n)
    r[:] = rng.normal(0, 1, n)
    d[:] = rng.integers(0, 2, n)
    k[:] = rng.integers(1, 4, n)
    buf.add(rec)
    return rec


@pytest.mark.parametrize("prioritized", [False, True])
def test_replay_add_matches_a_plain_ring(prioritized):
    """add(records, count) against a slot-by-slot ring: counts below the rows given, adds
    that end exactly at the capacity and ones that wrap, C-ordered records (a prioritized
    add's one-call copy) and not; the sum-tree's leaves of the slots written get the
    highest priority seen."""
    rng = np.random.default_rng(3)
    buf = ReplayBuffer(50, 24, gamma=0.9, prioritized=prioritized)
    ring, pos, size = np.zeros_like(buf.records), 0, 0
    for rows, count in ((20, 20), (30, 17), (13, 13), (40, 33), (50, 50), (10, 0), (7, 6)):
        rec = rng.integers(0, 256, (rows, buf.layout.width)).astype(np.uint8)
        if prioritized:
            buf.tree[buf.cap2:buf.cap2 + 50] = 0.0  # so that only this add's slots hold a priority
        buf.add(rec if count % 2 == 0 else np.asfortranarray(rec), count)
        slots = [(pos + k) % 50 for k in range(count)]
        for k, j in enumerate(slots):
            ring[j] = rec[k]
        pos, size = (pos + count) % 50, min(size + count, 50)
        assert np.array_equal(buf.records, ring) and (buf.pos, buf.size) == (pos, size)
        if prioritized:
            leaves = buf.tree[buf.cap2:buf.cap2 + 50]
            want = np.zeros(50)
            want[slots] = buf.max_priority ** buf.alpha
            assert np.array_equal(leaves, want)
    with pytest.raises(ValueError, match="more transitions at once than the buffer holds"):
        buf.add(np.zeros((51, buf.layout.width), np.uint8))
    for rec, count in ((np.zeros((5, buf.layout.width + 1), np.uint8), None),  # another width
                       (np.zeros((5, buf.layout.width), np.uint8), 6)):           # fewer rows than count
        with pytest.raises(ValueError, match="broadcast|another width"):
            buf.add(rec, count)
        with pytest.raises(ValueError, match="broadcast|another width"):
            buf.add(np.asfortranarray(rec), count)


@njit(cache=False)
def _powers_row_by_row(gamma, n, out):
    """out[k] = gamma ** n[k] (gamma a scalar of out's dtype, n uint8: _gather's types)."""
    for k in range(n.shape[0]):
        out[k] = gamma ** n[k]
    return out


@pytest.mark.parametrize("stickers", [24, 54, 96])  # records of 56 bytes, 116 and 200 padded to 128 and 256
@pytest.mark.parametrize("prioritized", [False, True])
def test_replay_sample_gathers_the_sampled_records(stickers, prioritized):
    """sample's gather (two passes: a byte of each cache line first, then the rows) gives
    the sampled records as they are and gamma to the power of their n-step counts, for
    records of one, two and four cache lines; gamma in each batch's own dtype (sample
    keeps it cast for the last dtype: float64 after float32 must not reuse float32's)."""
    rng = np.random.default_rng(4)
    buf = ReplayBuffer(3000, stickers, gamma=0.9, prioritized=prioritized)
    rec = rng.integers(0, 256, (3000, buf.layout.width)).astype(np.uint8)
    rec[:, buf.layout.nsteps] = rng.integers(1, 6, 3000)
    buf.add(rec)
    state = make_rng(2)
    for dtype, rtol in ((np.float32, 1e-6), (np.float64, 1e-13), (np.float32, 1e-6)):
        batch = Batch(64, stickers, dtype)
        buf.sample(state, batch)
        assert len(set(batch.indices.tolist())) > 1
        assert np.array_equal(batch.records, rec[batch.indices])
        n = rec[batch.indices, buf.layout.nsteps]
        np.testing.assert_allclose(batch.discounts, 0.9 ** n.astype(np.float64), rtol=rtol)
        # the power is computed again only where n changes from the row before: the same
        # bits as gamma ** n row by row (here n changes often; below, in long runs)
        assert np.array_equal(batch.discounts, _powers_row_by_row(dtype(0.9), n, np.empty(64, dtype)))
    buf.nsteps[:] = np.repeat([0, 3, 3, 1, 0], 600)  # long runs of one n, 0 first
    for dtype in (np.float32, np.float64):
        batch = Batch(64, stickers, dtype)
        buf.sample(state, batch)
        n = buf.nsteps[batch.indices]
        assert len(set(n.tolist())) > 1
        assert np.array_equal(batch.discounts, _powers_row_by_row(dtype(0.9), n, np.empty(64, dtype)))
    with pytest.raises(AttributeError):
        buf.gamma = 0.5  # fixed at construction: sample's cast of it would go stale


def test_records_longer_than_a_line_are_padded_to_whole_lines(tmp_path):
    """A record of more than 64 bytes takes whole cache lines in memory (rows on lines'
    boundaries, the padding zero, the fields where they were), and a file holds the packed
    fields only: what an older file holds, so it loads the same; a file of padded rows is
    refused with the shape it needed. The env writes its records with the same padding."""
    rng = np.random.default_rng(5)
    for stickers, packed, width in ((24, 56, 56), (54, 116, 128), (96, 200, 256)):
        layout = RecordLayout(stickers)
        assert (layout.packed, layout.width) == (packed, width) and layout.reward + 4 == packed
        buf = ReplayBuffer(50, stickers, gamma=0.9, prioritized=True)
        batch = Batch(8, stickers, np.float32)
        assert buf.records.shape == (50, width) and batch.records.shape == (8, width)
        assert buf.records.ctypes.data % 64 == 0 and batch.records.ctypes.data % 64 == 0
        rows = np.zeros((30, width), np.uint8)
        rows[:, :packed] = rng.integers(0, 256, (30, packed))
        buf.add(rows)
        buf.save(tmp_path / "r.npz")
        with np.load(tmp_path / "r.npz") as data:
            assert np.array_equal(data["replay_records"], rows[:, :packed])
        other = ReplayBuffer(50, stickers, gamma=0.9, prioritized=True)
        other.load(tmp_path / "r.npz")
        assert np.array_equal(other.records, buf.records) and np.array_equal(other.tree, buf.tree)
        other.sample(make_rng(1), batch)
        assert np.array_equal(batch.records, rows[batch.indices])
        if width != packed:
            arrays = {k: np.asarray(v) for k, v in buf.arrays().items()}
            arrays["replay_records"] = buf.records[:30]
            np.savez(tmp_path / "padded.npz", **arrays)
            with pytest.raises(ValueError, match=f"expected \\(30, {packed}\\)"):
                other.load(tmp_path / "padded.npz")
    env = VecEnv(get_puzzle("cube3"), 4, 12, max_moves=3, gamma=0.9, n_step=1)
    assert env.out.shape[1] == RecordLayout(54).width == 128
    env.reset(np.ones(4, np.bool_), 1, 3, make_rng(0))
    total = 0
    for _ in range(6):
        count, _ = env.step(np.zeros(4, np.int64))
        assert not env.out[:count, 116:].any() and env.out[:count, 0:54].any()
        total += count
        env.reset(env.ended, 1, 3, make_rng(1))
    assert total > 0


@pytest.mark.parametrize("prioritized", [False, True])
def test_adds_to_a_large_ring_stream_the_same_rows(prioritized):
    """A ring of STREAM_BYTES and more with rows a multiple of STREAM bytes (1M 3x3x3
    records) takes its adds by non-temporal stores (_add_rows says so); the rows land as
    numpy's copy puts them, across the wrap too, from a record matrix whose rows are not
    contiguous as well (the element loop). A smaller ring copies them as before."""
    from cubedqn.replay import STREAM_BYTES, _add_rows
    rng = np.random.default_rng(6)
    buf = ReplayBuffer(1_000_000, 54, gamma=0.9, prioritized=prioritized)
    assert buf.records.nbytes >= STREAM_BYTES
    rows = rng.integers(0, 256, (100, buf.layout.width)).astype(np.uint8)
    buf.add(rows, 70)
    assert np.array_equal(buf.records[:70], rows[:70]) and not buf.records[70:80].any()
    buf.pos = buf.capacity - 30
    wide = np.zeros((100, 2 * buf.layout.width), np.uint8)
    wide[:, ::2] = rows  # every other byte: rows of the width that are not contiguous
    for src in (wide[:, ::2], rows, rows, rows):  # the same rows from the third on: by the entry point
        buf.pos = buf.capacity - 30
        buf.records[:] = 0
        buf.add(src, 64)
        assert np.array_equal(buf.records[-30:], rows[:30]) and np.array_equal(buf.records[:34], rows[30:64])
        assert not buf.records[34:-30].any()
    assert buf._add_entry.keys[0] is rows
    if prioritized:
        assert np.array_equal(buf.tree[buf.cap2 + np.r_[0:34, buf.capacity - 30:buf.capacity]], np.ones(64))
    assert _add_rows(buf.records, rows, 0, 10)
    small = ReplayBuffer(1000, 54, gamma=0.9)
    assert not _add_rows(small.records, rows, 995, 10)
    assert buf._streams and not small._streams  # the buffer routes its adds by the kernel's own predicate
    assert np.array_equal(small.records[995:], rows[:5]) and np.array_equal(small.records[:5], rows[5:10])
    with pytest.raises(ValueError, match="another width"):
        buf.add(np.zeros((5, buf.layout.packed), np.uint8))


def test_replay_ring_round_trip_and_wraparound(tmp_path):
    rng = np.random.default_rng(0)
    buf = ReplayBuffer(100, 24, gamma=0.9)
    chunks = np.concatenate([fill(buf, 30, rng) for _ in range(4)])  # 120 > 100: wraps
    assert buf.size == 100 and buf.pos == 20
    # slot j holds the most recent transition written there
    for j in range(100):
        src = j + 100 if j < 20 else j
        assert np.array_equal(buf.records[j], chunks[src])
    assert buf.nbytes_per_transition == 24 + 24 + 1 + 1 + 1 + 1 + 4 <= 64
    buf.save(tmp_path / "r.npz")
    other = ReplayBuffer(100, 24, gamma=0.9)
    other.load(tmp_path / "r.npz")
    assert np.array_equal(other.records, buf.records) and other.pos == buf.pos
    batch = Batch(8, 24, np.float32)
    other.sample(make_rng(1), batch)
    for k in range(8):
        j = batch.indices[k]
        assert np.array_equal(batch.states[k], buf.states[j])
        assert np.array_equal(batch.next_states[k], buf.next_states[j])
        assert (batch.actions[k], batch.dones[k], batch.rewards[k]) == (buf.actions[j], buf.dones[j], buf.rewards[j])
        assert batch.discounts[k] == pytest.approx(0.9 ** buf.nsteps[j])


def test_uniform_sampling_distribution():
    buf = ReplayBuffer(50, 24, gamma=0.9)
    fill(buf, 50, np.random.default_rng(0))
    batch = Batch(64, 24, np.float32)
    rng = make_rng(2)
    counts = np.zeros(50)
    for _ in range(500):
        buf.sample(rng, batch)
        counts += np.bincount(batch.indices, minlength=50)
    expected = 500 * 64 / 50
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 100  # 49 dof: p ~ 1e-5 cut-off


@pytest.mark.parametrize("capacity,size", [(1, 1), (3, 2), (13, 13), (20, 20), (40, 37), (1000, 700), (5000, 5000),
                                           (1 << 18, 3000), ((1 << 20) + 1, (1 << 20) + 1)])
@pytest.mark.parametrize("dtype,n", [(np.float32, 64), (np.float64, 64), (np.float32, 30)])
def test_prioritized_sampling_descends_as_tree_find_does(capacity, size, dtype, n):
    """The sampler's descents, run level by level side by side, pick what tree_find picks
    one at a time from the same draws (zero priorities among the leaves too; trees of 0 to
    21 levels: the top 12 levels four draws a vector step, those of 17 and more their
    bottom levels three at a time; 30 draws, two past the last four, as well as 64), and
    the importance weights float64's pow gives, rounded once to the batch's dtype
    (positive_powers is within about 1e-13 of pow)."""
    from cubedqn.rng import uniform
    rng = np.random.default_rng(capacity)
    buf = ReplayBuffer(capacity, 24, gamma=0.9, prioritized=True)
    buf.add(rng.integers(0, 6, (size, buf.layout.width)).astype(np.uint8))
    pri = rng.uniform(0, 2, size) * (rng.uniform(size=size) > 0.2)  # a fifth of them zero
    pri[0] = max(pri[0], 0.1)
    tree_set(buf.tree, buf.cap2, np.arange(size), pri)
    batch = Batch(n, 24, dtype)
    state = make_rng(7)
    mine = state.copy()
    buf.sample(mine, batch, beta=0.4)
    tree, cap2, total = buf.tree, buf.cap2, buf.tree[1]
    want = []
    for k in range(n):
        i = min(tree_find(tree, cap2, (k + uniform(state)) * (total / n)), size - 1)
        want.append(i)
    assert batch.indices.tolist() == want and np.array_equal(mine, state)
    w = (size * tree[cap2 + np.array(want)] / total) ** -0.4
    np.testing.assert_allclose(batch.weights, w / w.max(), rtol=1e-6 if dtype == np.float32 else 1e-12)


def test_prioritized_weights_stay_finite_for_a_leaf_below_float32s_range():
    """A weight beyond float32's range ((1e-300 / 3) ** -0.4, about 1e120) is normalised in
    float64 before it is rounded to the batch's dtype (stored first, it was inf, and the
    weights inf or NaN after the division by the largest; with float32 powers, powf saw 0).
    Reached here through the clamp of draws past the filled leaves onto the last one, whose
    priority is 1e-300 of the others'."""
    buf = ReplayBuffer(4, 24, gamma=0.9, prioritized=True)
    buf.add(np.zeros((2, buf.layout.width), np.uint8))
    tree_set(buf.tree, buf.cap2, np.arange(3), np.array([1.0, 1e-300, 5.0]))  # leaf 2: past size
    batch = Batch(64, 24, np.float32)
    buf.sample(make_rng(0), batch)
    assert set(batch.indices.tolist()) == {0, 1}
    assert np.isfinite(batch.weights).all() and batch.weights.max() == 1.0
    assert (batch.weights[batch.indices == 1] == 1.0).all()  # the rarest leaf has the largest weight


@pytest.mark.parametrize("p", [-1.0, -0.4, -0.123, 0.0, -0.0, 0.5, 1.0, -2.5, 1.7])
def test_positive_powers_match_pow_over_float64s_range(p):
    """replay.positive_powers (the importance weights' powers: polynomials, no call) against
    libm's pow through numpy: within 2e-13 relative where the result is normal, within
    2e-13 of the smallest normal where it is subnormal, and the same 0 or inf where pow
    underflows or overflows; x from 5e-324 to float64's largest, the ends of [sqrt(1/2),
    sqrt(2)) and powers of two included; 0 gives 0 (a leaf that cannot be drawn)."""
    from cubedqn.replay import positive_powers
    rng = np.random.default_rng(5)
    tiny = np.finfo(np.float64).tiny
    x = np.concatenate([10.0 ** rng.uniform(-330, 308.2, 20000), rng.uniform(0.5, 2, 5000),
                        [0.0, 5e-324, 1e-320, tiny, np.nextafter(tiny, 0), 1.0, 2.0, 0.5, 2.0 ** -1022, 2.0 ** 1023,
                         np.sqrt(0.5), np.sqrt(2), np.nextafter(np.sqrt(2), 3), np.finfo(np.float64).max]])
    got = x.copy()
    positive_powers(got, p)
    with np.errstate(all="ignore"):
        want = np.where(x > 0, np.power(x, p), 0.0)
    normal = np.isfinite(want) & (want >= tiny)
    np.testing.assert_allclose(got[normal], want[normal], rtol=2e-13, atol=0)
    sub = (want > 0) & (want < tiny)
    assert np.abs(got[sub] - want[sub]).max(initial=0.0) <= 2e-13 * tiny
    edge = ~normal & ~sub
    assert np.array_equal(got[edge], want[edge])
    assert sub.any() == (abs(p) >= 1)  # subnormal results are reached where |p| >= 1
    assert (got[x == 0] == 0.0).all() and got.dtype == np.float64


def test_entry_binds_the_overload_with_its_fixed_arguments():
    """calls.Entry.bind holds the overload's own entry point, found for the types of the
    fixed arguments and of the stand-ins for the varying ones, with the fixed arguments
    bound, and the objects it holds it for."""
    from numba import typeof
    from cubedqn.calls import Entry
    from cubedqn.replay import _add_prioritized
    e = Entry(_add_prioritized)
    assert e.keys == () and e.missed == () and e.call is None
    records, tree = np.zeros((8, 4), np.uint8), np.zeros(16)
    src = np.arange(12, dtype=np.uint8).reshape(3, 4)
    fixed = (records, src, tree)
    _add_prioritized(*fixed, 2, 3, 1.0)
    e.missed = (src, records)
    e.bind((src, records), fixed, (0, 0, 0.0))
    types = tuple(typeof(a) for a in fixed + (0, 0, 0.0))
    assert e.call.func is _add_prioritized.overloads[types].entry_point and e.call.args == fixed
    assert e.keys[0] is src and e.keys[1] is records and e.missed == ()
    e.call(6, 3, 2)  # wraps: rows 6, 7, 0; an int for the float64 value is taken as 2.0
    assert np.array_equal(records[[6, 7, 0]], src) and np.array_equal(tree[[14, 15, 8]], [2.0, 2.0, 2.0])
    assert np.array_equal(records[2:5], src) and np.array_equal(tree[10:13], [1.0, 1.0, 1.0])


@pytest.mark.parametrize("prioritized", [False, True])
def test_replay_kernels_by_their_entry_points_give_what_the_dispatcher_gives(prioritized):
    """A buffer called on the same arrays over and over (adds from one record matrix,
    samples into one batch with one rng, priority updates from one pair of arrays: its
    kernels' entry points from the third call on) and a twin given new arrays every time
    (their dispatchers) hold the same records and tree and sample the same bits; a buffer
    array replaced by another object is met by the dispatcher again, and a Batch's
    arrays cannot be replaced."""
    rng = np.random.default_rng(11)
    bufs = [ReplayBuffer(300, 24, gamma=0.9, prioritized=prioritized) for _ in range(2)]
    rec = np.zeros((40, bufs[0].layout.width), np.uint8)
    batch, states = Batch(16, 24, np.float32), [make_rng(5), make_rng(5)]
    idx, td = np.zeros(16, np.int64), np.zeros(16, np.float32)
    for step in range(12):
        rec[:] = rng.integers(0, 6, rec.shape)
        rec[:, bufs[0].layout.nsteps] = rng.integers(1, 4, len(rec))
        bufs[0].add(rec, 25 + step)
        bufs[1].add(rec.copy(), 25 + step)
        assert np.array_equal(bufs[0].records, bufs[1].records) and np.array_equal(bufs[0].tree, bufs[1].tree)
        other = Batch(16, 24, np.float32)
        bufs[0].sample(states[0], batch, beta=0.5)
        bufs[1].sample(states[1], other, beta=0.5)
        for name in ("indices", "records", "weights", "discounts"):
            assert np.array_equal(getattr(batch, name), getattr(other, name))
        if prioritized:
            idx[:] = batch.indices
            td[:] = rng.normal(0, 2, 16)
            bufs[0].update_priorities(idx, td)
            bufs[1].update_priorities(idx.copy(), td.copy())
            assert np.array_equal(bufs[0].tree, bufs[1].tree) and bufs[0].max_priority == bufs[1].max_priority
        if step == 8:  # another records array: the dispatcher again, then its entry point
            bufs[0].records = bufs[0].records.copy()
    kernels = [bufs[0]._sample_entry] + ([bufs[0]._add_entry, bufs[0]._priorities_entry] if prioritized else [])
    for e in kernels:  # each ended on its entry point, not on the dispatcher
        assert e.keys and e.call.func is not e.kernel and e.missed == ()
    assert bufs[0]._sample_entry.keys[2] is bufs[0].records
    if prioritized:  # alpha and eps are read at every call, not bound with the arrays
        for b in bufs:
            b.alpha, b.eps = 0.5, 0.01
        bufs[0].update_priorities(idx, td)
        bufs[1].update_priorities(idx.copy(), td.copy())
        assert bufs[0]._priorities_entry.keys and np.array_equal(bufs[0].tree, bufs[1].tree)
        want = (np.abs(td[-1].astype(np.float64)) + 0.01) ** 0.5
        assert bufs[0].tree[bufs[0].cap2 + idx[-1]] == want
    for e in [bufs[1]._sample_entry] + ([bufs[1]._add_entry, bufs[1]._priorities_entry] if prioritized else []):
        assert e.keys == () and e.call is None and e.missed  # new arrays every call: the dispatcher
    e = bufs[0]._sample_entry  # new objects: the dispatcher, then the entry point on the third call
    other = Batch(16, 24, np.float32)
    bufs[0].sample(states[0], other)
    assert e.keys == () and e.missed[1] is other
    bufs[0].sample(states[0], other)
    assert e.keys[1] is other and e.missed == ()
    with pytest.raises(AttributeError, match="fixed"):
        batch.weights = np.ones(16, np.float64)


def libm_pow(values, alpha):
    """values ** alpha as the replay's kernels compute it: the C library's pow, one value at
    a time (Python's float power calls it too). numpy's power runs its own vector code on
    AVX-512 CPUs, which can differ from it in the last bit (seen on a Zen 4 host)."""
    return np.array([v ** alpha for v in np.asarray(values, np.float64).tolist()])


@pytest.mark.parametrize("capacity", [1, 13, 1000])
def test_priority_updates_set_the_tree_as_tree_set_does(capacity):
    """update_priorities (its ascents level by level side by side) leaves the sum-tree
    bit for bit as (|td| + eps) ** alpha through tree_set one leaf at a time does, indices
    listed twice in a batch included, and the same highest priority."""
    rng = np.random.default_rng(capacity)
    buf = ReplayBuffer(capacity, 24, gamma=0.9, prioritized=True)
    buf.add(rng.integers(0, 6, (capacity, buf.layout.width)).astype(np.uint8))
    tree, top = buf.tree.copy(), buf.max_priority
    for n in (64, 64, 7):
        idx = rng.integers(0, capacity, n)
        idx[n // 2] = idx[0]  # a leaf twice
        td = (rng.normal(0, 2, n) * (rng.uniform(size=n) > 0.1)).astype(np.float32)
        buf.update_priorities(idx, td)
        pri = np.abs(td).astype(np.float64) + buf.eps
        top = max(top, float(pri.max()))
        tree_set(tree, buf.cap2, idx, libm_pow(pri, buf.alpha))
        assert np.array_equal(buf.tree, tree) and buf.max_priority == top


@pytest.mark.parametrize("capacity", [1, 13, 64, 1000])
def test_sum_tree_holds_the_sums_of_its_leaves(capacity):
    """After any mix of adds (wrapping ones and whole-capacity ones included) and priority
    updates, every node of the replay's sum-tree is, bit for bit, the pairwise sum of its
    children as the numpy reference builds it from the leaves, and the same tree as
    tree_set one leaf at a time gives."""
    rng = np.random.default_rng(capacity)
    buf = ReplayBuffer(capacity, 24, gamma=0.9, prioritized=True)
    one_at_a_time = buf.tree.copy()
    for step in range(40):
        if step % 3 != 2:
            count = int(rng.integers(0, capacity + 1)) if step % 7 else capacity
            start = buf.pos
            buf.add(rng.integers(0, 6, (count, buf.layout.width)).astype(np.uint8))
            slots = (start + np.arange(count)) % capacity
            tree_set(one_at_a_time, buf.cap2, slots, np.full(count, buf.max_priority ** buf.alpha))
        else:
            n = int(rng.integers(1, 70))
            idx = rng.integers(0, max(buf.size, 1), n)
            td = rng.normal(0, 3, n).astype(np.float32)
            buf.update_priorities(idx, td)
            tree_set(one_at_a_time, buf.cap2, idx, libm_pow(np.abs(td).astype(np.float64) + buf.eps, buf.alpha))
        leaves = buf.tree[buf.cap2:buf.cap2 + capacity]
        assert np.array_equal(buf.tree[1:], ref.sum_tree(leaves, buf.cap2)[1:])
        assert np.array_equal(buf.tree, one_at_a_time)


def test_sum_tree_of_zero_leaves_sums_to_zero():
    """A subtree whose leaves go back to zero sums to exactly zero (a difference added up
    the tree would leave rounding residue there for a descent to follow), and the
    prioritized sampler never picks a zero-priority slot."""
    rng = np.random.default_rng(5)
    buf = ReplayBuffer(64, 24, gamma=0.9, prioritized=True)
    fill(buf, 64, rng)
    tree_set(buf.tree, buf.cap2, np.arange(64), rng.uniform(0.1, 1.0, 64) * 1e3)
    tree_set(buf.tree, buf.cap2, np.arange(8, 16), rng.uniform(0.1, 1.0, 8) * 1e-9)
    tree_set(buf.tree, buf.cap2, np.arange(8, 16), np.zeros(8))
    assert buf.tree[(buf.cap2 + 8) // 8] == 0.0  # the node above leaves 8..15
    batch, state = Batch(64, 24, np.float32), make_rng(2)
    for _ in range(200):
        buf.sample(state, batch, beta=0.4)
        assert not np.any((batch.indices >= 8) & (batch.indices < 16))


def test_loading_a_replay_buffer_sums_its_tree_again():
    """A saved tree whose inner nodes are off (files before stop 42 added differences up
    the tree) loads as the sums of its leaves; a tree of the wrong size is refused."""
    rng = np.random.default_rng(6)
    buf = ReplayBuffer(100, 24, gamma=0.9, prioritized=True)
    fill(buf, 100, rng)
    buf.update_priorities(np.arange(100), rng.normal(0, 1, 100).astype(np.float32))
    data = {k: v.copy() for k, v in buf.arrays().items()}
    data["replay_tree"][1:buf.cap2] *= 1 + 1e-12  # rounding residue in the inner nodes
    other = ReplayBuffer(100, 24, gamma=0.9, prioritized=True)
    other.load_arrays(data)
    assert np.array_equal(other.tree, buf.tree)
    data["replay_tree"] = data["replay_tree"][:-2]
    with pytest.raises(ValueError, match="replay priorities have shape"):
        ReplayBuffer(100, 24, gamma=0.9, prioritized=True).load_arrays(data)
    tree = buf.tree.copy()
    tree[1:buf.cap2] = 0.0
    tree_rebuild(tree, buf.cap2)
    assert np.array_equal(tree, buf.tree)


def test_sum_tree_matches_numpy_prefix_sums():
    rng = np.random.default_rng(0)
    cap2 = 16
    tree = np.zeros(2 * cap2)
    pri = rng.uniform(0, 2, 13)
    tree_set(tree, cap2, np.arange(13), pri)
    assert tree[1] == pytest.approx(pri.sum())
    cum = np.cumsum(pri)
    for m in rng.uniform(0, pri.sum(), 200):
        assert tree_find(tree, cap2, m) == int(np.searchsorted(cum, m, side="right"))
    tree_set(tree, cap2, np.array([3]), np.array([0.0]))
    pri[3] = 0
    assert tree[1] == pytest.approx(pri.sum())
    # a ring range that wraps: leaves 11, 12, 0, 1 of a 13-slot buffer
    _fill_ring(tree, cap2, 11, 4, 13, 0.5)
    pri[[11, 12, 0, 1]] = 0.5
    np.testing.assert_allclose(tree[cap2:cap2 + 13], pri)
    assert tree[1] == pytest.approx(pri.sum())


def test_prioritized_sampling_follows_priorities_and_weights():
    buf = ReplayBuffer(8, 24, gamma=0.9, prioritized=True, alpha=1.0, eps=0.0)
    fill(buf, 8, np.random.default_rng(0))
    pri = np.array([1, 1, 1, 1, 1, 1, 1, 9], float)
    buf.update_priorities(np.arange(8), pri)
    batch = Batch(64, 24, np.float32)
    rng = make_rng(3)
    counts = np.zeros(8)
    for _ in range(300):
        buf.sample(rng, batch, beta=1.0)
        counts += np.bincount(batch.indices, minlength=8)
    frac = counts / counts.sum()
    np.testing.assert_allclose(frac, pri / pri.sum(), atol=0.02)
    # weights (N P(i))^-1 normalised by the max: priority-1 items get weight 1, the heavy one 1/9
    w = dict(zip(batch.indices.tolist(), batch.weights.tolist()))
    assert w.get(7, 1 / 9) == pytest.approx(1 / 9, rel=1e-5)


def test_n_step_returns_on_a_hand_made_trajectory():
    # One env: scramble R U (2 moves), then play U' R' (solves on step 2).
    env = VecEnv(P2, 1, 12, max_moves=30, gamma=0.5, n_step=3)
    s0 = P2.solved[P2.moves[6]][P2.moves[0]]
    env.states[0] = s0
    env.step(np.array([1]))  # U'
    c1 = env.step(np.array([1]))  # wrong way: U' again (no solve)
    assert c1 == (0, 0) and env.n_ended == 0
    c2 = env.step(np.array([0]))  # U: back to after U'
    assert c2[0] == 1  # history full (3): emits the oldest
    assert env.out_n[0] == 3 and env.out_r[0] == pytest.approx(-(1 + 0.5 + 0.25))
    assert np.array_equal(env.out_s[0], s0) and env.out_done[0] == 0
    c3 = env.step(np.array([7]))  # R': solved -> emits the 3 remaining transitions
    assert c3 == (3, 1) and env.ended[0] and env.n_ended == 1
    np.testing.assert_allclose(env.out_r[:3], [-(1 + 0.5 + 0.25), -(1 + 0.5), -1])
    assert env.out_n[:3].tolist() == [3, 2, 1] and env.out_done[:3].tolist() == [1, 1, 1]
    assert all(np.array_equal(env.out_next[k], P2.solved) for k in range(3))


def test_truncation_is_not_terminal():
    env = VecEnv(P2, 1, 12, max_moves=2, gamma=0.9, n_step=1)
    env.states[0] = P2.solved[P2.moves[6]][P2.moves[0]][P2.moves[8]]
    env.step(np.array([2]))
    c, solved = env.step(np.array([2]))
    assert env.ended[0] and solved == 0 and env.out_done[0] == 0 and env.n_ended == 1


def test_ended_count_matches_the_ended_marks():
    # many envs, short episodes: some end by truncation, some by solving, some go on
    env = VecEnv(P2, 32, 12, max_moves=3, gamma=0.9, n_step=2)
    rng = np.random.default_rng(5)
    env.states[:] = P2.solved[P2.moves[rng.integers(0, 12, 32)]]  # one move from solved: a solve is likely
    mixed = False
    for _ in range(6):
        env.step(rng.integers(0, 12, 32))
        assert env.n_ended == int(env.ended.sum())
        mixed |= 0 < env.n_ended < 32
        env.reset(env.ended, 1, 3, make_rng(1))
    assert mixed


def test_double_vs_vanilla_targets_on_a_hand_made_batch():
    """live_targets on the rows that bootstrap (bootstrapped_rows), the target's rows of
    them compacted, against the reference's targets over every row."""
    q_on = np.array([[1.0, 5.0, 2.0], [0.0, -1.0, 3.0], [2.0, 0.0, 1.0]])
    q_t = np.array([[4.0, 0.5, 1.0], [2.0, 7.0, 1.0], [-3.0, 6.0, -2.0]])
    r = np.array([-1.0, -1.0, -1.0]); d = np.array([0, 1, 0], np.uint8); disc = np.array([0.9, 0.9, 0.81])
    live, best, y = np.zeros(3, np.int64), np.zeros(3, np.int64), np.zeros(3)
    k = bootstrapped_rows(d, disc, live)
    assert k == 2 and list(live[:2]) == [0, 2]
    best_actions(q_on, live, best[:k])
    assert list(best[:k]) == [1, 0]
    live_targets(q_t[live[:k]], live, k, best, r, d, disc, True, y)
    np.testing.assert_allclose(y, [-1 + 0.9 * 0.5, -1.0, -1 + 0.81 * -3.0])  # argmax online 1 -> Q_t 0.5
    np.testing.assert_allclose(y, ref.double_dqn_targets(r, d, disc, q_on, q_t))
    live_targets(q_t[live[:k]], live, k, best, r, d, disc, False, y)
    np.testing.assert_allclose(y, [-1 + 0.9 * 4.0, -1.0, -1 + 0.81 * 6.0])
    np.testing.assert_allclose(y, ref.dqn_targets(r, d, disc, q_t))
    disc[0] = 0.0  # no discount: nothing to bootstrap either
    assert bootstrapped_rows(d, disc, live) == 1 and live[0] == 2


def test_all_actions_targets_equal_per_action_ones():
    rng = np.random.default_rng(0)
    layout = Layout(144, 24, (32,), 12)
    moves = np.ascontiguousarray(P2.moves[:12])
    lr = Learner(layout, moves, 4, Encoder(P2, 12, canonical=False), targets="all-actions", gamma=0.9)
    states = np.repeat(P2.solved[None], 4, axis=0)
    for i in range(4):
        for a in rng.integers(0, 12, i):  # includes the solved cube and 1-move scrambles
            states[i] = states[i][P2.moves[a]]
    kids = np.empty((4, 12, 24), np.uint8)
    expand_children(states, moves, 12, kids)
    flat = kids.reshape(48, 24)
    solved = np.empty(48, np.bool_)
    solved_batch(flat, solved)
    q_kids = Policy(lr.target, lr.encoder).q_values(flat)
    Y = np.zeros((4, 12))
    kid_max = np.zeros(48)
    row_max(q_kids, kid_max)
    all_action_targets(kid_max, solved, 0.9, np.arange(12), Y)
    for i in range(4):
        for a in range(12):
            # the sampled rule for transition (s_i, a, r=-1, child, done=solved(child))
            y = ref.dqn_targets(np.array([-1.0]), np.array([float(solved[i * 12 + a])]), np.array([0.9]),
                                q_kids[i * 12 + a][None].astype(np.float64))
            assert Y[i, a] == pytest.approx(y[0], rel=1e-6)


def test_representative_children_give_the_same_targets_as_all_children():
    """Canonical 2x2x2: scoring 6 representative children == scoring all 12."""
    enc = Encoder(P2, 12, canonical=True)
    assert len(enc.child_reps) == 6
    layout = Layout(144, 24, (32,), 12)
    moves = np.ascontiguousarray(P2.moves[:12])
    lr = Learner(layout, moves, 16, enc, targets="all-actions", gamma=0.9, seed=2)
    b = a_batch(16, seed=4)
    b.states[:] = np.random.default_rng(5).integers(0, 6, (16, 24))
    for i in range(16):  # real positions, some one move from solved
        b.states[i] = P2.solved
        for a in np.random.default_rng(i).integers(0, 12, i % 5 + 1):
            b.states[i] = b.states[i][P2.moves[a]]
    lr._forward_loss(b, slice(0, 16), np.ones(16), 1 / 16)
    kids = np.empty((16, 12, 24), np.uint8)
    expand_children(b.states, moves, 12, kids)
    solved = np.empty(16 * 12, np.bool_)
    solved_batch(kids.reshape(-1, 24), solved)
    q_all = Policy(lr.target, enc).q_values(kids.reshape(-1, 24))
    Y = np.zeros((16, 12))
    kid_max = np.zeros(16 * 12)
    row_max(q_all, kid_max)
    all_action_targets(kid_max, solved, 0.9, np.arange(12), Y)
    np.testing.assert_allclose(lr.Y, Y, rtol=1e-6, atol=1e-6)


def learner_pair(**kw):
    layout = Layout(144, 24, (16, 8), 12)
    moves = np.ascontiguousarray(P2.moves[:12])
    a = Learner(layout, moves, 8, Encoder(P2, 12, canonical=True), dtype=np.float64, seed=3, **kw)
    return layout, a


def a_batch(n=8, seed=0):
    rng = np.random.default_rng(seed)
    b = Batch(n, 24, np.float64)
    b.states[:] = rng.integers(0, 6, (n, 24))
    b.next_states[:] = rng.integers(0, 6, (n, 24))
    b.actions[:] = rng.integers(0, 12, n)
    b.rewards[:] = -1
    b.dones[:] = rng.integers(0, 2, n)
    b.discounts[:] = 0.99
    return b


@pytest.mark.parametrize("targets", ["double", "dqn", "all-actions"])
def test_last_mean_q_is_the_stepped_batch_mean(targets):
    """The logged mean Q (computed only when read) is the mean over actions and states of the
    online Q-values the last step used, i.e. before its update (sampled targets: from the
    head the forward kept, its rows of s having had one value each)."""
    _, lr = learner_pair(targets=targets, lr=0.1)
    b = a_batch(seed=4)
    before = MLP(lr.layout, params=lr.online.params.copy(), dtype=np.float64)
    lr.train_step(b)
    expected = Policy(before, lr.encoder).q_values(b.states).mean()
    assert not np.array_equal(before.params, lr.online.params)
    assert lr.last_mean_q == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("inputs,symmetry,sparse,sets", [("pairs", 48, True, None), ("stickers", 1, True, None),
                                                         ("stickers", 48, False, None), ("pairs", 48, True, 2)])
def test_target_cache_gives_the_same_steps(inputs, symmetry, sparse, sets):
    """All-actions with the target cache == without it, step for step, across target
    copies (which must invalidate it); and it does hit. Few distinct positions (scrambles of
    1-3 moves) so that children repeat within a target period. sets=2: a table of 8
    entries, so that keys evict each other."""
    moves = np.ascontiguousarray(P2.moves[:12])
    enc = Encoder(P2, 12, inputs=inputs, symmetry=symmetry, sparse=sparse)
    layout = Layout(enc.in_dim, enc.n_active, (16,), 12)
    kw = dict(targets="all-actions", gamma=0.9, seed=5, optimizer="adam", lr=0.01, target_update_interval=3,
              sparse=sparse)
    on, off = (Learner(layout, moves, 16, enc, target_cache=c, **kw) for c in (True, False))
    assert on.target_cache and not off.target_cache
    if sets:
        ways = on.cache_tag.shape[1]
        on.cache_tag, on.cache_val = np.zeros((sets, ways), np.uint64), np.zeros((sets, ways), np.float32)
        on.cache_next = np.zeros(sets, np.uint8)
    rng = np.random.default_rng(2)
    for step in range(8):
        b = a_batch(16, seed=step)
        for i in range(16):
            b.states[i] = P2.solved
            for a in rng.integers(0, 12, rng.integers(1, 4)):
                b.states[i] = b.states[i][P2.moves[a]]
        same(on.train_step(b), off.train_step(b))
        same(on.Y, off.Y)
        same(on.online.params, off.online.params)
    assert on.generation == 2 and 0 < on.cache_hits < on.cache_lookups


def test_target_cache_is_cleared_where_the_generation_tags_wrap():
    """Tags hold the generation modulo 2**23 - 1 (plus one): where it wraps, an entry of
    that many generations ago would match again, so the table is emptied there, and only
    there."""
    from cubedqn.learner import GEN_BITS
    moves = np.ascontiguousarray(P2.moves[:12])
    enc = Encoder(P2, 12, inputs="pairs", symmetry=48)
    lr = Learner(Layout(enc.in_dim, enc.n_active, (16,), 12), moves, 8, enc, targets="all-actions")
    lr.cache_tag[:] = 7
    lr.generation = 5
    lr.bump_generation()
    assert lr.generation == 6 and (lr.cache_tag == 7).all()
    lr.generation = (1 << GEN_BITS) - 3
    lr.bump_generation()
    assert (lr.cache_tag == 7).all()
    lr.bump_generation()
    assert lr.generation % ((1 << GEN_BITS) - 1) == 0 and not lr.cache_tag.any()


@pytest.mark.parametrize("targets", ["double", "dqn"])
def test_whole_step_equals_the_numpy_reference(targets):
    """Learner.train_step (encode, target and online forward, targets, Huber loss, backward,
    clipped momentum) == the same step written with reference.py, in float64."""
    layout = Layout(144, 24, (16, 8), 12)
    moves = np.ascontiguousarray(P2.moves[:12])
    lr = Learner(layout, moves, 8, Encoder(P2, 12, canonical=False), targets=targets, dtype=np.float64,
                 seed=3, optimizer="momentum", lr=0.05, max_grad_norm=0.5, target_update_interval=10 ** 6)
    p = lr.online.params.copy()
    p_target = p.copy()
    opt = ref.ReferenceOptimizer("momentum", layout.size, lr.layer_slices, lr=0.05, max_grad_norm=0.5)
    for k in range(3):
        b = a_batch(seed=k)
        x, x_next = ref.onehot(b.states), ref.onehot(b.next_states)
        q_t = ref.forward(layout, p_target, x_next)[0]
        q_on = ref.forward(layout, p, x_next)[0]
        y = ref.double_dqn_targets(b.rewards, b.dones, b.discounts, q_on, q_t) if targets == "double" else \
            ref.dqn_targets(b.rewards, b.dones, b.discounts, q_t)
        q, acts = ref.forward(layout, p, x)
        loss, dq = ref.loss_and_dq(q, "huber", y, b.actions)
        opt.step(p, ref.backward(layout, p, x, acts, dq))
        assert lr.train_step(b) == pytest.approx(loss, rel=1e-12)
        np.testing.assert_allclose(lr.online.params, p, rtol=1e-10, atol=1e-12)
    assert opt.max_norm and lr.opt.last_norm > 0.5  # the clip was active


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("targets", ["double", "dqn"])
def test_terminal_transitions_skip_the_target_forward(targets, fused):
    """Only the transitions that bootstrap have their s' scored: the target net's rows are
    those s' in order, with double targets the online net's rows of s' hold s in a terminal
    transition's place, and the step's values are the reference's. An all-terminal batch
    runs no target forward: NaN target weights do not reach its targets or loss."""
    layout = Layout(144, 24, (16, 8), 12)
    moves = np.ascontiguousarray(P2.moves[:12])
    lr = Learner(layout, moves, 8, Encoder(P2, 12, canonical=False), targets=targets, dtype=np.float64, seed=3,
                 optimizer="momentum", lr=0.05, fused=fused, target_update_interval=10 ** 6)
    assert lr.fused == fused
    b = a_batch(seed=5)
    b.dones[:] = [0, 1, 1, 0, 0, 1, 0, 1]
    live = [0, 3, 4, 6]
    p, p_target = lr.online.params.copy(), lr.target.params.copy()
    x, x_next = ref.onehot(b.states), ref.onehot(b.next_states)
    q_t = ref.forward(layout, p_target, x_next)[0]
    y = ref.double_dqn_targets(b.rewards, b.dones, b.discounts, ref.forward(layout, p, x_next)[0], q_t) \
        if targets == "double" else ref.dqn_targets(b.rewards, b.dones, b.discounts, q_t)
    loss, _ = ref.loss_and_dq(ref.forward(layout, p, x)[0], "huber", y, b.actions)
    assert lr.train_step(b) == pytest.approx(loss, rel=1e-12)
    assert lr.last_target_rows == 4 and lr.target_rows_scored == 4
    np.testing.assert_allclose(lr.y, y, rtol=1e-12)
    assert np.array_equal(lr.y[[1, 2, 5, 7]], b.rewards[[1, 2, 5, 7]])  # r + 0, exactly
    W1t, b1t = lr.target.Ws[0], lr.target.bs[0]
    np.testing.assert_allclose(lr.ws_t.acts[0][:4], np.maximum(x_next[live] @ W1t + b1t, 0), rtol=1e-12)
    if targets == "double":
        first = lr.ws.acts[0]
        assert np.array_equal(first[8 + np.array([1, 2, 5, 7])], first[[1, 2, 5, 7]])
        assert not np.array_equal(first[8 + np.array(live)], first[live])
    b.dones[:] = 1
    lr.target.params[:] = np.nan
    loss = lr.train_step(b)
    assert lr.last_target_rows == 0 and lr.target_rows_scored == 4
    assert np.array_equal(lr.y, b.rewards) and np.isfinite(loss) and np.isfinite(lr.online.params).all()


@pytest.mark.parametrize("targets", ["double", "all-actions"])
def test_phase_parts_add_up_to_their_phase(targets):
    from cubedqn.learner import PhaseTimer
    _, lr = learner_pair(targets=targets)
    timer = PhaseTimer()
    for k in range(3):
        lr.train_step(a_batch(seed=k), timer)
    for phase, parts in timer.parts.items():
        assert sum(parts.values()) == pytest.approx(timer.total[phase], rel=1e-9)
        assert parts["GEMM layers"] > 0 and parts["first layer"] > 0
    assert timer.parts["forward"]["encode"] > 0 and timer.parts["backward"]["accumulate"] == 0


# (canonical frames, sparse input, dtype, targets, optimizer, clip, dueling, PER weights, hidden, batch)
FUSED_CASES = [(True, True, np.float64, "double", "momentum", "global", False, False, (16, 8), 8),
               (False, True, np.float32, "dqn", "adam", "layer", False, True, (16, 8), 8),
               (True, False, np.float32, "double", "sgd", "none", True, False, (16, 8), 8),
               (False, False, np.float64, "double", "adamw", "global", True, True, (16, 8), 8),
               (True, True, np.float32, "double", "nesterov", "global", False, False, (16, 8), 8),
               (True, True, np.float32, "double", "momentum", "global", False, False, (64,), 64)]  # panels


@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_step_equals_the_per_part_step_bitwise(case):
    """The one-kernel step (fused_sampled_step) gives the same bits as the per-part path:
    losses, td errors, gradient norms, weights, optimizer state and target copies, timed or
    not; and its timed parts add up to their phases."""
    from cubedqn.learner import PhaseTimer
    canonical, sparse, dtype, targets, opt, clip, dueling, per, hidden, n = case
    moves = np.ascontiguousarray(P2.moves[:12])
    pair = []
    for fused in (True, False):
        enc = Encoder(P2, 12, canonical=canonical, sparse=sparse)
        layout = Layout(enc.in_dim, enc.n_active, hidden, 12, dueling=dueling)
        pair.append(Learner(layout, moves, n, enc, targets=targets, dtype=dtype, seed=3, optimizer=opt, lr=0.05,
                            clip=clip, max_grad_norm=0.05, sparse=sparse, fused=fused, target_update_interval=2))
    f, p = pair
    assert f.fused and not p.fused
    assert (f.ws.panel is not None and f.ws.panel.size > 0) == (n == 64)  # None: no panel code compiled
    timer_f, timer_p = PhaseTimer(), PhaseTimer()
    for k in range(4):
        b = a_batch(n, seed=k)
        b.weights[:] = np.random.default_rng(k).random(n)
        loss = f.train_step(b, timer_f if k % 2 else None, use_weights=per)
        assert loss == p.train_step(b, timer_p, use_weights=per)
        same(f.td, p.td)
        assert f.opt.last_norm == p.opt.last_norm
        for a, c in [(f.online.params, p.online.params), (f.target.params, p.target.params), (f.opt.m, p.opt.m),
                     (f.opt.v, p.opt.v), (f.ws.q, p.ws.q)]:
            same(a, c)
    assert f.updates == p.updates == 4
    if sparse:  # both list the stickers in the encoder's order (framed: the DBL slot's first)
        for lr in (f, p):
            assert (lr.ws.idx[:n] // 6 == lr.encoder.sticker_order).all()
        assert (f.encoder.sticker_order[:3] == P2.corner_facelets[6]).all() == canonical
    same(f.target.params, f.online.params)  # copied at updates 2 and 4
    assert f.opt.last_norm > 0.05 or clip == "none"  # the clip was active
    for phase, parts in timer_f.parts.items():
        assert sum(parts.values()) == pytest.approx(timer_f.total[phase], rel=1e-9)
    for phase in ("forward", "backward", "optimizer"):
        assert timer_f.total[phase] > 0
    assert all(timer_f.parts["forward"][part] > 0 for part in ("encode", "first layer", "GEMM layers"))
    # the Python around the one call is its own part; the per-part path has no such call
    assert timer_f.parts["forward"]["kernel call"] > 0 and timer_p.parts["forward"]["kernel call"] == 0
    assert np.all(np.diff(f.stamps[:10]) >= 0)


def fused_pair(n=8):
    moves = np.ascontiguousarray(P2.moves[:12])
    pair = []
    for fused in (True, False):
        enc = Encoder(P2, 12, canonical=True, sparse=True)
        layout = Layout(enc.in_dim, enc.n_active, (16, 8), 12)
        pair.append(Learner(layout, moves, n, enc, targets="double", dtype=np.float64, seed=3, optimizer="momentum",
                            lr=0.05, fused=fused, target_update_interval=2))
    assert pair[0].fused and not pair[1].fused
    return pair


def test_fused_step_reuses_its_arguments_for_the_same_batch():
    """The one-call step gathers its fixed arguments once per batch object (one StepArgs
    struct, made again for another batch or a change of PER weights): one Batch refilled
    every step, PER weights on and off in turn, and then a second Batch, give the per-part
    path's bits throughout."""
    f, p = fused_pair()
    batches = [a_batch(8, seed=0), a_batch(8, seed=1)]
    for k in range(6):
        b = batches[k // 4]
        fresh = a_batch(8, seed=10 + k)
        for name in ("states", "next_states", "actions", "rewards", "dones", "discounts"):
            getattr(b, name)[:] = getattr(fresh, name)
        b.weights[:] = np.random.default_rng(k).random(8)
        per = k % 2 == 1
        assert f.train_step(b, use_weights=per) == p.train_step(b, use_weights=per)
        assert np.array_equal(f.td, p.td) and np.array_equal(f.online.params, p.online.params)
        assert np.array_equal(f.opt.m, p.opt.m) and np.array_equal(f.target.params, p.target.params)
    b = batches[1]
    args, kernel = f._step_args(b, False)
    assert f._step_args(b, False)[0] is args
    assert f._step_args(b, True)[0] is not args and f._step_args(batches[0], True)[0] is not args
    # the kernel called is the dispatcher's own overload for the StepArgs' type
    from numba import typeof
    from cubedqn.learner import fused_sampled_step
    assert kernel is fused_sampled_step.overloads[(typeof(args),)].entry_point


def test_fused_parts_are_booked_to_the_timer_they_ran_under():
    """The kernel sums its parts' times; a timer gets the sums of the steps run under it
    when it is read, whichever timers (or none) other steps ran under in between, and a
    reset drops what it has not yet shown."""
    from cubedqn.learner import FUSED_PARTS, PhaseTimer
    f, _ = fused_pair()
    a, b = PhaseTimer(), PhaseTimer()
    want = {id(a): np.zeros(len(FUSED_PARTS)), id(b): np.zeros(len(FUSED_PARTS))}
    for k, timer in enumerate((a, None, a, b, None, None, a, a)):
        f.train_step(a_batch(8, seed=k), timer)
        if timer is not None:
            want[id(timer)] += np.diff(f.stamps[:len(FUSED_PARTS) + 1]) * 1e-9
        if k == 2:
            assert a.total["forward"] > 0  # read between steps: booked so far, nothing twice
    for timer in (a, b):
        w = want[id(timer)]
        backward = sum(w[k] for k, (phase, _) in enumerate(FUSED_PARTS) if phase == "backward")
        assert timer.total["backward"] == pytest.approx(backward, rel=1e-9)
        assert timer.total["optimizer"] == pytest.approx(w[-1], rel=1e-9)
        gemm = sum(w[k] for k, part in enumerate(FUSED_PARTS) if part == ("forward", "GEMM layers"))
        assert timer.parts["forward"]["GEMM layers"] == pytest.approx(gemm, rel=1e-9)
        assert timer.parts["forward"]["kernel call"] > 0
        assert timer.total["forward"] == pytest.approx(sum(timer.parts["forward"].values()), rel=1e-12)
    f.train_step(a_batch(8, seed=9), a)
    a.reset()
    assert sum(a.total.values()) == 0 and sum(a.parts["forward"].values()) == 0


@pytest.mark.parametrize("kw,enc_kw", [(dict(targets="all-actions"), {}), (dict(grad_accum=2), {}),
                                       (dict(lomo=True), {}), (dict(sparse_update=True), {}),
                                       ({}, dict(symmetry=48)), ({}, dict(inputs="cubies")), (dict(fused=False), {})])
def test_fused_step_is_left_to_configurations_it_does_not_cover(kw, enc_kw):
    """all-actions targets, micro-batches, LOMO, lazy first-layer updates and encodings that
    need corner codes take the per-part path (covered by the tests above)."""
    moves = np.ascontiguousarray(P2.moves[:12])
    enc = Encoder(P2, 12, **enc_kw)
    layout = Layout(enc.in_dim, enc.n_active, (16,), 12)
    assert not Learner(layout, moves, 8, enc, **kw).fused
    assert Learner(layout, moves, 8, Encoder(P2, 12)).fused


def test_fused_step_by_default_at_any_size(monkeypatch):
    """fused=None: the one-call step wherever it covers the configuration, the issue's small
    and large shapes alike; an explicit fused=False keeps the per-part step; CUBEDQN_FUSED=0
    (FUSED False) takes it nowhere by default."""
    import cubedqn.learner as L
    moves = np.ascontiguousarray(P2.moves[:12])
    enc = Encoder(P2, 12)
    small, large = (Layout(enc.in_dim, enc.n_active, hidden, 12) for hidden in ((256, 256), (1024, 512)))
    assert Learner(small, moves, 64, enc).fused and Learner(large, moves, 256, enc).fused
    assert not Learner(large, moves, 256, enc, fused=False).fused
    monkeypatch.setattr(L, "FUSED", False)
    assert not Learner(small, moves, 64, enc).fused and not Learner(large, moves, 256, enc).fused
    assert Learner(large, moves, 256, enc, fused=True).fused


def test_the_kernel_clock_measures_durations():
    """clock.stamp (read inside njit) advances with time.perf_counter over a sleep."""
    import time
    from cubedqn import clock
    assert clock.AVAILABLE
    buf = np.zeros(4, np.int64)
    t0 = time.perf_counter_ns()
    clock.stamp(buf, 0)
    time.sleep(0.05)
    clock.stamp(buf, 1)
    t1 = time.perf_counter_ns()
    assert 0.05e9 <= buf[1] - buf[0] <= t1 - t0


@pytest.mark.parametrize("targets", ["double", "dqn", "all-actions"])
@pytest.mark.parametrize("opt", ["momentum", "adam"])
def test_accumulated_micro_batches_equal_one_batch(targets, opt):
    _, one = learner_pair(targets=targets, optimizer=opt, lr=0.01)
    _, acc = learner_pair(targets=targets, optimizer=opt, lr=0.01, grad_accum=4)
    for k in range(3):
        b = a_batch(seed=k)
        l1 = one.train_step(b)
        l2 = acc.train_step(b)
        assert l1 == pytest.approx(l2, rel=1e-12)
    np.testing.assert_allclose(one.online.params, acc.online.params, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam"])
def test_lomo_equals_full_step_with_per_layer_clipping(opt):
    _, full = learner_pair(optimizer=opt, lr=0.05, clip="layer", max_grad_norm=0.05)
    _, lomo = learner_pair(optimizer=opt, lr=0.05, lomo=True, clip="layer", max_grad_norm=0.05)
    assert lomo.grads.size == 0  # no stored gradient buffer
    for k in range(3):
        b = a_batch(seed=k)
        full.train_step(b)
        lomo.train_step(b)
        assert full.opt.last_norm == pytest.approx(lomo.opt.last_norm, rel=1e-12)
        assert full.opt.last_norm > 0.05  # the clip was active
    np.testing.assert_allclose(full.online.params, lomo.online.params, rtol=1e-12, atol=1e-14)


def tiny_cfg(**kw):
    base = dict(hidden=(32,), n_envs=16, batch_size=16, learning_starts=64, buffer_size=2000,
                steps=40, eval_interval=10, log_interval=10, depth_max=3, target_update_interval=7,
                curriculum_eval_n=16, seed=5)
    base.update(kw)
    return Config(**base)


@pytest.mark.parametrize("kw", [dict(), dict(prioritized_replay=True, n_step=3, optimizer="momentum"),
                                dict(targets="all-actions", tau=0.5)])
def test_resume_is_exact(tmp_path, kw):
    cfg = tiny_cfg(**kw)
    straight = Trainer(cfg).run()
    half = Trainer(cfg).run(max_steps=20)
    half.save(tmp_path / "run")
    resumed = Trainer.load(tmp_path / "run").run()
    assert resumed.grad_steps == straight.grad_steps == 40
    assert np.array_equal(resumed.learner.online.params, straight.learner.online.params)
    assert np.array_equal(resumed.learner.target.params, straight.learner.target.params)
    assert np.array_equal(resumed.learner.opt.m, straight.learner.opt.m)
    assert np.array_equal(resumed.rng, straight.rng)


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("kw", [dict(), dict(prioritized_replay=True, n_step=3, optimizer="momentum"),
                                dict(targets="all-actions", input_encoding="pairs", input_symmetry=48,
                                     sparse_update=True, curriculum="adaptive")])
def test_warm_up_leaves_the_trainer_as_it_was(kw, ahead, monkeypatch):
    """warm_up runs a twin (which compiles the kernels): the trainer's own run afterwards is
    the same as without it, bit for bit, and the twin's steps are not counted. With a
    second process compiling ahead (a stand-in here), the twin waits for it before its
    first gradient step, and stops it at the end."""
    import cubedqn.dqn as dqn
    cfg = tiny_cfg(**kw)
    plain = Trainer(cfg).run()
    warmed = Trainer(cfg)
    rng_before = warmed.rng.copy()
    stand_in = AheadStandIn() if ahead else None
    waited_at_steps = []
    gradient_step = dqn.Trainer.gradient_step

    def recording(self):
        waited_at_steps.append(stand_in.waited)
        gradient_step(self)
    monkeypatch.setattr(dqn.Trainer, "gradient_step", recording if ahead else gradient_step)
    assert warmed.warm_up(stand_in) > 0
    monkeypatch.undo()
    if ahead:
        assert waited_at_steps == [True, True] and stand_in.stopped
    assert warmed.grad_steps == warmed.env_steps == 0 and np.array_equal(warmed.rng, rng_before)
    warmed.run()
    assert warmed.grad_steps == plain.grad_steps == 40
    for a, b in ((warmed.learner.online.params, plain.learner.online.params),
                 (warmed.learner.target.params, plain.learner.target.params),
                 (warmed.learner.opt.m, plain.learner.opt.m), (warmed.rng, plain.rng)):
        assert np.array_equal(a, b)
    assert warmed.depth == plain.depth and warmed.last_solve_rate == plain.last_solve_rate


def _same_run(a, b):
    assert a.grad_steps == b.grad_steps
    for x, y in ((a.learner.online.params, b.learner.online.params), (a.learner.target.params, b.learner.target.params),
                 (a.learner.opt.m, b.learner.opt.m), (a.rng, b.rng)):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("failure", [None, "it exited with status 1: boom"])
def test_warm_up_hands_a_process_still_compiling_the_one_call_step_to_the_loop(failure, monkeypatch):
    """warm_up(wait=False) with the second process (a stand-in) still compiling when the
    twin would wait for it: the twin and the loop train with the per-part step, the loop
    looks every AHEAD_POLL_STEPS gradient steps and takes the one-call step from the look
    that finds the process done (or keeps the per-part step and says why, if it failed);
    the same bits as a run on the one-call step throughout (tested equal elsewhere)."""
    import cubedqn.dqn as dqn
    cfg = tiny_cfg()
    plain = Trainer(cfg).run()
    assert plain.learner.fused
    warmed = Trainer(cfg)
    stand_in = AheadStandIn(failure=failure, running_polls=2)  # the warm-up's look and the loop's first
    warmed.warm_up(stand_in, wait=False)
    assert warmed.ahead is stand_in and not warmed.learner.fused and not stand_in.stopped
    fused_at = []
    gradient_step = dqn.Trainer.gradient_step

    def recording(self):
        fused_at.append(self.learner.fused)
        gradient_step(self)
    monkeypatch.setattr(dqn.Trainer, "gradient_step", recording)
    warmed.run()
    done_at = 2 * dqn.AHEAD_POLL_STEPS
    assert len(fused_at) == 40 and done_at < 40
    assert fused_at == [False] * done_at + [failure is None] * (40 - done_at)
    assert stand_in.stopped and warmed.ahead is None and warmed.ahead_failure == failure
    _same_run(warmed, plain)


def test_a_run_ending_before_the_second_process_leaves_it_to_its_caller(monkeypatch):
    """A run over before the second process is done leaves it running (the CLI waits for it,
    for the next run's cache); an interrupted run, or a warm-up that is, stops it."""
    import cubedqn.dqn as dqn
    tr = Trainer(tiny_cfg())
    stand_in = AheadStandIn(running_polls=10 ** 6)
    tr.warm_up(stand_in, wait=False)
    tr.run(max_steps=10)
    assert tr.ahead is stand_in and not stand_in.stopped and not tr.learner.fused
    assert not tr.ahead_pending(wait=True)
    assert stand_in.waited and stand_in.stopped and tr.ahead is None and tr.learner.fused

    tr = Trainer(tiny_cfg())
    stand_in = AheadStandIn(running_polls=10 ** 6)
    tr.warm_up(stand_in, wait=False)
    gradient_step = dqn.Trainer.gradient_step

    def ctrl_c_at_step_5(self):
        gradient_step(self)
        if self.grad_steps == 5:
            self.interrupted = True
    monkeypatch.setattr(dqn.Trainer, "gradient_step", ctrl_c_at_step_5)
    tr.run()
    assert tr.interrupted and tr.grad_steps == 5 and stand_in.stopped and not stand_in.waited and tr.ahead is None
    monkeypatch.undo()

    tr = Trainer(tiny_cfg())
    stand_in = AheadStandIn(running_polls=10 ** 6)
    monkeypatch.setattr(dqn.Trainer, "run", lambda self, *a, **k: setattr(self, "interrupted", True))
    tr.warm_up(stand_in, wait=False)  # the twin's run "interrupted"
    assert tr.interrupted and stand_in.stopped and tr.ahead is None


def test_the_thread_tuner_waits_for_the_second_process(monkeypatch):
    """With --threads 2 and the tuner, the GEMMs stay on one thread while the second process
    compiles (it has the other CPU) and the tuner is not asked; once it is done they go back
    to the tuner's count and it probes at the next gradient step."""
    import cubedqn.dqn as dqn
    calls = []
    monkeypatch.setattr(dqn, "set_gemm_threads", calls.append)
    tr = Trainer(tiny_cfg(threads=2))
    tuner = tr.blas_tuner
    assert tuner is not None
    tuner.set_threads = lambda n: None  # its own probes (after a second of loop time) change nothing here
    stand_in = AheadStandIn(running_polls=2)
    tr.warm_up(stand_in, wait=False)
    assert calls == [1]
    asked = []
    step_done = type(tuner).step_done
    monkeypatch.setattr(type(tuner), "step_done", lambda self, s: (asked.append(tr.grad_steps), step_done(self, s)))
    monkeypatch.setattr(type(tuner), "probe_soon", lambda self: calls.append("probe"))
    tr.run()
    done_at = 2 * dqn.AHEAD_POLL_STEPS
    assert calls == [1, 2, "probe"] and asked and min(asked) == done_at + 1


def test_warm_up_ignores_a_diverging_twin_and_passes_on_ctrl_c(monkeypatch):
    import cubedqn.dqn as dqn

    def diverge(self, *a, **k):
        raise dqn.TrainingDiverged("twin")
    monkeypatch.setattr(dqn.Trainer, "log", diverge)
    tr = Trainer(tiny_cfg())
    tr.warm_up()  # no exception: the twin's divergence is not the run's
    assert not tr.interrupted
    monkeypatch.undo()

    def ctrl_c(self):
        self.interrupted = True
    monkeypatch.setattr(dqn.Trainer, "gradient_step", ctrl_c)
    tr.warm_up()
    assert tr.interrupted


def test_schedules_follow_the_clock_when_minutes_run_out_first(tmp_path, monkeypatch):
    import cubedqn.dqn as dqn
    now = [1000.0]
    monkeypatch.setattr(dqn.time, "perf_counter", lambda: now[0])
    cfg = tiny_cfg(steps=1000, lr_schedule="linear", learning_rate=0.01, lr_final=0.0,
                   exploration_fraction=0.5, exploration_initial_eps=1.0, exploration_final_eps=0.0)
    tr = Trainer(cfg)
    tr._budget = (now[0], 60.0, 0.0)      # what run(minutes=1) sets up
    now[0] += 15.0                         # a quarter of the budget, a few steps of 1000
    assert tr.progress() == pytest.approx(0.25)
    assert tr.epsilon() == pytest.approx(0.5)
    for _ in range(3):
        tr.env_iteration()
    tr.gradient_step()
    assert tr.learner.opt.lr == pytest.approx(0.0075)
    tr._budget = None
    # without a budget the step count rules (and the optimizer keeps its own schedule)
    fresh = Trainer(cfg)
    assert fresh.progress() == 0.0 and fresh.epsilon() == 1.0


def test_clock_progress_survives_a_checkpoint(tmp_path, monkeypatch):
    import cubedqn.dqn as dqn
    now = [0.0]

    def clock():  # every call advances the clock a little: a 1-minute budget ends mid-run
        now[0] += 0.05
        return now[0]
    monkeypatch.setattr(dqn.time, "perf_counter", clock)
    tr = Trainer(tiny_cfg(steps=10_000)).run(minutes=1.0)
    assert 0 < tr.grad_steps < 10_000
    assert tr.progress() == pytest.approx(1.0)  # the clock ran out: annealing finished
    tr.save(tmp_path / "run")
    back = Trainer.load(tmp_path / "run")
    assert back.progress() == pytest.approx(1.0) and back.epsilon() == pytest.approx(back.cfg.exploration_final_eps)


@pytest.mark.parametrize("eps", [0.0, 0.3, 0.8, 1.0])
def test_greedy_rows_acting_equals_select_actions_on_every_row(eps):
    """draw_explorers + greedy_actions on the greedy rows' Q-values pick what select_actions
    picks from every row's world-frame Q-values, with the same draws (ties, NaN included)."""
    rng = np.random.default_rng(3)
    n, a_n, s = 200, 12, 24
    states = rng.integers(0, 6, (n, s)).astype(np.uint8)
    act_map = np.array([rng.permutation(a_n) for _ in range(5)], np.int64)
    rot = rng.integers(0, 5, n)
    qc = rng.integers(-3, 3, (n, a_n)).astype(np.float32)  # few values: many ties
    qc[::17, 4] = np.nan
    q_world = np.empty_like(qc)
    q_to_world(qc, rot, act_map, q_world)
    want = np.full(n, -1, np.int64)
    r_want, r_got = make_rng(9), make_rng(9)
    select_actions(q_world, eps, r_want, want)
    got, greedy, greedy_states = np.full(n, -1, np.int64), np.full(n, -1, np.int64), np.zeros_like(states)
    k = draw_explorers(states, eps, a_n, r_got, got, greedy, greedy_states)
    assert np.array_equal(r_got, r_want)
    assert (k == n) if eps == 0 else (k == 0) if eps == 1 else 0 < k < n
    assert np.array_equal(greedy_states[:k], states[greedy[:k]])
    greedy_actions(qc[greedy[:k]], rot[greedy[:k]], act_map, greedy[:k], got)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("kw", [dict(), dict(input_encoding="pairs", input_symmetry=48, hidden=(64, 32)),
                                dict(input_encoding="cubies", sparse_input=True, canonical_input=True),
                                dict(canonical_input=False, sparse_input=False),
                                dict(puzzle="cube3", hidden=(64, 32)),
                                dict(matmul_precision="bfloat16", hidden=(64, 64))])
def test_trainer_acting_scores_only_greedy_states_and_picks_what_scoring_all_picks(kw):
    """Trainer.choose_actions (the greedy states encoded and scored, a subset of rows) gives
    the actions and rng of scoring every env state and running select_actions on them."""
    if kw.get("matmul_precision") and blas.bf16_problem() is not None:
        pytest.skip(blas.bf16_problem())
    tr = Trainer(tiny_cfg(n_envs=48, **kw))
    with blas.matmul_precision_as(tr.cfg.matmul_precision):
        _check_greedy_rows_acting(tr)


def _check_greedy_rows_acting(tr):
    for _ in range(3):  # states away from the first scrambles
        tr.env_iteration()
    for eps in (0.0, 0.5, 0.9):
        rng0, states = tr.rng.copy(), tr.env.states.copy()
        tr.encoder.encode(states, tr.act_ws, 0, tr.act_rot, want_codes=False)
        q_all = tr.learner.online.forward_ws(tr.act_ws, tr.env.n).copy()
        q_world, want = np.empty_like(q_all), np.zeros(tr.env.n, np.int64)
        q_to_world(q_all, tr.act_rot.copy(), tr.encoder.act_map, q_world)
        select_actions(q_world, eps, rng0, want)
        scored = tr.states_scored
        tr.choose_actions(eps)
        assert np.array_equal(tr.env.actions, want) and np.array_equal(tr.rng, rng0)
        k = tr.states_scored - scored
        assert k == tr.env.n if eps == 0 else k < tr.env.n
        assert np.array_equal(tr.env.states, states)


def test_same_seed_same_losses():
    logs = []
    for _ in range(2):
        recs = []
        Trainer(tiny_cfg()).run(on_log=recs.append)
        logs.append([r["loss"] for r in recs])
    assert logs[0] == logs[1] and len(logs[0]) == 4


def test_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Trainer.load(tmp_path / "nope")
    tr = Trainer(tiny_cfg(steps=5))
    tr.run()
    tr.save(tmp_path / "run")
    (tmp_path / "run" / "model.npz").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_policy(tmp_path / "run")
    tr.save(tmp_path / "run")
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    cfg["hidden"] = [33]
    (tmp_path / "run" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does not match"):
        load_policy(tmp_path / "run")
    with pytest.raises(CheckpointError, match="does not match"):
        Trainer.load(tmp_path / "run")


def test_nan_stops_the_run_and_keeps_last_checkpoint(tmp_path):
    from cubedqn.dqn import TrainingDiverged
    tr = Trainer(tiny_cfg(steps=10))
    tr.run()
    tr.save(tmp_path / "run")
    before = (tmp_path / "run" / "model.npz").read_bytes()
    tr.learner.online.params[3] = np.nan
    with pytest.raises(TrainingDiverged):
        tr.run(max_steps=30)
    with pytest.raises(TrainingDiverged):
        tr.save(tmp_path / "run")
    assert (tmp_path / "run" / "model.npz").read_bytes() == before


@pytest.mark.parametrize("puzzle,n_actions,depth", [("cube2", 12, 2), ("cube2", 18, 3), ("cube2", 12, 4),
                                                     ("cube3", 18, 3)])
def test_eval_states_are_never_solved(puzzle, n_actions, depth):
    """Depth moves can undo themselves (R L' turns a 2x2x2 whole; R R2 R): such draws are
    drawn again, and the other rows are the plain scramble's, so the set is still fixed."""
    from cubedqn.cube import scramble_into
    from cubedqn.dqn import eval_states
    p = get_puzzle(puzzle)
    states = eval_states(p, n_actions, depth, 1000, 0)
    solved = np.empty(1000, np.bool_)
    solved_batch(states, solved)
    assert not solved.any()
    assert np.array_equal(states, eval_states(p, n_actions, depth, 1000, 0))
    plain = np.repeat(p.solved[None], 1000, axis=0)
    scramble_into(plain, np.full(1000, depth), np.ascontiguousarray(p.moves), n_actions,
                  make_rng(0 * 1_000_003 + depth * 7919), True, np.empty((1000, 0), np.int8))
    solved_batch(plain, solved)
    assert solved.any()  # the case this guards against does occur at this depth
    assert np.array_equal(states[~solved], plain[~solved])
    zero = eval_states(p, n_actions, 0, 5, 0)
    assert np.array_equal(zero, np.repeat(p.solved[None], 5, axis=0))


def test_short_run_learns_shallow_scrambles():
    """Plumbing, not the learning goal: depth <= 3 on the 2x2x2 within a few seconds."""
    from cubedqn.dqn import eval_states
    from cubedqn.search import greedy_solve
    cfg = Config(hidden=(128,), targets="all-actions", n_envs=32, batch_size=64, learning_starts=500,
                 buffer_size=20000, steps=2500, curriculum="fixed", depth_min=1, depth_max=3, max_episode_moves=6,
                 target_update_interval=100, eval_interval=10 ** 6, log_interval=10 ** 6,
                 exploration_fraction=0.3, seed=1)
    tr = Trainer(cfg).run()
    moves = np.ascontiguousarray(P2.moves[:12])
    for depth in (1, 2, 3):
        solved, lengths, _ = greedy_solve(tr.policy, eval_states(P2, 12, depth, 200, 99), moves, 10)
        assert solved.mean() >= 0.9, (depth, solved.mean())


def test_ctrl_c_stops_between_steps_and_resumes_exactly(tmp_path):
    import os
    import signal
    cfg = tiny_cfg()
    straight = Trainer(cfg).run()
    tr = Trainer(cfg)
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a background job
    tr.run(on_log=lambda rec: os.kill(os.getpid(), signal.SIGINT))  # Ctrl-C at the first log line
    assert tr.interrupted and tr.grad_steps == cfg.log_interval
    assert signal.getsignal(signal.SIGINT) is before  # handler restored
    tr.save(tmp_path / "run")
    resumed = Trainer.load(tmp_path / "run").run()
    assert np.array_equal(resumed.learner.online.params, straight.learner.online.params)


def test_float32_learner_first_layer_by_panels_agrees_with_row_gather_and_lomo():
    """At batch 64 a float32 sticker network runs its first layer by panels (forward,
    backward and LOMO's backward); three steps agree with the same learner using the row
    gather, and LOMO with the full step."""
    layout = Layout(144, 24, (64,), 12)
    moves = np.ascontiguousarray(P2.moves[:12])

    def make(**kw):
        return Learner(layout, moves, 64, Encoder(P2, 12, canonical=True), dtype=np.float32, seed=3,
                       optimizer="momentum", lr=0.05, clip="layer", max_grad_norm=0.5, **kw)

    panels, rows, lomo = make(), make(), make(lomo=True)
    assert panels.ws.panel.size and panels.ws_t.panel.size and lomo.ws.panel.size
    rows.ws.panel = rows.ws_t.panel = np.zeros(0, np.float32)
    b = Batch(64, 24, np.float32)
    for k in range(3):
        rng = np.random.default_rng(k)
        b.states[:] = rng.integers(0, 6, (64, 24))
        b.next_states[:] = rng.integers(0, 6, (64, 24))
        b.actions[:] = rng.integers(0, 12, 64)
        b.rewards[:] = -1
        b.dones[:] = rng.integers(0, 2, 64)
        b.discounts[:] = 0.9
        losses = [lr.train_step(b) for lr in (panels, rows, lomo)]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5) and losses[0] == pytest.approx(losses[2], rel=1e-5)
    assert not np.array_equal(panels.online.params, panels.target.params)  # the steps moved the weights
    np.testing.assert_allclose(panels.online.params, rows.online.params, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(panels.online.params, lomo.online.params, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(optimizer="adam", grad_accum=2), dict(optimizer="momentum", lomo=True),
                                dict(optimizer="adam", sparse_update=True)])
def test_learner_buffers_start_on_cache_lines(kw):
    """Parameters, target, gradients, optimizer moments and both workspaces come from
    nn.aligned_zeros (see scripts/bench_alignment.py for what a misaligned start costs)."""
    lr = Learner(Layout(144, 24, (64, 32), 12), np.ascontiguousarray(P2.moves[:12]), 64,
                 Encoder(P2, 12, canonical=True), dtype=np.float32, **kw)
    bufs = [lr.online.params, lr.target.params, lr.opt.m, *lr.ws.acts, *lr.ws.deltas, *lr.ws_t.acts,
            lr.ws.idx, lr.ws_t.idx, lr.ws.panel]
    if kw.get("sparse_update"):
        bufs += [lr.grads, lr.grad_rows, lr.opt.v]
    else:
        bufs += [lr.grads, lr.grads_tmp, lr.opt.v] if kw["optimizer"] == "adam" else [lr.lomo_scratch]
    assert all(a.size for a in bufs)
    assert all(a.ctypes.data % ALIGN == 0 for a in bufs)


# -- BLAS thread tuning (threads.BlasThreadTuner) ----------------------------------------------

def run_tuner(tuner, step_seconds, steps):
    """Feed the tuner `steps` gradient steps (each after an env iteration) whose durations
    depend on the BLAS count in use; returns the counts it set, in order."""
    calls = []
    tuner.set_threads = lambda n: calls.append(n) or setattr(tuner, "_in_use", n)
    tuner._in_use = getattr(tuner, "_in_use", tuner.threads)
    for _ in range(steps):
        tuner.spent(0.5 * step_seconds[tuner._in_use])  # an env iteration
        tuner.step_done(step_seconds[tuner._in_use])
    return calls


def test_blas_tuner_first_probe_waits_first_probe_after_seconds_of_loop_time():
    from cubedqn.threads import BlasThreadTuner
    tuner = BlasThreadTuner(2, block_seconds=0.0, min_steps=1, first_probe_after=2.0)
    # each pass: an env iteration of 0.25 s and a gradient step of 0.5 s, 0.75 s of loop time
    assert run_tuner(tuner, {1: 0.5, 2: 0.5}, 2) == [] and tuner.probes == 0  # 1.5 s: not yet
    assert run_tuner(tuner, {1: 0.5, 2: 0.5}, 1) == [2]  # 2.25 s: the probe's first block begins
    with pytest.raises(ValueError, match="non-negative"):
        BlasThreadTuner(2, first_probe_after=-1.0)


@pytest.mark.parametrize("one_is_faster", [True, False])
def test_blas_tuner_probes_abba_and_keeps_the_faster_count(one_is_faster):
    from cubedqn.threads import BlasThreadTuner
    tuner = BlasThreadTuner(2, interval_seconds=60.0, block_seconds=5.0, min_steps=2)
    times = {1: 1.0, 2: 2.0} if one_is_faster else {1: 2.0, 2: 1.0}
    # the first step starts the probe; a block is 5 s and >= 2 steps: 4 steps at 1.5 s, 2 at 3 s.
    # Two threads at half speed are decided after the first two blocks (see the next test)
    blocks = (2, 1) if one_is_faster else (2, 1, 1, 2)
    steps = 1 + sum(2 if times[n] == 2.0 else 4 for n in blocks)
    calls = run_tuner(tuner, times, steps)
    best = 1 if one_is_faster else 2
    assert calls == [*blocks, best] and tuner.current == best and tuner.probes == 1
    assert tuner.last_probe == {2: 1.5 * times[2], 1: 1.5 * times[1]}  # loop seconds per gradient step
    quiet = int(60.0 / (1.5 * times[best]))
    assert run_tuner(tuner, times, quiet - 1) == [] and tuner.current == best  # under 60 s of loop time
    assert run_tuner(tuner, times, 1 + steps)[:len(blocks)] == list(blocks)  # then the next probe
    assert tuner.probes == 2


def test_blas_tuner_needs_a_margin_to_keep_the_requested_count_and_pause_restores_it():
    """T threads must beat one by `margin`: a tie, or T a little faster, keeps one (the
    count a one-thread run uses, which a T-thread run must not fall behind)."""
    from cubedqn.threads import BlasThreadTuner
    tuner = BlasThreadTuner(2, block_seconds=0.0, min_steps=3)
    assert run_tuner(tuner, {1: 1.0, 2: 0.97}, 13)[-1] == 1 and tuner.current == 1  # 3% faster: not enough
    tuner = BlasThreadTuner(2, block_seconds=0.0, min_steps=3)
    assert run_tuner(tuner, {1: 1.0, 2: 1.0}, 13)[-1] == 1 and tuner.current == 1  # a tie
    tuner = BlasThreadTuner(2, block_seconds=0.0, min_steps=3)
    assert run_tuner(tuner, {1: 1.0, 2: 0.90}, 13)[-1] == 2 and tuner.current == 2  # 10% faster
    tuner = BlasThreadTuner(2, block_seconds=0.0, min_steps=3)
    calls = run_tuner(tuner, {1: 1.0, 2: 3.0}, 6)  # stopped inside the probe's second block
    tuner.pause()
    assert calls == [2, 1, 2] and tuner._in_use == 2 and tuner.phase == -1 and tuner.probes == 0
    assert run_tuner(tuner, {1: 1.0, 2: 3.0}, 7) == [2, 1, 1]  # the next run probes at once
    with pytest.raises(ValueError, match="threads >= 2"):
        BlasThreadTuner(1)


def test_blas_tuner_probes_again_when_the_count_in_use_slows_down():
    """A second core taken after the probe: the kept count's steps slow past `slowdown`, so
    it probes again after one check window instead of waiting for the interval; a host
    that is slower for both counts gets one new probe, and its times are the new baseline."""
    from cubedqn.threads import BlasThreadTuner
    tuner = BlasThreadTuner(2, interval_seconds=1000.0, block_seconds=0.0, min_steps=3, check_seconds=1.0,
                            slowdown=0.25)
    assert run_tuner(tuner, {1: 1.0, 2: 0.5}, 13) == [2, 1, 1, 2, 2] and tuner.current == 2
    # the second core gone: two threads now 3x slower, one as before. A window (>= 1 s, >= 3
    # steps: 3 steps of 2.25 s loop time, against 0.75 probed) ends, then a probe, decided
    # after its first two blocks (two threads 50% slower than one)
    assert run_tuner(tuner, {1: 1.0, 2: 1.5}, 15) == [2, 1, 1] and tuner.current == 1
    assert tuner.probes == 2 and tuner.last_probe == {2: 2.25, 1: 1.5}
    # 20% slower than that probe: under the 25% slowdown, no probe
    assert run_tuner(tuner, {1: 1.2, 2: 1.8}, 30) == [] and tuner.probes == 2
    # 50% slower: one probe (one thread still faster), then its times are the baseline
    assert run_tuner(tuner, {1: 1.5, 2: 2.7}, 15) == [2, 1, 1] and tuner.probes == 3
    assert run_tuner(tuner, {1: 1.5, 2: 2.7}, 30) == [] and tuner.probes == 3


def test_blas_tuner_counts_the_loop_time_of_its_probe_blocks_and_settled_defers_the_next_probe():
    """probe_seconds is the loop time (env iterations and gradient steps) spent inside probe
    blocks, an unfinished probe's included. After a run ends (pause), the next run probes at
    once, unless settled() says the last probe's choice stands: then it waits the interval."""
    from cubedqn.threads import BlasThreadTuner
    tuner = BlasThreadTuner(2, interval_seconds=60.0, block_seconds=0.0, min_steps=3)
    times = {1: 1.0, 2: 0.5}
    # the first gradient step (1.5 s with its env iteration at 2 threads) starts the probe;
    # then 4 blocks of 3 passes: 1.5 s a pass at 1 thread, 0.75 at 2
    assert run_tuner(tuner, times, 13) == [2, 1, 1, 2, 2] and tuner.probes == 1
    assert tuner.probe_seconds == pytest.approx(3 * (0.75 + 1.5 + 1.5 + 0.75))
    assert run_tuner(tuner, times, 10) == [] and tuner.probe_seconds == pytest.approx(13.5)
    tuner.pause()
    assert run_tuner(tuner, times, 2) == [2]  # a new run: the next probe's first block at once
    assert tuner.probe_seconds == pytest.approx(13.5 + 0.75)  # its first pass
    tuner.pause()  # dropped unfinished (the BLAS back at 2), its time counted
    assert tuner._in_use == 2 and tuner.probes == 1
    tuner.settled()
    quiet = int(60.0 / 0.75)
    assert run_tuner(tuner, times, quiet - 1) == [] and tuner.probes == 1  # under 60 s of loop time
    assert run_tuner(tuner, times, 2) == [2]


def test_blas_tuner_decides_after_two_blocks_only_when_t_threads_are_clearly_slower():
    """The first two blocks (T, then one) end the probe where T ran more than `slowdown`
    slower than one: one thread is kept without timing T again. 20% slower is not clear
    enough: all four blocks, then one thread (it missed the margin)."""
    from cubedqn.threads import BlasThreadTuner
    tuner = BlasThreadTuner(2, block_seconds=0.0, min_steps=3, slowdown=0.25)
    assert run_tuner(tuner, {1: 1.0, 2: 1.3}, 7) == [2, 1, 1] and tuner.current == 1
    assert tuner.last_probe == {2: 1.5 * 1.3, 1: 1.5}
    tuner = BlasThreadTuner(2, block_seconds=0.0, min_steps=3, slowdown=0.25)
    assert run_tuner(tuner, {1: 1.0, 2: 1.2}, 13) == [2, 1, 1, 2, 1] and tuner.current == 1


def test_blas_tuner_probes_again_when_t_threads_fall_behind_one():
    """T threads kept on a probe reading them 10% faster than one, then 15% slower than
    that probe: under the 25% slowdown, but behind the one-thread time the probe read, so
    it probes again (and keeps one); one thread 15% slower than its probe does not."""
    from cubedqn.threads import BlasThreadTuner
    tuner = BlasThreadTuner(2, interval_seconds=1000.0, block_seconds=0.0, min_steps=3, check_seconds=1.0,
                            slowdown=0.25)
    assert run_tuner(tuner, {1: 1.0, 2: 0.9}, 13) == [2, 1, 1, 2, 2] and tuner.current == 2
    assert run_tuner(tuner, {1: 1.0, 2: 1.035}, 15) == [2, 1, 1, 2, 1] and tuner.current == 1  # all four blocks
    assert tuner.probes == 2
    assert run_tuner(tuner, {1: 1.15, 2: 1.5}, 30) == [] and tuner.probes == 2


def test_run_stops_after_the_gradient_step_at_which_until_returns_true():
    """run(until=f) asks f after each gradient step (profile's tuning runs until a probe has
    finished); max_steps still bounds it, and the run goes on from there."""
    cfg = Config(puzzle="cube2", hidden=(16,), n_envs=16, batch_size=16, learning_starts=16, buffer_size=500,
                 steps=100, seed=1)
    t = Trainer(cfg)
    asked = []
    t.run(max_steps=50, until=lambda: asked.append(t.grad_steps) or t.grad_steps >= 7)
    assert t.grad_steps == 7 and asked == list(range(1, 8))
    t.run(max_steps=9, until=lambda: False)
    assert t.grad_steps == 9


@pytest.mark.parametrize("mode,inputs", [("team", "stickers"), ("library", "stickers"), ("team", "pairs")])
def test_training_with_gemm_thread_switches_equals_one_thread_bitwise(mode, inputs):
    """Probes switch the GEMMs between 2 threads and 1 many times; the run's parameters are
    the same bits as a one-thread run's, where the BLAS is row-exact (tests/blas_rows.py):
    with the team (team.py) every element is one inner call's whichever column chunk it
    falls in, and the team's ranges (the optimizer's update, the sticker first layer's
    panel halves, the slot-pair first layer's row gather, the lazy rows of the all-actions
    preset's configuration) run the same code
    on every element; with the library's own threads (where there is no team), OpenBLAS
    splits rows and columns, not sums."""
    from cubedqn import blas
    from cubedqn.threads import BlasThreadTuner, limit_threads, set_blas_threads, set_gemm_threads
    if mode == "team" and blas.team_problem():
        pytest.skip(blas.team_problem())
    base = dict(puzzle="cube2", hidden=(256, 256), n_envs=16, batch_size=64, learning_starts=64,
                buffer_size=2000, steps=60, optimizer="adam", targets="double", input_encoding="stickers", seed=5)
    if inputs == "pairs":  # the cube2 presets' network, targets and lazy first-layer update
        base.update(input_encoding="pairs", targets="all-actions", batch_size=128, learning_starts=128)
    switch = set_gemm_threads if mode == "team" else set_blas_threads
    try:
        limit_threads(1)
        one = Trainer(Config(**base, threads=1)).run()
        limit_threads(2)
        if mode == "library":
            blas.set_team(0)
        tuned = Trainer(Config(**base, threads=2))
        used = []
        tuned.blas_tuner = BlasThreadTuner(2, interval_seconds=0.0, block_seconds=0.0, min_steps=2,
                                           set_threads=lambda n: used.append(n) or switch(n))
        tuned.run()
    finally:
        limit_threads(1)
    assert {1, 2} <= set(used) and tuned.blas_tuner.probes >= 3
    assert tuned.learner.updates == one.learner.updates == 60
    same(tuned.learner.online.params, one.learner.online.params)


@pytest.mark.parametrize("inputs", ["stickers", "pairs"])
def test_training_with_the_tile_sparse_path_equals_the_dense_loops_bitwise(inputs):
    """tile_sparse.py's path (ReLU outputs' zeros skipped in the products) on and off: the
    same parameters, bit for bit, after a run of the issue's Double-DQN step and of the
    cube2 presets' all-actions step (its children's forward through the target network)."""
    from cubedqn import blas
    from cubedqn.threads import limit_threads
    if blas.SPARSE_STATUS:
        pytest.skip(blas.SPARSE_STATUS)
    base = dict(puzzle="cube2", hidden=(128, 128), n_envs=16, batch_size=64, learning_starts=64,
                buffer_size=2000, steps=40, optimizer="adam", targets="double", input_encoding="stickers", seed=5)
    if inputs == "pairs":
        base.update(input_encoding="pairs", targets="all-actions", batch_size=128, learning_starts=128)
    limit_threads(1)
    runs = {}
    for on in (False, True):
        with blas.tile_sparse_as(on):
            runs[on] = Trainer(Config(**base, threads=1)).run()
    assert runs[True].learner.updates == runs[False].learner.updates == 40
    np.testing.assert_array_equal(runs[True].learner.online.params, runs[False].learner.online.params)


NO_LITERALS_RUN = """
import importlib, pkgutil
import cubedqn
from numba.core.registry import CPUDispatcher
from cubedqn.config import Config
from cubedqn.dqn import Trainer
tiny = dict(hidden=(32,), n_envs=16, batch_size=64, learning_starts=64, buffer_size=500, steps=3, log_interval=3,
            eval_interval=3, curriculum_eval_n=8)
for extra in (dict(targets="double", canonical_input=False, input_symmetry=1, optimizer="momentum"),
              dict(targets="all-actions", optimizer="adam", clip="layer")):
    Trainer(Config(puzzle="cube2", **tiny, **extra)).run()
found = []
for m in pkgutil.walk_packages(cubedqn.__path__, "cubedqn."):
    if ".cuda" not in m.name:
        for name, obj in vars(importlib.import_module(m.name)).items():
            if isinstance(obj, CPUDispatcher) and obj.__module__ == m.name:
                found += [f"{m.name}.{name}{sig}" for sig in obj.signatures if "Literal" in str(sig)]
                # the same signature but for arrays' read-only flag: one more compile of the kernel
                flat = [str(sig).replace(", True, aligned", ", False, aligned") for sig in obj.signatures]
                found += [f"{m.name}.{name}: read-only and writeable {s}" for s in set(flat) if flat.count(s) > 1]
print("\\n".join(found) or "none")
"""


def test_no_kernel_is_compiled_for_a_literal_argument(tmp_path):
    """numba compiles an njit function once per literal value a kernel calls it with
    (stamp(stamps, 0) .. stamp(stamps, 9): ten compiles, seconds of a cold start), so
    constants go in as np.int64 / np.bool_; and once more for an array that is read-only
    where another call's is not (expand_children's moves). A fresh cache, so that every
    callee compiles in this process and shows its signatures: a fused (double) and a
    per-part (all-actions, per-layer clipping) training run."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", NO_LITERALS_RUN], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "none", res.stdout
