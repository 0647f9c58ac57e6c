"""One `--threads` knob for both sides: Numba's own threads and the threads the GEMMs run on.

The GEMMs get their threads from the GEMM team (team.py: T - 1 resident workers share each
larger product's columns with the caller, the BLAS on one thread) where blas.py could bind
it, else from the BLAS itself. The kernels' GEMMs run on numpy's bundled OpenBLAS or on
scipy's (blas.py); numba's np.dot calls scipy's, which is loaded lazily on first use. A
thread limit applied before it is loaded does not reach it (it then starts with one
thread per core, and two such processes on two cores busy-wait against each other:
measured here at ~4.6x slower steps). So the library is loaded first, then limited.
`BlasThreadTuner` (the name kept from before the team) switches the GEMMs between T
threads and one while training runs.
"""

from __future__ import annotations

from contextlib import contextmanager


_MODE = ["blas"]  # how limit_threads last gave the GEMMs their threads: "blas" or "team"


class _Limits:
    """What limit_threads replaced; as a context manager, puts back the BLAS limits, the
    GEMM team size and the mode that were in place before it."""

    def __init__(self, blas_limiter, team_before, mode_before):
        self._blas, self._team_before, self._mode_before = blas_limiter, team_before, mode_before

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()

    def restore(self):
        from . import blas
        self._blas.restore_original_limits()
        blas.set_team(self._team_before)
        _MODE[0] = self._mode_before


def limit_threads(threads: int):
    """Give numba and the engine's GEMMs `threads` threads: where the GEMM team can be had
    (blas.set_team, team.py), the BLAS on one thread and threads - 1 team workers beside
    the caller (at most team.MAX_WORKERS); else every loaded BLAS at `threads`. Returns a context manager that puts
    back what was there before."""
    import numba
    import scipy.linalg.cython_blas  # noqa: F401  (loads the OpenBLAS that njit np.dot uses)
    from . import blas, team  # blas binds the GEMM's library before it is limited
    from threadpoolctl import threadpool_limits
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    before = _Limits(threadpool_limits(limits=None, user_api="blas"), blas.team_workers(), _MODE[0])
    set_blas_threads(1)  # the team's products run the library (where it takes them) on one thread
    workers = min(threads - 1, team.MAX_WORKERS)  # more threads than the team has: all of it
    if workers > 0 and blas.team_problem() is None and blas.set_team(workers) == workers:
        _MODE[0] = "team"
    else:
        blas.set_team(0)
        set_blas_threads(threads)
        _MODE[0] = "blas"
    return before


def gemm_threads() -> int:
    """Threads the engine's GEMMs run on now: the team's workers and the caller, or the
    library's thread count."""
    from . import blas
    if _MODE[0] == "team":
        return blas.team_workers() + 1
    from threadpoolctl import threadpool_info
    counts = [i.get("num_threads", 1) for i in threadpool_info() if i.get("user_api") == "blas"]
    return max(counts) if counts else 1


def set_gemm_threads(threads: int):
    """The GEMMs on `threads` threads from now on (the tuner's switch): in the team mode
    threads - 1 workers, else the BLAS's thread count."""
    from . import blas
    if _MODE[0] == "team":
        blas.set_team(threads - 1)
    else:
        set_blas_threads(threads)


@contextmanager
def one_gemm_thread():
    """The GEMMs on the calling thread alone for the block (threads of its own run
    products side by side: eval --threads), what was there before restored after."""
    from . import blas
    from threadpoolctl import threadpool_limits
    workers = blas.team_workers()
    blas.set_team(0)
    try:
        with threadpool_limits(limits=1, user_api="blas"):
            yield
    finally:
        blas.set_team(workers)


_CONTROLLER = None


