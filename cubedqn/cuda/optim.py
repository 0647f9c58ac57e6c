"""CUDA mirror of cubedqn/optim.py: global gradient norm, clipping and one fused optimizer
update per batch, on the device, with no round trip to the host.

The 2-phase pattern from the seeds: the backward kernels first accumulate the whole
batch's gradient into the flat gradient buffer; only then does one update kernel apply
SGD / momentum / Adam once per batch. (The seed CUDA MLP updated the optimizer state per
sample and diverged to 0% accuracy.) Two launches a step: per-block partial sums of g^2,
then the update kernel, whose every block first adds the partials up to the norm and
derives the clipping factor itself (the rule of optim.clip_factor), so the host never
waits for the norm; block 0 leaves the norm in out[1] for the step's one read-back. The
learning rate and Adam's bias corrections come from a small device array the host
writes with the step's inputs (the schedule stays in the CPU Optimizer).
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from .nn import BLOCK, SIM, Launch, _blocks, block_sum

NORM_BLOCKS = 2 if SIM else 256  # partial sums: one per block of the norm kernel
MAX_UPDATE_BLOCKS = 2 if SIM else 4096  # the update kernel strides over the rest
KINDS = {"sgd": 0, "momentum": 1, "nesterov": 2, "adam": 3, "adamw": 4}


@cuda.jit(cache=True)
def _sq_norm_partials_kernel(g, partials):
    buf = cuda.shared.array(BLOCK, float32)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * BLOCK + t
    stride = cuda.gridDim.x * BLOCK
    acc = float32(0.0)
    while i < g.shape[0]:
        acc += g[i] * g[i]
        i += stride
    total = block_sum(buf, acc, BLOCK)
    if t == 0:
        partials[cuda.blockIdx.x] = total


@cuda.jit(cache=True)
def _update_kernel(p, g, m, v, partials, hyper, touched, n_touched, width, dense_from, kind, clip_max, mu, b2,
                   eps, wd, out):
    """Element k < n_touched[0] * width is element k % width of first-layer row
    touched[k // width] (lazy updates, as optim.*_update_rows; the gradient here is the full
    flat one); the others are params[dense_from:]. A dense step has n_touched = 0 and
    dense_from = 0. hyper = (lr, 1 - b1^t, 1 - b2^t); mu is the momentum or Adam's b1."""
    buf = cuda.shared.array(BLOCK, float32)
    t = cuda.threadIdx.x
    acc = float32(0.0)
    for i in range(t, partials.shape[0], BLOCK):
        acc += partials[i]
    norm = math.sqrt(block_sum(buf, acc, BLOCK))
    scale = float32(1.0)
    if clip_max > 0 and norm > clip_max:
        scale = clip_max / (norm + float32(1e-6))
    if cuda.blockIdx.x == 0 and t == 0:
        out[1] = norm
    lr, bc1, bc2 = hyper[0], hyper[1], hyper[2]
    one = float32(1.0)
    head = n_touched[0] * width
    total = head + p.shape[0] - dense_from
    k = cuda.blockIdx.x * BLOCK + t
    stride = cuda.gridDim.x * BLOCK
    while k < total:
        if k < head:
            i = touched[k // width] * width + k % width
        else:
            i = dense_from + (k - head)
        gi = g[i] * scale
        if kind == 0:
            p[i] -= lr * (gi + wd * p[i])
        elif kind <= 2:
            gi += wd * p[i]
            b = mu * m[i] + gi
            m[i] = b
            if kind == 2:
                p[i] -= lr * (gi + mu * b)
            else:
                p[i] -= lr * b
        else:
            if kind == 4:
                p[i] -= lr * wd * p[i]
            else:
                gi += wd * p[i]
            mi = mu * m[i] + (one - mu) * gi
            vi = b2 * v[i] + (one - b2) * gi * gi
            m[i] = mi
            v[i] = vi
            p[i] -= (lr / bc1) * mi / (math.sqrt(vi / bc2) + eps)
        k += stride


@cuda.jit(cache=True)
def _polyak_kernel(t, o, tau):
    for i in range(cuda.grid(1), t.shape[0], cuda.gridsize(1)):
        t[i] += tau * (o[i] - t[i])


def polyak_launch(target, online, tau):
    return Launch(_polyak_kernel, _blocks(target.shape[0]), BLOCK, target, online, float32(tau))


class CudaOptimizer:
    """Device-resident optimizer state; the host keeps the schedule and step counter
    (mirrors optim.Optimizer, which it wraps)."""

    def __init__(self, host_opt, size):
        if host_opt.clip == "layer":
            raise ValueError("--device cuda supports clip = global or none")
        self.h = host_opt
        self.size = size
        self.kind = KINDS[host_opt.kind]
        self.m = cuda.to_device(host_opt.m) if host_opt.m.size else None
        self.v = cuda.to_device(host_opt.v) if host_opt.v.size else None
        self.partials = cuda.device_array(NORM_BLOCKS, np.float32)
        self.no_rows = cuda.to_device(np.zeros(1, np.int32))  # n_touched and touched of a dense step

    def begin_step(self, hyper_host):
        """Advance the host schedule and write (lr, 1 - b1^t, 1 - b2^t) for the update kernel."""
        h = self.h
        h.begin_step()
        b1, b2 = h.betas
        hyper_host[0], hyper_host[1], hyper_host[2] = h.lr, 1 - b1 ** h.t, 1 - b2 ** h.t

    def launches(self, params, grads, hyper, out, touched=None, n_touched=None, width=0, dense_from=0):
        """The step's two launches: partial sums of g^2, then clip + update (lazily for rows
        touched[:n_touched[0]] of params[:dense_from] when touched is given)."""
        h = self.h
        if touched is None:
            touched, n_touched, max_rows, width, dense_from = self.no_rows, self.no_rows, 0, 0, 0
        else:
            max_rows = touched.shape[0]
        f = float32
        clip_max = h.max_grad_norm if h.clip == "global" and h.max_grad_norm > 0 else 0.0
        mu = h.momentum if self.kind <= 2 else h.betas[0]
        m = self.m if self.m is not None else self.partials
        v = self.v if self.v is not None else self.partials
        blocks = min(_blocks(max_rows * width + self.size - dense_from), MAX_UPDATE_BLOCKS)
        return [Launch(_sq_norm_partials_kernel, NORM_BLOCKS, BLOCK, grads, self.partials),
                Launch(_update_kernel, blocks, BLOCK, params, grads, m, v, self.partials, hyper, touched, n_touched,
                       width, dense_from, self.kind, f(clip_max), f(mu), f(h.betas[1]), f(h.eps),
                       f(h.weight_decay), out)]

    def to_host(self):
        if self.m is not None:
            self.m.copy_to_host(self.h.m)
        if self.v is not None:
            self.v.copy_to_host(self.h.v)

    def to_device(self):
        if self.m is not None:
            self.m.copy_to_device(self.h.m)
        if self.v is not None:
            self.v.copy_to_device(self.h.v)
