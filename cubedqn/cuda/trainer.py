"""CUDA mirror of the training loop: the CPU Trainer with the device-resident learner.

Acting, replay and the environments stay on the CPU (they are a few microseconds per
step); the gradient step runs on the GPU. Before the network is used on the host (acting,
curriculum evaluation, checkpoints) the online parameters are copied back once.
"""

from __future__ import annotations

from ..dqn import Trainer
from .learner import CudaLearner


class CudaTrainer(Trainer):
    learner_class = CudaLearner
    tunes_blas = False  # its GEMMs run on the GPU

    def env_iteration(self):
        self.learner.sync_host()
        return super().env_iteration()

    def evaluate_curriculum(self):
        self.learner.sync_host()
        return super().evaluate_curriculum()