def set_blas_threads(threads: int):
    """Set every loaded BLAS to `threads` threads (numba's untouched); ~30 us a call once the
    libraries have been listed (listing them, at the first call, takes ~1.5 ms)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController
        _CONTROLLER = ThreadpoolController()
    _CONTROLLER.limit(limits=threads, user_api="blas")


class BlasThreadTuner:
    """Training with --threads T > 1: keeps the GEMMs at whichever of T threads and one ran
    the training loop faster in the last probe (`set_gemm_threads`: the GEMM team's size,
    or the BLAS's thread count where there is no team), so that T threads are not much
    slower than one when the other cores are busy. Measured on this 2-vCPU host with a process
    spinning on its second CPU (`runs/perf10/tune-busy`, the 144-256-256-12 loop, medians of
    3 alternating runs): two fixed BLAS threads ran at 0.37x the speed of one, tuned at 0.85x;
    without the spinner (`tune-quiet`) 1.28x and 1.33x (it kept two threads).

    A probe times four blocks at T, 1, 1 and T BLAS threads (ABBA: a steady drift in the
    host's speed cancels); a block lasts at least `block_seconds` of loop time and
    `min_steps` gradient steps. Where the first two blocks already read T threads more than
    `slowdown` slower than one, it keeps one without the other two (half the probe's cost
    where two threads run at half speed, as they do on a busy 2-vCPU host; the blocks at T
    are the probe's cost there). Else it keeps T threads only if they ran at least `margin`
    faster per gradient step than one, else one (short probes on a noisy host err, and the
    error is cheaper towards one thread: that count is the one-thread run's own, which T
    threads must not fall behind; until stop 24 ties went to T, and a `cube2` preset run
    that kept two on a probe reading them equal to one ran 0.91x a one-thread run,
    docs/performance-log.md), and probes again after `interval_seconds` of loop time (a
    gap from 2 s, doubling after each probe that kept the count and back to 2 s after one
    that changed it, was tried: on this host's noise the probes flipped, it probed three
    times as often and ran no faster, stop 35 in docs/performance-log.md), or sooner when
    the host changes under it: once `check_seconds` of loop time (and `min_steps` gradient
    steps) ran more than `slowdown` slower per gradient step than
    the last probe measured the count in use, or, with T threads in use, slower than it
    measured one thread (a second core taken by another process after the probe; on a
    2-vCPU Zen 4 host a run kept two BLAS threads on a probe reading them 4% faster, then ran
    at 1.6x the probe's time for the rest of it, docs/performance-log.md; on the same host two
    threads flip between 0.8x and 1.8x one thread's step time from one half second to the
    next, so the window is half a second: a 2,000-step `profile` run lasts about two). The
    first probe starts after `first_probe_after` seconds of loop time (0: at the first
    gradient step; the trainer asks for 1 s: in a run's first second the caches it fills
    make steps drift down faster than the ABBA order cancels, and the first block, at T
    threads, read slowest: the `cube2` preset's first probe kept one thread in 4 of 6
    processes probing at once and in 1 of 6 after a second, alternating, stop 33 in
    docs/performance-log.md). The trainer reports the
    time of each env iteration (`spent`) and gradient step (`step_done`), so evaluation,
    logging and checkpoints are not counted. The choice does not change results where every
    product's K is at most 256: OpenBLAS splits a product's rows and columns between
    threads, not its sums, and the tile GEMM that takes products on one thread sums as it
    does there (a training run switching between one and two threads came out bitwise
    equal to a one-thread run, tested); past K = 256 the two sum K in different orders
    (tile_gemm.py), so a wider net's last bits depend on the choice.
    """

    def __init__(self, threads: int, interval_seconds: float = 30.0, block_seconds: float = 0.1,
                 min_steps: int = 4, margin: float = 0.05, set_threads=None,
                 check_seconds: float = 0.5, slowdown: float = 0.25, first_probe_after: float = 0.0):
        if threads < 2 or min_steps < 1 or min(block_seconds, interval_seconds, check_seconds, first_probe_after) < 0:
            raise ValueError("the tuner needs threads >= 2, min_steps >= 1 and non-negative times")
        self.threads, self.interval, self.block, self.min_steps = threads, interval_seconds, block_seconds, min_steps
        self.margin, self.set_threads = margin, set_threads or set_gemm_threads
        self.check, self.slowdown = check_seconds, slowdown
        self.window = [0.0, 0]          # loop seconds, gradient steps since the last check (outside probes)
        self.schedule = (threads, 1, 1, threads)
        self.current = threads          # the BLAS thread count in use outside probes
        self.phase = -1                 # index into schedule while probing, else -1
        self.since = interval_seconds - first_probe_after  # loop time since the last probe ended
        self.steps, self.elapsed = 0, 0.0
        self._clear_totals()
        self.probes = 0                 # probes finished
        self.probe_seconds = 0.0        # loop time spent inside probe blocks, finished or not
        self.last_probe = None          # {threads: seconds per gradient step} of the last probe

    def spent(self, seconds: float):
        """Time of an env iteration (or any training work between gradient steps)."""
        if self.phase >= 0:
            self.elapsed += seconds
            self.probe_seconds += seconds
        else:
            self.since += seconds
            self.window[0] += seconds

    def step_done(self, seconds: float):
        """One gradient step took `seconds`; may switch the BLAS thread count."""
        if self.phase < 0:
            self.since += seconds
            self.window[0] += seconds
            self.window[1] += 1
            if self.since >= self.interval or self._slowed():
                self._begin_block(0)
            return
        self.elapsed += seconds
        self.probe_seconds += seconds
        self.steps += 1
        if self.steps < self.min_steps or self.elapsed < self.block:
            return
        total = self.totals[self.schedule[self.phase]]
        total[0] += self.elapsed
        total[1] += self.steps
        per_step = {n: t / k for n, (t, k) in self.totals.items() if k}
        decided = len(per_step) == 2 and per_step[self.threads] > (1 + self.slowdown) * per_step[1]
        if self.phase + 1 < len(self.schedule) and not decided:
            self._begin_block(self.phase + 1)
            return
        self.last_probe = per_step
        best = self.threads if per_step[self.threads] < (1.0 - self.margin) * per_step[1] else 1
        self.set_threads(best)
        self.current, self.phase, self.since = best, -1, 0.0
        self._clear_totals()
        self.probes += 1

    def _slowed(self) -> bool:
        """Whether the window just ended ran `slowdown` slower per gradient step than the last
        probe read for the count in use, or T threads in use ran slower than it read one
        thread (a window ends after check_seconds and min_steps)."""
        seconds, steps = self.window
        if seconds < self.check or steps < self.min_steps:
            return False
        self.window = [0.0, 0]
        if self.last_probe is None:
            return False
        limit = (1 + self.slowdown) * self.last_probe[self.current]
        if self.current != 1:
            limit = min(limit, self.last_probe[1])
        return seconds / steps > limit

    def _clear_totals(self):
        self.totals = {self.threads: [0.0, 0], 1: [0.0, 0]}  # seconds, gradient steps per count

    def _begin_block(self, phase):
        self.phase, self.steps, self.elapsed = phase, 0, 0.0
        self.window = [0.0, 0]
        self.set_threads(self.schedule[phase])

    def probe_soon(self):
        """Probe at the next gradient step (unless probing now): the step itself changed (the
        trainer switched to its one-call step, dqn.Trainer.ahead_pending), so the last probe's
        times no longer stand (and a probe made while a second compiling process took a CPU
        may have kept one thread)."""
        if self.phase < 0:
            self.since = self.interval

    def pause(self):
        """Leave the loop (end of a run): an unfinished probe is dropped, the BLAS goes back
        to the count in use, and the next run probes at its first gradient step."""
        if self.phase >= 0:
            self.set_threads(self.current)
            self.phase = -1
            self._clear_totals()
        self.since = self.interval
        self.window = [0.0, 0]

    def last_probe_json(self):
        """The last probe's loop seconds per gradient step, keyed by thread count as text
        (the form the log records and profile's JSON carry), or None before any probe."""
        return {str(k): v for k, v in self.last_probe.items()} if self.last_probe else None

    def settled(self):
        """Called after pause: the count in use stands for the next run, whose first probe
        waits `interval_seconds` of loop time (or a slowdown) instead of starting at once.
        For a run right after one that ended with a finished probe (profile's tuning, then
        its timed steps)."""
        self.since = 0.0
