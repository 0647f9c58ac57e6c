"""The DQN training loop for cube puzzles, top to bottom in one file.

One iteration steps N cubes together: the exploration draws come first and a batched Q
forward over the cubes that act greedily picks their actions (choose_actions), one kernel
applies them and emits n-step transitions, one call adds them to replay; then
(every `train_freq` iterations, once `learning_starts` transitions exist) `gradient_steps`
learner updates run. Every phase is timed (see learner.PhaseTimer).

Deviations from the DQN paper (Mnih et al. 2015), all deliberate and documented:
- Double DQN targets by default (van Hasselt et al. 2016); vanilla and a model-based
  "all-actions" mode (trains every action of a sampled state from its known children)
  are one config value away.
- Reward is -1 per move and solving terminates, so Q(s, a) ~ -(1 + cost-to-go of the
  child). gamma defaults to 0.99: with gamma = 1 an untrained policy's values diverge
  (episodes only end by truncation); 0.99 keeps values bounded while -(1 - 0.99^d)/0.01
  still ranks depths correctly (values at depth 14 differ by ~0.87 per move).
- Episodes are truncated (not terminated) after max_episode_moves; truncation bootstraps.
- A scramble-depth curriculum replaces a fixed start distribution.
- Schedules (epsilon, learning rate, PER beta) follow the run's progress: the fraction of
  `steps` done or of the `minutes` budget spent, whichever is larger, so a run cut by the
  clock still finishes its annealing (a resumed run continues from where it stopped).
- Epsilon decays linearly over `exploration_fraction` of the run.
- Optional, off by default: `matmul_precision = "bfloat16"` runs the loop's GEMMs (acting,
  learning, the curriculum's evaluation) on bf16-rounded operands with float32 sums
  (blas.set_matmul_precision); weights, gradients and optimizer state stay float32.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from pathlib import Path

import numpy as np

from . import __version__
from .blas import matmul_precision_as
from .checkpoint import CheckpointError, atomic_savez, atomic_write_json, read_json, read_npz
from .config import Config, ConfigError, validate
from .cube import METRICS, get_puzzle
from .encoding import Encoder, Policy
from .env import VecEnv, draw_explorers, greedy_actions
from .learner import Learner, PhaseTimer
from .nn import Layout
from .optim import all_finite
from .replay import Batch, ReplayBuffer
from .rng import make_rng, rng_from_list, rng_to_list
from .search import greedy_solve
from .threads import BlasThreadTuner, set_gemm_threads

AHEAD_POLL_STEPS = 16  # gradient steps between looks at warm_up's second process (a waitpid each)


class TrainingDiverged(RuntimeError):
    """Loss or parameters became NaN/Inf."""


def make_encoder(cfg: Config) -> Encoder:
    try:
        return Encoder(get_puzzle(cfg.puzzle), METRICS[cfg.metric], cfg.canonical_input, cfg.sparse_input,
                       cfg.input_encoding, cfg.input_symmetry)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def make_layout(cfg: Config, encoder: Encoder) -> Layout:
    return Layout(in_dim=encoder.in_dim, n_active=encoder.n_active, hidden=tuple(cfg.hidden),
                  n_actions=METRICS[cfg.metric], dueling=cfg.dueling)


def make_learner(cfg: Config, encoder: Encoder, layout: Layout, moves: np.ndarray, learner_class=Learner):
    """The config's learner (online and target nets, optimizer, workspaces)."""
    dtype = np.float32 if cfg.precision == "float32" else np.float64
    return learner_class(
        layout, moves, cfg.batch_size, encoder, targets=cfg.targets, gamma=cfg.gamma, loss=cfg.loss,
        optimizer=cfg.optimizer, seed=cfg.seed, dtype=dtype, sparse=cfg.sparse_input,
        grad_accum=cfg.grad_accum, lomo=cfg.lomo, sparse_update=cfg.sparse_update,
        target_cache=cfg.target_cache, child_cache=cfg.child_cache,
        target_update_interval=cfg.target_update_interval,
        tau=cfg.tau, lr=cfg.learning_rate, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm, clip=cfg.clip, schedule=cfg.lr_schedule,
        lr_final=cfg.lr_final, total_steps=max(cfg.steps, 1))


