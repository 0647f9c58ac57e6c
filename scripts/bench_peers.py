#!/usr/bin/env python
"""Time one Double-DQN training step in cubedqn, plain numpy and (if installed) PyTorch
eager and JAX jit, at the same shapes, one thread, alternating repetitions.

The step: online forward on s, online forward on s' (argmax), target forward on s',
Huber loss on the taken actions, backward, global-norm clipping (max 10), momentum
update (0.9); with --optimizer adam, an Adam update (betas 0.9, 0.999, eps 1e-8, bias
corrected) instead, the update `cubedqn profile` and `train` run by default (the issue's
profile commands time that step). cubedqn uses its sparse first layer (sticker
indices); the peers get the dense one-hot float input they would use. A "cubedqn dense" row runs the engine with the
dense first layer too, and "cubedqn per-part" without the fused step (one kernel call per
part instead of one for the whole step, as CUBEDQN_FUSED=0 does) where the "cubedqn" row
takes it (the engine's default at both shapes since stop 61), else "cubedqn one-call" with
it. Prints medians, ratios to cubedqn, and the BLAS kernel in use.

Then, per shape, the bound the performance issue asks for: the step's GEMMs (their FLOPs
over the sgemm peak measured in this process, and over the core's FMA ceiling, a loop of
vector FMAs in registers that no GEMM can outrun; each the higher of a reading before and
one after the shape's timings) against the time each target ratio allows (the peer's
median over the ratio), as the rate the GEMMs would need to fit in it with the rest of
cubedqn's step (encode, first layer, loss, optimizer, Python) as it is now, and with the
rest at zero; a rate above the ceiling is out of reach. The rest: the step timed once more
with its own PhaseTimer, minus its GEMM layers (the timer adds a few us). The host's speed changes within a run:
the medians, the peak and the timed step are different moments, all printed. Where the
tile's sparse path (cubedqn/tile_sparse.py) runs, the GEMMs leave out the zero terms of
their ReLU inputs: the bound is then on the multiply-adds they did in the step
(profiling.gemm_flops_done, from the step's own activations), not the dense count. The
batch (make_data) has a tenth of its transitions terminal; cubedqn does not score their
s' (y = r there; README, Design notes), the peers score every row: the script says how
many it skipped.

With --bf16, also cubedqn with matmul_precision bfloat16 and the peers' bf16 mixed
precision (rows "cubedqn bf16", "pytorch bf16", "jax bf16"), and a line of its ratios.

  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_peers.py [--bf16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cubedqn.cube import apply_actions, get_puzzle, scramble_into  # noqa: E402
from cubedqn.encoding import Encoder  # noqa: E402
from cubedqn.learner import Learner  # noqa: E402
from cubedqn.nn import Layout, init_params, views  # noqa: E402
from cubedqn.profiling import cpu_info, describe_cpu  # noqa: E402
from cubedqn.replay import Batch  # noqa: E402
from cubedqn.rng import make_rng  # noqa: E402

SHAPES = {"cube2": ("cube2", (256, 256), 64), "cube3": ("cube3", (1024, 512), 256)}
GAMMA, LR, MU, CLIP = 0.99, 1e-3, 0.9, 10.0
B1, B2, EPS = 0.9, 0.999, 1e-8  # Adam's (cubedqn's, PyTorch's and optax's defaults)
OPTIMIZERS = ("momentum", "adam")


def make_data(puzzle, batch, seed=0):
    """A batch of transitions as training samples them: states scrambled 1-20 quarter turns
    from solved (the 3x3x3's centres in place, which cubedqn's first layer makes use of;
    the peers' dense steps do the same work whatever the stickers are), s' one turn on."""
    rng = np.random.default_rng(seed)
    b = Batch(batch, puzzle.n_stickers, np.float32)
    b.states[:] = puzzle.solved
    scramble_into(b.states, rng.integers(1, 21, batch).astype(np.int64), puzzle.moves, 12, make_rng(seed), True,
                  np.zeros((batch, 0), np.int8))
    b.actions[:] = rng.integers(0, 12, batch)
    apply_actions(b.states, b.actions, puzzle.moves, b.next_states)
    b.rewards[:] = -1
    b.dones[:] = rng.random(batch) < 0.1
    b.discounts[:] = GAMMA
    return b


def start_params(layout):
    """The flat float32 parameters every implementation starts from (layers' W (in, out)
    then b, in the layout's order), so that their steps can be compared value for value
    (tests/test_bench_peers.py); the timings do not depend on the values."""
    return init_params(layout, np.random.default_rng(0))


def flat_of(pairs):
    """[(W, b)] per layer, W (in, out), as one flat float32 array in the layout's order."""
    return np.concatenate([np.concatenate([np.asarray(w, np.float32).ravel(), np.asarray(b, np.float32).ravel()])
                           for w, b in pairs])


def onehot(states):
    n, s = states.shape
    x = np.zeros((n, s * 6), np.float32)
    x[np.arange(n)[:, None], 6 * np.arange(s)[None, :] + states] = 1
    return x


# ---------------------------------------------------------------------------------------
def cubedqn_step(layout, puzzle, batch, sparse=True, fused=None, matmul_precision="float32", optimizer="momentum"):
    moves = np.ascontiguousarray(puzzle.moves[:12])
    enc = Encoder(puzzle, 12, canonical=False, sparse=sparse)
    lr = Learner(layout, moves, len(batch.actions), enc, targets="double", gamma=GAMMA, optimizer=optimizer,
                 lr=LR, momentum=MU, betas=(B1, B2), eps=EPS, max_grad_norm=CLIP, sparse=sparse,
                 target_update_interval=10 ** 9,
                 fused=fused)
    lr.online.params[:] = start_params(layout)
    lr.target.params[:] = lr.online.params

    def reset():
        """Back to the start (parameters, target, optimizer state): bench() calls it before
        each repetition, untimed. The step's time follows its activations' zeros (the tile's
        sparse path), and hundreds of steps on one fixed batch kill ReLUs that training on
        fresh batches would not: without it the cube3 Adam step did 41% of the dense
        multiply-adds by the end (runs/perf45/report2), against 71% with momentum."""
        lr.online.params[:] = start_params(layout)
        lr.target.params[:] = lr.online.params
        lr.opt.m[:] = 0
        lr.opt.v[:] = 0
        lr.opt.t = 0

    if matmul_precision == "float32":
        step = lambda: lr.train_step(batch)  # noqa: E731
    else:  # the switch around each step (two native calls, ~1 us): the other rows run float32
        from cubedqn.blas import matmul_precision_as

        def step():
            with matmul_precision_as(matmul_precision):
                lr.train_step(batch)
    step.learner = lr
    step.params = lambda: lr.online.params.copy()
    step.reset = reset
    return step


def numpy_step(layout, puzzle, batch, optimizer="momentum"):
    """The straightforward numpy version: dense one-hot input, no fusion, fresh arrays."""
    p = start_params(layout)
    tgt = p.copy()
    buf = np.zeros_like(p)
    sq = np.zeros_like(p)  # Adam's second moment
    t = [0]
    x, xn = onehot(batch.states), onehot(batch.next_states)
    a, r, d = batch.actions.astype(np.int64), batch.rewards.astype(np.float32), batch.dones.astype(np.float32)
    n = len(a)

    def fwd(flat, inp):
        Ws, bs = views(flat, layout)
        acts = [inp]
        for l in range(len(Ws)):
            h = acts[-1] @ Ws[l] + bs[l]
            if l < len(Ws) - 1:
                h = np.maximum(h, 0)
            acts.append(h)
        return acts

    def step():
        acts = fwd(p, x)
        q = acts[-1]
        a_star = fwd(p, xn)[-1].argmax(1)
        qt = fwd(tgt, xn)[-1][np.arange(n), a_star]
        y = r + GAMMA * (1 - d) * qt
        delta = q[np.arange(n), a] - y
        dq = np.zeros_like(q)
        dq[np.arange(n), a] = np.clip(delta, -1, 1) / n
        Ws, _ = views(p, layout)
        grads = []
        dcur = dq
        for l in range(len(Ws) - 1, -1, -1):
            grads.append((acts[l].T @ dcur, dcur.sum(0)))
            if l:
                dcur = (dcur @ Ws[l].T) * (acts[l] > 0)
        g = np.concatenate([np.concatenate([gw.ravel(), gb]) for gw, gb in reversed(grads)])
        norm = np.sqrt((g * g).sum())
        if norm > CLIP:
            g *= CLIP / norm
        if optimizer == "adam":
            t[0] += 1
            buf[:] = B1 * buf + (1 - B1) * g
            sq[:] = B2 * sq + (1 - B2) * g * g
            p[:] = p - LR / (1 - B1 ** t[0]) * buf / (np.sqrt(sq / (1 - B2 ** t[0])) + EPS)
        else:
            buf[:] = MU * buf + g
            p[:] = p - LR * buf

    step.params = lambda: p.copy()
    return step


def torch_step(layout, puzzle, batch, device="cpu", bf16=False, optimizer="momentum"):
    """bf16: the step's forward passes under torch.autocast(bfloat16) (Linear layers on
    bf16 operands), PyTorch's CPU mixed precision; the weights and optimizer stay float32."""
    import torch
    torch.set_num_threads(1)
    dims = layout.widths
    dev = torch.device(device)

    def mlp():
        mods = []
        for l in range(len(dims) - 1):
            mods.append(torch.nn.Linear(dims[l], dims[l + 1]))
            if l < len(dims) - 2:
                mods.append(torch.nn.ReLU())
        return torch.nn.Sequential(*mods)

    online, target = mlp().to(dev), mlp().to(dev)
    with torch.no_grad():
        Ws, bs = views(start_params(layout), layout)
        for lin, W, b in zip(online[::2], Ws, bs):
            lin.weight.copy_(torch.tensor(W.T))  # Linear keeps W as (out, in)
            lin.bias.copy_(torch.tensor(b))
    target.load_state_dict(online.state_dict())
    opt = (torch.optim.Adam(online.parameters(), lr=LR, betas=(B1, B2), eps=EPS) if optimizer == "adam"
           else torch.optim.SGD(online.parameters(), lr=LR, momentum=MU))
    x, xn = (torch.tensor(onehot(s), device=dev) for s in (batch.states, batch.next_states))
    a = torch.tensor(batch.actions.astype(np.int64), device=dev)
    r, d = (torch.tensor(v.astype(np.float32), device=dev) for v in (batch.rewards, batch.dones))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            q = online(x).gather(1, a[:, None])[:, 0].float()
            with torch.no_grad():
                a_star = online(xn).argmax(1, keepdim=True)
                y = r + GAMMA * (1 - d) * target(xn).gather(1, a_star)[:, 0].float()
        loss = torch.nn.functional.smooth_l1_loss(q, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(online.parameters(), CLIP)
        opt.step()
        sync()  # a GPU step is timed to its end, as cubedqn's (which reads its loss back)

    step.params = lambda: flat_of([(lin.weight.detach().cpu().numpy().T, lin.bias.detach().cpu().numpy())
                                   for lin in online[::2]])
    return step


def jax_step(layout, puzzle, batch, bf16=False, optimizer="momentum"):
    """bf16: each layer's product on bf16 operands with float32 results
    (preferred_element_type), the same arithmetic as cubedqn's bfloat16 matmuls."""
    import jax
    import jax.numpy as jnp
    Ws, bs = views(start_params(layout), layout)
    params = [(jnp.asarray(W), jnp.asarray(b)) for W, b in zip(Ws, bs)]
    target = [(w + 0, b + 0) for w, b in params]
    mom = [(jnp.zeros_like(w), jnp.zeros_like(b)) for w, b in params]
    x, xn = jnp.asarray(onehot(batch.states)), jnp.asarray(onehot(batch.next_states))
    a = jnp.asarray(batch.actions.astype(np.int32))
    r, d = jnp.asarray(batch.rewards.astype(np.float32)), jnp.asarray(batch.dones.astype(np.float32))

    def fwd(ps, inp):
        h = inp
        for l, (w, b) in enumerate(ps):
            if bf16:
                h = jnp.matmul(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                               preferred_element_type=jnp.float32) + b
            else:
                h = h @ w + b
            if l < len(ps) - 1:
                h = jax.nn.relu(h)
        return h

    def loss_fn(ps, tgt):
        q = jnp.take_along_axis(fwd(ps, x), a[:, None], 1)[:, 0]
        a_star = jnp.argmax(fwd(jax.lax.stop_gradient(ps), xn), 1)
        qt = jnp.take_along_axis(fwd(tgt, xn), a_star[:, None], 1)[:, 0]
        y = jax.lax.stop_gradient(r + GAMMA * (1 - d) * qt)
        delta = q - y
        ad = jnp.abs(delta)
        return jnp.mean(jnp.where(ad <= 1, 0.5 * delta * delta, ad - 0.5))

    def clipped_grads(ps, tgt):
        g = jax.grad(loss_fn)(ps, tgt)
        norm = jnp.sqrt(sum(jnp.sum(gw * gw) + jnp.sum(gb * gb) for gw, gb in g))
        return g, jnp.minimum(1.0, CLIP / (norm + 1e-6))

    @jax.jit
    def momentum_fn(ps, tgt, m):
        g, scale = clipped_grads(ps, tgt)
        m = [(MU * mw + scale * gw, MU * mb + scale * gb) for (mw, mb), (gw, gb) in zip(m, g)]
        ps = [(w - LR * mw, b - LR * mb) for (w, b), (mw, mb) in zip(ps, m)]
        return ps, m

    @jax.jit
    def adam_fn(ps, tgt, m, v, t):  # as optax.adam: bias-corrected moments, eps outside the root
        g, scale = clipped_grads(ps, tgt)
        t = t + 1
        tree = jax.tree_util.tree_map
        g = tree(lambda x: scale * x, g)
        m = tree(lambda mi, gi: B1 * mi + (1 - B1) * gi, m, g)
        v = tree(lambda vi, gi: B2 * vi + (1 - B2) * gi * gi, v, g)
        c1, c2 = 1 - B1 ** t, 1 - B2 ** t
        ps = tree(lambda w, mi, vi: w - LR * (mi / c1) / (jnp.sqrt(vi / c2) + EPS), ps, m, v)
        return ps, m, v, t

    state = {"p": params, "m": mom}
    if optimizer == "adam":  # (the momentum step carries no second moment through the call)
        state.update(v=[(jnp.zeros_like(w), jnp.zeros_like(b)) for w, b in params], t=jnp.zeros((), jnp.float32))

    def step():
        if optimizer == "adam":
            state["p"], state["m"], state["v"], state["t"] = adam_fn(state["p"], target, state["m"], state["v"],
                                                                     state["t"])
        else:
            state["p"], state["m"] = momentum_fn(state["p"], target, state["m"])
        jax.block_until_ready(state["p"])

    step.params = lambda: flat_of(state["p"])
    return step


# ---------------------------------------------------------------------------------------
def step_gemms(layout, batch):
    """The BLAS calls of one cubedqn Double-DQN step (sparse first layer): (a, b, out) triples
    in the layouts the engine passes them (x.T and W.T are transposed views, as in nn.py).
    The Q head's backward is no GEMM there (nn.head_backward_taken), so not here either."""
    rng = np.random.default_rng(0)
    w = layout.widths
    calls = []
    for l in range(1, layout.n_layers):
        W = rng.standard_normal((w[l], w[l + 1])).astype(np.float32)
        for rows in (2 * batch, batch):  # online on [s; s'], target on s'
            calls.append((rng.random((rows, w[l]), np.float32), W, np.empty((rows, w[l + 1]), np.float32)))
        if l == layout.n_layers - 1:
            continue
        x = rng.random((batch, w[l]), np.float32)
        dout = rng.standard_normal((batch, w[l + 1])).astype(np.float32)
        calls.append((x.T, dout, np.empty((w[l], w[l + 1]), np.float32)))  # dW = x.T @ dout
        calls.append((dout, W.T, np.empty((batch, w[l]), np.float32)))  # dx = dout @ W.T
    return calls


def gemm_floor(layout, batch, reps=200):
    """(seconds, flops) of the step's GEMMs alone, each timed hot in isolation (median)."""
    from cubedqn.profiling import _gemm
    total, flops = 0.0, 0.0
    for a, b, out in step_gemms(layout, batch):
        _gemm(a, b, out)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            _gemm(a, b, out)
            ts.append(time.perf_counter() - t)
        total += float(np.median(ts))
        flops += 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    return total, flops


def gemm_share_in_step(learner, batch, steps):
    """ms per step of the GEMM layers (forward + backward parts, the step's own PhaseTimer)
    and of the whole timed step, over `steps` steps of the engine."""
    from cubedqn.learner import PhaseTimer
    timer = PhaseTimer()
    t = time.perf_counter()
    for _ in range(steps):
        learner.train_step(batch, timer)
    wall = (time.perf_counter() - t) / steps
    gemm = (timer.parts["forward"]["GEMM layers"] + timer.parts["backward"]["GEMM layers"]) / steps
    return gemm * 1e3, wall * 1e3


# the performance issue's targets: (peer, how many times faster cubedqn's step should be)
TARGETS = {"cube2": (("jax jit", 2.0), ("pytorch eager", 4.0)), "cube3": (("jax jit", 1.5), ("pytorch eager", 3.0))}


def budget_lines(shape, med, g_flops, peak, ceiling, rest_now, peer_flops):
    """For each target: the step time it allows, and the rate the step's GEMMs would need
    to fit in it with the rest of the step as it is now and with the rest at zero, against
    the sgemm peak and the FMA ceiling (no GEMM runs faster than the latter: a rate above it
    is out of reach on this core)."""
    out = []

    def of(rate):
        return f"{rate / peak:.0%} of the peak, {rate / ceiling:.0%} of the ceiling"

    for peer, factor in TARGETS[shape]:
        if peer not in med:
            continue
        allowed = med[peer] * 1e3 / factor
        need_zero = g_flops / allowed / 1e6
        if allowed > rest_now:
            need = g_flops / (allowed - rest_now) / 1e6
            with_rest = f"{need:.1f} GFLOP/s ({of(need)}) with the rest as now, "
            if need > ceiling:
                with_rest += "out of reach with it; "
        else:
            with_rest = "more than any rate with the rest as now (it alone takes longer), "
        verdict = "; out of reach: above the FMA ceiling even with the rest at zero" if need_zero > ceiling else ""
        own = peer_flops / med[peer] / 1e9  # the peer's whole step, its dense first layer included
        out.append(f"target {factor:g}x {peer}: {allowed:.3f} ms/step allowed; the GEMMs would need {with_rest}"
                   f"{need_zero:.1f} GFLOP/s ({of(need_zero)}) with the rest at zero{verdict}; "
                   f"the latter is {need_zero / own:.2f}x the rate the peer reached over its own step "
                   f"({own:.1f} GFLOP/s, timed alongside)")
    return out


def blas_kernel():
    from cubedqn.profiling import blas_info, describe_tile
    b = blas_info()
    return (f"{b['library']} {b['version']} ({b['source']}'s, see cubedqn/blas.py) kernel {b['kernel']}, "
            f"OPENBLAS_CORETYPE={b['OPENBLAS_CORETYPE']}; tile GEMM (cubedqn/tile_gemm.py) {describe_tile(b)}")


def print_table(med, base, flops, width=16):
    """One line per implementation: its median (s/step) as ms/step, steps/min and dense
    GFLOP/s, and its time relative to `base`'s."""
    w = len(base) + 3
    print(f"{'implementation':<{width}s} {'ms/step':>9s} {'steps/min':>10s} {'dense GFLOP/s':>14s} {'vs ' + base:>{w + 1}s}")
    for name, t in med.items():
        print(f"{name:<{width}s} {t * 1e3:>9.3f} {60 / t:>10.0f} {flops / t / 1e9:>14.1f} {t / med[base]:>{w}.2f}x")


def rotated(names, rep):
    """The order of repetition rep: names started at rep mod len(names), so that over
    the repetitions each implementation is timed in every place, after every other one."""
    k = rep % len(names)
    return names[k:] + names[:k]


def bench(impls, reps, inner):
    """Medians (s/step) of reps timed blocks of inner steps each. Each repetition first
    resets the implementations that have a reset (cubedqn's, untimed), then times one
    block of each, in an order rotated every repetition: in a fixed order the first
    implementation always followed the last one's data and the second always followed
    the first's, so a ratio of two rows mixed their code with their places (at the large
    shape the one-call step read 0.98-0.99x the per-part one as the second row, 0.98-1.03x
    as the first, runs/perf54/fused_large.txt)."""
    times = {name: [] for name in impls}
    for name, f in impls.items():  # warm-up (compilation)
        for _ in range(3):
            f()
    for rep in range(reps):
        for f in impls.values():
            if hasattr(f, "reset"):  # cubedqn's: from the start parameters each repetition (cubedqn_step)
                f.reset()
        for name in rotated(list(impls), rep):
            f = impls[name]
            t = time.perf_counter()
            for _ in range(inner):
                f()
            times[name].append((time.perf_counter() - t) / inner)
    return {k: float(np.median(v)) for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-pin", action="store_true", help="do not pin the process to one CPU")
    ap.add_argument("--shapes", default="cube2,cube3")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--peers", default="numpy,torch,jax")
    ap.add_argument("--optimizer", choices=OPTIMIZERS, default="momentum",
                    help="the update every implementation applies: momentum (the performance issue's peer step) "
                         "or adam (what `cubedqn profile` runs unless told otherwise)")
    ap.add_argument("--bf16", action="store_true",
                    help="also time cubedqn with matmul_precision bfloat16 (CPUs with AVX512_BF16) and the peers' "
                         "bf16 mixed precision (PyTorch autocast, JAX bf16 operands with float32 results)")
    args = ap.parse_args()
    if set(args.shapes.split(",")) - set(SHAPES):
        ap.error(f"--shapes: expected a comma-separated list of {', '.join(SHAPES)}, got {args.shapes!r}")
    if set(args.peers.split(",")) - {"numpy", "torch", "jax"}:
        ap.error(f"--peers: expected a comma-separated list of numpy, torch, jax, got {args.peers!r}")
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        # One CPU for everything: a library that ignores its thread settings cannot use more.
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    from cubedqn.threads import limit_threads
    limit_threads(1)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    print(f"BLAS: {blas_kernel()}; CPUs allowed: {cpus}")
    print(f"CPU: {describe_cpu(cpu_info())}")
    from cubedqn.profiling import fma_ceiling_gflops, peak_gflops
    for shape in args.shapes.split(","):
        peak_before, ceiling_before = peak_gflops(), fma_ceiling_gflops()
        pname, hidden, bsz = SHAPES[shape]
        puzzle = get_puzzle(pname)
        layout = Layout(puzzle.n_stickers * 6, puzzle.n_stickers, hidden, 12)
        batch = make_data(puzzle, bsz)
        opt = args.optimizer
        engine = cubedqn_step(layout, puzzle, batch, optimizer=opt)
        fused = engine.learner.fused  # the other path, for the side-by-side row
        impls = {"cubedqn": engine,
                 "cubedqn one-call" if not fused else "cubedqn per-part":
                     cubedqn_step(layout, puzzle, batch, fused=not fused, optimizer=opt),
                 "cubedqn dense": cubedqn_step(layout, puzzle, batch, sparse=False, optimizer=opt)}
        skipped = []
        for peer in args.peers.split(","):
            try:
                impls[{"numpy": "numpy", "torch": "pytorch eager", "jax": "jax jit"}[peer]] = \
                    {"numpy": numpy_step, "torch": torch_step, "jax": jax_step}[peer](layout, puzzle, batch,
                                                                                     optimizer=opt)
            except ImportError:
                skipped.append(peer)
        if args.bf16:
            from cubedqn.blas import bf16_problem
            if bf16_problem():
                print(f"--bf16: cubedqn's bfloat16 matmuls {bf16_problem()}; bf16 rows skipped")
            else:
                impls["cubedqn bf16"] = cubedqn_step(layout, puzzle, batch, matmul_precision="bfloat16", optimizer=opt)
                for peer, name, make in (("torch", "pytorch bf16", torch_step), ("jax", "jax bf16", jax_step)):
                    if peer in args.peers.split(",") and peer not in skipped:
                        impls[name] = make(layout, puzzle, batch, bf16=True, optimizer=opt)
        inner = max(1, args.inner // (4 if shape == "cube3" else 1))
        med = bench(impls, args.reps, inner)
        flops = 3 * layout.flops_forward(bsz, sparse=False) + layout.flops_backward(bsz, sparse=False)
        from cubedqn.profiling import first_layer_kernel
        lr = impls["cubedqn"].learner
        print(f"\n{layout.describe()}  batch {bsz}  (Double DQN, Huber, clipped {opt}; medians of "
              f"{args.reps} x {inner} steps, 1 thread; cubedqn's first layer: "
              f"{first_layer_kernel(lr.online, lr.ws)})")
        print_table(med, "cubedqn", flops)
        if skipped:
            print(f"skipped (not installed): {', '.join(skipped)}")
        if "cubedqn bf16" in med:
            mine = med["cubedqn bf16"]
            pairs = [f"{med[k] / mine:.2f}x {k}" for k in ("pytorch eager", "jax jit", "pytorch bf16", "jax bf16")
                     if k in med]
            print(f"cubedqn bf16 (matmul_precision bfloat16): {mine * 1e3:.3f} ms/step, {med['cubedqn'] / mine:.2f}x "
                  f"cubedqn float32; faster than: {', '.join(pairs)} (the float32 targets are for float32 steps)")
        # read before and after the timings; the host's speed changes within a run, and the
        # higher reading is the machine's rate (a low one would understate the bound)
        peak, ceiling = max(peak_before, peak_gflops()), max(ceiling_before, fma_ceiling_gflops())
        g_s, g_flops = gemm_floor(layout, bsz)
        print(f"the step's GEMMs (layers 1..L-1, {g_flops / 1e6:.1f} MFLOP): {g_s * 1e3:.3f} ms when each is timed "
              f"hot on its own ({g_flops / g_s / 1e9:.1f} GFLOP/s), {g_flops / peak / 1e6:.3f} ms at the "
              f"{peak:.1f} GFLOP/s sgemm peak (n = 1024), {g_flops / ceiling / 1e6:.3f} ms at the {ceiling:.1f} GFLOP/s "
              f"FMA ceiling (vector FMAs in registers alone; each the higher of two readings, before and after "
              f"this shape)")
        gemm_step, timed = gemm_share_in_step(lr, batch, max(20, args.reps * inner // 4))
        rest = timed - gemm_step
        print(f"cubedqn's step timed again by its own PhaseTimer: {timed:.3f} ms/step, of it the GEMM layers "
              f"{gemm_step:.3f} ms ({g_flops / gemm_step / 1e6:.1f} GFLOP/s) and the rest {rest:.3f} ms")
        from cubedqn.profiling import gemm_flops_done
        if lr.last_target_rows < bsz:
            print(f"cubedqn's target net scored the s' of {lr.last_target_rows} of the batch's {bsz} transitions: the "
                  f"other {bsz - lr.last_target_rows} are terminal (y = r), whose s' the peers score like the rest")
        done, dense = gemm_flops_done(lr, 2 * bsz, bsz)
        if done < dense:  # the bound is on what the GEMMs did
            g_flops *= done / dense
            print(f"the tile's sparse path (cubedqn/tile_sparse.py) left out the zero terms of the GEMMs' ReLU inputs: "
                  f"they did {done / dense:.0%} of the dense multiply-adds in the step, {g_flops / 1e6:.1f} MFLOP, "
                  f"{g_flops / ceiling / 1e6:.3f} ms at the FMA ceiling; the rates below are of those")
        if min(gemm_step, med["cubedqn"] * 1e3) < g_flops / ceiling / 1e6:
            print(f"(no bound this time: cubedqn's step or its GEMM layers ran faster than the {ceiling:.1f} GFLOP/s "
                  f"FMA ceiling allows, so the host was slower whenever the ceiling was read)")
        else:
            for line in budget_lines(shape, med, g_flops, peak, ceiling, rest, flops):
                print(line)


if __name__ == "__main__":
    main()
