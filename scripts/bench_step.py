#!/usr/bin/env python
"""Time the engine's full training-step kernel sequence against a straightforward numpy
version in the same run: forward on the batch, target forward, Huber loss, backward,
clipped momentum update (Double DQN). Prints ms/step, steps/min and GFLOP/s.

  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_step.py
(144-256-256-12 at B=64 and 324-1024-512-12 at B=256; PyTorch/JAX: scripts/bench_peers.py)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from bench_peers import main  # noqa: E402

if __name__ == "__main__":
    if "--peers" not in sys.argv:
        sys.argv += ["--peers", "numpy"]
    main()
