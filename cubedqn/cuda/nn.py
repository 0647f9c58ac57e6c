"""CUDA mirror of cubedqn/nn.py: the same layers as numba.cuda kernels, launched from plans.

What this file is: one kernel per CPU kernel (or per fused group of them), and for each a
`*_launch` function that checks the shapes once and returns a `Launch`: the configured
kernel with its arguments bound. The learner builds every launch of a training step once,
on views of buffers it allocated once, and a step then only calls them, or rather replays
them as CUDA graphs (Plan). That matters on a GPU: numba-cuda spends tens of
microseconds of Python per launch (measured on an H100: scripts/bench_cuda.py --launches),
which for batch 64 is far more than the kernels' own time; the step is also built from as
few launches as possible:

  sparse_forward_launch    out (B,H) = b + sum_s W[idx[:, s]] (+ ReLU)      inp is (B,S) int32
  dense_forward_launch     out (B,O) = x (B,I) @ W (I,O) + b (+ ReLU)      one tiled GEMM, bias in its epilogue
  dense_backward_launches  dW (I,O) = x.T @ dout and db = column sums of dout in one GEMM
                           (a row of ones appended to x.T), dx (B,I) = (dout @ W.T) * (x > 0)
                           in another (the ReLU mask in its epilogue)
  sparse_backward_launches zero dW1|b1, then one scatter-add (atomics) of dout rows into the
                           W1 rows at idx, and of dout into db1
  sampled_loss_launch      targets (DQN / Double DQN) + Huber/MSE loss + dq + td, one block
  all_actions_loss_launch  all-actions targets from the children's target Q + loss, one block

Shapes follow nn.py: W is (in, out) inside the flat parameter buffer, activations (rows,
width); the number of rows is the views' (no `rows` argument). Everything is float32. What
it is not: a cuBLAS wrapper; the tiled GEMM is plain numba.cuda (numba-cuda has no cuBLAS
binding of its own).
"""

from __future__ import annotations

import os

import numpy as np
from numba import cuda, float32

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
# Simulated threads are Python threads: keep blocks tiny under the simulator (results do
# not depend on the tile or block size).
TILE = 4 if SIM else 16
LOSS_BLOCK = 8 if SIM else 256  # the one block of the loss kernels (a power of two)
BLOCK = 32 if SIM else 256  # threads per block of the 1-D kernels
MAX_BLOCKS = 2 if SIM else 8192


class Launch:
    """A kernel configured with its grid and bound to its arguments: `launch()` runs it;
    `launch(stream)` runs it on a stream (or records it into a cuda.core GraphBuilder)."""

    __slots__ = ("kernel", "grid", "block", "fn", "args")

    def __init__(self, kernel, grid, block, *args):
        self.kernel, self.grid, self.block, self.args = kernel, grid, block, args
        # numba-cuda's kernel[grid, block] is a new object, kept; the simulator's configures
        # the kernel itself, so there it is configured again at each call
        self.fn = None if SIM else kernel[grid, block]

    def __call__(self, stream=None):
        if stream is not None:
            self.kernel[self.grid, self.block, stream](*self.args)
        else:
            (self.fn or self.kernel[self.grid, self.block])(*self.args)


class Plan:
    """Named lists of launches ({name: [Launch]}). `run(name)` launches one list; after the
    first full use (`used()`: every kernel compiled and loaded) each list is captured as a
    CUDA graph through cuda.core's GraphBuilder (numba-cuda 0.30.4 launches into one), and
    `run` replays the graph: one launch's cost for all of its kernels. The kernels'
    arguments are fixed at capture, which is why every input that changes from step to step
    lives in device memory. The graphs go on the legacy default stream, so they stay ordered
    with numba's copies, which use it too. Where no graph can be made (the simulator, an
    older numba-cuda) the launches go one by one; `mode` says which."""

    def __init__(self, launches):
        self.launches = launches
        self.graphs, self.stream = None, None
        self.mode = "direct"  # until the first use ends
        self.fresh = True

    def run(self, name):
        if self.graphs is not None:
            self.graphs[name].launch(self.stream)
        else:
            for launch in self.launches[name]:
                launch()

    def used(self):
        if not self.fresh:
            return
        self.fresh = False
        if SIM:
            self.mode = "direct (the simulator has no graphs)"
            return
        try:
            from cuda.core import Device, Stream
            dev = Device()
            dev.set_current()
            capture = dev.create_stream()
            graphs = {}
            for name, launches in self.launches.items():
                builder = capture.create_graph_builder().begin_building()
                for launch in launches:
                    launch(builder)
                builder.end_building()
                graphs[name] = builder.complete()
            self.graphs, self.stream, self.mode = graphs, Stream.from_handle(0), "graphs"
        except Exception as e:  # noqa: BLE001 - an old cuda.core / numba-cuda: launch one by one
            self.mode = f"direct (no CUDA graphs: {e.__class__.__name__}: {str(e)[:100]})"


