"""Slow, obvious plain-numpy references for the Numba kernels.

What this file is: the trusted versions the tests compare the fast kernels against, and
the "straightforward numpy implementation" the benchmarks time. Nothing here is fused,
preallocated or clever; clarity is the point. Not used on any hot path.
"""

from __future__ import annotations

import numpy as np

from .nn import Layout, views


def onehot(states: np.ndarray) -> np.ndarray:
    n, s = states.shape
    x = np.zeros((n, s * 6))
    x[np.arange(n)[:, None], 6 * np.arange(s)[None, :] + states] = 1
    return x


def forward(layout: Layout, flat: np.ndarray, x: np.ndarray):
    """Returns (q, acts) with acts[l] the output of layer l (acts[-1] the raw head)."""
    Ws, bs = views(flat, layout)
    acts = []
    h = x
    for l, (W, b) in enumerate(zip(Ws, bs)):
        h = h @ W + b
        if l < len(Ws) - 1:
            h = np.maximum(h, 0)
        acts.append(h)
    head = acts[-1]
    if layout.dueling:
        a = layout.n_actions
        q = head[:, a:a + 1] + head[:, :a] - head[:, :a].mean(axis=1, keepdims=True)
    else:
        q = head
    return q, acts


def elem_loss(d, kind):
    if kind == "huber":
        ad = np.abs(d)
        return np.where(ad <= 1, 0.5 * d * d, ad - 0.5), np.clip(d, -1, 1)
    return 0.5 * d * d, d


def loss_and_dq(q, kind, targets, actions=None, weights=None, scale=None):
    """Loss on taken actions (actions given, targets (B,)) or on all actions (targets (B,A))."""
    n = q.shape[0]
    weights = np.ones(n) if weights is None else weights
    scale = 1.0 / n if scale is None else scale
    dq = np.zeros_like(q)
    if actions is not None:
        d = q[np.arange(n), actions] - targets
        l, g = elem_loss(d, kind)
        dq[np.arange(n), actions] = weights * g * scale
        return float((weights * l).sum() * scale), dq
    l, g = elem_loss(q - targets, kind)
    dq = weights[:, None] * g * scale
    return float((weights[:, None] * l).sum() * scale), dq


def backward(layout: Layout, flat: np.ndarray, x: np.ndarray, acts, dq) -> np.ndarray:
    """Flat gradient of the loss given dLoss/dq."""
    Ws, _ = views(flat, layout)
    grad = np.zeros_like(flat)
    gW, gb = views(grad, layout)
    if layout.dueling:
        d = np.concatenate([dq - dq.mean(axis=1, keepdims=True), dq.sum(axis=1, keepdims=True)], axis=1)
    else:
        d = dq
    for l in range(len(Ws) - 1, -1, -1):
        inp = x if l == 0 else acts[l - 1]
        gW[l][:] = inp.T @ d
        gb[l][:] = d.sum(axis=0)
        if l > 0:
            d = (d @ Ws[l].T) * (inp > 0)
    return grad


class ReferenceOptimizer:
    """Plain-numpy SGD/momentum/Nesterov/Adam/AdamW with global or per-layer clipping."""

    def __init__(self, kind, size, layer_slices, lr, momentum=0.9, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, max_grad_norm=0.0, clip="global"):
        self.kind, self.lr, self.mu, self.betas, self.eps = kind, lr, momentum, betas, eps
        self.wd, self.max_norm, self.clip, self.slices = weight_decay, max_grad_norm, clip, layer_slices
        self.m = np.zeros(size)
        self.v = np.zeros(size)
        self.t = 0

    def _clip(self, g):
        g = g.copy()
        if self.max_norm <= 0 or self.clip == "none":
            return g
        groups = [(0, len(g))] if self.clip == "global" else self.slices
        for lo, hi in groups:
            n = np.linalg.norm(g[lo:hi])
            if n > self.max_norm:
                g[lo:hi] *= self.max_norm / (n + 1e-6)
        return g

    def step(self, p, g):
        self.t += 1
        g = self._clip(g)
        if self.kind == "sgd":
            p -= self.lr * (g + self.wd * p)
        elif self.kind in ("momentum", "nesterov"):
            g = g + self.wd * p
            self.m = self.mu * self.m + g
            p -= self.lr * (g + self.mu * self.m if self.kind == "nesterov" else self.m)
        else:
            b1, b2 = self.betas
            if self.kind == "adamw":
                p -= self.lr * self.wd * p
            else:
                g = g + self.wd * p
            self.m = b1 * self.m + (1 - b1) * g
            self.v = b2 * self.v + (1 - b2) * g * g
            mhat = self.m / (1 - b1 ** self.t)
            vhat = self.v / (1 - b2 ** self.t)
            p -= self.lr * mhat / (np.sqrt(vhat) + self.eps)
        return p


def double_dqn_targets(rewards, dones, discounts, q_next_online, q_next_target):
    a_star = q_next_online.argmax(axis=1)
    return rewards + discounts * (1 - dones) * q_next_target[np.arange(len(rewards)), a_star]


def dqn_targets(rewards, dones, discounts, q_next_target):
    return rewards + discounts * (1 - dones) * q_next_target.max(axis=1)


def sum_tree(leaves: np.ndarray, cap2: int) -> np.ndarray:
    """The replay's sum-tree over these leaves (float64; tree[1] the root, leaves at
    tree[cap2 + i], tree[0] unused): each level the pairwise sums of the one below."""
    tree = np.zeros(2 * cap2)
    tree[cap2:cap2 + len(leaves)] = leaves
    width = cap2
    while width > 1:
        below = tree[width:2 * width]
        width //= 2
        tree[width:2 * width] = below[0::2] + below[1::2]
    return tree


