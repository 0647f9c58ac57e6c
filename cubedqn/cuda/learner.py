"""CUDA mirror of cubedqn/learner.py: the same gradient step with everything on the device.

Parameters, gradients, optimizer state and the target network stay resident on the GPU.
Per step, the host encodes the sampled batch (sticker indices, canonical frame; for
all-actions also the children) with the same CPU encoder as the CPU path, and the index
arrays move to the device once; forward, targets, loss, backward, norm, clipping and the
update then run as device kernels. The host copy of the online parameters is refreshed on
demand (`sync_host`) for acting, evaluation and checkpoints.

Supported here: targets dqn / double / all-actions, Huber / MSE, SGD / momentum / Nesterov /
Adam / AdamW, global or no clipping, hard or Polyak target updates, prioritized-replay
weights. Refused with a one-line message: dueling heads, LOMO, grad_accum > 1, the dense
first layer, float64. float16 storage (mixed precision) is not implemented.
"""

from __future__ import annotations

import time

import numpy as np
from numba import cuda, float32

from ..cube import expand_children, solved_batch
from ..encoding import actions_to_canonical
from ..learner import Learner
from . import nn as K
from .optim import CudaOptimizer, polyak_update


@cuda.jit
def _sampled_targets_kernel(q_next_on, q_next_t, rewards, dones, discounts, double, out, rows):
    i = cuda.grid(1)
    if i < rows:
        a_n = q_next_t.shape[1]
        if double:
            best = 0
            for a in range(1, a_n):
                if q_next_on[i, a] > q_next_on[i, best]:
                    best = a
            v = q_next_t[i, best]
        else:
            v = q_next_t[i, 0]
            for a in range(1, a_n):
                if q_next_t[i, a] > v:
                    v = q_next_t[i, a]
        out[i] = rewards[i] + discounts[i] * (1.0 - dones[i]) * v


@cuda.jit
def _all_action_targets_kernel(q_children, child_solved, gamma, rep_of, n_rep, rot, act_map, out, rows):
    """out[b, act_map[rot[b], a]] = -1 if child (b, a) is solved else -1 + gamma * max Q_t(child)."""
    t = cuda.grid(1)
    a_n = out.shape[1]
    if t < rows * a_n:
        b = t // a_n
        a = t % a_n
        r = b * n_rep + rep_of[a]
        if child_solved[r]:
            y = -1.0
        else:
            v = q_children[r, 0]
            for k in range(1, q_children.shape[1]):
                if q_children[r, k] > v:
                    v = q_children[r, k]
            y = -1.0 + gamma * v
        out[b, act_map[rot[b], a]] = y


class DeviceNet:
    """Views of one flat device buffer, per layer (mirrors nn.views)."""

    def __init__(self, flat_host, layout):
        self.flat = cuda.to_device(flat_host)
        self.Ws, self.bs = [], []
        for off, fi, fo, boff in layout.tensors:
            self.Ws.append(self.flat[off:off + fi * fo].reshape(fi, fo))
            self.bs.append(self.flat[boff:boff + fo])


class DeviceWorkspace:
    def __init__(self, layout, rows):
        w = layout.widths
        self.acts = [cuda.device_array((rows, w[l + 1]), np.float32) for l in range(layout.n_layers)]
        self.deltas = [cuda.device_array((rows, w[l + 1]), np.float32) for l in range(layout.n_layers)]
        self.idx = cuda.device_array((rows, layout.n_active), np.int32)


def device_forward(net: DeviceNet, ws: DeviceWorkspace, rows):
    L = len(net.Ws)
    K.sparse_forward(ws.idx, net.Ws[0], net.bs[0], ws.acts[0], L > 1, rows)
    for l in range(1, L):
        K.dense_forward(ws.acts[l - 1], net.Ws[l], net.bs[l], ws.acts[l], l < L - 1, rows)
    return ws.acts[-1]


def device_backward(net: DeviceNet, grads: DeviceNet, ws: DeviceWorkspace, rows, grads_flat_layer0):
    L = len(net.Ws)
    for l in range(L - 1, 0, -1):
        K.dense_backward(ws.acts[l - 1], ws.deltas[l], net.Ws[l], grads.Ws[l], grads.bs[l], ws.deltas[l - 1], rows)
    K.sparse_backward(ws.idx, ws.deltas[0], grads_flat_layer0, grads.Ws[0], grads.bs[0], rows)


