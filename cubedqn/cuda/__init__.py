"""Optional CUDA path (numba-cuda). See cubedqn/cuda/README in module docstrings."""
