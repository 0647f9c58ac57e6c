"""One config object for a training run, TOML presets (profiles/), and validation.

Hyperparameter names follow Stable-Baselines3 / CleanRL where one exists
(learning_rate, buffer_size, learning_starts, batch_size, tau, gamma, train_freq,
gradient_steps, target_update_interval, exploration_initial_eps, exploration_final_eps,
exploration_fraction, max_grad_norm).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .cube import METRICS, PUZZLES
from .learner import TARGETS
from .nn import LOSSES
from .optim import CLIPS, OPTIMIZERS, SCHEDULES


class ConfigError(ValueError):
    """An invalid configuration value. The message is one line."""


@dataclass
class Config:
    # puzzle and network
    puzzle: str = "cube2"
    metric: str = "qtm"
    hidden: tuple = (256, 256)
    dueling: bool = False
    sparse_input: bool = True
    canonical_input: bool = True          # 2x2x2: turn each cube to a fixed orientation first
    input_symmetry: int = 1               # 2x2x2: 1, 6 or 48 symmetric images of a position share one input
    input_encoding: str = "stickers"      # stickers | cubies (2x2x2: slot -> cubie + twist) | pairs
    precision: str = "float32"
    matmul_precision: str = "float32"     # bfloat16: the CPU GEMMs on bf16-rounded operands (AVX512_BF16)
    # environments and exploration
    n_envs: int = 64
    max_episode_moves: int = 30
    gamma: float = 0.99
    exploration_initial_eps: float = 1.0
    exploration_final_eps: float = 0.05
    exploration_fraction: float = 0.1
    # curriculum over scramble depth
    curriculum: str = "adaptive"          # adaptive | fixed
    depth_min: int = 1
    depth_max: int = 14
    curriculum_start: int = 1
    curriculum_threshold: float = 0.9
    curriculum_eval_n: int = 256
    eval_interval: int = 1000             # gradient steps between curriculum evaluations
    # replay
    buffer_size: int = 100_000
    prioritized_replay: bool = False
    prioritized_replay_alpha: float = 0.6
    prioritized_replay_beta0: float = 0.4
    prioritized_replay_eps: float = 1e-3
    # learning
    targets: str = "double"
    n_step: int = 1
    batch_size: int = 64
    learning_starts: int = 1000           # transitions in the buffer before learning
    train_freq: int = 1                   # vector-env steps between training rounds
    gradient_steps: int = 1               # gradient steps per training round
    target_update_interval: int = 1000    # gradient steps between hard target copies
    tau: float = 1.0                      # < 1: Polyak averaging every step instead
    optimizer: str = "adam"
    learning_rate: float = 1e-3
    lr_schedule: str = "constant"
    lr_final: float = 1e-4
    momentum: float = 0.9
    weight_decay: float = 0.0
    max_grad_norm: float = 10.0
    clip: str = "global"
    loss: str = "huber"
    grad_accum: int = 1
    lomo: bool = False
    sparse_update: bool = False           # lazy first-layer update: only rows of inputs in the batch
    target_cache: bool = True             # all-actions: reuse max Q_target of children seen since the last target copy
    child_cache: bool = True              # all-actions on cube2 code inputs: children's codes by parent position
    # run control
    steps: int = 10_000                   # gradient steps
    minutes: float = 0.0                  # wall-clock limit (0: none); whichever comes first
    seed: int = 0
    threads: int = 1
    tune_blas_threads: bool = True        # threads > 1: keep the GEMMs on that many if 5% faster than 1, else 1
    device: str = "cpu"
    log_interval: int = 1000
    checkpoint_interval: int = 0          # gradient steps between checkpoints (0: at the end)
    save_replay: bool = True
    description: str = field(default="", compare=False)

    def to_dict(self):
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        return d

    @classmethod
    def from_dict(cls, d: dict, source="config") -> "Config":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"{source}: unknown setting '{unknown[0]}'")
        cfg = cls()
        for k, v in d.items():
            setattr(cfg, k, coerce(k, v, source))
        return cfg

    def replace(self, **kw) -> "Config":
        out = dataclasses.replace(self)
        for k, v in kw.items():
            if v is not None:
                setattr(out, k, coerce(k, v, "option"))
        return out


def parse_hidden(v) -> tuple:
    if isinstance(v, (list, tuple)):
        parts = list(v)
    else:
        parts = [p for p in str(v).replace(" ", "").split(",") if p != ""]
    try:
        out = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise ConfigError(f"bad hidden spec '{v}': expected comma-separated positive widths like 256,256") from None
    if not out or any(w <= 0 for w in out):
        raise ConfigError(f"bad hidden spec '{v}': expected comma-separated positive widths like 256,256")
    return out


def coerce(name, value, source="config"):
    f = {f.name: f for f in fields(Config)}[name]
    default = f.default if f.default is not dataclasses.MISSING else None
    if name == "hidden":
        return parse_hidden(value)
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            return bool(value)
        if isinstance(default, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if isinstance(default, float):
            return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {name} must be a {type(default).__name__}, got '{value}'") from None
    return value


def _check(cond, msg):
    if not cond:
        raise ConfigError(msg)


def matmul_precision_device_problem(matmul_precision: str, device: str):
    """Why `matmul_precision` cannot run on `device`, or None. validate asks with the config's
    device; the CLI asks again with the device that --device auto resolved to."""
    if matmul_precision == "bfloat16" and device == "cuda":
        return "matmul_precision = bfloat16 is for the CPU (the CUDA path runs float32)"
    return None


def validate(c: Config) -> Config:
    _check(c.puzzle in PUZZLES, f"unknown puzzle '{c.puzzle}' (expected cube2 or cube3)")
    _check(c.metric in METRICS, f"unknown metric '{c.metric}' (expected qtm or htm)")
    _check(c.input_encoding in ("stickers", "cubies", "pairs"),
           f"unknown input_encoding '{c.input_encoding}' (expected stickers, cubies or pairs)")
    _check(c.input_encoding == "stickers" or (c.puzzle == "cube2" and c.sparse_input),
           f"input_encoding = {c.input_encoding} needs puzzle cube2 and sparse_input")
    _check(c.input_symmetry in (1, 6, 48), f"input_symmetry must be 1, 6 or 48, got {c.input_symmetry}")
    _check(c.input_symmetry == 1 or (c.puzzle == "cube2" and c.canonical_input),
           "input_symmetry 6 or 48 needs puzzle cube2 and canonical_input = true")
    _check(c.input_encoding != "pairs" or c.canonical_input,
           "input_encoding = pairs needs canonical_input = true")
    _check(c.precision in ("float32", "float64"), f"precision must be float32 or float64, got '{c.precision}'")
    if c.matmul_precision == "bfloat16":
        _check(c.precision == "float32", "matmul_precision = bfloat16 needs precision = float32")
        problem = matmul_precision_device_problem(c.matmul_precision, c.device)
        _check(problem is None, problem)
    if c.matmul_precision != "float32":  # a name to check, a CPU to ask: blas's rule and words
        from . import blas
        problem = blas.matmul_precision_problem(c.matmul_precision)
        _check(problem is None, problem)
    for name in ("n_envs", "max_episode_moves", "buffer_size", "batch_size", "train_freq",
                 "gradient_steps", "target_update_interval", "n_step", "grad_accum", "threads",
                 "log_interval", "curriculum_eval_n", "eval_interval", "depth_min", "depth_max",
                 "curriculum_start"):
        _check(getattr(c, name) > 0, f"{name} must be positive, got {getattr(c, name)}")
    _check(c.steps >= 0, f"steps must be >= 0, got {c.steps}")
    _check(c.minutes >= 0, f"minutes must be >= 0, got {c.minutes}")
    _check(c.learning_starts >= 0, f"learning_starts must be >= 0, got {c.learning_starts}")
    for name in ("exploration_initial_eps", "exploration_final_eps", "exploration_fraction",
                 "curriculum_threshold", "prioritized_replay_alpha", "prioritized_replay_beta0"):
        v = getattr(c, name)
        _check(0.0 <= v <= 1.0, f"{name} must be in [0, 1], got {v}")
    _check(0.0 < c.gamma <= 1.0, f"gamma must be in (0, 1], got {c.gamma}")
    _check(0.0 < c.tau <= 1.0, f"tau must be in (0, 1], got {c.tau}")
    _check(c.learning_rate > 0, f"learning_rate must be positive, got {c.learning_rate}")
    _check(c.lr_final >= 0, f"lr_final must be >= 0, got {c.lr_final}")
    _check(c.max_grad_norm >= 0, f"max_grad_norm must be >= 0, got {c.max_grad_norm}")
    _check(c.optimizer in OPTIMIZERS, f"unknown optimizer '{c.optimizer}' (expected one of: {', '.join(OPTIMIZERS)})")
    _check(c.lr_schedule in SCHEDULES, f"unknown lr_schedule '{c.lr_schedule}' (expected one of: {', '.join(SCHEDULES)})")
    _check(c.clip in CLIPS, f"unknown clip '{c.clip}' (expected one of: {', '.join(CLIPS)})")
    _check(c.loss in LOSSES, f"unknown loss '{c.loss}' (expected huber or mse)")
    _check(c.targets in TARGETS, f"unknown targets '{c.targets}' (expected one of: {', '.join(TARGETS)})")
    _check(c.curriculum in ("adaptive", "fixed"), f"unknown curriculum '{c.curriculum}' (expected adaptive or fixed)")
    _check(c.device in ("cpu", "cuda", "auto"), f"unknown device '{c.device}' (expected cpu, cuda or auto)")
    _check(c.depth_min <= c.depth_max, f"depth_min ({c.depth_min}) must be <= depth_max ({c.depth_max})")
    _check(c.batch_size % c.grad_accum == 0,
           f"batch_size {c.batch_size} must be divisible by grad_accum {c.grad_accum}")
    _check(not (c.lomo and c.grad_accum > 1), "lomo cannot be combined with grad_accum > 1")
    _check(not c.sparse_update or (c.sparse_input and not c.lomo and c.grad_accum == 1 and c.clip != "layer"),
           "sparse_update needs sparse_input, clip = global or none, and no lomo or grad_accum > 1")
    _check(not (c.lomo and c.clip == "global"),
           "lomo needs clip = layer or none (the global norm is unknown while layers are updated)")
    _check(c.n_step <= 32, f"n_step must be <= 32, got {c.n_step}")
    _check(c.buffer_size >= c.batch_size, f"buffer_size ({c.buffer_size}) must be >= batch_size ({c.batch_size})")
    _check(c.n_envs * c.n_step <= c.buffer_size, "buffer_size must hold at least n_envs * n_step transitions")
    return c


# ---------------------------------------------------------------------------------------
# Presets

def profiles_dir() -> Path:
    """The shipped presets: the repository's profiles/ (mapped to cubedqn.profiles when installed)."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "profiles", here / "profiles"):
        if cand.is_dir():
            return cand
    try:
        from importlib.resources import files
        return Path(str(files("cubedqn.profiles")))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover
        return here.parent / "profiles"


def list_profiles() -> list[tuple[str, str]]:
    out = []
    for p in sorted(profiles_dir().glob("*.toml")):
        with open(p, "rb") as f:
            data = tomllib.load(f)
        out.append((p.stem, data.get("description", "")))
    return out


def load_profile(name_or_path: str) -> Config:
    p = Path(name_or_path)
    if not (p.suffix == ".toml" or "/" in name_or_path):
        p = profiles_dir() / f"{name_or_path}.toml"
        if not p.exists():
            names = ", ".join(n for n, _ in list_profiles())
            raise ConfigError(f"unknown profile '{name_or_path}' (available: {names})")
    if not p.exists():
        raise ConfigError(f"profile file {p} does not exist")
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"profile {p} is not valid TOML: {e}") from None
    return Config.from_dict(data, source=f"profile {p.name}")
