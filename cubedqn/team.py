"""Two or more threads on one GEMM: a product's columns shared with resident worker threads.

What this file is: an LLVM IR module, compiled once per CPU and kept on disk like the tile
GEMM (native.py), whose two functions wrap the engine's GEMM symbols (blas.py binds them
in front of the tile GEMM, or of the library where there is no tile):

  TEAM_SGEMM  the CBLAS ILP64 sgemm signature, in front of INNER_SGEMM;
  TEAM_BIAS   tile_gemm's bias-and-ReLU signature, in front of INNER_BIAS (which returns 0
              where it leaves the product to the caller: so does TEAM_BIAS then).

With SET_TEAM(w) > 0 (`--threads w + 1`, threads.py), a row-major product with alpha 1,
beta 0, N >= 2 x CHUNK_MIN columns and at least SPLIT_MACS multiply-adds is cut into
column chunks (whole multiples of the tile's 32-column panel; the last takes the rest),
published in one atomic word, and taken chunk by chunk by the calling thread (from the
first) and by whichever of the w workers are awake (from the last), each chunk one call of
the inner function on that block of B's and C's columns; while SET_ROWS is on (blas.py
sets it with tile_sparse.py's path, whose lists are of A's rows), a product whose N is
whole ROW_PANELs and with 2 x ROW_MIN rows or more is cut into row chunks instead, one per
thread, each a call on its block of op(A)'s and C's rows (the tile's rows are independent:
the same bits). The caller never waits for a chunk no one has taken: a
worker that sleeps or was descheduled costs nothing but its own share; the caller waits
only for chunks a worker took and has not finished. Everything else (a smaller product,
w = 0, another thread already splitting a product: eval's threads) calls the inner
function as is.

Why not OpenBLAS's own threads: at the step's shapes (64 x 256 x 256, ~40 us on one Zen 4
core) OpenBLAS on two threads ran the GEMM layers 1.08x faster than on one
(runs/perf25/report), and the tile (faster than OpenBLAS on one thread) takes products
only while the library runs on one; the same products split by columns over two
threads ran 1.82-1.86x (a numba prange over two halves, each a tile call; scripts and
numbers in docs/performance-log.md, stop 33).

Results: every element of C is computed by one inner call over the same K in the same
order whichever chunk it falls in (the tile's panels and tail columns are the same; its
rows and columns are independent, tests/test_team.py checks the bits), so w changes no
result where the inner function's results do not depend on N. OpenBLAS's Haswell kernel's
do (a block of columns computed alone gets other bits in the last place): where it is the
inner function (no tile: a CPU without AVX2, or CUBEDQN_TILE_GEMM=0) blas._check_team
fails and the team is not used; where the tile is bound, the products it leaves to that
library (K past the tile's K_MAX) come out of a split equal to float32 rounding, not bit
for bit.

Workers: started by SET_TEAM (pthreads, never joined: they live as long as the process),
each spins on the job word while it has work (yielding the CPU at each look), after
SPIN_LOOKS looks without a chunk it polls with usleep(IDLE_US), and after DOZE_NAPS such
naps it sleeps on a condition variable until a caller posts a job (the caller wakes the
sleepers it counts: a few microseconds, once after a long idle) or SET_TEAM runs; a worker
whose index is at or past the team size in use sleeps there too, so an idle process and a
team switched off cost no CPU.

TEAM_RANGE  void (fn, ctx, n, grain): fn(ctx, lo, hi) over [0, n), split the same way
            into chunks of whole multiples of grain (n >= RANGE_MIN) or called once as
            fn(ctx, 0, n); fn is a void (i8*, i64, i64) function pointer (the optimizer's
            update, optim.py: the update of weights the worker read in the GEMMs, done by
            the caller alone, ran 2.3x slower than on one thread; docs/performance-log.md,
            stop 36; and, stop 37, nn.py's row gather and lazy backward of a first
            layer too big for the panels, and encoding.py's framing; stop 38, the panel
            gather and scatter in two halves of their columns).

What it is not: a thread pool for anything but these entry points, or a scheduler (no
priorities, no affinity).
"""

from __future__ import annotations

import llvmlite.ir as ir

