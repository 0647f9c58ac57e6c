"""Step-time breakdown of the training loop, achieved vs peak GEMM rate, BLAS in use.

What this file is: `profile_training` runs the configured loop past its warm-up
(compilation and replay fill excluded), then times N gradient steps phase by phase with
the trainer's own PhaseTimer, and reports ms per gradient step and per part of the
forward and backward phases, throughput, GFLOP/s of those two phases and of the GEMM
layers alone next to a single-thread-or-T sgemm peak measured in this process (and the
core's FMA ceiling, which no GEMM can pass), memory, and which BLAS library, kernel and
thread count ran.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
from numba import njit

from . import blas
from .learner import PhaseTimer

TRAIN_PHASES = ("sample", "forward", "backward", "optimizer")


@njit(cache=True)
def _gemm(a, b, c):
    blas.gemm(a, b, c)


def peak_gflops(dtype=np.float32, n=1024, reps=5) -> float:
    """Best-of-reps GEMM rate of the BLAS that njit kernels call, n x n x n."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    c = np.empty((n, n), dtype)
    _gemm(a, b, c)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        _gemm(a, b, c)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def _fma_ceiling_ir(kind, lanes, chains, name):
    """IR of `fma_loop(n)` as function `name`: `chains` independent chains of vector FMAs
    (lanes wide; kind "f32" or "f64", or "bf16": VDPBF16PS, float32 lanes each adding two
    bf16 products), n rounds, no memory traffic; returns one lane of their sum (so nothing
    is dead code)."""
    import llvmlite.ir as ir
    from .native import counted_loop
    fty = ir.DoubleType() if kind == "f64" else ir.FloatType()
    vec, i64 = ir.VectorType(fty, lanes), ir.IntType(64)
    mod = ir.Module(name="cubedqn_fma_ceiling")
    fn = ir.Function(mod, ir.FunctionType(fty, [i64]), name)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    if kind == "bf16":
        from .tile_bf16 import BFloatType
        pairs = ir.VectorType(BFloatType(), 2 * lanes)
        dot = ir.Function(mod, ir.FunctionType(vec, [vec, pairs, pairs]), "llvm.x86.avx512bf16.dpbf16ps.512")
        x = b.bitcast(ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0x3F803F80] * lanes), pairs)  # 1.0, 1.0

        def step(a):
            return b.call(dot, [a, x, x])
    else:
        fma = ir.Function(mod, ir.FunctionType(vec, [vec, vec, vec]), f"llvm.fma.v{lanes}{kind}")
        x, y = ir.Constant(vec, [1.0000001] * lanes), ir.Constant(vec, [1e-7] * lanes)

        def step(a):
            return b.call(fma, [a, x, y])
    _, accs, close = counted_loop(b, ir.Constant(i64, 0), fn.args[0], 1, "round",
                                  [ir.Constant(vec, [float(c)] * lanes) for c in range(chains)])
    close([step(a) for a in accs])
    total = accs[0]
    for a in accs[1:]:
        total = b.fadd(total, a)
    b.ret(b.extract_element(total, ir.Constant(ir.IntType(32), 0)))
    return str(mod)


_FMA_LOOPS = {}  # dtype name -> (engine, loop, lanes, chains)


def fma_loop(dtype=np.float32):
    """(loop, lanes, chains): loop(n) runs n rounds of the FMA chains `_fma_ceiling_ir`
    writes for this CPU (16 chains of 512-bit vectors with AVX-512, 12 of 256-bit without:
    enough in flight to cover the FMA latency on both FMA pipes) and returns lane 0 of
    their sum; dtype "bf16": 16 chains of VDPBF16PS (CPUs with AVX512_BF16; the ceiling of
    tile_bf16.py's products). Built once per process and dtype (its object code cached
    like the kernels')."""
    import ctypes

    from .native import host_has_avx512, load_or_compile
    bf16 = isinstance(dtype, str) and dtype == "bf16"
    double = not bf16 and np.dtype(dtype) == np.float64
    key = "bf16" if bf16 else np.dtype(dtype).name
    if key not in _FMA_LOOPS:
        wide = bf16 or host_has_avx512()
        lanes, chains = (16 if wide else 8) // (2 if double else 1), 16 if wide else 12
        name = f"cubedqn_fma_loop_{key}"
        sources = (__file__, Path(__file__).with_name("tile_bf16.py")) if bf16 else __file__
        kind = "bf16" if bf16 else "f64" if double else "f32"
        engine, _ = load_or_compile(f"fma-ceiling-{key}", sources, lambda: _fma_ceiling_ir(kind, lanes, chains, name),
                                    (name,), ",-prefer-256-bit" if wide else "")
        loop = ctypes.CFUNCTYPE(ctypes.c_double if double else ctypes.c_float, ctypes.c_int64)(
            engine.get_function_address(name))
        _FMA_LOOPS[key] = (engine, loop, lanes, chains)
    return _FMA_LOOPS[key][1:]