def eval_states(puzzle, n_actions, depth, n, seed):
    """A fixed evaluation batch at one scramble depth (independent of the training RNG).

    A scramble that lands on a solved cube is drawn again (as the training envs do): depth
    moves can undo themselves (R R2 R, or R L' on the 2x2x2, which only turns the whole
    cube), 8% of the 2x2x2's depth-2 quarter-turn scrambles, and would count as solved
    in zero moves. Depth 0 is the solved cube itself."""
    from .cube import scramble_into, solved_batch
    rng = make_rng(seed * 1_000_003 + depth * 7919)
    moves = np.ascontiguousarray(puzzle.moves)
    states = np.repeat(puzzle.solved[None], n, axis=0)
    rows = np.arange(n)
    while rows.size:
        redo = np.repeat(puzzle.solved[None], rows.size, axis=0)
        scramble_into(redo, np.full(rows.size, depth), moves, n_actions, rng, True, np.empty((rows.size, 0), np.int8))
        states[rows] = redo
        if depth == 0:
            break
        solved = np.empty(rows.size, np.bool_)
        solved_batch(redo, solved)
        rows = rows[solved]
    return states


class Trainer:
    learner_class = Learner  # the CUDA trainer swaps in its device-resident learner
    tunes_blas = True        # --threads > 1 may pick 1 BLAS thread where it runs faster (threads.py)

    def __init__(self, cfg: Config):
        self.cfg = cfg = validate(cfg)
        self.puzzle = get_puzzle(cfg.puzzle)
        self.n_actions = METRICS[cfg.metric]
        self.moves = np.ascontiguousarray(self.puzzle.moves[:self.n_actions])
        self.encoder = make_encoder(cfg)
        self.layout = make_layout(cfg, self.encoder)
        dtype = np.float32 if cfg.precision == "float32" else np.float64
        self.rng = make_rng(cfg.seed)  # one stream for envs, exploration and replay
        n_step = 1 if cfg.targets == "all-actions" else cfg.n_step
        self.replay = ReplayBuffer(cfg.buffer_size, self.puzzle.n_stickers, cfg.gamma,
                                   prioritized=cfg.prioritized_replay, alpha=cfg.prioritized_replay_alpha,
                                   eps=cfg.prioritized_replay_eps)
        self.batch = Batch(cfg.batch_size, self.puzzle.n_stickers, dtype)
        self.env = VecEnv(self.puzzle, cfg.n_envs, self.n_actions, cfg.max_episode_moves, cfg.gamma, n_step)
        self.depth = cfg.curriculum_start if cfg.curriculum == "adaptive" else cfg.depth_max
        self.depth = min(max(self.depth, cfg.depth_min), cfg.depth_max)
        self.env.reset(np.ones(cfg.n_envs, np.bool_), *self.depth_range(), self.rng)
        # the learner after the environments: on a cold start, their kernels compile here while
        # a second process compiles the learner's (precompile.py), which this one then loads
        self.learner = make_learner(cfg, self.encoder, self.layout, self.moves, self.learner_class)
        self.act_ws = self.learner.online.workspace(cfg.n_envs, self.encoder.input_groups)
        self.act_rot = np.zeros(cfg.n_envs, np.int64)
        self.greedy_rows = np.zeros(cfg.n_envs, np.int64)            # draw_explorers' outputs
        self.greedy_states = np.zeros_like(self.env.states)
        self.policy = Policy(self.learner.online, self.encoder)
        self.timer = PhaseTimer()
        self.blas_tuner = BlasThreadTuner(cfg.threads, first_probe_after=1.0) \
            if self.tunes_blas and cfg.tune_blas_threads and cfg.threads > 1 else None
        self.grad_steps = self.env_steps = self.vec_steps = self.episodes = self.solved_episodes = 0
        self.states_scored = 0  # env states the acting forward scored (the greedy ones; profile reports it)
        self.pending = 0
        self.last_solve_rate = None
        self.saved_progress = 0.0  # progress reached by earlier runs that had a wall-clock budget
        # gradient steps the schedules leave out (profile's thread probe before its timed
        # steps: profiling.profile_training)
        self.unscheduled_steps = 0
        self._budget = None        # (start time, seconds, progress at start) while run() has a deadline
        self._eval_cache = {}
        self._log_acc = [0.0, 0]
        self.interrupted = False
        # the second compiling process (precompile.py) that warm_up left still compiling the
        # one-call step; the loop trains with the per-part step until it is done (ahead_pending)
        self.ahead = None
        self.ahead_failure = None  # why that process did not finish, once it ended (None: it did)

    # -- schedules -------------------------------------------------------------------------
    def depth_range(self):
        return self.cfg.depth_min, max(self.depth, self.cfg.depth_min)

    def progress(self):
        """Fraction of the run done, in [0, 1]: of cfg.steps (less unscheduled_steps), or of
        the wall-clock budget."""
        p = max((self.grad_steps - self.unscheduled_steps) / max(self.cfg.steps, 1), self.saved_progress)
        if self._budget is not None:
            start, seconds, p0 = self._budget
            p = max(p, p0 + (1.0 - p0) * (time.perf_counter() - start) / seconds)
        return min(p, 1.0)

    def epsilon(self, progress=None):
        c = self.cfg
        progress = self.progress() if progress is None else progress
        if c.exploration_fraction <= 0:
            return c.exploration_final_eps
        frac = min(1.0, progress / c.exploration_fraction)
        return c.exploration_initial_eps + frac * (c.exploration_final_eps - c.exploration_initial_eps)

    def per_beta(self, progress):
        b0 = self.cfg.prioritized_replay_beta0
        return b0 + (1.0 - b0) * progress

    # -- one iteration of the N environments ----------------------------------------------
    def act_values(self, states):
        """The online network's Q-values of states (n <= n_envs of them), each state in its
        own frame ((n, A); the frames go to self.act_rot[:n])."""
        self.encode_for_acting(states)
        return self.learner.online.forward_ws(self.act_ws, len(states))

    def encode_for_acting(self, states):
        """act_values' input rows of states (n <= n_envs), frames to self.act_rot[:n]."""
        self.encoder.encode(states, self.act_ws, 0, self.act_rot, want_codes=False)

    def choose_actions(self, eps):
        """Epsilon-greedy actions of the environments into env.actions. Only the states that
        act greedily are encoded and scored (draw_explorers draws first, in select_actions'
        order, so the actions are the ones select_actions picks from every state's
        Q-values); early in a run, when most cubes explore, that is a fraction of them."""
        env = self.env
        k = draw_explorers(env.states, eps, self.n_actions, self.rng, env.actions, self.greedy_rows,
                           self.greedy_states)
        self.states_scored += k
        if k:
            qc = self.act_values(self.greedy_states[:k])
            greedy_actions(qc, self.act_rot, self.encoder.act_map, self.greedy_rows[:k], env.actions)

    def env_iteration(self):
        clock, timer, env = time.perf_counter, self.timer, self.env
        t0 = clock()
        self.choose_actions(self.epsilon())
        t1 = clock()
        count, solved = env.step(env.actions)
        # the step's kernel counts the ended episodes: numpy's any() and sum() of `ended` here took
        # about 57 us of the cube2 preset's step (its env part 126.5 -> 69.5 us; stop 49 in
        # docs/performance-log.md)
        if env.n_ended:
            self.episodes += env.n_ended
            self.solved_episodes += solved
            env.reset(env.ended, *self.depth_range(), self.rng)
        t2 = clock()
        self.replay.add(env.out, count)
        t3 = clock()
        timer.add("act", t1 - t0)
        timer.add("env", t2 - t1)
        timer.add("replay add", t3 - t2)
        self.env_steps += env.n
        self.vec_steps += 1

    def gradient_step(self):
        clock, timer, c = time.perf_counter, self.timer, self.cfg
        t0 = clock()
        progress = self.progress()
        # without a clock budget the optimizer keeps its own step-based schedule
        clocked = self._budget is not None or self.saved_progress > 0
        self.learner.opt.progress = progress if clocked else None
        self.replay.sample(self.rng, self.batch, self.per_beta(progress))
        timer.add("sample", clock() - t0)
        loss = self.learner.train_step(self.batch, timer, use_weights=c.prioritized_replay)
        if c.prioritized_replay:
            t1 = clock()
            self.replay.update_priorities(self.batch.indices, self.learner.td)
            timer.add("sample", clock() - t1)
        if not math.isfinite(loss):
            raise TrainingDiverged(f"loss became {loss} at gradient step {self.grad_steps + 1}; "
                                   "try a lower learning_rate or max_grad_norm")
        self.grad_steps += 1
        self._log_acc[0] += loss
        self._log_acc[1] += 1

    def eval_batch(self, depth):
        """The curriculum's evaluation states at this scramble depth (drawn once)."""
        if depth not in self._eval_cache:
            c = self.cfg
            self._eval_cache[depth] = eval_states(self.puzzle, self.n_actions, depth, c.curriculum_eval_n, c.seed)
        return self._eval_cache[depth]

    def evaluate_curriculum(self):
        """Greedy solve rate on a fixed batch at the current max depth; raise depth on success."""
        t0 = time.perf_counter()
        c = self.cfg
        key = self.depth
        # a greedy rollout may use twice the scramble depth (+2), whatever the episode length
        solved, _, _ = greedy_solve(self.policy, self.eval_batch(key), self.moves, 2 * key + 2)
        self.last_solve_rate = float(solved.mean())
        if c.curriculum == "adaptive" and self.last_solve_rate >= c.curriculum_threshold \
                and self.depth < c.depth_max:
            self.depth += 1
        self.timer.add("eval", time.perf_counter() - t0)

    # -- the loop ----------------------------------------------------------------------------
    def warm_up(self, ahead=None, wait=True) -> float:
        """Compile (or load from Numba's cache) the kernels the training loop calls, by running
        a small twin of this trainer for two gradient steps: the same config, so the same
        kernels and types, with a small replay buffer and evaluation batch and its own
        objects and random stream. Nothing of this trainer changes (tested). `train` calls it
        before a run with a time budget, so that the budget is all training: a cold first
        run of the one-minute preset otherwise spent about a third of its minute compiling.
        The twin explores until its first gradient step and acts greedily for half its cubes
        after it, so that the acting kernels compile too.

        ahead: a second process compiling the learner's kernels (precompile.start) or None.
        The twin then encodes its cubes as acting does, steps its environments until its
        replay can serve a batch, draws its evaluation batch and runs its learner's backward
        and update once (those kernels compile here meanwhile, to be loaded there), waits for
        that process, and goes on, loading the forward's and the rest from the cache. The
        process is stopped when this returns or raises, whatever happened, unless it was
        handed to this trainer (wait=False, below).

        wait=False: where the learner takes the one-call step (learner.fused) and that process
        is still compiling it at that point, the twin and then this trainer's loop train with
        the per-part step instead, which gives the same bits (tested), and the loop switches
        to the one-call step once the process is done (`self.ahead` until then; a run that
        ends before then leaves it running, for its caller to wait for with
        `ahead_pending(wait=True)`, so that the next run finds the cache complete; one that
        is interrupted or raises stops it). Where the thread tuner runs, the GEMMs stay on
        one thread until then (that process has the other CPU; tuning resumes after).
        `train --puzzle cube2` (double targets) cold: training began at 21-22 s instead of
        30-32 s (README, Design notes, "A cold start compiles on two cores").

        Returns the seconds it took. A Ctrl-C during it sets `interrupted` (nothing trained);
        a twin whose two steps diverge is ignored (its kernels are compiled by then, and the
        run itself reports divergence at its own steps)."""
        t0 = time.perf_counter()
        c = self.cfg
        buffer = max(4 * c.batch_size, c.n_envs * c.n_step)
        ran = False  # the twin ran to its end (or diverged): this trainer's own run may follow
        try:
            twin = type(self)(c.replace(steps=2, minutes=0.0, learning_starts=c.batch_size, buffer_size=buffer,
                                        eval_interval=1, log_interval=1, curriculum_eval_n=min(c.curriculum_eval_n, 8),
                                        checkpoint_interval=0, tune_blas_threads=False, exploration_initial_eps=1.0,
                                        exploration_final_eps=0.5, exploration_fraction=0.5))
            if ahead is not None:
                try:
                    twin.encode_for_acting(twin.env.states)
                    while twin.replay.size < max(twin.cfg.learning_starts, c.batch_size):
                        twin.env_iteration()
                    twin.replay.sample(twin.rng, twin.batch, twin.per_beta(0.0))
                    twin.eval_batch(twin.depth)
                    with matmul_precision_as(c.matmul_precision):
                        twin.learner.compile_update()
                    if not wait and self.learner.fused and ahead.poll() is None:
                        twin.learner.fused = self.learner.fused = False
                        self.ahead, ahead = ahead, None  # the loop's now (ahead_pending)
                        if self.blas_tuner is not None:  # the other CPU compiles meanwhile
                            set_gemm_threads(1)
                    else:
                        ahead.wait()
                except KeyboardInterrupt:
                    self.interrupted = True
                    return time.perf_counter() - t0
            twin.run()
            ran = not twin.interrupted
        except TrainingDiverged:
            ran = True
        finally:
            if ahead is not None:
                ahead.stop()
            if not ran:  # no run of this trainer follows: stop what was handed over
                self.ahead_pending(stop=True)
        self.interrupted = twin.interrupted
        return time.perf_counter() - t0

    def ahead_pending(self, wait=False, stop=False) -> bool:
        """Whether the second compiling process that warm_up(wait=False) left running still
        runs (after waiting for it with wait=True, or ending it with stop=True). When it
        has ended, the learner takes the one-call step if it finished its work (and the
        thread tuner probes again: the step's time changed), else it keeps the per-part step
        and `ahead_failure` says why."""
        if self.ahead is None:
            return False
        if not stop:
            done = self.ahead.wait() if wait else self.ahead.poll()
            if done is None:
                return True
            if done:
                self.learner.fused = True
            else:
                self.ahead_failure = self.ahead.failure
        self.ahead.stop()
        self.ahead = None
        if self.blas_tuner is not None:  # back to the tuner's count, and a probe soon
            set_gemm_threads(self.blas_tuner.current)
            self.blas_tuner.probe_soon()
        return False

    def run(self, max_steps=None, minutes=None, run_dir=None, on_log=None, until=None):
        """Train until max_steps gradient steps in total (default cfg.steps) or `minutes` pass,
        or until `until()`, asked after each gradient step, returns true."""
        c = self.cfg
        target = c.steps if max_steps is None else max_steps
        minutes = c.minutes if minutes is None else minutes
        deadline = time.perf_counter() + minutes * 60 if minutes else math.inf
        if minutes:
            self._budget = (time.perf_counter(), minutes * 60, self.progress())
        metrics = Path(run_dir) / "metrics.jsonl" if run_dir else None
        self._interval_start = (time.perf_counter(), self.grad_steps, self.env_steps)
        learn_after = max(c.learning_starts, c.batch_size)
        # Ctrl-C sets a flag that is checked between steps, so an interrupted run stops in a
        # consistent state that can be checkpointed and resumed exactly.
        self.interrupted = False
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, lambda *_: setattr(self, "interrupted", True))
        finished = False
        try:
            with matmul_precision_as(c.matmul_precision):  # the GEMMs of acting, learning and evaluation
                self._loop(target, deadline, learn_after, run_dir, metrics, on_log, until)
            if (metrics or on_log) and self.grad_steps > self._interval_start[1]:
                # the steps since the last log line (a run shorter than log_interval, or one
                # stopped by its time budget or Ctrl-C), so that every run leaves its record
                self.log(metrics, on_log)
            finished = True
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            if not finished or self.interrupted:  # warm_up(wait=False)'s second process, if it still runs
                self.ahead_pending(stop=True)
            if self._budget is not None:
                self.saved_progress = self.progress()
                self._budget = None
            if self.blas_tuner is not None:
                self.blas_tuner.pause()
        return self

    def _loop(self, target, deadline, learn_after, run_dir, metrics, on_log, until):
        c, clock = self.cfg, time.perf_counter
        tuner = self.blas_tuner if self.ahead is None else None  # held at one thread until then (warm_up)
        # Each pass does one env iteration or one gradient step, so a run stopped between any
        # two gradient steps (and checkpointed, `pending` included) resumes exactly.
        while self.grad_steps < target and clock() < deadline and not self.interrupted:
            t0 = clock()
            if self.pending == 0:
                self.env_iteration()
                if tuner is not None:
                    tuner.spent(clock() - t0)
                if self.replay.size >= learn_after and self.vec_steps % c.train_freq == 0:
                    self.pending = c.gradient_steps
                continue
            self.gradient_step()
            if tuner is not None:
                tuner.step_done(clock() - t0)
            self.pending -= 1
            if self.ahead is not None and self.grad_steps % AHEAD_POLL_STEPS == 0 and not self.ahead_pending():
                tuner = self.blas_tuner
            if self.grad_steps % c.eval_interval == 0:
                self.evaluate_curriculum()
            if self.grad_steps % c.log_interval == 0:
                self.log(metrics, on_log)
            if run_dir and c.checkpoint_interval and self.grad_steps % c.checkpoint_interval == 0:
                self.save(run_dir)
            if until is not None and until():
                break

    def log(self, metrics_path=None, on_log=None):
        t0 = time.perf_counter()
        start, g0, e0 = self._interval_start
        dt = max(t0 - start, 1e-9)
        steps = self.grad_steps - g0
        rec = {
            "step": self.grad_steps, "env_steps": self.env_steps,
            "steps_per_min": steps / dt * 60, "env_steps_per_s": (self.env_steps - e0) / dt,
            "loss": self._log_acc[0] / max(self._log_acc[1], 1), "mean_q": self.learner.last_mean_q,
            "epsilon": self.epsilon(), "depth": self.depth, "solve_rate": self.last_solve_rate,
            "lr": self.learner.opt.lr, "grad_norm": self.learner.opt.last_norm,
            "episodes": self.episodes, "solved_episodes": self.solved_episodes,
            "phases_ms": {k: v / max(steps, 1) * 1e3 for k, v in self.timer.total.items()},
            "blas_threads": self.blas_tuner.current if self.blas_tuner is not None else self.cfg.threads,
            # probes the thread tuner has finished in this process, and the loop seconds
            # spent in probe blocks (the blocks at the count not kept are what tuning costs)
            "blas_probes": self.blas_tuner.probes if self.blas_tuner is not None else 0,
            "blas_probe_seconds": self.blas_tuner.probe_seconds if self.blas_tuner is not None else 0.0,
            # the last probe's loop seconds per gradient step at each count
            "blas_probe": self.blas_tuner.last_probe_json() if self.blas_tuner is not None else None,
        }
        if self.learner.target_cache:  # share of children's values reused so far in this process
            rec["target_cache_hit_rate"] = self.learner.target_cache_hit_rate
        if self.learner.child_codes is not None:  # share of sampled states whose children's codes were in the table
            rec["child_cache_hit_rate"] = self.learner.child_codes.hit_rate
        if not all_finite(self.learner.online.params):
            raise TrainingDiverged(f"parameters became NaN/Inf by gradient step {self.grad_steps}; "
                                   "try a lower learning_rate or max_grad_norm")
        if metrics_path:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if on_log:
            on_log(rec)
        self._log_acc = [0.0, 0]
        self.timer.reset()
        self._interval_start = (time.perf_counter(), self.grad_steps, self.env_steps)
        self.timer.add("other", time.perf_counter() - t0)
        return rec

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self):
        return {
            "version": __version__, "puzzle": self.cfg.puzzle, "metric": self.cfg.metric,
            "layout": self.layout.describe(), "param_count": self.layout.size,
            "grad_steps": self.grad_steps, "env_steps": self.env_steps, "vec_steps": self.vec_steps,
            "episodes": self.episodes, "solved_episodes": self.solved_episodes, "pending": self.pending,
            "depth": self.depth, "last_solve_rate": self.last_solve_rate,
            "progress": self.progress() if self._budget is not None else self.saved_progress,
            "optimizer_t": self.learner.opt.t, "updates": self.learner.updates,
            "rng": rng_to_list(self.rng), "has_replay": bool(self.cfg.save_replay),
        }

    def save(self, run_dir):
        """Write config.json, model.npz, replay.npz (optional) and state.json atomically."""
        if not (all_finite(self.learner.online.params) and all_finite(self.learner.target.params)):
            raise TrainingDiverged("parameters are NaN/Inf: the last good checkpoint was left untouched")
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run_dir / "config.json", self.cfg.to_dict())
        atomic_savez(run_dir / "model.npz", self.learner.arrays())
        if self.cfg.save_replay:
            arrays = self.replay.arrays()
            arrays.update(self.env.arrays())
            atomic_savez(run_dir / "replay.npz", arrays)
        atomic_write_json(run_dir / "state.json", self.state_dict())
        return run_dir

    @classmethod
    def load(cls, run_dir, cfg: Config | None = None, **overrides) -> "Trainer":
        """Resume from run_dir; cfg (already loaded from it) saves reading config.json again."""
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise CheckpointError(f"checkpoint directory {run_dir} does not exist")
        cfg = cfg if cfg is not None else load_config(run_dir)
        if overrides:
            cfg = cfg.replace(**overrides)
        state = read_json(run_dir / "state.json")
        tr = cls(cfg)
        if state.get("param_count") != tr.layout.size:
            raise CheckpointError(f"{run_dir}: state.json does not match config.json (network size)")
        data = read_npz(run_dir / "model.npz")
        try:
            tr.learner.load_arrays(data, state["optimizer_t"])
            if state.get("has_replay") and (run_dir / "replay.npz").exists():
                rep = read_npz(run_dir / "replay.npz")
                tr.replay.load_arrays(rep)
                tr.env.load_arrays(rep)
            for k in ("grad_steps", "env_steps", "vec_steps", "episodes", "solved_episodes", "pending", "depth"):
                setattr(tr, k, int(state[k]))
            tr.last_solve_rate = state["last_solve_rate"]
            tr.saved_progress = float(state.get("progress", 0.0))
            tr.learner.updates = int(state["updates"])
            tr.rng[:] = rng_from_list(state["rng"])
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"{run_dir}: checkpoint is corrupt or mismatched ({e})") from None
        return tr