from . import tile_sparse
from .native import bias_gemm_type, declare, flag_with_setter, load_or_compile, sgemm_type

TEAM_SGEMM, TEAM_BIAS = "cubedqn_team_sgemm64", "cubedqn_team_sgemm_bias"
TEAM_RANGE = "cubedqn_team_range"  # void (fn, ctx, n, grain): fn(ctx, lo, hi) over chunks of [0, n)
INNER_SGEMM, INNER_BIAS = "cubedqn_team_inner_sgemm64", "cubedqn_team_inner_bias"
SET_TEAM = "cubedqn_team_set"      # i32 (i32 w): use w workers (started if new); returns w in use
TEAM_STATS = "cubedqn_team_stats"  # void (i64 out[3]): products split, chunks workers took, workers in use
# void (): in a child just forked (blas.py registers it with os.register_at_fork): the
# parent's workers are not there, and the mutex may have been held by one of them; forget
# them and start afresh (the next SET_TEAM starts the child's own)
TEAM_FORKED = "cubedqn_team_forked"
# void (i32): 1 splits the GEMM jobs whose N is whole ROW_PANELs by rows instead (blas.py
# sets it while tile_sparse.py's path is on: its lists are of A's rows, which column chunks
# would each make again), 0 (the start) by columns
SET_ROWS = "cubedqn_team_set_rows"
MAX_WORKERS = 15
CHUNK_MIN = 32            # the tile's panel: chunks are whole panels
ROW_PANEL = tile_sparse.PANEL  # its panel (64, 32 with AVX2): products split by rows have whole ones
ROW_MIN = 16              # rows of a row chunk (whole multiples of it; the last takes the rest)
SPLIT_MACS = 1 << 17      # ~1.2 us on one Zen 4 core; smaller products are not worth a hand-off
RANGE_MIN = 1 << 15       # TEAM_RANGE splits ranges this long or longer (a momentum update of
                          # that many floats: ~5 us on one Zen 4 core)
SPIN_LOOKS = 4096         # looks before the naps: ~2 ms (a sched_yield each, ~0.4 us here: a
                          # ctypes loop of it against one of getpid, 0.69 against 0.31 us a call)
DOZE_NAPS = 400           # naps of IDLE_US (~60 us each) before it sleeps until woken: ~25 ms
IDLE_US = 50
ROW_MAJOR, NO_TRANS = 101, 111
KIND_PLAIN, KIND_BIAS, KIND_RANGE = 0, 1, 2  # the job's kind: TEAM_SGEMM, TEAM_BIAS, TEAM_RANGE
# the job: fields of the product being split, stored before the job word is published
JOB_FIELDS = ("kind", "ta", "tb", "m", "n", "k", "a", "lda", "b", "ldb", "c", "ldc", "bias", "relu", "width",
              "rows")