def fma_ceiling_gflops(dtype=np.float32, reps=5, seconds=0.02) -> float:
    """The most floating-point operations per second one core does here: the best of reps
    readings (about `seconds` each) of fma_loop, vector FMAs in registers and nothing else.
    No GEMM can run faster; the sgemm peak says how close the library gets. dtype "bf16":
    the bf16 dot-product loop's, two products per lane."""
    loop, lanes, chains = fma_loop(dtype)
    flops_per_round = (4 if dtype == "bf16" else 2) * lanes * chains  # multiplies and adds per lane
    rounds = 1000
    while True:  # find how many rounds take about `seconds`
        t = time.perf_counter()
        loop(rounds)
        dt = time.perf_counter() - t
        if dt >= seconds / 4:
            break
        rounds *= 4
    rounds = max(1, int(rounds * seconds / dt))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        loop(rounds)
        best = min(best, time.perf_counter() - t)
    return flops_per_round * rounds / best / 1e9


def _ceiling_or_none(dtype, device):
    """fma_ceiling_gflops on the CPU; None for CUDA runs or where LLVM cannot build the loop
    (the report then leaves the ceiling out rather than failing)."""
    if device != "cpu":
        return None
    try:
        return fma_ceiling_gflops(dtype)
    except Exception:  # noqa: BLE001 - a measurement aid, not worth a failed profile
        return None


def blas_info() -> dict:
    """The BLAS the kernels' float32 GEMMs run on (blas.BACKEND: numpy's bundled OpenBLAS,
    or scipy's, which numba's np.dot uses), its kernel and threads."""
    from threadpoolctl import threadpool_info

    from .threads import gemm_threads
    infos = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    if blas.BACKEND == "numpy":  # the library blas.py bound (read again: threads may have changed)
        pick = next((i for i in infos if i.get("filepath") == blas.BACKEND_INFO["filepath"]), blas.BACKEND_INFO)
    else:
        pick = next((i for i in infos if blas.is_scipy_blas(i)), infos[0] if infos else {})
    return {"library": pick.get("internal_api", "unknown"), "version": pick.get("version"),
            "kernel": pick.get("architecture"), "threads": pick.get("num_threads"), "source": blas.BACKEND,
            "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
            "tile_gemm": "on" if blas.TILE else blas.TILE_STATUS,
            # the tile's code: "avx512" or "avx2" (CUBEDQN_TILE_GEMM=avx2 on an AVX-512 CPU too)
            "tile_isa": ("avx512" if blas.tile_gemm.AVX512 else "avx2") if blas.TILE else None,
            # team.py: workers that share the larger products' columns with the caller now
            # (--threads T: T - 1, the BLAS then on one thread), or why there are none
            "gemm_team": blas.team_problem() or f"{blas.team_workers()} worker(s)",
            "gemm_threads": gemm_threads()}


def describe_tile(b: dict) -> str:
    """blas_info's tile GEMM in words: "on (AVX-512)", "on (AVX2)", or why it is not used."""
    isa = {"avx512": " (AVX-512)", "avx2": " (AVX2)"}.get(b.get("tile_isa"), "")
    return f"{b.get('tile_gemm', 'absent')}{isa}"


def cpu_info() -> dict:
    """The CPU the numbers came from, so that a saved profile says which machine it was:
    its model name (Linux's /proc/cpuinfo, else `platform`), LLVM's name for it (what Numba
    and panels.py compile for), logical CPUs, the L2 cache of CPU 0 as Linux reports it
    (None elsewhere), and whether it has AVX2 and AVX-512 (which kernels OpenBLAS and LLVM
    can pick: this project's numbers moved between hosts with and without it)."""
    import platform
    import llvmlite.binding as llb
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    l2 = None
    try:
        for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
            if (index / "level").read_text().strip() == "2" and (index / "type").read_text().strip() != "Instruction":
                l2 = (index / "size").read_text().strip()
    except OSError:
        pass
    try:  # LLVM cannot list the features on every platform
        features = llb.get_host_cpu_features()
    except RuntimeError:
        features = {}
    return {"model": model, "llvm_cpu": llb.get_host_cpu_name(), "logical_cpus": os.cpu_count(), "l2_cache": l2,
            "avx2": bool(features.get("avx2", False)), "avx512": bool(features.get("avx512f", False))}


