import os

# These tests run in a subprocess started by tests/test_cuda.py: under the numba CUDA
# simulator (NUMBA_ENABLE_CUDASIM=1, which must be set before numba is imported) and, where
# a real GPU is present, once more on it (CUBEDQN_CUDA_TESTS=gpu).
if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1" and os.environ.get("CUBEDQN_CUDA_TESTS") != "gpu":
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config):
    # small batches launch few blocks by design (cubedqn.cuda filters this warning outside pytest)
    config.addinivalue_line("filterwarnings", "ignore:.*Grid size")