def module_ir() -> str:
    mod = ir.Module(name="cubedqn_team")
    i8p, i32, i64, f32 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64), ir.FloatType()
    fp = f32.as_pointer()

    def c64(v):
        return ir.Constant(i64, v)

    def c32(v):
        return ir.Constant(i32, v)

    def global_(name, t, init):
        g = ir.GlobalVariable(mod, t, name)
        g.linkage, g.initializer = "internal", init
        g.align = 64  # each on its own cache line: the job word is what the threads pass around
        return g

    active = global_("team_active", i32, c32(0))      # workers in use
    started = global_("team_started", i32, c32(0))    # workers started (SET_TEAM only)
    owner = global_("team_owner", i32, c32(0))        # 1 while a caller is splitting a product
    # the job word: generation (bits 48-63), chunks (32-47), chunks taken from the back
    # (16-31: the workers'), from the front (0-15: the caller's); see take_chunk
    state = global_("team_state", i64, c64(0))
    done = global_("team_done", i64, c64(0))          # chunks workers finished, this job
    refused = global_("team_refused", i64, c64(0))    # an inner bias call returned 0, this job
    split_count = global_("team_split", i64, c64(0))  # products split (statistics)
    by_rows = flag_with_setter(mod, "team_rows", SET_ROWS, 0, align=64)  # products split by rows (SET_ROWS)
    taken = global_("team_taken", i64, c64(0))        # chunks workers took (statistics)
    job_t = ir.ArrayType(i64, len(JOB_FIELDS))
    job = global_("team_job", job_t, ir.Constant(job_t, [0] * len(JOB_FIELDS)))

    inner = declare(mod, INNER_SGEMM, sgemm_type())
    range_fn_t = ir.FunctionType(ir.VoidType(), [i8p, i64, i64])  # TEAM_RANGE's fn(ctx, lo, hi)
    inner_bias = declare(mod, INNER_BIAS, bias_gemm_type())
    usleep = declare(mod, "usleep", ir.FunctionType(i32, [i32]))
    yield_cpu = declare(mod, "sched_yield", ir.FunctionType(i32, []))
    # a mutex and a condition variable where workers that are off, or idle for long, sleep;
    # 128 bytes each covers every platform's pthread types, initialised by the first SET_TEAM
    sync_t = ir.ArrayType(ir.IntType(8), 128)
    mutex_buf = global_("team_mutex", sync_t, ir.Constant(sync_t, None))
    cond_buf = global_("team_cond", sync_t, ir.Constant(sync_t, None))
    sleepers = global_("team_sleepers", i64, c64(0))  # workers waiting on the condition for a job
    pthread = {name: declare(mod, f"pthread_{name}", ir.FunctionType(i32, args)) for name, args in (
        ("mutex_init", [i8p, i8p]), ("cond_init", [i8p, i8p]), ("mutex_lock", [i8p]), ("mutex_unlock", [i8p]),
        ("cond_wait", [i8p, i8p]), ("cond_broadcast", [i8p]))}

    def mutex(b):
        return b.bitcast(mutex_buf, i8p)

    def cond(b):
        return b.bitcast(cond_buf, i8p)

    def wake_all(b):
        """Wake every sleeping worker (under the mutex, so none misses it between its
        last look and its wait)."""
        b.call(pthread["mutex_lock"], [mutex(b)])
        b.call(pthread["cond_broadcast"], [cond(b)])
        b.call(pthread["mutex_unlock"], [mutex(b)])

    def field(b, name):
        return b.gep(job, [c64(0), c64(JOB_FIELDS.index(name))])

    def load_field(b, name):
        return b.load_atomic(field(b, name), "monotonic", 8)

    # --- one chunk: columns [i * width, ...) of the published job (rows, where its `rows`
    # field is set); returns the inner result
    run = ir.Function(mod, ir.FunctionType(i64, [i64]), name="team_run_chunk")
    run.linkage = "internal"
    b = ir.IRBuilder(run.append_basic_block("entry"))
    (i,) = run.args
    f = {name: load_field(b, name) for name in JOB_FIELDS}
    chunks = b.and_(b.lshr(b.load_atomic(state, "monotonic", 8), c64(32)), c64(0xFFFF))
    rows = b.icmp_signed("!=", f["rows"], c64(0))
    j0 = b.mul(i, f["width"])
    last = b.icmp_signed("==", i, b.sub(chunks, c64(1)))
    width = b.select(last, b.sub(b.select(rows, f["m"], f["n"]), j0), f["width"])
    tb_as_is = b.icmp_signed("==", b.trunc(f["tb"], i32), c32(NO_TRANS))
    ta_as_is = b.icmp_signed("==", b.trunc(f["ta"], i32), c32(NO_TRANS))
    # by rows: op(A)'s rows j0.. (A's rows, or its columns where transposed) and C's; B whole
    a_ptr = b.gep(b.inttoptr(f["a"], fp), [b.select(rows, b.select(ta_as_is, b.mul(j0, f["lda"]), j0), c64(0))])
    b_ptr = b.gep(b.inttoptr(f["b"], fp), [b.select(rows, c64(0), b.select(tb_as_is, j0, b.mul(j0, f["ldb"])))])
    c_ptr = b.gep(b.inttoptr(f["c"], fp), [b.select(rows, b.mul(j0, f["ldc"]), j0)])
    m_chunk, n_chunk = b.select(rows, width, f["m"]), b.select(rows, f["n"], width)
    bias_at = b.select(rows, c64(0), j0)
    plain_bb, bias_bb, range_bb = (run.append_basic_block(x) for x in ("plain", "bias", "range"))
    switch = b.switch(f["kind"], bias_bb)
    switch.add_case(c64(KIND_PLAIN), plain_bb)
    switch.add_case(c64(KIND_RANGE), range_bb)
    b.position_at_end(range_bb)  # a: the function, b: its context; elements [j0, j0 + width)
    b.call(b.inttoptr(f["a"], range_fn_t.as_pointer()), [b.inttoptr(f["b"], i8p), j0, b.add(j0, width)])
    b.ret(c64(1))
    b.position_at_end(plain_bb)
    b.call(inner, [c32(ROW_MAJOR), b.trunc(f["ta"], i32), b.trunc(f["tb"], i32), m_chunk, n_chunk, f["k"],
                   ir.Constant(f32, 1.0), a_ptr, f["lda"], b_ptr, f["ldb"], ir.Constant(f32, 0.0), c_ptr, f["ldc"]])
    b.ret(c64(1))
    b.position_at_end(bias_bb)
    bias_ptr = b.gep(b.inttoptr(f["bias"], fp), [bias_at])
    b.ret(b.call(inner_bias, [m_chunk, n_chunk, f["k"], a_ptr, f["lda"], b_ptr, f["ldb"], c_ptr, f["ldc"], bias_ptr,
                              f["relu"]]))

    def run_noting_refusal(b, chunk):
        """Emit: run the chunk; where the inner bias GEMM left it to the caller, say so."""
        result = b.call(run, [chunk])
        with b.if_then(b.icmp_signed("==", result, c64(0))):
            b.store_atomic(c64(1), refused, "monotonic", 8)

    def open_chunks(b, word):
        """Emit: (i1) whether the job word has a chunk no one took."""
        front, back = b.and_(word, c64(0xFFFF)), b.and_(b.lshr(word, c64(16)), c64(0xFFFF))
        return b.icmp_unsigned("<", b.add(front, back), b.and_(b.lshr(word, c64(32)), c64(0xFFFF)))

    def take_chunk(b, on_chunk, from_back):
        """Emit: claim a chunk of the job word (one atomic add): the caller the next from the
        front, a worker the next from the back. Where that was a chunk of its job,
        on_chunk(b, chunk index) runs. Returns (i1 whether a chunk was claimed).
        Two ends, so that while both threads keep up each takes the same chunks every
        call: what a chunk writes stays in one core's cache from one step to the next
        (one counter handed chunks out in whatever order the threads came, and the lazy
        backward split by rows ran 145-163 us against 109 alone; docs/performance-log.md,
        stop 37). A claim is the one whose add saw front + back below the chunks: two
        claims of one index would each have had to see the other's add first."""
        old = b.atomic_rmw("add", state, c64(1 << 16 if from_back else 1), "acq_rel")
        front, back = b.and_(old, c64(0xFFFF)), b.and_(b.lshr(old, c64(16)), c64(0xFFFF))
        chunks = b.and_(b.lshr(old, c64(32)), c64(0xFFFF))
        got = b.icmp_unsigned("<", b.add(front, back), chunks)
        with b.if_then(got):
            on_chunk(b, b.sub(b.sub(chunks, c64(1)), back) if from_back else front)
        return got

    # --- a worker: its index in the pointer argument
    worker = ir.Function(mod, ir.FunctionType(i8p, [i8p]), name="team_worker")
    worker.linkage = "internal"
    b = ir.IRBuilder(worker.append_basic_block("entry"))
    me = b.ptrtoint(worker.args[0], i64)
    loop_bb = worker.append_basic_block("loop")
    b.branch(loop_bb)
    entry_end = b.block
    b.position_at_end(loop_bb)
    # looks at the job word since the last chunk (or since the worker was last off); a look
    # is one sched_yield, so this counts time without a clock (a cycle counter read traps
    # on some ARM systems)
    idle = b.phi(i64, "idle")
    idle.add_incoming(c64(0), entry_end)
    in_use = b.icmp_signed("<", me, b.sext(b.load_atomic(active, "monotonic", 4), i64))
    off_bb, on_bb = worker.append_basic_block("off"), worker.append_basic_block("on")
    b.cbranch(in_use, on_bb, off_bb)
    b.position_at_end(off_bb)  # not in the team now: sleep until SET_TEAM changes the size
    b.call(pthread["mutex_lock"], [mutex(b)])
    off_wait, off_end = worker.append_basic_block("off.wait"), worker.append_basic_block("off.end")
    b.branch(off_wait)
    b.position_at_end(off_wait)
    still_off = b.icmp_signed(">=", me, b.sext(b.load_atomic(active, "monotonic", 4), i64))
    off_sleep = worker.append_basic_block("off.sleep")
    b.cbranch(still_off, off_sleep, off_end)
    b.position_at_end(off_sleep)
    b.call(pthread["cond_wait"], [cond(b), mutex(b)])
    b.branch(off_wait)
    b.position_at_end(off_end)
    b.call(pthread["mutex_unlock"], [mutex(b)])
    idle.add_incoming(c64(0), b.block)  # back on: work is coming, spin
    b.branch(loop_bb)
    b.position_at_end(on_bb)
    word = b.load_atomic(state, "acquire", 8)
    open_ = open_chunks(b, word)
    claim_bb, idle_bb = worker.append_basic_block("claim"), worker.append_basic_block("idle")
    b.cbranch(open_, claim_bb, idle_bb)
    b.position_at_end(claim_bb)

    def work(b, chunk):
        run_noting_refusal(b, chunk)
        b.atomic_rmw("add", taken, c64(1), "monotonic")
        b.atomic_rmw("add", done, c64(1), "release")

    take_chunk(b, work, from_back=True)
    idle.add_incoming(c64(0), b.block)
    b.branch(loop_bb)
    b.position_at_end(idle_bb)  # nothing to take: spin a while, then poll slowly
    # each look yields the CPU: where the scheduler put this worker beside the caller, a
    # plain spin would take half of its time (bimodal runs, docs/performance-log.md)
    b.call(yield_cpu, [])
    looks = b.add(idle, c64(1))
    nap_bb, spin_bb = worker.append_basic_block("nap"), worker.append_basic_block("spin")
    b.cbranch(b.icmp_signed(">", looks, c64(SPIN_LOOKS)), nap_bb, spin_bb)
    b.position_at_end(nap_bb)
    dozing = b.icmp_signed(">", looks, c64(SPIN_LOOKS + DOZE_NAPS))
    short_bb, doze_bb = worker.append_basic_block("nap.short"), worker.append_basic_block("doze")
    b.cbranch(dozing, doze_bb, short_bb)
    b.position_at_end(short_bb)
    b.call(usleep, [c32(IDLE_US)])
    idle.add_incoming(looks, b.block)
    b.branch(loop_bb)
    # long idle: sleep on the condition until a caller posts a job (it wakes the sleepers
    # it sees) or SET_TEAM runs. The count goes up before the last look under the mutex and
    # the caller stores the job word before it reads the count (both seq_cst), so one of
    # the two sees the other: no job is slept through (and one that were would only be
    # done by its caller alone)
    b.position_at_end(doze_bb)
    b.atomic_rmw("add", sleepers, c64(1), "seq_cst")
    b.call(pthread["mutex_lock"], [mutex(b)])
    word = b.load_atomic(state, "seq_cst", 8)
    no_job = b.not_(open_chunks(b, word))
    still_in = b.icmp_signed("<", me, b.sext(b.load_atomic(active, "monotonic", 4), i64))
    sleep_bb, woke_bb = worker.append_basic_block("doze.sleep"), worker.append_basic_block("doze.woke")
    b.cbranch(b.and_(no_job, still_in), sleep_bb, woke_bb)
    b.position_at_end(sleep_bb)
    b.call(pthread["cond_wait"], [cond(b), mutex(b)])
    b.branch(woke_bb)
    b.position_at_end(woke_bb)
    b.call(pthread["mutex_unlock"], [mutex(b)])
    b.atomic_rmw("sub", sleepers, c64(1), "seq_cst")
    idle.add_incoming(c64(0), b.block)
    b.branch(loop_bb)
    b.position_at_end(spin_bb)
    idle.add_incoming(looks, b.block)
    b.branch(loop_bb)

    # --- SET_TEAM(w): start workers up to w, use w
    create = declare(mod, "pthread_create", ir.FunctionType(i32, [i64.as_pointer(), i8p, worker.type, i8p]))
    setter = ir.Function(mod, ir.FunctionType(i32, [i32]), name=SET_TEAM)
    b = ir.IRBuilder(setter.append_basic_block("entry"))
    want = setter.args[0]
    want = b.select(b.icmp_signed("<", want, c32(0)), c32(0), want)
    want = b.select(b.icmp_signed(">", want, c32(MAX_WORKERS)), c32(MAX_WORKERS), want)
    tid = b.alloca(i64)
    with b.if_then(b.icmp_signed("==", b.load(started), c32(0))):  # before the first worker
        b.call(pthread["mutex_init"], [mutex(b), ir.Constant(i8p, None)])
        b.call(pthread["cond_init"], [cond(b), ir.Constant(i8p, None)])
    head_bb, body_bb, end_bb = (setter.append_basic_block(x) for x in ("start.head", "start.body", "start.end"))
    b.branch(head_bb)
    b.position_at_end(head_bb)
    n_started = b.load(started)
    b.cbranch(b.icmp_signed("<", n_started, want), body_bb, end_bb)
    b.position_at_end(body_bb)
    ok = b.call(create, [tid, ir.Constant(i8p, None), worker, b.inttoptr(b.sext(n_started, i64), i8p)])
    fail_bb, next_bb = setter.append_basic_block("start.fail"), setter.append_basic_block("start.next")
    b.cbranch(b.icmp_signed("==", ok, c32(0)), next_bb, fail_bb)
    b.position_at_end(next_bb)
    b.store(b.add(n_started, c32(1)), started)
    b.branch(head_bb)
    b.position_at_end(fail_bb)  # as many as could be started
    b.branch(end_bb)
    b.position_at_end(end_bb)
    n_started = b.load(started)
    use = b.select(b.icmp_signed("<", n_started, want), n_started, want)
    b.store_atomic(use, active, "monotonic", 4)
    with b.if_then(b.icmp_signed(">", n_started, c32(0))):
        wake_all(b)  # those now off go back to sleep, those now on come back
    b.ret(use)

    forked = ir.Function(mod, ir.FunctionType(ir.VoidType(), []), name=TEAM_FORKED)
    b = ir.IRBuilder(forked.append_basic_block("entry"))
    for g, zero in ((active, c32(0)), (started, c32(0)), (owner, c32(0)), (sleepers, c64(0)), (done, c64(0))):
        b.store_atomic(zero, g, "seq_cst", 4 if zero.type == i32 else 8)
    b.store_atomic(c64(0), state, "seq_cst", 8)  # no job open (0 chunks)
    b.call(pthread["mutex_init"], [mutex(b), ir.Constant(i8p, None)])
    b.call(pthread["cond_init"], [cond(b), ir.Constant(i8p, None)])
    b.ret_void()

    stats = ir.Function(mod, ir.FunctionType(ir.VoidType(), [i64.as_pointer()]), name=TEAM_STATS)
    b = ir.IRBuilder(stats.append_basic_block("entry"))
    b.store(b.load_atomic(split_count, "monotonic", 8), stats.args[0])
    b.store(b.load_atomic(taken, "monotonic", 8), b.gep(stats.args[0], [c64(1)]))
    b.store(b.sext(b.load_atomic(active, "monotonic", 4), i64), b.gep(stats.args[0], [c64(2)]))
    b.ret_void()

    # --- the caller's side: split (kind 0 plain, 1 bias) or hand the product on as is
    def emit_caller(fn, kind, args, unit=c64(CHUNK_MIN)):
        """args: dict of the job's fields as i64 (pointers as integers); chunks are whole
        multiples of `unit` columns (elements for KIND_RANGE; a constant or unit(b))."""
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        unit = unit(b) if callable(unit) else unit
        go, as_is = fn.append_basic_block("split.try"), fn.append_basic_block("as_is")
        w = b.sext(b.load_atomic(active, "monotonic", 4), i64)
        n, m, k = args["n"], args["m"], args["k"]
        rows = ir.Constant(ir.IntType(1), 0)
        if kind == KIND_RANGE:
            big = b.icmp_signed(">=", n, c64(RANGE_MIN))
        else:
            big = b.icmp_signed(">=", b.mul(b.mul(m, n), k), c64(SPLIT_MACS))
            # by rows (SET_ROWS; rows enough for two chunks, else columns): chunks of whole
            # ROW_MIN rows, one a thread
            rows = b.and_(b.and_(b.icmp_signed("!=", b.load(by_rows), c32(0)),
                                 b.icmp_signed("==", b.srem(n, c64(ROW_PANEL)), c64(0))),
                          b.icmp_signed(">=", m, c64(2 * ROW_MIN)))
            n = b.select(rows, m, n)  # the dimension split from here on
            unit = b.select(rows, c64(ROW_MIN), unit)
        wide = b.icmp_signed(">=", n, b.mul(unit, c64(2)))
        worth_it = b.and_(b.icmp_signed(">", w, c64(0)), b.and_(big, wide))
        for extra in args.get("conds", ()):
            worth_it = b.and_(worth_it, extra(b))
        b.cbranch(worth_it, go, as_is)
        b.position_at_end(go)
        pair = b.cmpxchg(owner, c32(0), c32(1), "acquire", "monotonic")
        lock_bb = fn.append_basic_block("split")
        b.cbranch(b.extract_value(pair, 1), lock_bb, as_is)
        b.position_at_end(lock_bb)
        # chunks: two per thread where N allows (a late worker still finds work), whole panels;
        # by rows one a thread (each copies all of B's panels)
        parts = b.select(rows, b.add(w, c64(1)), b.mul(b.add(w, c64(1)), c64(2)))
        if kind == KIND_RANGE:  # grains (the last one partial) in at most `parts` chunks, the last the shortest
            panels = b.sdiv(b.add(n, b.sub(unit, c64(1))), unit)
        else:
            panels = b.sdiv(n, unit)
        per = b.sdiv(b.add(panels, b.sub(parts, c64(1))), parts)  # panels per chunk, >= 1
        width = b.mul(per, unit)
        if kind == KIND_RANGE:
            n_chunks = b.sdiv(b.add(n, b.sub(width, c64(1))), width)
        else:
            n_chunks = b.sdiv(n, width)  # the last chunk takes the columns past n_chunks * width
        for name in JOB_FIELDS:
            value = {"kind": c64(kind), "width": width, "rows": b.zext(rows, i64)}.get(name, args.get(name, c64(0)))
            if isinstance(value.type, ir.PointerType):
                value = b.ptrtoint(value, i64)
            elif value.type == i32:
                value = b.sext(value, i64)
            b.store_atomic(value, field(b, name), "monotonic", 8)
        b.store_atomic(c64(0), done, "monotonic", 8)
        b.store_atomic(c64(0), refused, "monotonic", 8)
        gen = b.add(b.lshr(b.load_atomic(state, "monotonic", 8), c64(48)), c64(1))
        word = b.or_(b.shl(b.and_(gen, c64(0xFFFF)), c64(48)), b.shl(n_chunks, c64(32)))
        b.store_atomic(word, state, "seq_cst", 8)
        with b.if_then(b.icmp_signed(">", b.load_atomic(sleepers, "seq_cst", 8), c64(0))):
            wake_all(b)  # after a long idle: a few us, once
        b.atomic_rmw("add", split_count, c64(1), "monotonic")
        mine = b.alloca(i64)
        b.store(c64(0), mine)
        own_bb, own_end = fn.append_basic_block("own"), fn.append_basic_block("own.end")
        b.branch(own_bb)
        b.position_at_end(own_bb)

        def work(b, chunk):
            run_noting_refusal(b, chunk)
            b.store(b.add(b.load(mine), c64(1)), mine)

        got = take_chunk(b, work, from_back=False)
        b.cbranch(got, own_bb, own_end)
        b.position_at_end(own_end)
        others = b.sub(n_chunks, b.load(mine))
        wait_bb, wait_body, wait_end = (fn.append_basic_block(x) for x in ("wait", "wait.body", "wait.end"))
        b.branch(wait_bb)
        b.position_at_end(wait_bb)
        b.cbranch(b.icmp_signed("<", b.load_atomic(done, "acquire", 8), others), wait_body, wait_end)
        b.position_at_end(wait_body)
        b.call(yield_cpu, [])  # the worker may share this CPU
        b.branch(wait_bb)
        b.position_at_end(wait_end)
        result = b.select(b.icmp_signed("!=", b.load_atomic(refused, "monotonic", 8), c64(0)), c64(0), c64(1))
        b.store_atomic(c32(0), owner, "release", 4)
        if kind == KIND_BIAS:
            b.ret(result)
        else:
            b.ret_void()
        b.position_at_end(as_is)
        return b

    fn = ir.Function(mod, sgemm_type(), name=TEAM_SGEMM)
    order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc = fn.args
    b = emit_caller(fn, 0, {
        "ta": ta, "tb": tb, "m": M, "n": N, "k": K, "lda": lda, "ldb": ldb, "ldc": ldc, "a": A, "b": B, "c": C,
        "conds": (lambda b: b.icmp_signed("==", order, c32(ROW_MAJOR)),
                  lambda b: b.fcmp_ordered("==", alpha, ir.Constant(f32, 1.0)),
                  lambda b: b.fcmp_ordered("==", beta, ir.Constant(f32, 0.0)))})
    b.call(inner, fn.args)
    b.ret_void()

    fn = ir.Function(mod, bias_gemm_type(), name=TEAM_BIAS)
    M, N, K, A, lda, B, ldb, C, ldc, bias, relu = fn.args
    b = emit_caller(fn, 1, {
        "ta": c64(NO_TRANS), "tb": c64(NO_TRANS), "m": M, "n": N, "k": K, "lda": lda, "ldb": ldb, "ldc": ldc,
        "a": A, "b": B, "c": C, "bias": bias, "relu": relu})
    b.ret(b.call(inner_bias, fn.args))

    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [range_fn_t.as_pointer(), i8p, i64, i64]), name=TEAM_RANGE)
    run_fn, ctx, n, grain = fn.args
    b = emit_caller(fn, KIND_RANGE, {"m": c64(1), "n": n, "k": c64(1), "a": run_fn, "b": ctx},
                    unit=lambda b: b.select(b.icmp_signed("<", grain, c64(1)), c64(1), grain))
    b.call(run_fn, [ctx, c64(0), n])
    b.ret_void()
    return str(mod)


