"""CUDA mirror of the training loop: the CPU Trainer with the device-resident learner.

The environments and the replay buffer stay on the CPU (a few microseconds per step); the
gradient step runs on the GPU, and so does acting: the host encodes the environments'
states and the online network scores them on the device (CudaLearner.device_q), so the
parameters need not come back to the host every iteration. They are copied back once
before the network is used on the host: curriculum evaluation, checkpoints.
"""

from __future__ import annotations

import numpy as np

from ..dqn import Trainer
from ..encoding import q_to_world
from ..env import select_actions
from .learner import CudaLearner


class CudaTrainer(Trainer):
    learner_class = CudaLearner
    tunes_blas = False  # its GEMMs run on the GPU

    def __init__(self, cfg):
        super().__init__(cfg)
        self.act_q = np.zeros((cfg.n_envs, self.n_actions), self.learner.dtype)

    def choose_actions(self, eps):
        """Every state scored on the device, then select_actions: the device actor is
        captured for one batch size, and the host's way (only the greedy states, a number
        that changes every iteration) would capture one per count. Same actions."""
        self.states_scored += self.env.n
        qc = self.learner.device_q(self.env.states, self.encoder, self.act_rot)
        q_to_world(qc, self.act_rot, self.encoder.act_map, self.act_q)
        select_actions(self.act_q, eps, self.rng, self.env.actions)

    def evaluate_curriculum(self):
        self.learner.sync_host()
        return super().evaluate_curriculum()