def describe_cpu(c: dict) -> str:
    """One line from cpu_info(): 'AMD EPYC (LLVM: znver3), 2 logical CPUs, L2 512K, AVX2, no AVX-512'."""
    l2 = f", L2 {c['l2_cache']}" if c.get("l2_cache") else ""
    vec = "AVX-512" if c["avx512"] else ("AVX2, no AVX-512" if c["avx2"] else "no AVX2")
    return f"{c['model']} (LLVM: {c['llvm_cpu']}), {c['logical_cpus']} logical CPUs{l2}, {vec}"


def forward_rows(trainer, children_per_step=None) -> tuple[float, float]:
    """(online rows, target rows) one step's forward passes run. For all-actions, the target
    net scores the distinct children formed, or with the target cache the measured average
    number it actually scored (children_per_step)."""
    cfg, b = trainer.cfg, trainer.cfg.batch_size
    if cfg.targets == "double":
        return 2 * b, b
    if cfg.targets == "dqn":
        return b, b
    return b, b * trainer.learner.n_rep if children_per_step is None else children_per_step


def picked_rows(learner, rows_online, rows_target) -> tuple[int, int]:
    """(online rows, target rows) of a step's forward passes whose Q head gave one value
    (nn.head_forward_picked): with the head's backward from the taken actions, the online
    rows of s, and with double targets the target's rows."""
    if not len(learner.head_taken):
        return 0, 0
    b = learner.micro
    return min(b, rows_online), (rows_target if learner.targets == "double" else 0)


def step_flops(trainer, children_per_step=None) -> tuple[float, float]:
    """(forward, backward) FLOPs of one gradient step's forward and backward phases."""
    lay, sparse, b = trainer.layout, trainer.cfg.sparse_input, trainer.cfg.batch_size
    on, tg = forward_rows(trainer, children_per_step)
    p_on, p_tg = picked_rows(trainer.learner, on, tg)
    return (float(lay.flops_forward(on, sparse, p_on) + lay.flops_forward(tg, sparse, p_tg)),
            float(lay.flops_backward(b, sparse, head=not head_from_taken(trainer))))


def head_from_taken(trainer) -> bool:
    """Whether the learner's backward takes the Q head's gradient from the taken actions
    alone (nn.head_backward_taken), not by its two GEMMs."""
    return len(trainer.learner.head_taken) > 0


def gemm_layers_rate(trainer, parts, children_per_step=None) -> dict:
    """GFLOP/s of the GEMM layers alone (layers 1 .. L-1: their BLAS call, bias and ReLU,
    forward and backward), from the phase parts the learner timed. Empty if not timed."""
    f_ms = parts.get("forward", {}).get("GEMM layers", 0.0)
    b_ms = parts.get("backward", {}).get("GEMM layers", 0.0)
    if f_ms <= 0:
        return {}
    lay, b = trainer.layout, trainer.cfg.batch_size
    rows = forward_rows(trainer, children_per_step)
    flops = lay.flops_gemm_forward(sum(rows), sum(picked_rows(trainer.learner, *rows))) + (
        lay.flops_gemm_backward(b, not head_from_taken(trainer)) if b_ms > 0 else 0.0)
    return {"gemm_layers_ms": f_ms + b_ms, "gemm_layers_flops": float(flops),
            "gemm_layers_gflops": flops / (f_ms + b_ms) / 1e6}


