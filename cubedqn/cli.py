"""The `cubedqn` command line: train, profile, eval, solve, scramble, oracle, plot, profiles.

Every user mistake (bad value, unknown name, missing or corrupt checkpoint) ends in one
line on stderr, `cubedqn: error: ...`, and exit status 2; never a traceback.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import fields
from pathlib import Path

import click
import numpy as np

from . import __version__
from .checkpoint import CheckpointError, read_metrics, rewind_metrics, set_aside_unfinished
from .config import Config, ConfigError, list_profiles, load_profile, matmul_precision_device_problem, validate
from .threads import limit_threads
from .cube import (CubeError, METRICS, ascii_net, format_moves, from_facelets, get_puzzle, is_solved,
                   parse_moves, to_facelets)

USER_ERRORS = (CubeError, ConfigError, CheckpointError)


class UserError(click.ClickException):
    exit_code = 2


class CubeGroup(click.Group):
    """A group whose errors are one line and exit 2 (Click's usage errors included)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            click.echo(f"cubedqn: error: {e.format_message()}", err=True)
            sys.exit(2)
        except USER_ERRORS as e:
            click.echo(f"cubedqn: error: {e}", err=True)
            sys.exit(2)
        except click.Abort:
            click.echo("cubedqn: aborted", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)


@click.group(cls=CubeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cubedqn")
def main():
    """cubedqn: a fast CPU deep-Q-network engine for Rubik's-cube puzzles."""
    # unknown CUBEDQN_BLAS, CUBEDQN_TILE_GEMM, CUBEDQN_TILE_SPARSE, CUBEDQN_TEAM values (blas.py)
    from .blas import CONFIG_PROBLEM, SPARSE_PROBLEM, TEAM_PROBLEM, TILE_PROBLEM
    from .learner import FUSED_PROBLEM  # an unknown CUBEDQN_FUSED value (see learner.py)
    from .nn import PANELS_PROBLEM  # an unknown CUBEDQN_PANELS value (see nn.py)
    problem = CONFIG_PROBLEM or TILE_PROBLEM or SPARSE_PROBLEM or TEAM_PROBLEM or PANELS_PROBLEM or FUSED_PROBLEM
    if problem:
        raise UserError(problem)


# ---------------------------------------------------------------------------------------
# helpers

def resolve_device(device: str) -> str:
    if device == "cpu":
        return "cpu"
    from .cuda import gpu_status
    ok, why = gpu_status()
    if device == "auto":
        return "cuda" if ok else "cpu"
    if not ok:
        raise UserError(f"--device cuda: {why}")
    return "cuda"


THREADS_HELP = "threads for numba kernels and the GEMMs (a team of T - 1 workers, or the BLAS's own)"
HELP = {
    "metric": "move set: qtm (12 quarter turns) or htm (18 moves)",
    "hidden": "hidden layer widths, e.g. 256,256",
    "dueling": "dueling Q head", "sparse_input": "sparse one-hot first layer (gather/scatter)",
    "canonical_input": "2x2x2: canonicalise orientation (fix the DBL corner) before the network",
    "input_symmetry": "2x2x2: 1, 6 or 48: encode each position as the smallest of its images under the 6 "
                      "symmetries that keep the DBL corner home or under all 48 (needs canonical_input)",
    "input_encoding": "stickers, cubies (2x2x2: which cubie and twist in each corner slot) or pairs (2x2x2: one input per pair of corner slots)",
    "precision": "float32 or float64",
    "matmul_precision": "float32, or bfloat16: the GEMMs on bf16-rounded operands with float32 sums (CPUs with "
                        "AVX512_BF16; 1.4-1.9x the GEMMs' speed on Zen 4)",
    "n_envs": "cubes stepped together",
    "max_episode_moves": "moves before an episode is truncated", "gamma": "discount",
    "exploration_initial_eps": "initial epsilon", "exploration_final_eps": "final epsilon",
    "exploration_fraction": "fraction of steps over which epsilon decays",
    "curriculum": "adaptive or fixed scramble-depth curriculum", "depth_min": "smallest scramble depth",
    "depth_max": "largest scramble depth", "curriculum_start": "adaptive: first max depth",
    "curriculum_threshold": "adaptive: greedy solve rate that raises the depth",
    "curriculum_eval_n": "cubes in the curriculum's evaluation batch",
    "eval_interval": "gradient steps between curriculum evaluations",
    "buffer_size": "replay capacity (transitions)", "prioritized_replay": "proportional prioritized replay",
    "prioritized_replay_alpha": "PER alpha", "prioritized_replay_beta0": "PER initial beta",
    "prioritized_replay_eps": "PER priority epsilon", "targets": "dqn, double or all-actions",
    "n_step": "n-step returns", "batch_size": "batch size", "learning_starts": "transitions before learning",
    "train_freq": "env iterations between training rounds", "gradient_steps": "gradient steps per round",
    "target_update_interval": "gradient steps between target copies", "tau": "Polyak tau (<1: soft updates)",
    "optimizer": "sgd, momentum, nesterov, adam or adamw", "learning_rate": "learning rate",
    "lr_schedule": "constant, linear or cosine", "lr_final": "final learning rate of a schedule",
    "momentum": "momentum", "weight_decay": "weight decay", "max_grad_norm": "gradient clipping norm",
    "clip": "global, layer or none", "loss": "huber or mse", "grad_accum": "micro-batches per update",
    "lomo": "update each layer during backward (LOMO)",
    "sparse_update": "update only the first-layer rows of inputs present in the batch (lazy Adam/momentum)",
    "target_cache": "all-actions on cube2: reuse the target net's value of children seen since its last copy",
    "child_cache": "all-actions on cube2 with pairs/cubies inputs: look the children's corner codes up by the "
                   "parent's position instead of framing every child every step (the same steps)",
    "tune_blas_threads": "with --threads T > 1: after the first second and every 30 s of training, time the loop "
                         "with the GEMMs on T threads and on one; keep T only if they are 5% faster than one",
    "log_interval": "gradient steps between log lines",
    "checkpoint_interval": "gradient steps between checkpoints (0: end only)",
    "save_replay": "save replay buffer and envs with checkpoints (exact resume)",
}
EXPLICIT = {"puzzle", "steps", "minutes", "seed", "threads", "device", "description"}


def hyperparameter_options(f):
    """Add a --flag for every Config field (values are validated by config.validate)."""
    for fld in reversed(fields(Config)):
        if fld.name in EXPLICIT:
            continue
        flag = "--" + fld.name.replace("_", "-")
        if isinstance(fld.default, bool):
            f = click.option(f"{flag}/--no-{fld.name.replace('_', '-')}", fld.name, default=None,
                             help=HELP.get(fld.name, ""))(f)
        else:
            f = click.option(flag, fld.name, default=None, metavar="VALUE", help=HELP.get(fld.name, ""))(f)
    return f


def build_config(profile, overrides) -> Config:
    cfg = load_profile(profile) if profile else Config()
    return validate(cfg.replace(**{k: v for k, v in overrides.items() if v is not None}))


def print_profiles():
    for name, desc in list_profiles():
        click.echo(f"{name:16s} {desc}")


# ---------------------------------------------------------------------------------------
# train

@main.command()
@click.option("--profile", "profile", default=None, help="preset name from profiles/ or a TOML path ('list' to list)")
@click.option("--puzzle", default=None, help="cube2 or cube3")
@click.option("--steps", type=int, default=None, help="gradient steps to train (total, when resuming)")
@click.option("--minutes", type=float, default=None, help="wall-clock limit in minutes")
@click.option("--out", "out", default=None, type=click.Path(), help="run directory (default runs/NAME-TIME)")
@click.option("--resume", default=None, type=click.Path(), help="continue the run in this directory")
@click.option("--seed", type=int, default=None, help="random seed")
@click.option("--threads", type=int, default=None, help=THREADS_HELP)
@click.option("--device", default=None, help="cpu, cuda or auto")
@hyperparameter_options
def train(profile, puzzle, steps, minutes, out, resume, seed, threads, device, **hp):
    """Train a DQN agent; writes config.json, model.npz, state.json, metrics.jsonl."""
    from .dqn import TrainingDiverged
    if profile == "list":
        print_profiles()
        return
    overrides = dict(hp, puzzle=puzzle, steps=steps, minutes=minutes, seed=seed, threads=threads, device=device)
    if resume:
        from .dqn import load_config
        tune = hp.pop("tune_blas_threads")  # run control, like --threads: results do not depend on it
        fixed = [k for k, v in dict(hp, profile=profile, puzzle=puzzle, seed=seed, device=device, out=out).items()
                 if v is not None]
        if fixed:
            raise UserError(f"--resume continues a run with its saved config; --{fixed[0].replace('_', '-')} "
                            "cannot change (only --steps, --minutes, --threads and --[no-]tune-blas-threads can)")
        run_dir = Path(resume)
        extend = {k: v for k, v in (("steps", steps), ("minutes", minutes), ("threads", threads),
                                    ("tune_blas_threads", tune)) if v is not None}
        cfg = load_config(run_dir).replace(**extend)
    else:
        cfg = build_config(profile, overrides)
        name = Path(profile).stem if profile else cfg.puzzle
        run_dir = Path(out) if out else Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        if (run_dir / "state.json").exists():
            raise UserError(f"{run_dir} already holds a run; use --resume {run_dir} or another --out")
        try:
            kept = set_aside_unfinished(run_dir)
        except OSError as e:
            raise UserError(f"cannot write the run directory {run_dir}: {e.strerror or e}") from None
        if kept:
            click.echo(f"{run_dir} held a run that saved no checkpoint: kept as {' and '.join(p.name for p in kept)}")
    dev = resolve_device(cfg.device)
    if not resume:  # before the trainer is built: an --out that cannot be written fails at once
        write_config(run_dir, cfg)
    limit_threads(cfg.threads)
    click.echo("config: " + json.dumps({k: v for k, v in cfg.to_dict().items() if k != "description"}))
    click.echo(f"device: {dev}; run directory: {run_dir}")
    ahead = None
    if dev == "cpu":
        from . import precompile
        ahead = precompile.start(cfg)  # None unless the cache is cold and there are two CPUs
    # compile first, so that a time budget is all training; on a cold cache with a second
    # process compiling, a run bounded by steps alone warms up too (it then compiles sooner)
    warm_up = dev == "cpu" and (cfg.minutes > 0 or ahead is not None)
    try:
        trainer = make_trainer(cfg, dev, resume=run_dir if resume else None)
    except BaseException:
        if ahead is not None:
            ahead.stop()
        raise
    if resume:
        click.echo(f"resuming {run_dir} at gradient step {trainer.grad_steps}")
        write_config(run_dir, cfg)  # the steps and minutes it now runs to
        try:
            dropped = rewind_metrics(run_dir / "metrics.jsonl", trainer.grad_steps)
        except CheckpointError as e:
            raise UserError(str(e)) from None
        except OSError as e:
            raise UserError(f"cannot rewrite {run_dir / 'metrics.jsonl'}: {e.strerror or e}") from None
        if dropped:
            click.echo(f"metrics.jsonl: dropped {dropped} record(s) logged after the checkpoint (those steps run again)")

    def on_log(r):
        solve = "-" if r["solve_rate"] is None else f"{r['solve_rate']:.2f}"
        click.echo(f"step {r['step']:>8d}/{cfg.steps} | {r['steps_per_min']:>8.0f} steps/min | "
                   f"{r['env_steps_per_s']:>8.0f} env steps/s | loss {r['loss']:.4f} | "
                   f"eps {r['epsilon']:.3f} | depth {r['depth']:>2d} | solve {solve}")

    if warm_up:
        click.echo("compiling the training kernels (Numba keeps them for later runs"
                   + ("; a second process compiles the learner's)..." if ahead else ")..."))
        # which stops `ahead` however it ends, or hands it to the trainer (trainer.ahead) to
        # finish the one-call step's compile while training begins with the per-part step
        seconds = trainer.warm_up(ahead, wait=False)
        if ahead is not None and ahead.failure:
            click.echo(f"cubedqn: note: the second compiling process did not finish ({ahead.failure}); "
                       "this one compiled the rest", err=True)
        if trainer.interrupted:
            click.echo("\ninterrupted while compiling the kernels; nothing was trained", err=True)
            sys.exit(130)
        click.echo(f"kernels ready in {seconds:.1f} s" + (
            " (the second process is still compiling the one-call step: training begins with the "
            "per-part step, the same results)" if trainer.ahead is not None else ""))
    t0 = time.perf_counter()
    try:
        trainer.run(run_dir=run_dir, on_log=on_log)
    except TrainingDiverged as e:
        click.echo(f"cubedqn: error: training diverged: {e}", err=True)
        sys.exit(1)
    seconds = time.perf_counter() - t0
    if trainer.ahead_pending():  # still compiling the one-call step: let it finish, for the next run
        click.echo("waiting for the second process to finish compiling the one-call step (the next run loads it)...")
        try:
            trainer.ahead_pending(wait=True)
        except KeyboardInterrupt:
            trainer.ahead_pending(stop=True)
    if trainer.ahead_failure:
        click.echo(f"cubedqn: note: the second compiling process did not finish ({trainer.ahead_failure}); "
                   "trained with the per-part step", err=True)
    trainer.save(run_dir)
    if trainer.interrupted:
        click.echo(f"\ninterrupted at gradient step {trainer.grad_steps}; checkpoint saved to {run_dir}")
        click.echo(f"resume with: cubedqn train --resume {run_dir}")
        sys.exit(130)
    click.echo(f"trained {trainer.grad_steps} gradient steps, {trainer.env_steps} env steps in {seconds:.1f} s")
    if trainer.learner.target_cache and trainer.learner.cache_lookups:
        click.echo(f"target cache: {100 * trainer.learner.target_cache_hit_rate:.1f}% of "
                   f"children's target values reused")
    cc = trainer.learner.child_codes
    if cc is not None and cc.lookups:
        click.echo(f"child cache: {100 * cc.hit_rate:.1f}% of sampled states' children found by position")
    tuner = trainer.blas_tuner
    if tuner is not None:
        click.echo(f"thread tuning: the GEMMs on {tuner.current} of {cfg.threads} thread(s) at the end; "
                   f"{tuner.probes} probe(s), {tuner.probe_seconds:.1f} s of the loop in their blocks")
    click.echo(f"checkpoint: {run_dir}")
    click.echo(f"evaluate with: cubedqn eval --checkpoint {run_dir}"
               + (" --random-states 1000" if cfg.puzzle == "cube2" else ""))


def write_config(run_dir: Path, cfg):
    """Create run_dir if needed and write its config.json (atomically); exit 2 if it cannot."""
    from .checkpoint import atomic_write_json
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run_dir / "config.json", cfg.to_dict())
    except OSError as e:
        raise UserError(f"cannot write the run directory {run_dir}: {e.strerror or e}") from None


def make_trainer(cfg, device, resume=None):
    """A CPU or CUDA trainer, new or resumed from `resume` with cfg; unsupported configs exit 2."""
    from .dqn import Trainer
    cls = Trainer
    if device == "cuda":
        problem = matmul_precision_device_problem(cfg.matmul_precision, device)  # --device auto that found a GPU
        if problem:
            raise UserError(problem)
        from .cuda.trainer import CudaTrainer
        cls = CudaTrainer
    try:
        return cls.load(resume, cfg) if resume else cls(cfg)
    except ValueError as e:
        if isinstance(e, USER_ERRORS):
            raise
        raise UserError(str(e)) from None


# ---------------------------------------------------------------------------------------
# profile

@main.command("profile")
@click.option("--profile", "profile", default=None,
              help="preset name or TOML path (default: cube2; with --puzzle, the plain defaults for that puzzle: "
                   "sticker inputs, so --hidden 256,256 times the 144-256-256-12 network)")
@click.option("--puzzle", default=None, help="cube2 or cube3")
@click.option("--hidden", default=None, help="hidden widths, e.g. 256,256")
@click.option("--input-encoding", default=None, help="stickers, cubies or pairs (cube2)")
@click.option("--batch-size", type=int, default=None, help="batch size")
@click.option("--targets", default=None, help="dqn, double or all-actions")
@click.option("--optimizer", default=None, help="optimizer")
@click.option("--steps", type=int, default=500, show_default=True, help="gradient steps to time")
@click.option("--warmup", type=int, default=100, show_default=True, help="gradient steps before timing")
@click.option("--threads", type=int, default=None, help=THREADS_HELP)
@click.option("--device", default=None, help="cpu, cuda or auto")
@click.option("--sparse-update/--no-sparse-update", default=None,
              help="lazy first-layer updates (the 2x2x2 presets use them; CUDA needs --no-sparse-update)")
@click.option("--tune-blas-threads/--no-tune-blas-threads", default=None,
              help="with --threads T > 1: keep the GEMMs on T threads or 1, whichever runs faster (default: on)")
@click.option("--matmul-precision", default=None, metavar="VALUE", help=HELP["matmul_precision"])
@click.option("--epsilon", type=float, default=None,
              help="exploration rate throughout (default: the run's schedule at its start; acting scores only "
                   "the greedy states, so the act phase shrinks as epsilon grows)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def profile_cmd(profile, puzzle, hidden, input_encoding, batch_size, targets, optimizer, steps, warmup, threads,
                device, sparse_update, tune_blas_threads, matmul_precision, epsilon, as_json):
    """Time the training loop and print where every millisecond of a step goes.

    Phases (env, act, replay, sample, forward, backward, optimizer, ...), the forward and
    backward phases split into encode / first layer / GEMM layers / targets and loss, the
    GEMM layers' GFLOP/s against an sgemm peak measured in the same process, memory, and
    the BLAS kernel and threads that ran.
    """
    from .profiling import profile_training
    if steps <= 0 or warmup < 0:
        raise UserError("--steps must be positive and --warmup >= 0")
    if epsilon is not None and not 0.0 <= epsilon <= 1.0:
        raise UserError(f"--epsilon must be in [0, 1], got {epsilon}")
    over = dict(puzzle=puzzle, hidden=hidden, input_encoding=input_encoding, batch_size=batch_size,
                targets=targets, optimizer=optimizer, threads=threads, device=device, sparse_update=sparse_update,
                tune_blas_threads=tune_blas_threads, matmul_precision=matmul_precision)
    cfg = build_config(profile or (None if puzzle else "cube2"), over)
    dev = resolve_device(cfg.device)
    with limit_threads(cfg.threads):
        report = profile_training(cfg, steps, warmup, dev, epsilon)
    if as_json:
        click.echo(json.dumps(report))
        return
    from .profiling import format_report
    click.echo(format_report(report))


# ---------------------------------------------------------------------------------------
# eval and solve

def parse_depths(spec: str) -> list[int]:
    out = []
    try:
        for part in spec.split(","):
            if "-" in part:
                a, b = part.split("-")
                out += list(range(int(a), int(b) + 1))
            elif part.strip():
                out.append(int(part))
    except ValueError:
        raise UserError(f"bad --depths '{spec}': expected a range like 1-14 or a list like 1,3,5") from None
    if not out or min(out) < 0:
        raise UserError(f"bad --depths '{spec}': expected a range like 1-14 or a list like 1,3,5")
    return out


def check_search(search, beam_width, max_moves, weight=0.6):
    from .search import SEARCHES
    if search not in SEARCHES:
        raise UserError(f"unknown search '{search}' (expected one of: {', '.join(SEARCHES)})")
    if beam_width <= 0:
        raise UserError(f"--beam-width must be positive, got {beam_width}")
    if max_moves <= 0:
        raise UserError(f"--max-moves must be positive, got {max_moves}")
    if not 0 <= weight <= 1:
        raise UserError(f"--astar-weight must be between 0 and 1, got {weight}")


SEARCH_HELP = "greedy, beam or astar (batched weighted A*)"
WIDTH_HELP = "beam width (beam), nodes expanded per forward pass (astar)"
WEIGHT_HELP = "A*: f = weight * moves so far + estimated moves to go (1 = plain A*)"


VIEWS_HELP = ("average the network over this many cube symmetries (1-48; 6 keep the 2x2x2's fixed "
              "corner in place, 48 = all rotations and mirrors); costs that many forward passes")


def check_views(views):
    if not 1 <= views <= 48:
        raise UserError(f"--views must be between 1 and 48, got {views}")


def check_matmul_precision(name):
    """A --matmul-precision this process can run, else exit 2 with why."""
    from .blas import matmul_precision_problem
    problem = matmul_precision_problem(name)
    if problem:
        raise UserError(f"--matmul-precision: {problem}")


@main.command("eval")
@click.option("--checkpoint", required=True, type=click.Path(), help="run directory")
@click.option("--depths", default=None, help="scramble depths, e.g. 1-14 (default 1-14 cube2, 1-20 cube3)")
@click.option("--n", "n", type=int, default=1000, show_default=True, help="cubes per depth")
@click.option("--random-states", type=int, default=0, help="cube2: N uniformly random positions, scored against the oracle")
@click.option("--search", default="greedy", show_default=True, help=SEARCH_HELP)
@click.option("--beam-width", type=int, default=64, show_default=True, help=WIDTH_HELP)
@click.option("--astar-weight", type=float, default=0.6, show_default=True, help=WEIGHT_HELP)
@click.option("--max-moves", type=int, default=30, show_default=True, help="move limit per cube")
@click.option("--views", type=int, default=1, show_default=True, help=VIEWS_HELP)
@click.option("--seed", type=int, default=12345, show_default=True, help="seed of the test cubes")
@click.option("--threads", type=int, default=1, show_default=True,
              help="cubes solved at once, one per thread (each thread's GEMMs then run on that thread alone)")
@click.option("--matmul-precision", default="float32", show_default=True,
              help="the network's GEMMs in search: float32, or bfloat16 (bf16-rounded operands, float32 sums; "
                   "CPUs with AVX512_BF16)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def eval_cmd(checkpoint, depths, n, random_states, search, beam_width, astar_weight, max_moves, views, seed,
             threads, matmul_precision, as_json):
    """Solve rate, solution length and time per cube, by depth or on random positions."""
    from .blas import matmul_precision_as
    from .dqn import eval_states, load_policy
    from .search import solve_many
    check_search(search, beam_width, max_moves, astar_weight)
    check_views(views)
    check_matmul_precision(matmul_precision)
    if n <= 0 or random_states < 0:
        raise UserError("--n must be positive and --random-states >= 0")
    if threads <= 0:
        raise UserError(f"--threads must be positive, got {threads}")
    cfg, policy = load_policy(checkpoint, views)
    puzzle = get_puzzle(cfg.puzzle)
    n_actions = METRICS[cfg.metric]
    rows = []
    all_ok, all_len, all_time, all_opt, opt_dist = [], [], [], [], []
    wall = 0.0  # seconds spent solving, all threads together
    with limit_threads(threads), matmul_precision_as(matmul_precision):
        if random_states:
            if cfg.puzzle != "cube2":
                raise UserError("--random-states needs the 2x2x2 oracle: only for cube2 checkpoints")
            from .oracle import load_oracle
            oracle = load_oracle(cfg.metric)
            states = oracle.random_states(random_states, np.random.default_rng(seed))
            optimal = oracle.distances(states)
            t0 = time.perf_counter()
            ok, lengths, secs, _ = solve_many(policy, puzzle, states, n_actions, search, beam_width, max_moves,
                                              astar_weight, cfg.gamma, threads)
            wall += time.perf_counter() - t0
            for d in sorted(set(optimal.tolist())):
                m = optimal == d
                rows.append({"distance": d, "n": int(m.sum()), "solved_frac": float(ok[m].mean()),
                             "optimal_frac": float((ok[m] & (lengths[m] == d)).mean()),
                             "mean_length": float(lengths[m & ok].mean()) if (m & ok).any() else None,
                             "median_seconds": float(np.median(secs[m]))})
            all_ok, all_len, all_time, opt_dist = [ok], [lengths], [secs], optimal
            all_opt = [ok & (lengths == optimal)]
        else:
            for d in parse_depths(depths or ("1-14" if cfg.puzzle == "cube2" else "1-20")):
                states = eval_states(puzzle, n_actions, d, n, seed)
                t0 = time.perf_counter()
                ok, lengths, secs, _ = solve_many(policy, puzzle, states, n_actions, search, beam_width, max_moves,
                                                  astar_weight, cfg.gamma, threads)
                wall += time.perf_counter() - t0
                rows.append({"depth": d, "n": n, "solved_frac": float(ok.mean()),
                             "mean_length": float(lengths[ok].mean()) if ok.any() else None,
                             "median_seconds": float(np.median(secs))})
                all_ok.append(ok), all_len.append(lengths), all_time.append(secs)
    ok = np.concatenate(all_ok)
    lengths = np.concatenate(all_len)
    secs = np.concatenate(all_time)
    result = {"checkpoint": str(checkpoint), "puzzle": cfg.puzzle, "metric": cfg.metric, "search": search,
              "beam_width": beam_width if search == "beam" else None, "max_moves": max_moves,
              "astar_batch": beam_width if search == "astar" else None,
              "astar_weight": astar_weight if search == "astar" else None,
              "views": views, "rows": rows, "n": int(len(ok)), "solved_frac": float(ok.mean()),
              "mean_length": float(lengths[ok].mean()) if ok.any() else None,
              "median_seconds": float(np.median(secs)), "threads": threads, "wall_seconds": wall,
              "matmul_precision": matmul_precision,
              "cubes_per_second": len(ok) / wall if wall > 0 else None}
    if random_states:
        result["optimal_frac"] = float(np.concatenate(all_opt).mean())
        result["mean_optimal_length"] = float(np.mean(opt_dist))
        result["length_ratio"] = float(lengths[ok].mean() / np.mean(opt_dist[ok])) if ok.any() else None
    if as_json:
        click.echo(json.dumps(result))
        return
    key = "distance" if random_states else "depth"
    click.echo(f"{key:>8s} {'n':>6s} {'solved':>7s} {'optimal':>8s} {'mean len':>9s} {'median ms':>10s}")
    for r in rows:
        opt = f"{r['optimal_frac']:.3f}" if "optimal_frac" in r else "-"
        ml = f"{r['mean_length']:.2f}" if r["mean_length"] is not None else "-"
        click.echo(f"{r[key]:>8d} {r['n']:>6d} {r['solved_frac']:>7.3f} {opt:>8s} {ml:>9s} "
                   f"{r['median_seconds'] * 1e3:>10.3f}")
    line = f"solved {result['solved_frac']:.3f}"
    if result["mean_length"] is not None:
        line += f", mean length {result['mean_length']:.2f}"
    if random_states:
        line += f", optimal {result['optimal_frac']:.3f}, mean optimal length {result['mean_optimal_length']:.2f}"
    views_note = f", {views} symmetry views" if views > 1 else ""
    click.echo(line + f", median {result['median_seconds'] * 1e3:.2f} ms per cube ({search}{views_note})")
    click.echo(f"{len(ok)} cubes in {wall:.2f} s with {threads} thread(s)")


@main.command()
@click.option("--checkpoint", required=True, type=click.Path(), help="run directory")
@click.option("--scramble", default=None, help="moves applied to the solved cube, e.g. \"R U2 F'\"")
@click.option("--facelets", default=None, help="facelet string (Kociemba order U R F D L B)")
@click.option("--search", default="beam", show_default=True, help=SEARCH_HELP)
@click.option("--beam-width", type=int, default=256, show_default=True, help=WIDTH_HELP)
@click.option("--astar-weight", type=float, default=0.6, show_default=True, help=WEIGHT_HELP)
@click.option("--max-moves", type=int, default=40, show_default=True)
@click.option("--views", type=int, default=1, show_default=True, help=VIEWS_HELP)
@click.option("--threads", type=int, default=1, show_default=True,
              help="threads for the network's GEMMs (T - 1 workers share the larger products; the same solution)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def solve(checkpoint, scramble, facelets, search, beam_width, astar_weight, max_moves, views, threads, as_json):
    """Solve one cube with the trained network and verify the solution."""
    from .dqn import load_policy
    from .search import solve_many
    check_search(search, beam_width, max_moves, astar_weight)
    check_views(views)
    if threads <= 0:
        raise UserError(f"--threads must be positive, got {threads}")
    if (scramble is None) == (facelets is None):
        raise UserError("give exactly one of --scramble or --facelets")
    cfg, policy = load_policy(checkpoint, views)
    puzzle = get_puzzle(cfg.puzzle)
    if facelets is not None:
        state = from_facelets(puzzle, facelets)
    else:
        state = puzzle.solved.copy()
        for a in parse_moves(scramble, "htm"):
            state = state[puzzle.moves[a]]
    with limit_threads(threads):
        ok, lengths, secs, sols = solve_many(policy, puzzle, state[None], METRICS[cfg.metric], search,
                                             beam_width, max_moves, astar_weight, cfg.gamma)
    out = {"solution": format_moves(sols[0]) if ok[0] else "", "length": int(lengths[0]) if ok[0] else None,
           "solved": bool(ok[0]), "seconds": float(secs[0])}
    if as_json:
        click.echo(json.dumps(out))
        return
    if ok[0]:
        click.echo(f"solution ({out['length']} moves, verified, {out['seconds'] * 1e3:.1f} ms): "
                   f"{out['solution'] or '(none: the cube is already solved)'}")
    else:
        click.echo(f"no solution found within {max_moves} moves ({search})")
        sys.exit(1)


# ---------------------------------------------------------------------------------------
# scramble, oracle, plot, profiles

@main.command()
@click.option("--puzzle", default="cube3", show_default=True, help="cube2 or cube3")
@click.option("--depth", type=int, default=None, help="random scramble of this many moves")
@click.option("--seed", type=int, default=None, help="seed for --depth")
@click.option("--moves", default=None, help="apply these moves to the solved cube (any of the 18)")
@click.option("--metric", default="htm", show_default=True, help="moves drawn for --depth: qtm or htm")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def scramble(puzzle, depth, seed, moves, metric, as_json):
    """Scramble a cube: print the moves, the facelet string and the net."""
    from .cube import scramble_into
    p = get_puzzle(puzzle)
    n_actions = METRICS.get(metric)
    if n_actions is None:
        raise UserError(f"unknown metric '{metric}' (expected qtm or htm)")
    if (depth is None) == (moves is None):
        raise UserError("give exactly one of --depth or --moves")
    if moves is not None:
        actions = parse_moves(moves, "htm")
    else:
        if depth < 0:
            raise UserError(f"--depth must be >= 0, got {depth}")
        st = p.solved[None].copy()
        rec = np.empty((1, max(depth, 1)), np.int8)
        from .rng import make_rng
        scramble_into(st, np.array([depth]), np.ascontiguousarray(p.moves), n_actions, make_rng(seed), True, rec)
        actions = [int(a) for a in rec[0, :depth]]
    state = p.solved.copy()
    for a in actions:
        state = state[p.moves[a]]
    out = {"puzzle": puzzle, "moves": format_moves(actions), "facelets": to_facelets(state),
           "solved": is_solved(state)}
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"moves:    {out['moves']}")
    click.echo(f"facelets: {out['facelets']}")
    click.echo(ascii_net(state))


@main.command()
@click.option("--puzzle", default="cube2", show_default=True, help="only cube2 has an exact oracle")
@click.option("--metric", default="qtm", show_default=True, help="qtm or htm")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def oracle(puzzle, metric, as_json):
    """Build (or load) the exact 2x2x2 distance table and print positions per distance."""
    from .oracle import N_STATES, cache_dir, load_oracle
    get_puzzle(puzzle)
    if puzzle != "cube2":
        raise UserError(f"no exact oracle for {puzzle}: only cube2 (3,674,160 positions) is enumerable")
    if metric not in METRICS:
        raise UserError(f"unknown metric '{metric}' (expected qtm or htm)")
    t = time.perf_counter()
    o = load_oracle(metric)
    counts = o.counts()
    if as_json:
        click.echo(json.dumps({"puzzle": puzzle, "metric": metric, "states": N_STATES, "counts": counts}))
        return
    click.echo(f"2x2x2 {metric}: {N_STATES} positions, God's number {len(counts) - 1} "
               f"({time.perf_counter() - t:.2f} s; cache {cache_dir()})")
    for d, c in enumerate(counts):
        click.echo(f"{d:>3d} {c:>10d}")


@main.command()
@click.argument("run_dir", type=click.Path())
@click.option("--out", "out", default=None, type=click.Path(), help="image file (default RUN_DIR/metrics.png)")
def plot(run_dir, out):
    """Plot loss, solve rate, curriculum depth and steps/min from metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise UserError(f"{path} does not exist (train a run first)")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install 'cubedqn[plot]'") from None
    try:
        recs, torn = read_metrics(path)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    if torn:
        click.echo(f"{path}: left out its last line, cut short (a run killed while logging)", err=True)
    if not recs:
        raise UserError(f"{path} has no records yet")
    steps = [r["step"] for r in recs]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, key, label in zip(axes.flat, ("loss", "solve_rate", "depth", "steps_per_min"),
                              ("loss", "greedy solve rate (curriculum batch)", "curriculum depth",
                               "gradient steps / min")):
        ys = [r.get(key) if r.get(key) is not None else float("nan") for r in recs]
        ax.plot(steps, ys)
        ax.set_title(label)
        ax.set_xlabel("gradient step")
        if key == "loss":
            ax.set_yscale("log")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "metrics.png"
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror or e}") from None
    except ValueError as e:  # an image format matplotlib does not know, named by the suffix
        raise UserError(f"cannot write {out}: {e}") from None
    click.echo(f"wrote {out}")


@main.command("profiles")
def profiles_cmd():
    """List the training presets with one-line descriptions."""
    print_profiles()


if __name__ == "__main__":  # pragma: no cover
    main()
