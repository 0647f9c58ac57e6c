"""Optional CUDA path (numba-cuda). Importing this package never needs a GPU or numba-cuda;
`gpu_status()` says whether `--device cuda` can run and, if not, why."""

from __future__ import annotations

import functools
import os
import warnings

import numpy as np

# numba-cuda (0.30.4 and earlier) registers an overload for np.row_stack when it compiles its
# first kernel; numpy 2.5 removed that alias of np.vstack, so every kernel failed to compile
# (seen on an H100 machine with numpy 2.5.2). Put the alias back for it; nothing else changes.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

# A batch of 64 launches few blocks by design: numba-cuda's low-occupancy warning is noise
# here. (Its config switch lives in numba's own config, read when numba is first imported,
# before this package: a filter is the reliable way. The message starts with a terminal
# colour code, hence the leading .*)
warnings.filterwarnings("ignore", message=r".*Grid size \d+ will likely result in GPU under-utilization")


@functools.lru_cache(maxsize=1)
def gpu_status() -> tuple[bool, str]:
    """(usable, reason). Under NUMBA_ENABLE_CUDASIM=1 the simulator counts as usable.

    Usable means a trial kernel compiled, ran and gave the right answer: a driver that is
    present but a numba-cuda that cannot compile (a version clash) is a reason, not a crash
    in the middle of a training run."""
    try:
        from numba import cuda
    except ImportError:
        return False, "numba-cuda is not installed (pip install 'cubedqn[cuda]')"
    try:
        if not cuda.is_available():
            return False, "no usable NVIDIA GPU or CUDA driver was found"
    except Exception as e:  # noqa: BLE001 - driver probing can fail in many ways
        return False, f"CUDA is not usable ({e.__class__.__name__})"
    sim = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    if not sim:
        try:
            _trial_kernel(cuda)
        except Exception as e:  # noqa: BLE001 - any failure here is the reason to report
            from importlib.metadata import PackageNotFoundError, version
            try:
                nc = version("numba-cuda")
            except PackageNotFoundError:
                nc = "?"
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            return False, (f"numba-cuda {nc} could not run a trial kernel with numpy {np.__version__} "
                           f"({e.__class__.__name__}: {first})")
    return True, "simulator" if sim else "gpu"


def _trial_kernel(cuda):
    @cuda.jit
    def add_one(x):
        i = cuda.grid(1)
        if i < x.shape[0]:
            x[i] += 1.0

    d = cuda.to_device(np.arange(4, dtype=np.float32))
    add_one[1, 32](d)
    if not np.array_equal(d.copy_to_host(), np.arange(1, 5, dtype=np.float32)):
        raise RuntimeError("a trial kernel gave a wrong answer")


def real_gpu_present() -> bool:
    ok, why = gpu_status()
    return ok and why == "gpu"
