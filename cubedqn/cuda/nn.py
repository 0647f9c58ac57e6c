"""CUDA mirror of cubedqn/nn.py: the same layers as numba.cuda kernels.

What this file is: one kernel (or launch helper) per CPU kernel, same names, same
argument order where it makes sense, so the two files can be read side by side:

  sparse_forward   gather-sum of W1 rows (one thread per output element)
  sparse_backward  scatter-add into dW1 with atomics (one thread per (row, sticker, col))
  dense_forward    tiled shared-memory GEMM, then bias (+ ReLU)
  dense_backward   dW = x.T @ dout and dx = dout @ W.T (the same tiled GEMM with
                   transpose flags), db as a column sum, ReLU mask on dx
  loss_taken / loss_full   Huber or MSE on the Q head, dq written in place

Shapes follow nn.py: W is (in, out) inside the flat parameter buffer, activations
(rows, width). Everything is float32 on the device. What it is not: a cuBLAS wrapper;
the tiled GEMM is plain numba.cuda (numba-cuda has no cuBLAS binding of its own).
"""

from __future__ import annotations

import math
import os

from numba import cuda, float32

# Simulated threads are Python threads: keep blocks tiny under the simulator (results do
# not depend on the tile size).
TILE = 4 if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else 16


@cuda.jit
def _gemm_kernel(A, B, C, trans_a, trans_b, M, N, K):
    """C (M,N) = op(A) @ op(B): op(A) is A (M,K) or A.T with A (K,M); op(B) likewise (K,N)."""
    sa = cuda.shared.array((TILE, TILE), float32)
    sb = cuda.shared.array((TILE, TILE), float32)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    acc = float32(0.0)
    for t in range((K + TILE - 1) // TILE):
        k_a = t * TILE + tx
        if row < M and k_a < K:
            sa[ty, tx] = A[k_a, row] if trans_a else A[row, k_a]
        else:
            sa[ty, tx] = 0.0
        k_b = t * TILE + ty
        if col < N and k_b < K:
            sb[ty, tx] = B[col, k_b] if trans_b else B[k_b, col]
        else:
            sb[ty, tx] = 0.0
        cuda.syncthreads()
        for k in range(TILE):
            acc += sa[ty, k] * sb[k, tx]
        cuda.syncthreads()
    if row < M and col < N:
        C[row, col] = acc


def gemm(A, B, C, trans_a=False, trans_b=False):
    M, N = C.shape
    K = A.shape[0] if trans_a else A.shape[1]
    grid = ((N + TILE - 1) // TILE, (M + TILE - 1) // TILE)
    _gemm_kernel[grid, (TILE, TILE)](A, B, C, trans_a, trans_b, M, N, K)


def _grid1(n, block=256):
    return (max(1, (n + block - 1) // block),), (block,)


@cuda.jit
def _sparse_forward_kernel(idx, W, b, out, relu, n):
    t = cuda.grid(1)
    h = W.shape[1]
    if t < n * h:
        i = t // h
        j = t % h
        acc = b[j]
        for k in range(idx.shape[1]):
            acc += W[idx[i, k], j]
        if relu and acc < 0:
            acc = 0.0
        out[i, j] = acc


def sparse_forward(idx, W, b, out, relu, rows):
    """idx (B,S) int32, W (in,H), out (B,H) = b + sum_s W[idx[:,s]] over the first `rows` rows."""
    g, blk = _grid1(rows * W.shape[1])
    _sparse_forward_kernel[g, blk](idx, W, b, out, relu, rows)


@cuda.jit
def _fill_kernel(x, v, n):
    t = cuda.grid(1)
    if t < n:
        x[t] = v


@cuda.jit
def _sparse_backward_kernel(idx, dout, dW, n):
    t = cuda.grid(1)
    s = idx.shape[1]
    h = dout.shape[1]
    if t < n * s * h:
        j = t % h
        k = (t // h) % s
        i = t // (h * s)
        cuda.atomic.add(dW, (idx[i, k], j), dout[i, j])


@cuda.jit
def _colsum_kernel(d, db, rows):
    j = cuda.grid(1)
    if j < d.shape[1]:
        acc = float32(0.0)
        for i in range(rows):
            acc += d[i, j]
        db[j] = acc


def sparse_backward(idx, dout, dW_flat, dW, db, rows):
    """dW (in,H) = scatter-add of dout rows at idx; db = column sums. dW_flat is dW's flat view."""
    g, blk = _grid1(dW_flat.shape[0])
    _fill_kernel[g, blk](dW_flat, 0.0, dW_flat.shape[0])
    g, blk = _grid1(rows * idx.shape[1] * dout.shape[1])
    _sparse_backward_kernel[g, blk](idx, dout, dW, rows)
    g, blk = _grid1(dout.shape[1])
    _colsum_kernel[g, blk](dout, db, rows)


@cuda.jit
def _bias_act_kernel(out, b, relu, rows):
    t = cuda.grid(1)
    h = out.shape[1]
    if t < rows * h:
        i = t // h
        j = t % h
        v = out[i, j] + b[j]
        if relu and v < 0:
            v = 0.0
        out[i, j] = v


def dense_forward(x, W, b, out, relu, rows):
    """x (B,in), W (in,out) -> out (B,out) = x @ W + b (+ ReLU), first `rows` rows."""
    gemm(x[:rows], W, out[:rows])
    g, blk = _grid1(rows * out.shape[1])
    _bias_act_kernel[g, blk](out, b, relu, rows)


@cuda.jit
def _relu_mask_kernel(dx, x, rows):
    t = cuda.grid(1)
    c = dx.shape[1]
    if t < rows * c:
        i = t // c
        j = t % c
        if x[i, j] <= 0:
            dx[i, j] = 0.0


def dense_backward(x, dout, W, dW, db, dx, rows, need_dx=True):
    """dW = x.T @ dout, db = column sums of dout, dx = (dout @ W.T) * (x > 0)."""
    gemm(x[:rows], dout[:rows], dW, trans_a=True)
    g, blk = _grid1(dout.shape[1])
    _colsum_kernel[g, blk](dout, db, rows)
    if need_dx:
        gemm(dout[:rows], W, dx[:rows], trans_b=True)
        g, blk = _grid1(rows * dx.shape[1])
        _relu_mask_kernel[g, blk](dx, x, rows)


@cuda.jit(device=True)
def _elem(d, kind):
    if kind == 0:
        ad = abs(d)
        if ad <= 1.0:
            return 0.5 * d * d, d
        return ad - 0.5, (1.0 if d > 0 else -1.0)
    return 0.5 * d * d, d


@cuda.jit
def _loss_taken_kernel(q, actions, targets, weights, scale, kind, dq, td, loss, rows):
    i = cuda.grid(1)
    if i < rows:
        a = actions[i]
        d = q[i, a] - targets[i]
        td[i] = d
        l, g = _elem(d, kind)
        for j in range(q.shape[1]):
            dq[i, j] = 0.0
        dq[i, a] = weights[i] * g * scale
        cuda.atomic.add(loss, 0, weights[i] * l * scale)


def loss_taken(q, actions, targets, weights, scale, kind, dq, td, loss, rows):
    g, blk = _grid1(rows)
    _fill_kernel[1, 1](loss, 0.0, 1)
    _loss_taken_kernel[g, blk](q, actions, targets, weights, scale, kind, dq, td, loss, rows)


@cuda.jit
def _loss_full_kernel(q, targets, weights, scale, kind, dq, td, loss, rows):
    i = cuda.grid(1)
    if i < rows:
        m = 0.0
        acc = 0.0
        for j in range(q.shape[1]):
            d = q[i, j] - targets[i, j]
            if abs(d) > m:
                m = abs(d)
            l, g = _elem(d, kind)
            acc += weights[i] * l
            dq[i, j] = weights[i] * g * scale
        td[i] = m
        cuda.atomic.add(loss, 0, acc * scale)


def loss_full(q, targets, weights, scale, kind, dq, td, loss, rows):
    g, blk = _grid1(rows)
    _fill_kernel[1, 1](loss, 0.0, 1)
    _loss_full_kernel[g, blk](q, targets, weights, scale, kind, dq, td, loss, rows)


def n_blocks(n, block=256):
    return max(1, math.ceil(n / block))