def sq_norm(g: np.ndarray) -> float:
    """sums.py's squared norm in its order, in numpy (every op in g's dtype, one rounding
    each): blocks of 256 values scaled by 2^48 and squared, value j of a block into
    accumulator (j // lanes) % 4, lane j % lanes (16 float32 lanes, 8 float64), the four
    summed (a0 + a1) + (a2 + a3), the lanes halved down to one, the blocks' sums added in
    float64; not finite: the whole array in float64; else times 2^-96 plus the tail's
    squares in float64."""
    g = np.ascontiguousarray(g)
    dt = g.dtype.type
    lanes, block, scale = (16 if g.dtype == np.float32 else 8), 256, 2.0 ** 48
    n = g.shape[0]
    m = n // block * block
    total = 0.0
    for i in range(0, m, block):
        with np.errstate(over="ignore"):  # an overflow sends the sum to the float64 redo
            x = g[i:i + block] * dt(scale)
            squares = (x * x).reshape(block // lanes, lanes)
            accs = [np.zeros(lanes, g.dtype) for _ in range(4)]
            for v in range(block // lanes):
                accs[v % 4] = accs[v % 4] + squares[v]
            s = (accs[0] + accs[1]) + (accs[2] + accs[3])
            while len(s) > 1:
                s = s[:len(s) // 2] + s[len(s) // 2:]
        total += float(s[0])
    if not total <= 1.7976931348623157e308:
        return sq_norm_exact(g)
    return total * (1.0 / (scale * scale)) + sq_norm_exact(g[m:])


def sq_norm_exact(g: np.ndarray) -> float:
    """Sum of squares of a 1-D array, each square and the sum in float64, in index order
    (sq_norm's redo and tail)."""
    total = 0.0
    for v in np.asarray(g, np.float64):
        total += v * v
    return total


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 x rounded to the nearest bfloat16 (ties to even), as float32 (finite x)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32).reshape(np.shape(x))


def gemm_bf16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (M,K) @ b (K,N) as the bf16 tile (tile_bf16.py) defines it: both rounded to bf16,
    products exact in float32, per pair p of k: acc += a[2p+1] b[2p+1], then acc += a[2p] b[2p],
    float32 sums from zero in that order (an odd K's last pair has a zero second half).
    Denormal flushing is not modelled (test data stays normal)."""
    a, b = bf16_round(a), bf16_round(b)
    m, k = a.shape
    acc = np.zeros((m, b.shape[1]), np.float32)
    for p in range(0, k, 2):
        if p + 1 < k:
            acc = acc + np.outer(a[:, p + 1], b[p + 1])  # float32: exact product, one rounding
        acc = acc + np.outer(a[:, p], b[p])
    return acc


def astar_search(policy, state, moves, n_actions, batch=64, weight=0.6, max_depth=30, gamma=1.0,
                 max_nodes=200_000):
    """search.astar_search with Python's heapq as the open set and a dict of position keys
    (bytes) to their best g: the same nodes popped in the same order, so the same result."""
    import heapq

    from .cube import expand_children, is_solved, solved_batch
    from .search import cost_to_go, position_keys
    state = np.asarray(state, dtype=np.uint8)
    if is_solved(state):
        return []
    s = state.shape[0]
    states = np.empty((max_nodes, s), np.uint8)
    parent = np.empty(max_nodes, np.int64)
    action = np.empty(max_nodes, np.int64)
    g = np.empty(max_nodes, np.int64)
    states[0], parent[0], action[0], g[0] = state, -1, -1, 0
    best_g = {position_keys(policy, state[None])[0].tobytes(): 0}
    heap = [(0.0, 0)]
    n_nodes = 1

    def path_to(node, last):
        out = [last]
        while parent[node] >= 0:
            out.append(int(action[node]))
            node = int(parent[node])
        return out[::-1]

    while heap:
        popped = []
        while heap and len(popped) < batch:
            _, i = heapq.heappop(heap)
            if g[i] < max_depth:
                popped.append(i)
        if not popped:
            break
        idx = np.array(popped)
        b = len(popped)
        q = policy.q_values(states[idx])
        kids = np.empty((b, n_actions, s), np.uint8)
        expand_children(states[idx], moves, n_actions, kids)
        flat = kids.reshape(b * n_actions, s)
        solved = np.empty(b * n_actions, np.bool_)
        solved_batch(flat, solved)
        hit = np.flatnonzero(solved)
        if hit.size:
            c = int(hit[np.argmin(g[idx[hit // n_actions]])])
            return path_to(int(idx[c // n_actions]), c % n_actions)
        if n_nodes + b * n_actions > max_nodes:
            break
        h = np.maximum(cost_to_go(q, gamma) - 1.0, 0.0).reshape(-1)
        keys = position_keys(policy, flat)
        for c in range(b * n_actions):
            gc = int(g[idx[c // n_actions]]) + 1
            key = keys[c].tobytes()
            if best_g.get(key, max_depth + 1) <= gc:
                continue
            best_g[key] = gc
            states[n_nodes], parent[n_nodes], action[n_nodes], g[n_nodes] = flat[c], idx[c // n_actions], \
                c % n_actions, gc
            heapq.heappush(heap, (weight * gc + h[c], n_nodes))
            n_nodes += 1
    return None
