"""CUDA mirror of cubedqn/learner.py: the same gradient step with everything on the device.

Parameters, gradients, optimizer state and the target network stay resident on the GPU.
Per step the host encodes the sampled batch (sticker indices and canonical frames; for
all-actions also the children) with the same CPU encoder as the CPU path, straight into
one pinned staging buffer that also holds the actions, rewards, dones, discounts, weights,
the touched first-layer rows and the step's learning rate; one copy moves it to the
device. Then the step's launches, built once in __init__ on views of buffers allocated
once (cuda/nn.py says why): forward, targets and loss, backward, norm, clipping and the
update, and one read-back of (loss, norm, td). The first step launches them one by one
(which compiles them); then they are captured as three CUDA graphs (forward, backward,
optimizer) that every later step replays (nn.Plan; `launch_mode` says which ran: where
graphs cannot be made, as under the simulator, the launches go one by one). Acting runs on the
device too (`device_q`, an Actor per batch size); the host copy of the online parameters
is refreshed on demand (`sync_host`) for evaluation and checkpoints.

Supported here: targets dqn / double / all-actions, Huber / MSE, SGD / momentum / Nesterov /
Adam / AdamW, global or no clipping, hard or Polyak target updates, prioritized-replay
weights, lazy first-layer updates. Refused with a one-line message: dueling heads, LOMO,
grad_accum > 1, the dense first layer, float64. float16 storage is not implemented.

With `sync_phases` set (cubedqn profile does), the step waits for the GPU at the end of
each phase so that the forward / backward / optimizer times are the GPU's; a training run
leaves it off and waits once, for the read-back.
"""

from __future__ import annotations

import time

import numpy as np
from numba import cuda

from ..encoding import actions_to_canonical
from ..learner import Learner
from . import nn as K
from .optim import CudaOptimizer, polyak_launch


class DeviceNet:
    """Views of one flat device buffer, per layer (mirrors nn.views)."""

    def __init__(self, flat_host, layout):
        self.flat = cuda.to_device(flat_host)
        self.Ws, self.bs = [], []
        for off, fi, fo, boff in layout.tensors:
            self.Ws.append(self.flat[off:off + fi * fo].reshape(fi, fo))
            self.bs.append(self.flat[boff:boff + fo])


def forward_launches(net, idx, acts):
    """The launches of one forward pass: idx (rows, S) int32 -> acts[l] (rows, width l+1)."""
    L = len(net.Ws)
    out = [K.sparse_forward_launch(idx, net.Ws[0], net.bs[0], acts[0], L > 1)]
    for l in range(1, L):
        out.append(K.dense_forward_launch(acts[l - 1], net.Ws[l], net.bs[l], acts[l], l < L - 1))
    return out


class Actor:
    """Acting on the device: pinned input rows and Q-values for n states, the online
    network's forward pass on them (a CUDA graph after its first run)."""

    def __init__(self, net, layout, n):
        self.h_idx = cuda.pinned_array((n, layout.n_active), np.int32)
        self.h_idx[:] = 0
        self.rows = _IdxRows(self.h_idx)
        self.d_idx = cuda.to_device(self.h_idx)
        w = layout.widths
        acts = [cuda.device_array((n, w[l + 1]), np.float32) for l in range(layout.n_layers)]
        self.d_q = acts[-1]
        self.h_q = cuda.pinned_array((n, w[-1]), np.float32)
        self.plan = K.Plan({"act": forward_launches(net, self.d_idx, acts)})

    def q_values(self):
        self.d_idx.copy_to_device(self.h_idx)
        self.plan.run("act")
        self.d_q.copy_to_host(self.h_q)
        self.plan.used()
        return self.h_q


class Staging:
    """One pinned host buffer and its device twin, carved into named views (int32 and
    float32 alike: floats are stored as their bits). `upload()` is the step's one copy."""

    def __init__(self, fields):
        self.offsets, n = {}, 0
        for name, shape, dtype in fields:
            size = int(np.prod(shape))
            self.offsets[name] = (n, shape, np.dtype(dtype))
            n += size
        self.host = cuda.pinned_array(max(n, 1), np.int32)
        self.host[:] = 0
        self.dev = cuda.to_device(self.host)
        self.h, self.d = {}, {}
        for name, (off, shape, dtype) in self.offsets.items():
            size = int(np.prod(shape))
            self.h[name] = self.host[off:off + size].view(dtype).reshape(shape)
            self.d[name] = self.dev[off:off + size].view(dtype).reshape(shape)

    def upload(self):
        self.dev.copy_to_device(self.host)


