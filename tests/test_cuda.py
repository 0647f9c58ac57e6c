"""Runs the CUDA simulator tests (tests/cuda_sim) in a subprocess: NUMBA_ENABLE_CUDASIM must be
set before numba is first imported, so they cannot share this process."""
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_cuda_kernels_under_simulator():
    pytest.importorskip("numba.cuda")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                        str(root / "tests" / "cuda_sim")],
                       cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout


def test_cuda_status_without_gpu_is_a_reason_not_an_error():
    from cubedqn.cuda import gpu_status
    ok, why = gpu_status()
    assert isinstance(ok, bool) and why
