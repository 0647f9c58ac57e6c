"""scripts/bench_peers.py times "the same step" in cubedqn, numpy, PyTorch and JAX: these
tests hold it to that. From the same parameters and batch, a few steps of each
implementation must leave the same parameters (float32; cubedqn's sparse first layer
against the peers' dense one-hot input), for the momentum step the issue names and the
Adam step `cubedqn profile` runs by default. PyTorch and JAX are optional: their tests
skip where they are not installed."""
import importlib.util
import os

import numpy as np
import pytest

from cubedqn.cube import get_puzzle
from cubedqn.nn import Layout

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_peers.py")
_spec = importlib.util.spec_from_file_location("bench_peers", _PATH)
bench_peers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_peers)

STEPS = 3


def _run(step, n=STEPS):
    for _ in range(n):
        step()
    return step.params()


@pytest.fixture(scope="module")
def setup():
    puzzle = get_puzzle("cube2")
    layout = Layout(puzzle.n_stickers * 6, puzzle.n_stickers, (32, 32), 12)
    return layout, puzzle, bench_peers.make_data(puzzle, 16, seed=3)


def _assert_same_steps(mine, ref, p0):
    moved = np.abs(ref - p0)
    assert moved.max() > 1e-4  # the steps changed the parameters: a comparison of nothing cannot pass
    # float32 sums in different orders; Adam's steps are about lr per parameter whatever
    # the gradient's size, so a tolerance well under lr (1e-3) still tells a wrong update
    np.testing.assert_allclose(mine, ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("optimizer", bench_peers.OPTIMIZERS)
@pytest.mark.parametrize("variant", [{}, {"fused": False}, {"sparse": False}])  # its three rows
def test_cubedqn_step_is_the_numpy_step(setup, optimizer, variant):
    layout, puzzle, batch = setup
    ref = bench_peers.numpy_step(layout, puzzle, batch, optimizer=optimizer)
    p0 = ref.params()
    mine = bench_peers.cubedqn_step(layout, puzzle, batch, optimizer=optimizer, **variant)
    np.testing.assert_array_equal(mine.params(), p0)  # one starting point
    _assert_same_steps(_run(mine), _run(ref), p0)


def test_the_optimizers_differ(setup):
    """The comparison above tells the two updates apart (else it would pass for either)."""
    layout, puzzle, batch = setup
    a = _run(bench_peers.numpy_step(layout, puzzle, batch, optimizer="momentum"))
    b = _run(bench_peers.numpy_step(layout, puzzle, batch, optimizer="adam"))
    assert np.abs(a - b).max() > 1e-4


@pytest.mark.parametrize("optimizer", bench_peers.OPTIMIZERS)
@pytest.mark.parametrize("peer", ["torch", "jax"])
def test_peer_step_is_the_numpy_step(setup, optimizer, peer):
    pytest.importorskip(peer)
    layout, puzzle, batch = setup
    ref = bench_peers.numpy_step(layout, puzzle, batch, optimizer=optimizer)
    p0 = ref.params()
    make = bench_peers.torch_step if peer == "torch" else bench_peers.jax_step
    theirs = make(layout, puzzle, batch, optimizer=optimizer)
    np.testing.assert_allclose(theirs.params(), p0, rtol=0, atol=0)
    _assert_same_steps(_run(theirs), _run(ref), p0)


def test_bench_times_each_implementation_in_every_place_after_the_resets():
    """bench() rotates its order each repetition (no implementation always first or always
    right after another), and resets come before a repetition's timed blocks."""
    log = []

    def impl(name, resettable=False):
        f = lambda: log.append(name)  # noqa: E731
        if resettable:
            f.reset = lambda: log.append("reset " + name)
        return f

    names = ["a", "b", "c"]
    impls = {"a": impl("a", True), "b": impl("b"), "c": impl("c", True)}
    med = bench_peers.bench(impls, reps=3, inner=2)
    assert sorted(med) == names
    timed = log[3 * 3:]  # after the warm-up's three calls of each
    reps = [timed[i:i + 2 + 3 * 2] for i in range(0, len(timed), 8)]
    assert len(reps) == 3
    firsts = []
    for rep in reps:
        assert rep[:2] == ["reset a", "reset c"]
        order = rep[2::2]
        assert rep[2:] == [n for n in order for _ in range(2)]  # a block of inner calls each
        assert sorted(order) == names
        firsts.append(order[0])
    assert sorted(firsts) == names
    assert bench_peers.rotated(names, 4) == ["b", "c", "a"]
