import os

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    collect_ignore_glob = ["test_*.py"]  # run through tests/test_cuda.py in a subprocess