SERIAL_RANGE = "cubedqn_serial_range"  # TEAM_RANGE's signature, fn(ctx, 0, n) alone


def serial_range_ir() -> str:
    """SERIAL_RANGE: the range symbol's stand-in where the team is not built (CUBEDQN_TEAM=0,
    platforms without pthreads)."""
    mod = ir.Module(name="cubedqn_serial_range")
    i8p, i64 = ir.IntType(8).as_pointer(), ir.IntType(64)
    range_fn_t = ir.FunctionType(ir.VoidType(), [i8p, i64, i64])
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [range_fn_t.as_pointer(), i8p, i64, i64]), name=SERIAL_RANGE)
    run_fn, ctx, n, _ = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    b.call(run_fn, [ctx, ir.Constant(i64, 0), n])
    b.ret_void()
    return str(mod)


def compile_serial_range():
    """(engine, "cache" or "compiled") with SERIAL_RANGE bound."""
    return load_or_compile("serial_range", __file__, serial_range_ir, (SERIAL_RANGE,))


def compile_team():
    """(engine, "cache" or "compiled") with TEAM_SGEMM, TEAM_BIAS, TEAM_RANGE, SET_TEAM, TEAM_STATS and
    TEAM_FORKED bound; INNER_SGEMM and INNER_BIAS must be bound before. Raises where LLVM cannot
    compile the IR here."""
    return load_or_compile(f"team-rows{ROW_PANEL}", __file__, module_ir,  # ROW_PANEL: the tile's ISA
                           (TEAM_SGEMM, TEAM_BIAS, TEAM_RANGE, SET_TEAM, TEAM_STATS, TEAM_FORKED, SET_ROWS))