def _paired_rows(op_a, halves):
    """op(A)'s rows as tile_sparse.py pairs them: (first rows, second rows), an odd last
    row's partner a row of zeros (neighbours 0 and 1, 2 and 3, ...; with halves and an even
    count, i and i + M/2)."""
    a = np.asarray(op_a)
    if halves and a.shape[0] % 2 == 0:
        return a[:a.shape[0] // 2], a[a.shape[0] // 2:]
    if a.shape[0] % 2:
        a = np.vstack([a, np.zeros((1, a.shape[1]), a.dtype)])
    return a[0::2], a[1::2]


def _walk_lengths(op_a, halves):
    """Per pair of op(A)'s rows (_paired_rows): the two rows' own lists' lengths and their
    union's (the k where the row, or either row, is nonzero), and whether tile_sparse.py's
    sample (its first SAMPLE_PAIRS pairs over the first K block) has the product walk its
    rows' own lists rather than the unions (STEP_COSTS)."""
    from . import tile_sparse
    r0, r1 = _paired_rows(op_a, halves)
    nz0, nz1 = r0 != 0, r1 != 0
    n0, n1, nu = nz0.sum(axis=1), nz1.sum(axis=1), (nz0 | nz1).sum(axis=1)
    pairs, kb = tile_sparse.SAMPLE_PAIRS, tile_sparse.K_BLOCK
    s0, s1 = nz0[:pairs, :kb].sum(axis=1), nz1[:pairs, :kb].sum(axis=1)
    su = (nz0[:pairs, :kb] | nz1[:pairs, :kb]).sum()
    own = _own_cost(s0, s1).sum() < tile_sparse.STEP_COSTS["union"] * su
    return n0, n1, nu, bool(own)


def _own_cost(n0, n1):
    """tile_sparse.py's cost of walking two rows' own lists of these lengths (STEP_COSTS)."""
    from .tile_sparse import STEP_COSTS
    shorter, longer = np.minimum(n0, n1), np.maximum(n0, n1)
    return STEP_COSTS["own"] * shorter + STEP_COSTS["rest"] * (longer - shorter)


def _walk_cost(op_a, halves):
    """(listed_fraction, whether the product walks its rows' own lists)."""
    from .tile_sparse import STEP_COSTS
    a = np.asarray(op_a)
    if a.size == 0:
        return 1.0, False
    n0, n1, nu, own = _walk_lengths(a, halves)
    cost = _own_cost(n0, n1) / STEP_COSTS["union"] if own else nu
    return float(cost.sum() / (len(nu) * a.shape[1])), own


def listed_fraction(op_a, halves=False) -> float:
    """What tile_sparse.py's walks for C = op(A) @ B cost, in entries of a pair's union list,
    as a fraction of K: its test against FILL_MAX (sparse_path_takes; over all rows and k
    here, over the first block of each in the kernel). A union list holds the k where
    either row of a pair (_paired_rows) is nonzero; where the product walks its rows' own
    lists (_walk_lengths), a pair costs their walk's STEP_COSTS."""
    return _walk_cost(op_a, halves)[0]


def sparse_path_takes(op_a, halves=False) -> bool:
    """Whether tile_sparse.py's walks would cost little enough for the path to take the
    product (listed_fraction against FILL_MAX, or FILL_MAX_OWN where the rows' own lists
    are walked); the caller checks that the tile takes it and N is whole panels."""
    from . import tile_sparse
    cost, own = _walk_cost(op_a, halves)
    return cost <= (tile_sparse.FILL_MAX_OWN if own else tile_sparse.FILL_MAX)


def walked_fraction(op_a, halves=False, trans_a=False) -> float:
    """The multiply-adds tile_sparse.py's walks do for C = op(A) @ B, as a fraction of the
    dense loops': a pair whose two rows hold the same bits, or the last row without a
    partner (op(A) = A: "one" walk), its first row's nonzeros once; else, walking the rows'
    own lists, each row's nonzeros, or walking their union, its length twice."""
    a = np.asarray(op_a)
    if a.size == 0:
        return 1.0
    n0, n1, nu, own = _walk_lengths(a, halves)
    done = n0 + n1 if own else 2 * nu
    if not trans_a:
        r0, r1 = _paired_rows(a, halves)
        as_bits = np.dtype(f"u{a.itemsize}")
        one = (np.ascontiguousarray(r0).view(as_bits) == np.ascontiguousarray(r1).view(as_bits)).all(axis=1)
        if a.shape[0] % 2:
            one[-1] = True
        done = np.where(one, n0, done)
    return float(done.sum() / a.size)


def gemm_flops_done(learner, rows_online, rows_target) -> tuple[float, float]:
    """(FLOPs the GEMM layers' products did, their dense FLOPs) in the learner's last
    training step, from its workspaces' activations and deltas (float32 CPU learners):
    where tile_sparse.py's path takes a product (the tile takes it, its columns are whole
    panels, sparse_path_takes) its multiply-adds are the walks' (walked_fraction),
    else all of them. Rows: the forward passes' (forward_rows); the backward's are the batch's. The Q
    head's backward from the taken actions alone (no GEMM) counts as the layout counts it.
    The s' of terminal transitions, which the step does not score (learner.bootstrapped_rows),
    count in the dense FLOPs and not in the done ones."""
    from . import threads, tile_gemm, tile_sparse
    layout, ws, wt = learner.layout, learner.ws, learner.ws_t
    w, L, b = layout.widths, layout.n_layers, learner.micro  # the last micro-batch's rows (grad_accum)
    scale = learner.batch_size / learner.micro  # what the step's micro-batches did, as the flops count it
    # the tile takes no product while the library runs on several threads (no team)
    on = blas.tile_sparse_on() and (blas.team_workers() > 0 or threads.gemm_threads() == 1)

    def product(op_a, n, trans_a=False, trans_b=False, halves=False):
        m, k = op_a.shape
        dense = 2.0 * m * n * k
        if not on or n % tile_sparse.PANEL or not tile_gemm.takes(m, n, k, trans_a, trans_b, bias=not (trans_a or
                                                                                                      trans_b)):
            return dense, dense
        if not sparse_path_takes(op_a, halves):
            return dense, dense
        return dense * walked_fraction(op_a, halves, trans_a), dense

    done = dense = 0.0
    parts = []
    r_on, r_tg = int(rows_online / scale), int(min(rows_target / scale, wt.rows))
    p_on, p_tg = picked_rows(learner, r_on, r_tg)
    # sampled targets: the target net scored the s' of the transitions that bootstrap alone
    # (learner.bootstrapped_rows); the rows it left out count as dense and not done
    r_run = min(r_tg, learner.last_target_rows) if learner.targets != "all-actions" else r_tg
    p_run = min(p_tg, r_run)
    for l in range(1, L):
        # double targets: the online rows are s, then s', paired by halves (mlp_forward_upper);
        # the head's picked rows (nn.head_forward_picked) come first, one column each
        lo_on, lo_tg, lo_run = (p_on, p_tg, p_run) if l == L - 1 else (0, 0, 0)
        parts.append(product(ws.acts[l - 1][lo_on:r_on], w[l + 1], halves=learner.targets == "double" and lo_on == 0))
        d, n = product(wt.acts[l - 1][lo_run:r_run], w[l + 1])
        parts.append((d, n + 2.0 * ((r_tg - lo_tg) - (r_run - lo_run)) * w[l] * w[l + 1]))
        if lo_on + lo_tg:
            parts.append((2.0 * (lo_on + lo_run) * w[l], 2.0 * (lo_on + lo_tg) * w[l]))
    for l in range(1, L):
        if l == L - 1 and len(learner.head_taken) > 0:
            head = 4.0 * b * w[L - 1]  # flops_gemm_backward(head=False)'s share of the head
            parts.append((head, head))
            continue
        parts.append(product(ws.acts[l - 1][:b].T, w[l + 1], trans_a=True))
        parts.append(product(ws.deltas[l][:b], w[l], trans_b=True))
    for d, n in parts:
        done += d * scale
        dense += n * scale
    return done, dense


def profile_training(cfg, steps, warmup, device="cpu", epsilon=None) -> dict:
    """Time `steps` gradient steps after `warmup` of them (see the module's docstring).
    Acting scores only the env states that act greedily (Trainer.choose_actions), so the act
    phase depends on the exploration rate: the run's own schedule, at its start (for a
    preset's long run, close to exploration_initial_eps), or `epsilon` throughout."""
    from .cli import make_trainer
    import numba
    cfg = cfg.replace(steps=max(cfg.steps, warmup + steps), minutes=0.0, log_interval=10 ** 9,
                      eval_interval=10 ** 9, checkpoint_interval=0,
                      learning_starts=min(cfg.learning_starts, cfg.batch_size * 4))
    if epsilon is not None:
        cfg = cfg.replace(exploration_initial_eps=epsilon, exploration_final_eps=epsilon)
    dtype = np.float32 if cfg.precision == "float32" else np.float64
    peak_before = peak_gflops(dtype)
    ceiling_before = _ceiling_or_none(dtype, device)
    from . import precompile
    ahead = precompile.start(cfg) if device == "cpu" else None  # None unless the cache is cold (two CPUs)
    try:
        trainer = make_trainer(cfg, device)
        if ahead is not None:  # compile on two cores before the warm-up steps (precompile.py)
            trainer.warm_up(ahead)
            if trainer.interrupted:
                raise KeyboardInterrupt
    finally:
        if ahead is not None:
            ahead.stop()
    if device == "cuda":  # wait for the GPU at each phase's end, so each phase shows its own time
        trainer.learner.sync_phases = True
    trainer.run(max_steps=warmup)
    tuner, tuning = trainer.blas_tuner, None
    if tuner is not None:
        # threads > 1 with the tuner on: train on until a probe has picked the GEMMs' thread
        # count, so that the timed steps run at that count rather than half of them inside
        # the probe's blocks at T and at one thread (loop time a training run spends there
        # once in interval_seconds; what later probes cost is reported below)
        g, p, t = trainer.grad_steps, tuner.probes, time.perf_counter()
        trainer.run(max_steps=g + 10 ** 9, until=lambda: tuner.probes > p)
        tuning = {"steps": trainer.grad_steps - g, "seconds": time.perf_counter() - t}
        tuner.settled()
        # ... without moving the run's schedules: the timed steps explore at the rate a
        # one-thread run's do. Acting scores only the greedy states, so a lower epsilon is
        # more work a step: the cube2 command at --threads 2, its tuner keeping one
        # thread after 367 probe steps, acted on more states and read 0.98x the one-thread
        # run's steps a minute, the difference its act phase (runs/perf47/report)
        trainer.unscheduled_steps += trainer.grad_steps - g
    probes0, probe_s0 = (tuner.probes, tuner.probe_seconds) if tuner is not None else (0, 0.0)
    trainer.timer.reset()
    g0, e0, scored0, eps0 = trainer.grad_steps, trainer.env_steps, trainer.states_scored, trainer.epsilon()
    learner = trainer.learner
    lk0, hit0, sc0 = learner.cache_lookups, learner.cache_hits, learner.children_scored
    boot0 = learner.target_rows_scored
    cc = learner.child_codes
    cc0 = (cc.lookups, cc.hits) if cc is not None else (0, 0)
    t0 = time.perf_counter()
    trainer.run(max_steps=trainer.grad_steps + steps)
    wall = time.perf_counter() - t0
    eps1 = trainer.epsilon()
    kept = trainer.blas_tuner.current if trainer.blas_tuner is not None else cfg.threads
    peak_kept = None
    if trainer.blas_tuner is not None:  # the peak and the BLAS info at the thread count asked for
        from .threads import set_gemm_threads
        if kept != cfg.threads:  # and the peak at the count the loop ran with at the end
            set_gemm_threads(kept)
            peak_kept = peak_gflops(dtype)
        set_gemm_threads(cfg.threads)
    # measured before and after the timed steps: on a shared host one reading can land in a
    # slow second; the higher one is the machine's rate (the one the percentages are against)
    peak = max(peak_before, peak_gflops(dtype))
    ceiling = _ceiling_or_none(dtype, device)
    ceiling = max(ceiling, ceiling_before) if ceiling and ceiling_before else ceiling or ceiling_before
    bf16_ceiling = _ceiling_or_none("bf16", device) if cfg.matmul_precision == "bfloat16" else None
    n = trainer.grad_steps - g0
    phases = {k: v / n * 1e3 for k, v in trainer.timer.total.items()}
    phases["other"] += max(0.0, wall / n * 1e3 - sum(phases.values()))
    train_ms = sum(phases[k] for k in TRAIN_PHASES)
    children = (learner.children_scored - sc0) / n if learner.target_cache else None
    fwd, bwd = step_flops(trainer, children)
    gemm_s = (phases["forward"] + phases["backward"]) / 1e3
    parts = {ph: {k: v / n * 1e3 for k, v in d.items()} for ph, d in trainer.timer.parts.items()}
    layers = gemm_layers_rate(trainer, parts, children)
    if layers and device == "cpu" and cfg.precision == "float32" and cfg.matmul_precision == "float32":
        # the multiply-adds the last step's GEMM layers did (tile_sparse.py skips ReLU zeros)
        done, dense = gemm_flops_done(learner, *forward_rows(trainer, children))
        layers["gemm_layers_done_fraction"] = done / dense if dense else None
    lookups = learner.cache_lookups - lk0
    hit_rate = (learner.cache_hits - hit0) / lookups if lookups else None
    child_hit_rate = (cc.hits - cc0[1]) / (cc.lookups - cc0[0]) if cc is not None and cc.lookups > cc0[0] else None
    rep = trainer.replay
    return {
        "puzzle": cfg.puzzle, "metric": cfg.metric, "network": trainer.layout.describe(),
        "batch_size": cfg.batch_size, "targets": cfg.targets, "optimizer": cfg.optimizer,
        "device": device, "threads": cfg.threads, "numba_threads": numba.get_num_threads(),
        "steps": n, "train_step_ms": train_ms, "step_ms": wall / n * 1e3,
        "steps_per_min": n / wall * 60, "env_steps_per_s": (trainer.env_steps - e0) / wall,
        "train_steps_per_min": 60e3 / train_ms if train_ms > 0 else None,
        "phases": phases,
        # acting: the exploration rate at the timed steps' start and end, and the share of
        # the env states the network scored (the greedy ones)
        "epsilon_start": eps0, "epsilon_end": eps1,
        # sampled targets: the share of the timed steps' transitions that bootstrapped, whose
        # s' the target net scored (the terminal ones' it skips: learner.bootstrapped_rows)
        "bootstrapped_fraction": ((learner.target_rows_scored - boot0) / (n * cfg.batch_size)
                                  if cfg.targets != "all-actions" and device == "cpu" else None),
        "act_scored_fraction": ((trainer.states_scored - scored0) / (trainer.env_steps - e0)
                                if trainer.env_steps > e0 else None),
        "flops_per_step": fwd + bwd, "gflops": (fwd + bwd) / gemm_s / 1e9 if gemm_s > 0 else None,
        "peak_gflops": peak, "fma_ceiling_gflops": ceiling,
        # the sgemm peak at the BLAS thread count in use at the end (blas_threads), which the
        # tuner may have set below `threads`: the GEMM layers ran on that many threads
        "peak_gflops_blas_threads": peak if peak_kept is None else peak_kept,
        # bfloat16: the GEMM layers' products ran on bf16-rounded operands (tile_bf16.py), whose
        # ceiling (bf16 dot products in registers) is this
        "matmul_precision": cfg.matmul_precision, "bf16_ceiling_gflops": bf16_ceiling,
        "bf16_available": device == "cpu" and cfg.precision == "float32" and blas.bf16_problem() is None,
        "phase_parts": parts, **layers, "target_cache_hit_rate": hit_rate, "child_cache_hit_rate": child_hit_rate,
        "memory_bytes": {"parameters": int(trainer.learner.online.params.nbytes * 2),
                         "gradients": int(trainer.learner.gradient_nbytes),
                         "optimizer_state": int(trainer.learner.opt.nbytes),
                         "child_cache": int(cc.nbytes) if cc is not None else 0,
                         "replay_buffer": int(rep.nbytes), "replay_per_transition": int(rep.nbytes_per_transition)},
        "blas": blas_info(),
        "cpu": cpu_info(),
        "first_layer": "cuda" if device == "cuda" else first_layer_kernel(learner.online, learner.ws),
        # how the CUDA step's kernels were launched: "graphs" (replayed CUDA graphs) or "direct ..."
        "cuda_launch": learner.launch_mode if device == "cuda" else None,
        # threads > 1: the BLAS thread count the tuner kept at the end, and its last probe's
        # loop seconds per gradient step at each count (threads.BlasThreadTuner)
        "blas_threads": kept,
        "blas_probe": tuner.last_probe_json() if tuner is not None else None,
        # the probe before the timed steps (gradient steps and seconds it took), and the
        # probes that ran inside them (the host changed, or interval_seconds passed) with
        # the loop time their blocks took, which the phases above include
        "blas_tuning": tuning,
        "blas_probes": tuner.probes - probes0 if tuner is not None else None,
        "blas_probe_seconds": tuner.probe_seconds - probe_s0 if tuner is not None else None,
    }


def first_layer_kernel(net, ws) -> str:
    """Which first-layer kernel a CPU workspace runs: "panels" (panels.py), "rows" (the
    row gather) or "dense" (a GEMM on one-hot rows)."""
    if not net.sparse:
        return "dense"
    return "panels" if ws.panel is not None and ws.panel.size else "rows"


def format_report(r: dict) -> str:
    lines = [f"{r['puzzle']} {r['metric']}  network {r['network']}  batch {r['batch_size']}  "
             f"targets {r['targets']}  optimizer {r['optimizer']}  device {r['device']}  threads {r['threads']}",
             f"{'phase':<14s} {'ms/step':>9s} {'%':>6s}"]
    total = sum(r["phases"].values())
    for k in PhaseTimer.PHASES:
        v = r["phases"][k]
        lines.append(f"{k:<14s} {v:>9.4f} {100 * v / total:>6.1f}")
        for name, pv in r.get("phase_parts", {}).get(k, {}).items():
            if pv > 0:
                lines.append(f"  {name:<18s} {pv:>7.4f} {100 * pv / total:>6.1f}")
    lines.append(f"{'total':<14s} {total:>9.4f} {100.0:>6.1f}")
    lines.append(f"train step (sample+forward+backward+optimizer): {r['train_step_ms']:.4f} ms "
                 f"= {r['train_steps_per_min']:.0f} steps/min")
    lines.append(f"end to end: {r['steps_per_min']:.0f} gradient steps/min, {r['env_steps_per_s']:.0f} env steps/s")
    if r.get("act_scored_fraction") is not None:
        lines.append(f"acting: epsilon {r['epsilon_start']:.2f} -> {r['epsilon_end']:.2f} over the timed steps; "
                     f"the network scored {100 * r['act_scored_fraction']:.0f}% of the env states (the greedy ones; "
                     f"--epsilon fixes the rate)")
    if r.get("bootstrapped_fraction") is not None:
        lines.append(f"targets: {100 * r['bootstrapped_fraction']:.0f}% of the sampled transitions bootstrapped "
                     f"(the target net scored their s'; the terminal ones' it skips)")
    if r["gflops"] and r.get("device") == "cuda":  # the sgemm peak is the host's: no ratio
        lines.append(f"forward+backward phases: {r['gflops']:.1f} GFLOP/s on the GPU, host encoding included")
    elif r["gflops"]:
        lines.append(f"forward+backward phases: {r['gflops']:.1f} GFLOP/s achieved vs {r['peak_gflops']:.1f} "
                     f"GFLOP/s peak sgemm ({100 * r['gflops'] / r['peak_gflops']:.0f}%)")
    if r.get("gemm_layers_gflops"):
        ceiling = ""
        if r.get("fma_ceiling_gflops"):  # one core's; the GEMMs may run on more
            cores = max(1, int(r.get("blas_threads") or 1))
            ceiling = (f", {100 * r['gemm_layers_gflops'] / (cores * r['fma_ceiling_gflops']):.0f}% of the "
                       f"{cores * r['fma_ceiling_gflops']:.1f} GFLOP/s FMA ceiling"
                       f"{f' of {cores} cores' if cores > 1 else ''}")
        kept = r.get("blas_threads")
        at_kept = ""
        if r.get("peak_gflops_blas_threads") and kept != r.get("threads"):
            at_kept = (f"; {100 * r['gemm_layers_gflops'] / r['peak_gflops_blas_threads']:.0f}% of the "
                       f"{r['peak_gflops_blas_threads']:.1f} GFLOP/s peak of the {kept} BLAS thread(s) the run "
                       f"ended with")
        lines.append(f"GEMM layers alone: {r['gemm_layers_gflops']:.1f} GFLOP/s "
                     f"({100 * r['gemm_layers_gflops'] / r['peak_gflops']:.0f}% of peak{ceiling}{at_kept}) in "
                     f"{r['gemm_layers_ms']:.4f} ms/step")
        done = r.get("gemm_layers_done_fraction")
        if done is not None and done < 1:
            lines.append(f"  rates of the dense products' FLOPs: the tile's sparse path (tile_sparse.py) left out the "
                         f"zero terms of their ReLU inputs and did {100 * done:.0f}% of the multiply-adds (the last "
                         f"step's), {done * r['gemm_layers_gflops']:.1f} GFLOP/s of them")
        if r.get("matmul_precision") == "float32" and r.get("bf16_available"):
            lines.append("  this CPU has AVX512_BF16: --matmul-precision bfloat16 runs these GEMMs on bf16-rounded "
                         "operands with float32 sums, up to twice as fast (README, Design notes)")
        if r.get("matmul_precision") == "bfloat16":
            bf = r.get("bf16_ceiling_gflops")
            lines.append("  matmul precision bfloat16 (operands rounded to bf16, float32 sums): the percentages "
                         "above are of float32 rates" + (f"; {100 * r['gemm_layers_gflops'] / bf:.0f}% of the "
                                                          f"{bf:.1f} GFLOP/s bf16 dot-product ceiling" if bf else ""))
    if r.get("target_cache_hit_rate") is not None:
        lines.append(f"target cache: {100 * r['target_cache_hit_rate']:.1f}% of children's values reused "
                     f"(the rest went through the target network)")
    if r.get("child_cache_hit_rate") is not None:
        lines.append(f"child cache: {100 * r['child_cache_hit_rate']:.1f}% of sampled states' children's codes "
                     f"found by position ({r['memory_bytes'].get('child_cache', 0) / 1e6:.1f} MB table; the rest "
                     f"expanded and framed)")
    m = r["memory_bytes"]
    lines.append(f"memory: parameters+target {m['parameters'] / 1e6:.2f} MB, gradients {m['gradients'] / 1e6:.2f} MB, "
                 f"optimizer state {m['optimizer_state'] / 1e6:.2f} MB, replay {m['replay_buffer'] / 1e6:.2f} MB "
                 f"({m['replay_per_transition']} B/transition)")
    b = r["blas"]
    lines.append(f"BLAS: {b['library']} {b['version']} ({b.get('source', 'scipy')}'s) kernel {b['kernel']}, "
                 f"{b['threads']} thread(s), OPENBLAS_CORETYPE={b['OPENBLAS_CORETYPE']}; GEMMs on "
                 f"{b.get('gemm_threads', b['threads'])} thread(s); "
                 f"tile GEMM (tile_gemm.py; used while BLAS runs on one thread) {describe_tile(b)}; "
                 f"GEMM team (team.py) {b.get('gemm_team', 'absent')}")
    if r.get("cpu"):
        lines.append(f"CPU: {describe_cpu(r['cpu'])}")
    if r.get("blas_probe"):
        probe = ", ".join(f"{k} thread(s) {v * 1e3:.3f} ms" for k, v in r["blas_probe"].items())
        lines.append(f"BLAS thread tuning (tune_blas_threads): kept {r['blas_threads']} thread(s); its last "
                     f"probe, loop time per gradient step (env iterations included): {probe}")
        if r.get("blas_tuning"):
            lines.append(f"  probed before the timed steps ({r['blas_tuning']['steps']} gradient steps, "
                         f"{r['blas_tuning']['seconds']:.2f} s); inside them {r['blas_probes']} probe(s), "
                         f"{r['blas_probe_seconds']:.2f} s of loop time in probe blocks")
    if r.get("cuda_launch"):
        lines.append(f"CUDA step: {r['cuda_launch']}; each phase waits for the GPU at its end while profiling")
    if r.get("first_layer") and r["first_layer"] != "cuda":
        lines.append(f"first layer: {r['first_layer']} (panels: column panels in LLVM IR, see cubedqn/panels.py; "
                     f"rows: the row gather)")
    return "\n".join(lines)
