"""Cold start on two cores: a second process compiles the learner's kernels ahead.

A first run on a machine compiles about ninety Numba kernels, one after another on one
core, before it can train (`scripts/compile_times.py`). Numba compiles under a process-wide
lock, so threads cannot share the work, but processes can: they share Numba's on-disk
cache. `start` runs `python -m cubedqn.precompile CONFIG` beside `cubedqn train` (or
`profile`), which builds the same learner and runs its forward, a greedy search and two of
its gradient steps on made-up cubes (`compile_learner`): the forward's, the search's, the
children and target caches' and the loss's kernels. Meanwhile the trainer builds itself,
and its warm-up (`Trainer.warm_up`) encodes and steps its environments, samples its replay,
draws its evaluation batch and runs its learner's backward and update once
(`Learner.compile_update`), which that process, coming to them last, then loads. The
warm-up waits for that process before its first gradient step, which loads the rest; in
`train`, where that process is still compiling the one-call step (`learner.fused`: dqn and
double targets) by then, training begins with the per-part step, which gives the same
bits, and takes the one-call step once that process is done (`Trainer.ahead_pending`).

What it is not: a way to make anything faster once the cache is warm (then `start` starts
nothing), or a requirement. The second process only ever writes Numba's cache, through
Numba, whose cache files are written to a temporary name and renamed, each save under a
lock both processes take (lock_cache_saves); if it fails or is stopped, the trainer
compiles what is missing itself. The same kernels, the same bits.

`CUBEDQN_COMPILE_AHEAD=0` turns it off (as does a machine that gives this process one CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np


WAIT_SECONDS = 300.0  # the most the trainer waits for it (a cold compile of everything takes 15-35 s)


def enabled() -> bool:
    """A second process may compile ahead: not switched off, two CPUs to run on, and a way
    to lock Numba's cache saves (lock_cache_saves)."""
    if os.environ.get("CUBEDQN_COMPILE_AHEAD", "1") == "0":
        return False
    try:
        import fcntl
        from numba.core.caching import IndexDataCacheFile
    except ImportError:  # not POSIX, or another Numba
        return False
    if not (hasattr(fcntl, "flock") and hasattr(IndexDataCacheFile, "save") and hasattr(IndexDataCacheFile, "flush")):
        return False
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return cpus >= 2


def learner_cached() -> bool:
    """Whether Numba's cache already holds the learner's backward kernel for some signature
    (a warm cache: then nothing is worth starting). Reads the kernel's cache index, which
    Numba returns empty when it is missing or older than the source; anything unexpected
    (caching off, another Numba) counts as cached, so that nothing is started."""
    from .nn import mlp_backward_upper
    try:
        return bool(mlp_backward_upper._cache._cache_file._load_index())
    except Exception:
        return True


LOCK_NAME = "cubedqn-cache.lock"


def lock_cache_saves():
    """Make each of Numba's cache saves in this process hold an exclusive lock on a file in
    the cache's folder (LOCK_NAME), as the other process's do. A save reads a function's
    index, adds its signature and names a new data file after the ones the index lists;
    two processes saving two signatures of one function at once (a kernel both call, each
    with its own argument types) would otherwise both name the same data file, and the
    index could end up pointing one signature at the other's machine code. Idempotent."""
    import fcntl
    from numba.core.caching import IndexDataCacheFile
    if getattr(IndexDataCacheFile.save, "locked", False):
        return

    def under_lock(method):
        def locked(self, *args):
            folder = getattr(self, "_cache_path", None)
            if folder is None:  # not the IndexDataCacheFile this was written against
                return method(self, *args)
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, LOCK_NAME), "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
                return method(self, *args)
        locked.locked = True
        return locked
    IndexDataCacheFile.save = under_lock(IndexDataCacheFile.save)
    IndexDataCacheFile.flush = under_lock(IndexDataCacheFile.flush)