class CudaLearner(Learner):
    """Learner whose step runs on the GPU; the inherited host objects hold the schedule and encoder."""

    def __init__(self, layout, moves, batch_size, encoder, **kw):
        if layout.dueling:
            raise ValueError("--device cuda does not support dueling heads yet")
        if kw.get("lomo") or kw.get("grad_accum", 1) > 1:
            raise ValueError("--device cuda does not support lomo or grad_accum > 1")
        if np.dtype(kw.get("dtype", np.float32)) != np.float32:
            raise ValueError("--device cuda runs float32 only")
        if not kw.get("sparse", True):
            raise ValueError("--device cuda uses the sparse first layer only")
        if kw.get("clip", "global") == "layer":
            raise ValueError("--device cuda supports clip = global or none")
        kw["target_cache"] = False  # the device step scores every child
        super().__init__(layout, moves, batch_size, encoder, **kw)
        self.d_online = DeviceNet(self.online.params, layout)
        self.d_target = DeviceNet(self.target.params, layout)
        self.d_grads = DeviceNet(np.zeros(layout.size, np.float32), layout)
        off, fi, fo, _ = layout.tensors[0]
        self.d_grad0 = self.d_grads.flat[off:off + fi * fo]
        self.d_opt = CudaOptimizer(self.opt, layout.size)
        self.d_ws = DeviceWorkspace(layout, self.ws.idx.shape[0])
        self.d_ws_t = DeviceWorkspace(layout, self.ws_t.idx.shape[0])
        m = self.micro
        self.d_y = cuda.device_array(m, np.float32)
        self.d_Y = cuda.device_array((m, self.n_actions), np.float32)
        self.d_td = cuda.device_array(m, np.float32)
        self.d_loss = cuda.device_array(1, np.float32)
        # per-step inputs, copied into preallocated device buffers
        self.h_f32 = np.zeros((4, m), np.float32)  # weights, rewards, dones, discounts
        self.d_f32 = cuda.device_array((4, m), np.float32)
        self.d_actions = cuda.device_array(m, np.int64)
        self.d_rot = cuda.device_array(m, np.int64)
        self.d_solved = cuda.device_array(m * self.n_rep, np.bool_)
        self.d_act_map = cuda.to_device(np.ascontiguousarray(encoder.act_map))
        self.d_rep_of = cuda.to_device(np.ascontiguousarray(encoder.child_rep_of))
        self.d_touched = cuda.device_array(max(m * layout.n_active, 1) if self.sparse_update else 1, np.int64)
        self.host_stale = False

    @property
    def last_mean_q(self):
        """Mean Q(s, .) of the last batch, read back from the device when asked (for the log)."""
        m = self.micro
        return float(self.d_ws.acts[-1][:m].copy_to_host().mean()) if m else 0.0

    # -- the step (mirrors Learner.train_step / _forward_loss) ---------------------------
    def train_step(self, batch, timer=None, use_weights=False):
        clock = time.perf_counter
        t0 = clock()
        m, enc, n_a = self.micro, self.encoder, self.n_actions
        scale = float32(1.0 / self.batch_size)
        hf = self.h_f32
        hf[0] = batch.weights[:m] if use_weights else 1.0
        hf[1], hf[2], hf[3] = batch.rewards, batch.dones, batch.discounts
        self.d_f32.copy_to_device(hf)
        d_w, d_r, d_d, d_disc = self.d_f32[0], self.d_f32[1], self.d_f32[2], self.d_f32[3]
        states = self.states_c  # contiguous copies, as in Learner._forward_loss
        np.copyto(states, batch.states)
        enc.encode(states, self.ws, 0, self.rot)
        if self.targets == "all-actions":
            expand_children(states, self.rep_moves, self.n_rep, self.children)
            kids = self.children.reshape(m * self.n_rep, -1)
            solved_batch(kids, self.child_solved)
            enc.encode(kids, self.ws_t, 0, self.rot_scratch)
            self.d_ws_t.idx.copy_to_device(self.ws_t.idx)
            self.d_ws.idx[:m].copy_to_device(self.ws.idx[:m])
            self.d_solved.copy_to_device(self.child_solved)
            self.d_rot.copy_to_device(self.rot)
            q_kids = device_forward(self.d_target, self.d_ws_t, m * self.n_rep)
            g, b = K._grid1(m * n_a)
            _all_action_targets_kernel[g, b](q_kids, self.d_solved, float32(self.gamma), self.d_rep_of, self.n_rep,
                                             self.d_rot, self.d_act_map, self.d_Y, m)
            q = device_forward(self.d_online, self.d_ws, m)
            K.loss_full(q, self.d_Y, d_w, scale, self.loss_kind, self.d_ws.deltas[-1], self.d_td, self.d_loss, m)
        else:
            nxt = self.next_c
            np.copyto(nxt, batch.next_states)
            enc.encode(nxt, self.ws_t, 0, self.rot_scratch[:m])
            self.d_ws_t.idx.copy_to_device(self.ws_t.idx)
            q_next_t = device_forward(self.d_target, self.d_ws_t, m)
            if self.targets == "double":
                enc.encode(nxt, self.ws, m, self.rot_scratch[:m])
                self.d_ws.idx.copy_to_device(self.ws.idx)
                q_all = device_forward(self.d_online, self.d_ws, 2 * m)
                q, q_next_on = q_all[:m], q_all[m:2 * m]
            else:
                self.d_ws.idx[:m].copy_to_device(self.ws.idx[:m])
                q = device_forward(self.d_online, self.d_ws, m)
                q_next_on = q_next_t
            g, b = K._grid1(m)
            _sampled_targets_kernel[g, b](q_next_on, q_next_t, d_r, d_d, d_disc, self.targets == "double",
                                          self.d_y, m)
            actions_to_canonical(batch.actions, self.rot, enc.act_map, self.actions_c)
            self.d_actions.copy_to_device(self.actions_c)
            K.loss_taken(q, self.d_actions, self.d_y, d_w, scale, self.loss_kind, self.d_ws.deltas[-1],
                         self.d_td, self.d_loss, m)
        loss = float(self.d_loss.copy_to_host()[0])
        self.td[:m] = self.d_td.copy_to_host()
        t1 = clock()
        device_backward(self.d_online, self.d_grads, self.d_ws, m, self.d_grad0)
        cuda.synchronize()
        t2 = clock()
        if self.sparse_update:
            # lazy first-layer update: the host knows the batch's input rows (it encoded them)
            touched = np.unique(self.ws.idx[:m]).astype(np.int64)
            self.d_touched[:touched.size].copy_to_device(touched)
            h1 = self.layout.widths[1]
            self.d_opt.step_rows(self.d_online.flat, self.d_grads.flat, self.d_touched, touched.size, h1,
                                 self.layout.in_dim * h1)
        else:
            self.d_opt.step(self.d_online.flat, self.d_grads.flat)
        cuda.synchronize()
        self.updates += 1
        self.host_stale = True
        t3 = clock()
        if timer:
            timer.add("forward", t1 - t0)
            timer.add("backward", t2 - t1)
            timer.add("optimizer", t3 - t2)
        self.maybe_update_target(timer, t3)
        self.last_loss = loss
        return loss

    def maybe_update_target(self, timer=None, t0=None):
        if self.tau < 1.0:
            polyak_update(self.d_target.flat, self.d_online.flat, float32(self.tau))
        elif self.updates % self.target_update_interval == 0:
            self.d_target.flat.copy_to_device(self.d_online.flat)
        if timer:
            cuda.synchronize()
            timer.add("target update", time.perf_counter() - t0)

    # -- host mirror ---------------------------------------------------------------------
    def sync_host(self):
        """Copy the online parameters to the host MLP (acting, evaluation)."""
        if self.host_stale:
            self.d_online.flat.copy_to_host(self.online.params)
            self.host_stale = False

    def arrays(self):
        self.sync_host()
        self.d_target.flat.copy_to_host(self.target.params)
        self.d_opt.to_host()
        return super().arrays()

    def load_arrays(self, data, opt_t):
        super().load_arrays(data, opt_t)
        self.d_online.flat.copy_to_device(self.online.params)
        self.d_target.flat.copy_to_device(self.target.params)
        if self.d_opt.m is not None:
            self.d_opt.m.copy_to_device(self.opt.m)
        if self.d_opt.v is not None:
            self.d_opt.v.copy_to_device(self.opt.v)

