"""The FMA ceiling probe (profiling.fma_loop / fma_ceiling_gflops): it must do the rounds of
FMAs it is timed for, or the ceiling it reports (the bound bench_peers and profile compare
the GEMMs against) would be made up."""
import numpy as np
import pytest

from cubedqn.profiling import fma_ceiling_gflops, fma_loop


@pytest.mark.parametrize("dtype,rtol", [(np.float32, 1e-4), (np.float64, 1e-12)])
def test_fma_loop_runs_every_round_on_every_chain(dtype, rtol):
    loop, lanes, chains = fma_loop(dtype)
    assert lanes * np.dtype(dtype).itemsize in (32, 64) and chains in (12, 16)
    x, y = dtype(1.0000001), dtype(1e-7)  # the loop's constants, rounded as the loop holds them
    assert loop(0) == chains * (chains - 1) / 2  # chain c starts at c
    for n in (1, 7, 1000, 20000):
        xn = float(x) ** n
        # each chain: a -> a * x + y, n times: c x^n + y (x^n - 1) / (x - 1); all chains summed
        want = chains * (chains - 1) / 2 * xn + chains * float(y) * (xn - 1) / (float(x) - 1)
        assert loop(n) == pytest.approx(want, rel=rtol * max(1, n / 1000))


def test_fma_ceiling_is_a_rate():
    assert 0 < fma_ceiling_gflops(reps=1, seconds=0.002) < 1e5


def test_listed_fraction_costs_the_walk_the_sample_chooses():
    """tile_sparse.py's cost (in union entries, a fraction of K): the rows' own lists where
    their STEP_COSTS (a side-by-side step, an entry of the longer one's rest) are under a
    union entry's over the sampled pairs, else the unions."""
    from cubedqn.profiling import listed_fraction
    from cubedqn.tile_sparse import STEP_COSTS
    own, rest, union = (STEP_COSTS[x] / STEP_COSTS["union"] for x in ("own", "rest", "union"))
    assert own < 2 * union and rest < union < own  # what the cases below rely on
    a = np.array([[1, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 3]], np.float32)  # pairs (0, 1) and (2, -)
    assert listed_fraction(a) == pytest.approx((own + rest) / 8)  # own lists: a step and a rest, unions 3
    alike = np.array([[1, 0, 0], [2, 0, 0], [0, 3, 0], [0, 4, 0]], np.float32)
    assert listed_fraction(alike) == 2 / 6  # unions: 2 entries against 2 steps
    assert listed_fraction(np.zeros((4, 6), np.float32)) == 0.0
    b = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 1, 0]], np.float32)
    assert listed_fraction(b) == pytest.approx(2 * own / 6)  # pairs (0, 1), (2, 3): own lists
    assert listed_fraction(b, halves=True) == 2 / 6  # pairs (0, 2), (1, 3): unions of one k
    assert listed_fraction(a, halves=True) == listed_fraction(a)  # an odd count keeps neighbours


def test_walked_fraction_counts_each_walks_multiply_adds():
    """The walks' multiply-adds: the rows' own nonzeros (own lists) or a pair's union twice
    (unions); one row's where the two rows hold the same bits (a terminal transition's s'
    row holds s) or the last row has no partner, except for A transposed (dW)."""
    from cubedqn.profiling import walked_fraction
    a = np.array([[1, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 3]], np.float32)  # pairs (0, 1) and (2, -): own lists
    assert walked_fraction(a) == (1 + 1 + 1) / 12
    assert walked_fraction(a, trans_a=True) == (1 + 1 + 1 + 0) / 12
    alike = np.array([[1, 0, 0], [2, 0, 0], [0, 3, 0], [0, 4, 0]], np.float32)  # unions
    assert walked_fraction(alike) == (1 * 2 + 1 * 2) / 12
    b = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 1, 0]], np.float32)
    assert walked_fraction(b) == 4 / 12  # (0, 1), (2, 3): own lists of one k each
    assert walked_fraction(b, halves=True) == 2 / 12  # (0, 2), (1, 3): twins, one row each
    assert walked_fraction(b.astype(np.float64), halves=True) == 2 / 12  # the bits of any float type
    c = b.copy()
    c[2, 0] = 2.0  # row 2 no longer row 0's bits: a union of one k, two rows
    assert walked_fraction(c, halves=True) == (1 * 2 + 1 * 1) / 12
    z = np.array([[0.0, 1.0], [-0.0, 1.0]], np.float32)  # equal values, not the same bits
    assert walked_fraction(z) == 1 * 2 / 4  # a union of one k (a zero of either sign is not listed), two rows
    assert walked_fraction(np.zeros((0, 3), np.float32)) == 1.0


@pytest.mark.parametrize("on", [False, True])
def test_gemm_flops_done_counts_the_step_the_layout_counts(on):
    """Its dense count is the layout's count of a Double-DQN step's GEMM layers (the head's
    backward from the taken actions); with tile_sparse.py's path off the products did all
    of it but the target net's rows of terminal transitions (not scored), with it on (where
    there is one) less: the activations have zeros."""
    from cubedqn import blas
    from cubedqn.config import Config
    from cubedqn.dqn import Trainer
    from cubedqn.profiling import gemm_flops_done
    from cubedqn.threads import limit_threads
    limit_threads(1)
    tr = Trainer(Config(puzzle="cube2", hidden=(128, 128), n_envs=16, batch_size=64, learning_starts=64,
                        buffer_size=500, steps=5, targets="double", input_encoding="stickers", seed=2))
    with blas.tile_sparse_as(on):
        tr.run()
        tr.batch.dones[:] = 0  # the last batch again, 5 of its transitions terminal
        tr.batch.dones[[3, 10, 11, 40, 63]] = 1
        tr.learner.train_step(tr.batch)
        done, dense = gemm_flops_done(tr.learner, 128, 64)
    lay = tr.layout
    # the head gives the online rows of s and the target's rows one value each (head_forward_picked)
    assert dense == lay.flops_gemm_forward(192, picked=128) + lay.flops_gemm_backward(64, head=False)
    # the terminal transitions: the target net did not score their s'
    skipped = 64 - tr.learner.last_target_rows
    assert skipped == 5
    if on and blas.SPARSE_STATUS is None:
        assert 0.3 * dense < done < dense - lay.flops_gemm_forward(skipped, picked=skipped)
    else:
        assert done == dense - lay.flops_gemm_forward(skipped, picked=skipped)
