"""CUDA mirror of the training loop: the CPU Trainer with the device-resident learner.

The environments and the replay buffer stay on the CPU (a few microseconds per step); the
gradient step runs on the GPU, and so does acting: the host encodes the environments'
states and the online network scores them on the device (CudaLearner.device_q), so the
parameters need not come back to the host every iteration. They are copied back once
before the network is used on the host: curriculum evaluation, checkpoints.
"""

from __future__ import annotations

from ..dqn import Trainer
from .learner import CudaLearner


class CudaTrainer(Trainer):
    learner_class = CudaLearner
    tunes_blas = False  # its GEMMs run on the GPU

    def act_values(self):
        return self.learner.device_q(self.env.states, self.encoder, self.act_rot)

    def evaluate_curriculum(self):
        self.learner.sync_host()
        return super().evaluate_curriculum()
