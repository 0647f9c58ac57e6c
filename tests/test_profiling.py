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
