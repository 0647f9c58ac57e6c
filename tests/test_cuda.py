"""Runs the CUDA tests (tests/cuda_sim) in a subprocess: under the numba CUDA simulator
always (NUMBA_ENABLE_CUDASIM must be set before numba is first imported, so they cannot
share this process), and on the real GPU too where one is present."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cuda_tests(**env):
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "cuda_sim")],
                       cwd=ROOT, env=dict(os.environ, **env), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout
    return r.stdout


def test_cuda_kernels_under_simulator():
    pytest.importorskip("numba.cuda")
    run_cuda_tests(NUMBA_ENABLE_CUDASIM="1")


def test_cuda_kernels_on_a_real_gpu():
    pytest.importorskip("numba.cuda")
    from cubedqn.cuda import real_gpu_present
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or not real_gpu_present():
        pytest.skip("no real GPU here")
    out = run_cuda_tests(CUBEDQN_CUDA_TESTS="gpu")
    assert " skipped" not in out  # on a GPU every test runs, the large shapes too


def test_cuda_status_without_gpu_is_a_reason_not_an_error():
    from cubedqn.cuda import gpu_status
    ok, why = gpu_status()
    assert isinstance(ok, bool) and why