def load_config(run_dir) -> Config:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {run_dir} does not exist")
    try:
        return validate(Config.from_dict(read_json(run_dir / "config.json"), source=f"{run_dir}/config.json"))
    except ConfigError as e:
        raise CheckpointError(f"checkpoint config is invalid: {e}") from None


def load_policy(run_dir, views=1):
    """(config, Policy) from a run directory, for eval and solve; no optimizer or replay.

    views > 1 averages the network over that many cube symmetries (encoding.Policy).
    """
    from .nn import MLP
    cfg = load_config(run_dir)
    encoder = make_encoder(cfg)
    layout = make_layout(cfg, encoder)
    data = read_npz(Path(run_dir) / "model.npz")
    if "params" not in data:
        raise CheckpointError(f"{run_dir}/model.npz has no 'params' array")
    if data["params"].shape != (layout.size,):
        raise CheckpointError(f"{run_dir}/model.npz does not match its config.json "
                              f"({data['params'].size} parameters, the network needs {layout.size})")
    net = MLP(layout, params=data["params"], dtype=np.float32 if cfg.precision == "float32" else np.float64,
              sparse=cfg.sparse_input)
    if not all_finite(net.params):
        raise CheckpointError(f"{run_dir}/model.npz holds NaN/Inf parameters")
    return cfg, Policy(net, encoder, views=views)