def _pin(a):
    """Page-lock a host array while the returned handle lives (faster device-to-host
    copies); None under the simulator or where the driver refuses."""
    if K.SIM:
        return None
    try:
        return cuda.current_context().mempin(a, a.ctypes.data, a.nbytes, mapped=False)
    except Exception:  # noqa: BLE001 - pinning is an optimisation only
        return None


class _IdxRows:
    """What Encoder.encode writes through: `.idx` (the sparse path's field) and an empty `.x`
    (the dense one's, which it passes along without writing)."""

    def __init__(self, idx):
        self.idx = idx
        self.x = np.zeros((len(idx), 0), np.float32)


class CudaLearner(Learner):
    """Learner whose step runs on the GPU; the inherited host objects hold the schedule and encoder."""

    sync_phases = False

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
        self.head_taken = self.actions_c[:0]  # the device backward runs the head's GEMMs (profile's FLOPs)
        m, S = self.micro, layout.n_active
        L = layout.n_layers
        w = layout.widths
        all_actions, double = self.targets == "all-actions", self.targets == "double"
        rows_t = m * self.n_rep if all_actions else m  # target network rows
        rows_on = 2 * m if double else m  # online rows: [s; s'] for Double DQN
        lazy = self.sparse_update
        fields = [("idx", (m + rows_t, S), np.int32),  # rows [0, m): s; [m, m + rows_t): s' or children
                  ("actions", (m,), np.int32), ("rot", (m,), np.int32), ("solved", (rows_t,), np.int32),
                  ("n_touched", (1,), np.int32), ("touched", (m * S if lazy else 1,), np.int32),
                  ("f32", (4, m), np.float32),  # weights, rewards, dones, discounts
                  ("hyper", (3,), np.float32)]  # lr, 1 - b1^t, 1 - b2^t
        self.st = st = Staging(fields)
        hi, di = st.h["idx"], st.d["idx"]
        self.h_idx_s, self.h_idx_t = _IdxRows(hi[:m]), _IdxRows(hi[m:])
        d_idx_on, d_idx_t = di[:rows_on], di[m:]  # Double DQN: the online rows m..2m are s' too
        self.h_out = cuda.pinned_array(2 + m, np.float32)  # loss, norm, td
        self.d_out = cuda.device_array(2 + m, np.float32)

        self.d_online = DeviceNet(self.online.params, layout)
        self.d_target = DeviceNet(self.target.params, layout)
        self.d_grads = DeviceNet(np.zeros(layout.size, np.float32), layout)
        self.d_opt = CudaOptimizer(self.opt, layout.size)
        acts_on = [cuda.device_array((rows_on, w[l + 1]), np.float32) for l in range(L)]
        acts_t = [cuda.device_array((rows_t, w[l + 1]), np.float32) for l in range(L)]
        deltas = [cuda.device_array((m, w[l + 1]), np.float32) for l in range(L)]
        self.d_q = acts_on[-1]
        self.d_act_map = cuda.to_device(np.ascontiguousarray(encoder.act_map, dtype=np.int32))
        self.d_rep_of = cuda.to_device(np.ascontiguousarray(encoder.child_rep_of, dtype=np.int32))

        fwd = forward_launches(self.d_target, d_idx_t, acts_t) + forward_launches(self.d_online, d_idx_on, acts_on)
        q = acts_on[-1][:m]
        if all_actions:
            fwd.append(K.all_actions_loss_launch(q, acts_t[-1], st.d["solved"], st.d["rot"], self.d_act_map,
                                                 self.d_rep_of, st.d["f32"], self.gamma, self.loss_kind,
                                                 1.0 / self.batch_size, deltas[-1], self.d_out))
        else:
            q_next_on = acts_on[-1][m:2 * m] if double else acts_t[-1]
            fwd.append(K.sampled_loss_launch(q, q_next_on, acts_t[-1], st.d["actions"], st.d["f32"], double,
                                             self.loss_kind, 1.0 / self.batch_size, deltas[-1], self.d_out))
        bwd = []
        g = self.d_grads
        for l in range(L - 1, 0, -1):
            bwd += K.dense_backward_launches(acts_on[l - 1][:m], deltas[l], self.d_online.Ws[l], g.Ws[l], g.bs[l],
                                             deltas[l - 1])
        off, fi, fo, boff = layout.tensors[0]
        bwd += K.sparse_backward_launches(di[:m], deltas[0], g.flat[off:boff + fo], g.Ws[0], g.bs[0])
        if lazy:
            opt = self.d_opt.launches(self.d_online.flat, g.flat, st.d["hyper"], self.d_out, st.d["touched"],
                                      st.d["n_touched"], fo, fi * fo)
        else:
            opt = self.d_opt.launches(self.d_online.flat, g.flat, st.d["hyper"], self.d_out)
        self.plan = K.Plan({"forward": fwd, "backward": bwd, "optimizer": opt})
        self.polyak = polyak_launch(self.d_target.flat, self.d_online.flat, self.tau) if self.tau < 1.0 else None
        self.host_stale = False
        self.params_pin = _pin(self.online.params)  # sync_host copies into page-locked memory
        self.actors = {}  # acting batch size -> Actor

    @property
    def launch_mode(self):
        """How the step's launches run: "graphs" (replayed CUDA graphs) or "direct ..." (one by one)."""
        return self.plan.mode

    @property
    def gradient_nbytes(self):
        return self.d_grads.flat.nbytes

    @property
    def last_mean_q(self):
        """Mean Q(s, .) of the last batch, read back from the device when asked (for the log)."""
        m = self.micro
        return float(self.d_q[:m].copy_to_host().mean()) if m else 0.0

    # -- the step (mirrors Learner.train_step / _forward_loss) ---------------------------
    def _stage(self, batch, use_weights):
        """Encode the batch into the staging buffer (host work only)."""
        m, enc, st = self.micro, self.encoder, self.st
        f32 = st.h["f32"]
        f32[0] = batch.weights[:m] if use_weights else 1.0
        f32[1], f32[2], f32[3] = batch.rewards, batch.dones, batch.discounts
        self.d_opt.begin_step(st.h["hyper"])
        states = self.states_c  # contiguous copies, as in Learner._forward_loss
        np.copyto(states, batch.states)
        codes = enc.encode(states, self.h_idx_s, 0, self.rot, want_codes=self.child_codes is not None)
        st.h["rot"][:] = self.rot
        if self.targets == "all-actions":  # the device step scores every child
            kid_codes, solved, encoded = self.children_of(states, codes, self.h_idx_t)
            st.h["solved"][:] = solved
            if not encoded:
                enc.encode_codes(kid_codes, self.h_idx_t.idx)
        else:
            nxt = self.next_c
            np.copyto(nxt, batch.next_states)
            enc.encode(nxt, self.h_idx_t, 0, self.rot_scratch[:m], want_codes=False)
            actions_to_canonical(batch.actions, self.rot, enc.act_map, self.actions_c)
            st.h["actions"][:] = self.actions_c
        if self.sparse_update:
            # lazy first-layer update: the host knows the batch's input rows (it encoded them)
            touched = np.unique(st.h["idx"][:m])
            st.h["touched"][:touched.size] = touched
            st.h["n_touched"][0] = touched.size

    def train_step(self, batch, timer=None, use_weights=False):
        clock = time.perf_counter
        t0 = clock()
        self._stage(batch, use_weights)
        t_enc = clock()
        self.st.upload()
        sync = self.sync_phases and timer is not None
        marks = [t0]
        for phase in ("forward", "backward", "optimizer"):
            self.plan.run(phase)
            if sync:
                cuda.synchronize()
                marks.append(clock())
        self.d_out.copy_to_host(self.h_out)  # waits for the step
        loss, norm = float(self.h_out[0]), float(self.h_out[1])
        m = self.micro
        self.td[:m] = self.h_out[2:2 + m]
        self.opt.last_norm = norm
        self.updates += 1
        self.host_stale = True
        t3 = clock()
        if timer:
            if sync:
                for phase, a, b in zip(("forward", "backward", "optimizer"), marks, marks[1:]):
                    timer.add(phase, b - a)
                timer.add("optimizer", t3 - marks[-1])
            else:  # the GPU's time lands where the host waits: the read-back
                timer.add("forward", t_enc - t0)
                timer.add("optimizer", t3 - t_enc)
            timer.parts["forward"]["encode"] += t_enc - t0
        self.maybe_update_target(timer, t3)
        self.last_loss = loss
        self.plan.used()
        return loss

    def maybe_update_target(self, timer=None, t0=None):
        if self.polyak is not None:
            self.polyak()
        elif self.updates % self.target_update_interval == 0:
            self.d_target.flat.copy_to_device(self.d_online.flat)
        if timer:
            if self.sync_phases:
                cuda.synchronize()
            timer.add("target update", time.perf_counter() - t0)

    # -- acting --------------------------------------------------------------------------
    def device_q(self, states, encoder, rot):
        """The online network's Q-values of states, computed on the device, each state in
        its own frame (rot (n,) receives the frames): the host encodes, one copy each way.
        The returned (n, A) array is reused by the next call."""
        n = len(states)
        actor = self.actors.get(n)
        if actor is None:
            actor = self.actors[n] = Actor(self.d_online, self.layout, n)
        encoder.encode(states, actor.rows, 0, rot, want_codes=False)
        return actor.q_values()

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
        self.d_opt.to_device()
