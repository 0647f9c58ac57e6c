"""CUDA mirror of cubedqn/optim.py: gradient norm and fused optimizer updates on the device.

The 2-phase pattern from the seeds: the backward kernels first accumulate the whole
batch's gradient into the flat gradient buffer; only then does one update kernel apply
SGD / momentum / Adam once per batch, one thread per parameter. (The seed CUDA MLP
updated the optimizer state per sample and diverged to 0% accuracy.)
"""

from __future__ import annotations

import math

from numba import cuda, float32

from .nn import _fill_kernel, _grid1

_BLOCK = 256


@cuda.jit
def _sq_norm_kernel(g, out, n):
    buf = cuda.shared.array(_BLOCK, float32)
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * _BLOCK + t
    acc = float32(0.0)
    stride = cuda.gridDim.x * _BLOCK
    while i < n:
        acc += g[i] * g[i]
        i += stride
    buf[t] = acc
    cuda.syncthreads()
    s = _BLOCK // 2
    while s > 0:
        if t < s:
            buf[t] += buf[t + s]
        cuda.syncthreads()
        s //= 2
    if t == 0:
        cuda.atomic.add(out, 0, buf[0])


def sq_norm(g, out):
    """out[0] = sum(g^2) (float32 on the device)."""
    _fill_kernel[1, 1](out, 0.0, 1)
    blocks = min(1024, max(1, (g.shape[0] + _BLOCK - 1) // _BLOCK))
    _sq_norm_kernel[blocks, _BLOCK](g, out, g.shape[0])


# One thread per updated element. Thread k < n_rows * width updates element k % width of
# row touched[k // width] of the first layer (lazy updates, as optim.*_update_rows; the
# gradient here is the full flat one, not compact rows); the others update
# params[dense_from:]. A dense step is n_rows = 0, dense_from = 0.

@cuda.jit(device=True)
def _element(k, touched, n_rows, width, dense_from):
    head = n_rows * width
    if k < head:
        return touched[k // width] * width + k % width
    return dense_from + (k - head)


@cuda.jit
def _sgd_kernel(p, g, scale, lr, wd, touched, n_rows, width, dense_from, n):
    k = cuda.grid(1)
    if k < n_rows * width + n - dense_from:
        i = _element(k, touched, n_rows, width, dense_from)
        p[i] -= lr * (g[i] * scale + wd * p[i])


@cuda.jit
def _momentum_kernel(p, g, buf, scale, lr, mu, nesterov, wd, touched, n_rows, width, dense_from, n):
    k = cuda.grid(1)
    if k < n_rows * width + n - dense_from:
        i = _element(k, touched, n_rows, width, dense_from)
        gi = g[i] * scale + wd * p[i]
        b = mu * buf[i] + gi
        buf[i] = b
        if nesterov:
            p[i] -= lr * (gi + mu * b)
        else:
            p[i] -= lr * b


@cuda.jit
def _adam_kernel(p, g, m, v, scale, lr, b1, b2, eps, bc1, bc2, wd, decoupled, touched, n_rows, width,
                 dense_from, n):
    k = cuda.grid(1)
    if k < n_rows * width + n - dense_from:
        i = _element(k, touched, n_rows, width, dense_from)
        gi = g[i] * scale
        if decoupled:
            p[i] -= lr * wd * p[i]
        else:
            gi += wd * p[i]
        mi = b1 * m[i] + (float32(1.0) - b1) * gi
        vi = b2 * v[i] + (float32(1.0) - b2) * gi * gi
        m[i] = mi
        v[i] = vi
        p[i] -= (lr / bc1) * mi / (math.sqrt(vi / bc2) + eps)


@cuda.jit
def _polyak_kernel(t, o, tau, n):
    i = cuda.grid(1)
    if i < n:
        t[i] += tau * (o[i] - t[i])


def polyak_update(target, online, tau):
    g, b = _grid1(target.shape[0])
    _polyak_kernel[g, b](target, online, tau, target.shape[0])


class CudaOptimizer:
    """Device-resident optimizer state; the host keeps only the schedule (mirrors optim.Optimizer)."""

    def __init__(self, host_opt, size):
        self.h = host_opt  # schedule, hyperparameters and step counter live in the CPU object
        self.m = cuda.to_device(host_opt.m) if host_opt.m.size else None
        self.v = cuda.to_device(host_opt.v) if host_opt.v.size else None
        self.norm_buf = cuda.device_array(1, dtype="float32")
        self.no_rows = cuda.device_array(1, dtype="int64")  # placeholder for dense steps
        self.size = size

    def step(self, params, grads):
        return self.step_rows(params, grads, self.no_rows, 0, 0, 0)

    def step_rows(self, params, grads, touched, n_rows, width, dense_from):
        """step() with lazy first-layer rows (mirrors Optimizer.step_rows): rows touched[:n_rows]
        of params[:dense_from] and all of params[dense_from:]. The norm is taken over the
        whole gradient: the backward pass leaves the other first-layer rows zero."""
        h = self.h
        h.begin_step()
        sq_norm(grads, self.norm_buf)
        norm = math.sqrt(float(self.norm_buf.copy_to_host()[0]))
        scale = h.clip_scale(norm)
        n = self.size
        rows = (touched, n_rows, width, dense_from, n)
        g, b = _grid1(max(n_rows * width + n - dense_from, 1))
        f = float32
        if h.kind == "sgd":
            _sgd_kernel[g, b](params, grads, f(scale), f(h.lr), f(h.weight_decay), *rows)
        elif h.kind in ("momentum", "nesterov"):
            _momentum_kernel[g, b](params, grads, self.m, f(scale), f(h.lr), f(h.momentum),
                                   h.kind == "nesterov", f(h.weight_decay), *rows)
        else:
            b1, b2 = h.betas
            _adam_kernel[g, b](params, grads, self.m, self.v, f(scale), f(h.lr), f(b1), f(b2), f(h.eps),
                               f(1 - b1 ** h.t), f(1 - b2 ** h.t), f(h.weight_decay), h.kind == "adamw", *rows)
        h.last_norm = norm
        return norm

    def to_host(self):
        if self.m is not None:
            self.m.copy_to_host(self.h.m)
        if self.v is not None:
            self.v.copy_to_host(self.h.v)