def _blocks(n, block=BLOCK):
    """Blocks for n elements, one thread each, at most MAX_BLOCKS: the 1-D kernels stride
    over the rest (under the simulator, where each thread is a Python thread, two blocks)."""
    return max(1, min((n + block - 1) // block, MAX_BLOCKS))


_dummies = {}


def _dummy(ndim):
    """A one-element float32 device array for an unused array argument."""
    if ndim not in _dummies:
        _dummies[ndim] = cuda.device_array((1,) * ndim, np.float32)
    return _dummies[ndim]


# ---------------------------------------------------------------------------------------
# GEMM with epilogues

EPI_NONE, EPI_BIAS, EPI_MASK, EPI_COLSUM = 0, 1, 2, 3


@cuda.jit(cache=True)
def _gemm_kernel(A, B, C, vec, mask, trans_a, trans_b, epilogue, relu):
    """C (M,N) = op(A) (M,K) @ op(B) (K,N); op(A) is A or A.T (A stored (K,M)), op(B) likewise.

    epilogue EPI_BIAS: C += vec[col], then ReLU if relu. EPI_MASK: C = 0 where mask <= 0
    (ReLU backward; mask is the layer's post-ReLU input, (M,N)). EPI_COLSUM: the grid has
    one more row of tiles, op(A)'s row M is all ones, and its result, the column sums of
    op(B), goes to vec (db for dW = x.T @ dout).
    """
    sa = cuda.shared.array((TILE, TILE), float32)
    sb = cuda.shared.array((TILE, TILE), float32)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    M, N = C.shape
    K = A.shape[0] if trans_a else A.shape[1]
    row = cuda.blockIdx.y * TILE + ty
    col = cuda.blockIdx.x * TILE + tx
    ones_row = epilogue == EPI_COLSUM and row == M
    acc = float32(0.0)
    for t in range((K + TILE - 1) // TILE):
        k_a = t * TILE + tx
        if k_a < K and row < M:
            sa[ty, tx] = A[k_a, row] if trans_a else A[row, k_a]
        elif k_a < K and ones_row:
            sa[ty, tx] = 1.0
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
    if col < N:
        if row < M:
            if epilogue == EPI_BIAS:
                acc += vec[col]
                if relu and acc < 0:
                    acc = 0.0
            elif epilogue == EPI_MASK:
                if mask[row, col] <= 0:
                    acc = 0.0
            C[row, col] = acc
        elif ones_row:
            vec[col] = acc


def gemm_launch(A, B, C, trans_a=False, trans_b=False, vec=None, mask=None, epilogue=EPI_NONE, relu=False):
    M, N = C.shape
    K = A.shape[0] if trans_a else A.shape[1]
    if (A.shape[1] if trans_a else A.shape[0]) != M or (B.shape[1] if trans_b else B.shape[0]) != K \
            or (B.shape[0] if trans_b else B.shape[1]) != N:
        raise ValueError(f"gemm shapes do not match: A {A.shape}, B {B.shape}, C {C.shape}")
    rows = M + 1 if epilogue == EPI_COLSUM else M
    grid = ((N + TILE - 1) // TILE, (rows + TILE - 1) // TILE)
    return Launch(_gemm_kernel, grid, (TILE, TILE), A, B, C, _dummy(1) if vec is None else vec,
                  _dummy(2) if mask is None else mask, trans_a, trans_b, epilogue, relu)


def dense_forward_launch(x, W, b, out, relu):
    """out (B,O) = x (B,I) @ W (I,O) + b (+ ReLU)."""
    return gemm_launch(x, W, out, vec=b, epilogue=EPI_BIAS, relu=relu)


def dense_backward_launches(x, dout, W, dW, db, dx=None):
    """dW = x.T @ dout and db = column sums of dout (one launch); dx = (dout @ W.T) * (x > 0)
    (another, when dx is given). x is the layer's input, post-ReLU."""
    out = [gemm_launch(x, dout, dW, trans_a=True, vec=db, epilogue=EPI_COLSUM)]
    if dx is not None:
        out.append(gemm_launch(dout, W, dx, trans_b=True, mask=x, epilogue=EPI_MASK))
    return out


# ---------------------------------------------------------------------------------------
# the sparse first layer

@cuda.jit(cache=True)
def _sparse_forward_kernel(idx, W, b, out, relu):
    n, h = out.shape
    for t in range(cuda.grid(1), n * h, cuda.gridsize(1)):
        i = t // h
        j = t % h
        acc = b[j]
        for k in range(idx.shape[1]):
            acc += W[idx[i, k], j]
        if relu and acc < 0:
            acc = 0.0
        out[i, j] = acc


def sparse_forward_launch(idx, W, b, out, relu):
    """out (B,H) = b + sum_s W[idx[:, s]] (+ ReLU); idx (B,S) int32."""
    if idx.shape[0] != out.shape[0] or W.shape[1] != out.shape[1]:
        raise ValueError(f"sparse_forward shapes do not match: idx {idx.shape}, W {W.shape}, out {out.shape}")
    return Launch(_sparse_forward_kernel, _blocks(out.size), BLOCK, idx, W, b, out, relu)


@cuda.jit(cache=True)
def _fill_kernel(x, v):
    for t in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
        x[t] = v


def fill_launch(x, value=0.0):
    return Launch(_fill_kernel, _blocks(x.shape[0]), BLOCK, x, float32(value))


@cuda.jit(cache=True)
def _scatter_kernel(idx, dout, dW, db):
    """One thread per (row i, input k, column j): dW[idx[i, k], j] += dout[i, j]; the k = 0
    threads also add dout[i, j] into db[j]."""
    n, h = dout.shape
    s = idx.shape[1]
    for t in range(cuda.grid(1), n * s * h, cuda.gridsize(1)):
        j = t % h
        k = (t // h) % s
        i = t // (h * s)
        g = dout[i, j]
        cuda.atomic.add(dW, (idx[i, k], j), g)
        if k == 0:
            cuda.atomic.add(db, j, g)


def sparse_backward_launches(idx, dout, dWb_flat, dW, db):
    """dW (in,H) = scatter-add of dout rows at idx; db = column sums of dout. dWb_flat is
    the flat view of dW followed by db (contiguous in the layout): zeroed first."""
    if dWb_flat.shape[0] != dW.size + db.size:
        raise ValueError("sparse_backward: dWb_flat must cover dW and db")
    return [fill_launch(dWb_flat), Launch(_scatter_kernel, _blocks(dout.shape[0] * idx.shape[1] * dout.shape[1]),
                                          BLOCK, idx, dout, dW, db)]


# ---------------------------------------------------------------------------------------
# targets and losses (one block each: a batch is at most a few hundred rows)

@cuda.jit(device=True)
def _elem(d, kind):
    """(loss, dloss/dd): Huber with delta 1 (kind 0) or 0.5 d^2 (as nn._elem_loss)."""
    half = float32(0.5)
    if kind == 0:
        ad = abs(d)
        if ad <= float32(1.0):
            return half * d * d, d
        return ad - half, (float32(1.0) if d > 0 else float32(-1.0))
    return half * d * d, d


@cuda.jit(device=True)
def block_sum(buf, acc, width):
    """The sum of acc over the block's `width` threads (a power of two), returned to every
    thread; buf is a shared float32 array of `width`."""
    t = cuda.threadIdx.x
    buf[t] = acc
    cuda.syncthreads()
    s = width // 2
    while s > 0:
        if t < s:
            buf[t] += buf[t + s]
        cuda.syncthreads()
        s //= 2
    return buf[0]


@cuda.jit(cache=True)
def _sampled_loss_kernel(q, q_next_on, q_next_t, actions, f32in, double, kind, scale, dq, out):
    """Rows i of the batch: y = r + discount (1 - done) Q_t(s', a*) with a* = argmax of the
    online Q(s') (double) or of Q_t (dqn); d = Q(s, a) - y; dq row; out[2 + i] = d (td);
    out[0] = loss. f32in rows: weights, rewards, dones, discounts."""
    buf = cuda.shared.array(LOSS_BLOCK, float32)
    n_a = q.shape[1]
    acc = float32(0.0)
    for i in range(cuda.threadIdx.x, q.shape[0], LOSS_BLOCK):
        best = 0
        if double:
            for a in range(1, n_a):
                if q_next_on[i, a] > q_next_on[i, best]:
                    best = a
        else:
            for a in range(1, n_a):
                if q_next_t[i, a] > q_next_t[i, best]:
                    best = a
        y = f32in[1, i] + f32in[3, i] * (float32(1.0) - f32in[2, i]) * q_next_t[i, best]
        a = actions[i]
        d = q[i, a] - y
        out[2 + i] = d
        l, g = _elem(d, kind)
        w = f32in[0, i]
        for j in range(n_a):
            dq[i, j] = 0.0
        dq[i, a] = w * g * scale
        acc += w * l
    loss = block_sum(buf, acc * scale, LOSS_BLOCK)
    if cuda.threadIdx.x == 0:
        out[0] = loss


def sampled_loss_launch(q, q_next_on, q_next_t, actions, f32in, double, kind, scale, dq, out):
    return Launch(_sampled_loss_kernel, 1, LOSS_BLOCK, q, q_next_on, q_next_t, actions, f32in, double, kind,
                  float32(scale), dq, out)


@cuda.jit(cache=True)
def _all_actions_loss_kernel(q, q_kids, solved, rot, act_map, rep_of, f32in, gamma, kind, scale, dq, out):
    """All-actions targets: for action a of row b, y = -1 if its child is solved, else
    -1 + gamma max Q_t(child), the child being row b * n_rep + rep_of[a] of q_kids; it is
    compared with the online Q at the action's canonical column act_map[rot[b], a].
    dq rows; out[2 + b] = max |d| (td); out[0] = loss. f32in row 0: weights."""
    buf = cuda.shared.array(LOSS_BLOCK, float32)
    n_a = q.shape[1]
    n_rep = q_kids.shape[0] // q.shape[0]
    acc = float32(0.0)
    for b in range(cuda.threadIdx.x, q.shape[0], LOSS_BLOCK):
        w = f32in[0, b]
        top = float32(0.0)
        for a in range(n_a):
            r = b * n_rep + rep_of[a]
            if solved[r]:
                y = float32(-1.0)
            else:
                v = q_kids[r, 0]
                for k in range(1, q_kids.shape[1]):
                    if q_kids[r, k] > v:
                        v = q_kids[r, k]
                y = float32(-1.0) + gamma * v
            c = act_map[rot[b], a]
            d = q[b, c] - y
            if abs(d) > top:
                top = abs(d)
            l, g = _elem(d, kind)
            acc += w * l
            dq[b, c] = w * g * scale
        out[2 + b] = top
    loss = block_sum(buf, acc * scale, LOSS_BLOCK)
    if cuda.threadIdx.x == 0:
        out[0] = loss


def all_actions_loss_launch(q, q_kids, solved, rot, act_map, rep_of, f32in, gamma, kind, scale, dq, out):
    if q_kids.shape[0] % q.shape[0]:
        raise ValueError("all_actions_loss: q_kids must hold n_rep rows per batch row")
    return Launch(_all_actions_loss_kernel, 1, LOSS_BLOCK, q, q_kids, solved, rot, act_map, rep_of, f32in,
                  float32(gamma), kind, float32(scale), dq, out)