class AheadCompile:
    """The second process, started by `start`. `wait` until it is done (or `poll`); `stop`
    ends it; `failure` says, after a wait, why it did not finish its work (None if it did)."""

    def __init__(self, process: subprocess.Popen, errors):
        self.process, self.errors = process, errors
        self.failure = None

    def wait(self, timeout: float = WAIT_SECONDS) -> bool:
        """Wait for the process (at most timeout seconds, then stop it). Returns whether it
        finished its work."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            self.failure = f"it was stopped after {timeout:.0f} s"
            return False
        if code != 0:
            self.errors.seek(0)
            lines = self.errors.read().decode(errors="replace").strip().splitlines()
            self.failure = f"it exited with status {code}" + (f": {lines[-1]}" if lines else "")
        return code == 0

    def poll(self):
        """None while the process runs; then, as `wait`, whether it finished its work."""
        if self.process.poll() is None:
            return None
        return self.wait(0)

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.errors.close()


def start(cfg) -> AheadCompile | None:
    """Start compiling cfg's learner kernels in a second process, where that helps (enabled,
    cold cache); else None."""
    if not enabled() or learner_cached():
        return None
    lock_cache_saves()
    env = dict(os.environ)
    # the child imports this copy of cubedqn, whatever its sys.path would find first
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    errors = tempfile.TemporaryFile()  # its stderr, for `failure` (a file: a pipe could fill and block it)
    process = subprocess.Popen(
        [sys.executable, "-m", "cubedqn.precompile", json.dumps(cfg.to_dict()), str(os.getpid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors, env=env)
    return AheadCompile(process, errors)


def compile_learner(cfg):
    """Run what compiles cfg's learner kernels: build the learner as the trainer does, a
    greedy search of a few scrambled cubes and two gradient steps on a batch of them.
    Returns the learner."""
    from .blas import matmul_precision_as
    from .cube import METRICS, get_puzzle
    from .dqn import make_encoder, make_layout, make_learner
    from .encoding import Policy
    from .learner import PhaseTimer
    from .replay import Batch
    from .search import greedy_solve

    puzzle, n_actions = get_puzzle(cfg.puzzle), METRICS[cfg.metric]
    moves = np.ascontiguousarray(puzzle.moves[:n_actions])
    encoder = make_encoder(cfg)
    learner = make_learner(cfg, encoder, make_layout(cfg, encoder), moves)
    batch = Batch(cfg.batch_size, puzzle.n_stickers, learner.dtype)
    # cubes three random moves from solved, made in numpy: the scrambling kernels are the
    # trainer's to compile (for its evaluation batch) while this process does the forward
    draws = np.random.default_rng(cfg.seed).integers(n_actions, size=(3, cfg.batch_size))
    states = np.repeat(puzzle.solved[None], cfg.batch_size, axis=0)
    for actions in draws:
        states = np.ascontiguousarray(np.take_along_axis(states, moves[actions], axis=1))
    batch.states[:] = states
    batch.next_states[:] = states
    batch.nsteps[:] = 1
    batch.rewards[:] = -1.0
    batch.discounts[:] = cfg.gamma
    batch.indices[:] = np.arange(cfg.batch_size)
    with matmul_precision_as(cfg.matmul_precision):
        # the forward first (on the workspace as it is: no encoding, whose kernels the
        # trainer's warm-up compiles meanwhile), then the search; the backward and the update
        # come last, as the warm-up compiles them too (Learner.compile_update) to load here
        learner.online.forward_ws(learner.ws, learner.micro)
        greedy_solve(Policy(learner.online, encoder), states[:8], moves, 8)
        for _ in range(2):
            learner.train_step(batch, PhaseTimer(), use_weights=cfg.prioritized_replay)
    return learner


def _exit_with(parent_pid: int):
    """End this process when the one that started it is gone (a killed `train`)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def main(argv=None):
    from .config import Config
    from .threads import limit_threads
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or not argv[1].isdigit():
        print("cubedqn.precompile: error: expected CONFIG_JSON PARENT_PID (train and profile start this "
              "process themselves; it is not a command)", file=sys.stderr)
        sys.exit(2)
    config_json, parent_pid = argv
    _exit_with(int(parent_pid))
    lock_cache_saves()
    cfg = Config.from_dict(json.loads(config_json))
    limit_threads(cfg.threads)
    compile_learner(cfg)


if __name__ == "__main__":
    main()
