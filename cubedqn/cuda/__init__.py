"""Optional CUDA path (numba-cuda). Importing this package never needs a GPU or numba-cuda;
`gpu_status()` says whether `--device cuda` can run and, if not, why."""

from __future__ import annotations

import os


def gpu_status() -> tuple[bool, str]:
    """(usable, reason). Under NUMBA_ENABLE_CUDASIM=1 the simulator counts as usable."""
    try:
        from numba import cuda
    except ImportError:
        return False, "numba-cuda is not installed (pip install 'cubedqn[cuda]')"
    try:
        if not cuda.is_available():
            return False, "no usable NVIDIA GPU or CUDA driver was found"
    except Exception as e:  # noqa: BLE001 - driver probing can fail in many ways
        return False, f"CUDA is not usable ({e.__class__.__name__})"
    return True, "simulator" if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else "gpu"


def real_gpu_present() -> bool:
    ok, why = gpu_status()
    return ok and why == "gpu"
