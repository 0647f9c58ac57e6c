"""children.ChildCodes: the children's corner codes and solved flags looked up by the
parent's position equal those of expanding and framing every child, and a learner using
them takes the same steps bit for bit."""
import numpy as np
import pytest

from cubedqn.children import ChildCodes
from cubedqn.cube import expand_children, get_puzzle, scramble_into, solved_batch
from cubedqn.encoding import Encoder
from cubedqn.learner import Learner
from cubedqn.nn import Layout
from cubedqn.replay import Batch
from cubedqn.rng import make_rng

P2 = get_puzzle("cube2")


def scrambled(n, depths, n_actions, rng):
    """n valid 2x2x2 states, depths (n,) random moves from solved (short ones repeat)."""
    st = np.repeat(P2.solved[None], n, axis=0)
    scramble_into(st, depths, np.ascontiguousarray(P2.moves), n_actions, rng, True, np.empty((n, 0), np.int8))
    return np.ascontiguousarray(st)


def framed_children(enc, moves, states):
    """The reference: every representative child expanded and framed, and solved_batch."""
    reps = enc.child_reps
    kids = np.zeros((len(states), len(reps), states.shape[1]), np.uint8)
    expand_children(states, np.ascontiguousarray(moves[reps]), len(reps), kids)
    kids = kids.reshape(-1, states.shape[1])
    codes = np.zeros((len(kids), 8), np.int64)
    enc.frames(kids, np.zeros(len(kids), np.int64), codes)
    solved = np.zeros(len(kids), np.bool_)
    solved_batch(kids, solved)
    return codes, solved


@pytest.mark.parametrize("inputs,symmetry,n_actions", [("pairs", 48, 12), ("pairs", 48, 18), ("pairs", 6, 12),
                                                       ("pairs", 1, 18), ("cubies", 48, 12), ("cubies", 1, 12)])
def test_looked_up_children_equal_framed_ones(inputs, symmetry, n_actions):
    """With a 32-set table, so that entries are evicted and refilled; scrambles of 0-4
    moves, so that parents repeat (within a batch too) and children are solved."""
    enc = Encoder(P2, n_actions, inputs=inputs, symmetry=symmetry)
    moves = np.ascontiguousarray(P2.moves[:n_actions])
    cc = ChildCodes(enc, moves, 64, sets=32)
    rng = make_rng(3)
    n_solved = 0
    for it in range(40):
        states = scrambled(64, np.arange(64) % (1 + it % 5), n_actions, rng)
        rot, codes = np.zeros(64, np.int64), np.zeros((64, 8), np.int64)
        enc.frames(states, rot, codes)
        got_codes, got_solved = cc.compute(states, codes, rot)
        want_codes, want_solved = framed_children(enc, moves, states)
        assert np.array_equal(got_codes, want_codes)
        assert np.array_equal(got_solved, want_solved)
        n_solved += int(want_solved.sum())
    assert n_solved > 0
    assert 0 < cc.hits < cc.lookups == 40 * 64


def test_the_table_keeps_what_it_learned():
    """A second pass over the same states finds every parent (a table big enough)."""
    enc = Encoder(P2, 12, inputs="pairs", symmetry=48)
    moves = np.ascontiguousarray(P2.moves[:12])
    cc = ChildCodes(enc, moves, 128)
    states = scrambled(128, np.full(128, 14), 12, make_rng(1))
    rot, codes = np.zeros(128, np.int64), np.zeros((128, 8), np.int64)
    enc.frames(states, rot, codes)
    first = cc.compute(states, codes, rot)[0].copy()
    hits = cc.hits
    second = cc.compute(states, codes, rot)[0]
    assert np.array_equal(first, second)
    assert cc.hits - hits == 128


def test_applies_only_to_canonical_code_inputs():
    assert ChildCodes.applies(Encoder(P2, 12, inputs="pairs", symmetry=48))
    assert ChildCodes.applies(Encoder(P2, 12, inputs="cubies"))
    assert not ChildCodes.applies(Encoder(P2, 12, inputs="stickers", symmetry=48))  # rows need stickers
    assert not ChildCodes.applies(Encoder(P2, 12, canonical=False, inputs="cubies"))  # a turned solved cube
    assert not ChildCodes.applies(Encoder(get_puzzle("cube3"), 12))
    moves = np.ascontiguousarray(P2.moves[:12])
    with pytest.raises(ValueError, match="canonical 2x2x2 encoder with code inputs"):
        ChildCodes(Encoder(P2, 12, inputs="stickers"), moves, 8)
    with pytest.raises(ValueError, match="power of two"):
        ChildCodes(Encoder(P2, 12, inputs="pairs"), moves, 8, sets=48)


@pytest.mark.parametrize("target_cache", [True, False])
@pytest.mark.parametrize("inputs,symmetry", [("pairs", 48), ("cubies", 6)])
def test_child_cache_gives_the_same_steps(target_cache, inputs, symmetry):
    """All-actions steps with the child cache (a small table: evictions) == without it."""
    moves = np.ascontiguousarray(P2.moves[:12])
    enc = Encoder(P2, 12, inputs=inputs, symmetry=symmetry)
    layout = Layout(enc.in_dim, enc.n_active, (16,), 12)
    kw = dict(targets="all-actions", gamma=0.9, seed=5, optimizer="adam", lr=0.01, target_update_interval=3,
              target_cache=target_cache)
    on, off = (Learner(layout, moves, 16, enc, child_cache=c, **kw) for c in (True, False))
    assert on.child_codes is not None and off.child_codes is None
    on.child_codes = ChildCodes(enc, moves, 16, sets=4)
    rng = make_rng(7)
    for step in range(10):
        b = Batch(16, 24, np.float32)
        b.states[:] = scrambled(16, (np.arange(16) + step) % 6, 12, rng)
        # the target network sees the same rows in the same order either way: equal bits
        # with any BLAS
        assert on.train_step(b) == off.train_step(b)
        np.testing.assert_array_equal(on.Y, off.Y)
        np.testing.assert_array_equal(on.online.params, off.online.params)
    assert 0 < on.child_codes.hits < on.child_codes.lookups
    assert on.children_scored == off.children_scored


def test_the_config_switch_reaches_the_learner():
    from cubedqn.config import Config
    from cubedqn.dqn import Trainer
    kw = dict(puzzle="cube2", input_encoding="pairs", targets="all-actions", hidden=(8,), batch_size=8, n_envs=4,
              buffer_size=64, learning_starts=8)
    assert Trainer(Config(**kw)).learner.child_codes is not None
    assert Trainer(Config(**kw, child_cache=False)).learner.child_codes is None
    assert Trainer(Config(**dict(kw, targets="double"))).learner.child_codes is None  # no children to score
