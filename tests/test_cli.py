"""CLI contracts: JSON keys, one-line errors with exit status 2, train -> eval -> solve."""
import json

import pytest
from click.testing import CliRunner

from cubedqn.cli import main
from cubedqn.cube import get_puzzle, parse_moves, apply_moves, to_facelets

TINY = ["--hidden", "16", "--n-envs", "8", "--batch-size", "8", "--learning-starts", "16",
        "--buffer-size", "500", "--log-interval", "5", "--eval-interval", "5", "--curriculum-eval-n", "8"]


def run(args, code=0):
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == code, r.output
    return r


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "tiny"
    r = run(["train", "--profile", "cube2-quick", "--steps", "10", "--minutes", "0", "--out", str(out)] + TINY)
    assert "evaluate with: cubedqn eval --checkpoint" in r.output
    return out


def test_version_and_help():
    assert "cubedqn, version" in run(["--version"]).output
    out = run(["--help"]).output
    for cmd in ("train", "profile", "eval", "solve", "scramble", "oracle", "plot", "profiles"):
        assert cmd in out


def test_scramble_json_contract():
    r = run(["scramble", "--puzzle", "cube3", "--moves", "R U R' U'", "--json"])
    d = json.loads(r.output)
    assert set(d) == {"puzzle", "moves", "facelets", "solved"}
    p = get_puzzle("cube3")
    assert d["facelets"] == to_facelets(apply_moves(p, p.solved, parse_moves("R U R' U'")))
    assert d["solved"] is False
    d1 = json.loads(run(["scramble", "--puzzle", "cube2", "--depth", "7", "--seed", "3", "--json"]).output)
    d2 = json.loads(run(["scramble", "--puzzle", "cube2", "--depth", "7", "--seed", "3", "--json"]).output)
    assert d1 == d2 and len(d1["moves"].split()) == 7
    assert json.loads(run(["scramble", "--puzzle", "cube2", "--moves", "R2", "--metric", "qtm", "--json"]).output)["moves"] == "R2"


def test_oracle_json_contract(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBEDQN_CACHE_DIR", str(tmp_path))
    d = json.loads(run(["oracle", "--puzzle", "cube2", "--metric", "htm", "--json"]).output)
    assert d == {"puzzle": "cube2", "metric": "htm", "states": 3674160,
                 "counts": [1, 9, 54, 321, 1847, 9992, 50136, 227536, 870072, 1887748, 623800, 2644]}


def one_line_error(args, needle):
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 2, r.output
    lines = [l for l in r.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("cubedqn: error:"), r.output
    assert needle in lines[0], lines[0]
    assert "Traceback" not in r.output


@pytest.mark.parametrize("args, needle", [
    (["scramble", "--moves", "R Q"], "unknown move 'Q' at position 2"),
    (["scramble", "--puzzle", "cube4", "--depth", "2"], "unknown puzzle 'cube4'"),
    (["scramble", "--depth", "-1"], "--depth must be >= 0"),
    (["scramble"], "give exactly one of --depth or --moves"),
    (["scramble", "--depth", "x"], "'x' is not a valid integer"),
    (["oracle", "--puzzle", "cube3"], "no exact oracle for cube3"),
    (["train", "--profile", "nope"], "unknown profile 'nope'"),
    (["train", "--batch-size", "0"], "batch_size must be positive"),
    (["train", "--buffer-size", "-5"], "buffer_size must be positive"),
    (["train", "--exploration-final-eps", "1.5"], "exploration_final_eps must be in [0, 1]"),
    (["train", "--optimizer", "rmsprop"], "unknown optimizer 'rmsprop'"),
    (["train", "--hidden", "256,abc"], "bad hidden spec '256,abc'"),
    (["train", "--hidden", "0"], "bad hidden spec"),
    (["train", "--targets", "maybe"], "unknown targets 'maybe'"),
    (["train", "--learning-rate", "fast"], "learning_rate must be a float"),
    (["train", "--puzzle", "cube9"], "unknown puzzle 'cube9'"),
    (["train", "--resume", "/nonexistent/run"], "does not exist"),
    (["eval", "--checkpoint", "/nonexistent/run"], "does not exist"),
    (["solve", "--checkpoint", "/nonexistent/run", "--scramble", "R"], "does not exist"),
    (["profile", "--steps", "0"], "--steps must be positive"),
    (["profile", "--epsilon", "1.5"], "--epsilon must be in [0, 1], got 1.5"),
    (["train", "--input-symmetry", "5"], "input_symmetry must be 1, 6 or 48"),
    (["train", "--input-encoding", "pairs", "--no-canonical-input"], "pairs needs canonical_input"),
    (["train", "--input-encoding", "pairs", "--puzzle", "cube3"], "pairs needs puzzle cube2"),
    (["train", "--sparse-update", "--lomo", "--clip", "none"], "sparse_update needs"),
    (["plot", "/nonexistent/run"], "metrics.jsonl does not exist"),
    (["frobnicate"], "No such command 'frobnicate'"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    one_line_error(args, needle)


def test_device_cuda_without_gpu_fails_at_once(monkeypatch):
    import cubedqn.cuda as cu
    monkeypatch.setattr(cu, "gpu_status", lambda: (False, "no usable NVIDIA GPU or CUDA driver was found"))
    one_line_error(["train", "--device", "cuda", "--steps", "1"], "--device cuda: no usable NVIDIA GPU")


def test_device_cuda_with_a_numba_cuda_that_cannot_compile_is_a_reason(monkeypatch):
    """A driver that answers but a numba-cuda that cannot build a kernel (the numpy 2.5 /
    numba-cuda 0.30 clash seen on an H100 machine): one line naming it, exit 2."""
    pytest.importorskip("numba.cuda")
    from numba import cuda
    import cubedqn.cuda as cu

    def broken(_cuda):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cu, "_trial_kernel", broken)
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    cu.gpu_status.cache_clear()
    try:
        ok, why = cu.gpu_status()
        assert not ok and "could not run a trial kernel" in why and "row_stack" in why
        one_line_error(["profile", "--device", "cuda", "--steps", "1"], "could not run a trial kernel")
    finally:
        cu.gpu_status.cache_clear()


def test_a_timed_run_compiles_before_its_budget_starts(tmp_path, monkeypatch):
    """With a time budget, train first warms the kernels up (a twin trainer), then trains;
    a run bounded by steps alone does not, unless a second process compiles ahead (a cold
    cache; a stand-in here), when it warms up with it."""
    from cubedqn import precompile
    monkeypatch.setenv("CUBEDQN_COMPILE_AHEAD", "0")  # whatever this session's cache holds
    common = ["--puzzle", "cube2", "--hidden", "16", "--batch-size", "16", "--learning-starts", "32",
              "--n-envs", "8"]
    out = run(["train", *common, "--steps", "3", "--minutes", "5", "--out", str(tmp_path / "timed")]).output
    assert "compiling the training kernels (Numba keeps them for later runs)..." in out and "kernels ready in" in out
    assert "trained 3 gradient steps" in out
    out = run(["train", *common, "--steps", "3", "--minutes", "0", "--out", str(tmp_path / "steps")]).output
    assert "kernels ready" not in out and "trained 3 gradient steps" in out

    from ahead_stand_in import AheadStandIn
    stand_in = AheadStandIn()
    monkeypatch.setattr(precompile, "start", lambda cfg: stand_in)
    out = run(["train", *common, "--steps", "3", "--minutes", "0", "--out", str(tmp_path / "ahead")]).output
    assert "a second process compiles the learner's" in out and "kernels ready in" in out
    assert "trained 3 gradient steps" in out and stand_in.waited and stand_in.stopped
    stand_in = AheadStandIn(failure="it exited with status 1: boom")
    r = CliRunner().invoke(main, ["train", *common, "--steps", "3", "--minutes", "0", "--out", str(tmp_path / "f")])
    assert r.exit_code == 0 and "the second compiling process did not finish (it exited with status 1: boom)" in r.output

    # still compiling the one-call step when the warm-up is done: training begins with the
    # per-part step, and the command waits for that process at the end (for the next run)
    stand_in = AheadStandIn(running_polls=10 ** 6)
    out = run(["train", *common, "--steps", "3", "--minutes", "0", "--out", str(tmp_path / "late")]).output
    assert "still compiling the one-call step" in out and "trained 3 gradient steps" in out
    assert "waiting for the second process to finish" in out and stand_in.waited and stand_in.stopped
    stand_in = AheadStandIn(failure="it exited with status 1: late", running_polls=10 ** 6)
    r = CliRunner().invoke(main, ["train", *common, "--steps", "3", "--minutes", "0", "--out", str(tmp_path / "lf")])
    assert r.exit_code == 0 and "trained 3 gradient steps" in r.output
    assert "did not finish (it exited with status 1: late); trained with the per-part step" in r.output


def test_ctrl_c_while_compiling_trains_nothing(tmp_path, monkeypatch):
    from cubedqn.dqn import Trainer

    def interrupted(self, ahead=None, wait=True):
        self.interrupted = True
        return 1.0
    monkeypatch.setattr(Trainer, "warm_up", interrupted)
    r = CliRunner().invoke(main, ["train", "--puzzle", "cube2", "--hidden", "16", "--steps", "3", "--minutes", "5",
                                  "--out", str(tmp_path / "r")])
    assert r.exit_code == 130 and "interrupted while compiling the kernels; nothing was trained" in r.output
    assert "trained" not in r.output.replace("nothing was trained", "")


def test_train_eval_solve_round_trip(trained):
    for f in ("config.json", "model.npz", "state.json", "metrics.jsonl", "replay.npz"):
        assert (trained / f).exists(), f
    rec = json.loads((trained / "metrics.jsonl").read_text().splitlines()[0])
    for k in ("step", "env_steps", "steps_per_min", "env_steps_per_s", "loss", "mean_q", "epsilon", "depth",
              "solve_rate", "phases_ms"):
        assert k in rec
    assert 0 <= rec["target_cache_hit_rate"] <= 1  # cube2-quick: all-actions targets, cached
    assert 0 <= rec["child_cache_hit_rate"] <= 1  # and slot-pair inputs: children's codes by position
    d = json.loads(run(["eval", "--checkpoint", str(trained), "--depths", "1-2", "--n", "5", "--json"]).output)
    assert {"rows", "solved_frac", "mean_length"} <= set(d) and len(d["rows"]) == 2
    d = json.loads(run(["eval", "--checkpoint", str(trained), "--random-states", "5", "--search", "beam",
                        "--beam-width", "4", "--max-moves", "3", "--json"]).output)
    assert {"rows", "solved_frac", "mean_length", "optimal_frac", "mean_optimal_length"} <= set(d)
    assert d["views"] == 1 and d["threads"] == 1 and d["wall_seconds"] > 0
    d2 = json.loads(run(["eval", "--checkpoint", str(trained), "--random-states", "5", "--search", "beam",
                         "--beam-width", "4", "--max-moves", "3", "--threads", "2", "--json"]).output)
    assert d2["threads"] == 2 and [r["solved_frac"] for r in d2["rows"]] == [r["solved_frac"] for r in d["rows"]]
    one_line_error(["eval", "--checkpoint", str(trained), "--threads", "0"], "--threads must be positive")
    d6 = json.loads(run(["eval", "--checkpoint", str(trained), "--depths", "1-2", "--n", "5", "--views", "6",
                         "--json"]).output)
    assert d6["views"] == 6 and len(d6["rows"]) == 2
    one_line_error(["eval", "--checkpoint", str(trained), "--views", "0"], "--views must be between 1 and 48")
    one_line_error(["solve", "--checkpoint", str(trained), "--scramble", "R", "--views", "49"], "--views must be")
    d = json.loads(run(["solve", "--checkpoint", str(trained), "--scramble", "R U", "--search", "beam",
                        "--beam-width", "512", "--json"]).output)
    assert set(d) == {"solution", "length", "solved", "seconds"}
    from cubedqn.threads import gemm_threads
    d2 = json.loads(run(["solve", "--checkpoint", str(trained), "--scramble", "R U", "--search", "beam",
                         "--beam-width", "512", "--threads", "2", "--json"]).output)
    assert (d2["solution"], d2["solved"]) == (d["solution"], d["solved"])
    assert gemm_threads() == 1  # put back after the command
    one_line_error(["solve", "--checkpoint", str(trained), "--scramble", "R", "--threads", "0"],
                   "--threads must be positive")
    if d["solved"]:
        p = get_puzzle("cube2")
        s = apply_moves(p, apply_moves(p, p.solved, parse_moves("R U")), parse_moves(d["solution"]))
        assert len(set(s[:4])) == 1
    one_line_error(["solve", "--checkpoint", str(trained), "--facelets", "UUUU"], "must have 24 letters")
    p2 = get_puzzle("cube2")
    t = list(to_facelets(p2.solved))
    a, b, c = p2.corner_facelets[0]
    t[a], t[b], t[c] = t[c], t[a], t[b]  # twist one corner in place
    one_line_error(["solve", "--checkpoint", str(trained), "--facelets", "".join(t)], "corner twist")
    d = json.loads(run(["eval", "--checkpoint", str(trained), "--random-states", "5", "--search", "astar",
                        "--beam-width", "8", "--astar-weight", "0.8", "--max-moves", "14", "--json"]).output)
    assert d["search"] == "astar" and d["astar_weight"] == 0.8 and d["astar_batch"] == 8
    assert d["beam_width"] is None and d["n"] == 5
    one_line_error(["eval", "--checkpoint", str(trained), "--search", "astra"], "unknown search 'astra'")
    one_line_error(["solve", "--checkpoint", str(trained), "--scramble", "R", "--search", "astar",
                    "--astar-weight", "2"], "--astar-weight must be between 0 and 1")
    one_line_error(["eval", "--checkpoint", str(trained), "--depths", "a-b"], "bad --depths")
    one_line_error(["train", "--out", str(trained), "--steps", "1"], "already holds a run")


def test_resume_continues(trained, tmp_path):
    import shutil
    run_dir = tmp_path / "copy"
    shutil.copytree(trained, run_dir)
    r = run(["train", "--resume", str(run_dir), "--steps", "15"])
    assert "resuming" in r.output
    one_line_error(["train", "--resume", str(run_dir), "--learning-rate", "0.1"], "--learning-rate cannot change")
    assert json.loads((run_dir / "state.json").read_text())["grad_steps"] == 15
    from cubedqn.threads import limit_threads
    try:
        run(["train", "--resume", str(run_dir), "--steps", "17", "--threads", "2", "--no-tune-blas-threads"])
    finally:
        limit_threads(1)  # train sets the process's thread counts for good; the tests run with one
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["threads"] == 2 and saved["tune_blas_threads"] is False
    assert json.loads((run_dir / "state.json").read_text())["grad_steps"] == 17


def test_resume_drops_the_metrics_logged_after_its_checkpoint(trained, tmp_path):
    """A run that logged past its last checkpoint and stopped (killed, say) resumes from the
    checkpoint: its records of the steps that run again are dropped, and so is a last line
    cut short, so the steps in metrics.jsonl keep increasing."""
    import shutil
    run_dir = tmp_path / "copy"
    shutil.copytree(trained, run_dir)
    metrics = run_dir / "metrics.jsonl"
    before = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert before[-1]["step"] == 10
    ghost = dict(before[-1], step=15)
    metrics.write_text(metrics.read_text() + json.dumps(ghost) + "\n" + '{"step": 20, "loss": 0.')
    r = run(["train", "--resume", str(run_dir), "--steps", "20"])
    assert "dropped 2 record(s) logged after the checkpoint" in r.output
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == [rec["step"] for rec in before] + [15, 20] and steps == sorted(steps)
    assert json.loads(metrics.read_text().splitlines()[len(before)]) != ghost  # logged again, not kept
    r = run(["train", "--resume", str(run_dir), "--steps", "21"])  # nothing past the checkpoint now
    assert "dropped" not in r.output
    metrics.write_text(metrics.read_text().replace('"step": 15', '"step": "x"', 1))  # corrupt in the middle
    r = CliRunner().invoke(main, ["train", "--resume", str(run_dir), "--steps", "22"], catch_exceptions=False)
    assert r.exit_code == 2 and r.output.splitlines()[-1].startswith("cubedqn: error: ")
    assert r.output.splitlines()[-1].endswith("metrics.jsonl is corrupt (line 3 is not a metrics record)")


def test_a_new_run_keeps_the_metrics_of_an_unfinished_one_aside(tmp_path):
    """A run killed before its first checkpoint leaves config.json and metrics.jsonl but no
    state.json; a new run with the same --out starts its own record and keeps the old one
    with its config."""
    out = tmp_path / "r"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1000, "loss": 1.0}\n{"step": 2000, "lo')
    (out / "config.json").write_text('{"the": "old config"}')
    args = ["train", "--profile", "cube2-quick", "--steps", "5", "--minutes", "0", "--out", str(out)] + TINY
    r = run(args)
    assert "kept as metrics.unfinished.jsonl and config.unfinished.json" in r.output
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [5]
    assert (out / "metrics.unfinished.jsonl").read_text().startswith('{"step": 1000')
    assert (out / "config.unfinished.json").read_text() == '{"the": "old config"}'
    assert json.loads((out / "config.json").read_text())["steps"] == 5
    (out / "state.json").unlink()
    assert "kept as metrics.unfinished.1.jsonl and config.unfinished.1.json" in run(args).output
    (out / "state.json").unlink()
    (out / "metrics.jsonl").unlink()  # killed before its first log line: nothing to keep
    assert "kept as" not in run(args).output


def test_metrics_with_a_torn_last_line_are_read_without_it(tmp_path):
    from cubedqn.checkpoint import CheckpointError, read_metrics
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1000, "loss": 1.0}\n\n{"step": 2000, "loss": 0.5}\n{"step": 3000, "lo')
    assert read_metrics(path) == ([{"step": 1000, "loss": 1.0}, {"step": 2000, "loss": 0.5}], 1)
    path.write_text('{"step": 1000, "loss": 1.0}\n')
    assert read_metrics(path) == ([{"step": 1000, "loss": 1.0}], 0)
    for bad in ('{"step": 1000, "lo\n{"step": 2000}\n', '[1, 2]\n{"step": 2000}\n', '{"loss": 1}\n{"step": 2}\n'):
        path.write_text(bad)
        with pytest.raises(CheckpointError, match=r"metrics.jsonl is corrupt \(line 1 is not a metrics record\)$"):
            read_metrics(path)
    pytest.importorskip("matplotlib")
    path.write_text('{"step": 1000, "loss": 1.0}\n{"step": 2000, "loss": 0.5}\n{"step": 3000, "lo')
    r = CliRunner().invoke(main, ["plot", str(tmp_path), "--out", str(tmp_path / "m.png")])
    assert r.exit_code == 0 and "left out its last line, cut short" in r.output, r.output
    assert (tmp_path / "m.png").stat().st_size > 0


def test_checkpoint_for_wrong_puzzle_is_rejected(trained, tmp_path):
    import shutil
    run_dir = tmp_path / "bad"
    shutil.copytree(trained, run_dir)
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg.update(puzzle="cube3", input_encoding="stickers", input_symmetry=1)  # a valid cube3 config, 2x2x2 weights
    (run_dir / "config.json").write_text(json.dumps(cfg))
    one_line_error(["eval", "--checkpoint", str(run_dir)], "does not match")
    (run_dir / "config.json").write_text("{not json")
    one_line_error(["eval", "--checkpoint", str(run_dir)], "corrupt")


def test_plot_and_profiles(trained, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "m.png"
    run(["plot", str(trained), "--out", str(out)])
    assert out.stat().st_size > 1000
    r = run(["profiles"])
    for name in ("cube2-quick", "cube2", "cube2-fast", "cube2-quality", "cube3"):
        assert name in r.output
    assert "cube2-quick" in run(["train", "--profile", "list"]).output
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    one_line_error(["plot", str(trained), "--out", str(blocker / "m.png")], f"cannot write {blocker / 'm.png'}")
    one_line_error(["plot", str(trained), "--out", str(tmp_path / "m.xyz")], "Format 'xyz' is not supported")


def test_unwritable_run_directory_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"  # a file where the run directory's parent should be (root may write anywhere)
    blocker.write_text("")
    one_line_error(["train", "--puzzle", "cube2", "--hidden", "16", "--steps", "1", "--out", str(blocker / "run")],
                   f"cannot write the run directory {blocker / 'run'}")


def test_a_run_shorter_than_its_log_interval_still_leaves_its_record(tmp_path):
    out = tmp_path / "short"
    r = run(["train", "--profile", "cube2-quick", "--steps", "7", "--minutes", "0", "--out", str(out)] + TINY
            + ["--log-interval", "1000"])  # the later value wins
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in recs] == [7] and "step        7/7" in r.output


def test_solving_a_solved_cube_says_so(trained):
    p = get_puzzle("cube2")
    r = run(["solve", "--checkpoint", str(trained), "--facelets", to_facelets(p.solved)])
    assert "solution (0 moves, verified" in r.output and "already solved" in r.output


def test_profile_json_contract():
    r = run(["profile", "--profile", "cube2-quick", "--hidden", "16", "--batch-size", "16", "--steps", "5",
             "--warmup", "2", "--json"])
    d = json.loads(r.output)
    for k in ("train_step_ms", "steps_per_min", "env_steps_per_s", "phases", "gflops", "peak_gflops", "blas"):
        assert k in d
    assert set(d["phases"]) == {"env", "act", "replay add", "sample", "forward", "backward", "optimizer",
                                "target update", "eval", "other"}
    assert d["train_step_ms"] > 0
    for phase in ("forward", "backward"):  # the parts split each phase exactly
        assert sum(d["phase_parts"][phase].values()) == pytest.approx(d["phases"][phase], rel=1e-6)
    assert 0 < d["gemm_layers_ms"] < d["phases"]["forward"] + d["phases"]["backward"]
    assert d["gemm_layers_gflops"] == pytest.approx(d["gemm_layers_flops"] / d["gemm_layers_ms"] / 1e6)
    text = run(["profile", "--profile", "cube2-quick", "--hidden", "16", "--batch-size", "16", "--steps", "5",
                "--warmup", "2"]).output
    assert "GEMM layers alone" in text and "  encode" in text
    # cube2-quick: slot pairs, all-actions: the children's codes come from the parent table
    assert 0 <= d["child_cache_hit_rate"] <= 1 and d["memory_bytes"]["child_cache"] > 0
    assert "child cache: " in text and "MB table" in text
    assert d["fma_ceiling_gflops"] > 0 and "GFLOP/s FMA ceiling" in text  # one core's, profiling.fma_loop
    assert d["first_layer"] == "rows" and "first layer: rows" in text  # 16 wide: no panels
    cpu = d["cpu"]  # which machine the numbers came from
    assert cpu["logical_cpus"] >= 1 and cpu["llvm_cpu"] and cpu["model"]
    assert isinstance(cpu["avx2"], bool) and isinstance(cpu["avx512"], bool)
    assert f"CPU: {cpu['model']} (LLVM: {cpu['llvm_cpu']})" in text


@pytest.mark.parametrize("eps", [0.0, 0.4, 1.0])
def test_profile_epsilon_sets_the_share_of_states_acting_scores(eps):
    r = run(["profile", "--profile", "cube2-quick", "--hidden", "16", "--batch-size", "16", "--steps", "20",
             "--warmup", "2", "--epsilon", str(eps), "--json"])
    d = json.loads(r.output)
    assert d["epsilon_start"] == d["epsilon_end"] == eps
    if eps in (0.0, 1.0):  # all scored, none scored
        assert d["act_scored_fraction"] == 1.0 - eps
    else:  # 20 iterations of the preset's 64 cubes: 1,280 draws
        assert abs(d["act_scored_fraction"] - (1.0 - eps)) < 0.06
    text = run(["profile", "--profile", "cube2-quick", "--hidden", "16", "--batch-size", "16", "--steps", "5",
                "--warmup", "2", "--epsilon", str(eps)]).output
    assert f"acting: epsilon {eps:.2f} -> {eps:.2f} over the timed steps; the network scored " in text
    if eps in (0.0, 1.0):
        assert f"scored {100 * (1 - eps):.0f}% of the env states" in text


def test_describe_cpu():
    from cubedqn.profiling import describe_cpu
    c = {"model": "X", "llvm_cpu": "znver3", "logical_cpus": 2, "l2_cache": "512K", "avx2": True, "avx512": False}
    assert describe_cpu(c) == "X (LLVM: znver3), 2 logical CPUs, L2 512K, AVX2, no AVX-512"
    c.update(l2_cache=None, avx512=True, llvm_cpu="cascadelake")
    assert describe_cpu(c) == "X (LLVM: cascadelake), 2 logical CPUs, AVX-512"


def test_profile_reports_the_blas_thread_tuning(monkeypatch):
    """--threads 2 probes 2 against 1 BLAS threads and says what it kept; the probe's
    numbers are loop seconds per gradient step at each count. Off, nothing is probed.
    Blocks of 4 steps, not of 0.1 s: on a fast host 1500 tiny steps took less than the
    four 0.1 s blocks, and no probe finished (the test failed there)."""
    import cubedqn.dqn as dqn
    from cubedqn.threads import BlasThreadTuner
    monkeypatch.setattr(dqn, "BlasThreadTuner", lambda threads, **kw: BlasThreadTuner(threads, block_seconds=0.0))
    base = ["profile", "--profile", "cube2-quick", "--hidden", "16", "--batch-size", "16", "--warmup", "0",
            "--threads", "2", "--json"]
    d = json.loads(run(base + ["--steps", "1500"]).output)
    assert d["blas_threads"] in (1, 2) and set(d["blas_probe"]) == {"1", "2"}
    assert all(0 < v < 1 for v in d["blas_probe"].values())
    assert d["blas"]["gemm_threads"] == 2  # the peak and BLAS info are read at the count asked for
    # the probe ran before the timed steps: the step that starts it, then 4 blocks of 4
    # steps, or 2 where two threads read 25% slower than one
    assert d["blas_tuning"]["steps"] in (9, 17) and d["blas_tuning"]["seconds"] > 0
    assert d["blas_probes"] >= 0 and d["blas_probe_seconds"] >= 0
    # the probe's steps leave the exploration schedule where it was: the timed steps start
    # at the epsilon of a one-thread run's
    one = json.loads(run(base[:-3] + ["--threads", "1", "--json", "--steps", "1500"]).output)
    assert d["epsilon_start"] == one["epsilon_start"] and d["epsilon_end"] == one["epsilon_end"]
    off = json.loads(run(base + ["--steps", "50", "--no-tune-blas-threads"]).output)
    assert off["blas_threads"] == 2 and off["blas_probe"] is None
    assert off["blas_tuning"] is off["blas_probes"] is off["blas_probe_seconds"] is None


def test_train_reports_the_thread_tuning(monkeypatch, tmp_path):
    """--threads 2 with the tuner: each metrics record and the run's last lines say how many
    probes ran and how much of the loop they took."""
    import cubedqn.dqn as dqn
    from cubedqn.threads import BlasThreadTuner, limit_threads
    monkeypatch.setattr(dqn, "BlasThreadTuner",
                        lambda threads, **kw: BlasThreadTuner(threads, block_seconds=0.0, first_probe_after=0.0))
    out = tmp_path / "r"
    try:
        r = run(["train", "--profile", "cube2-quick", "--hidden", "16", "--batch-size", "16", "--steps", "60",
                 "--log-interval", "30", "--threads", "2", "--out", str(out)])
    finally:
        limit_threads(1)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["step"] == 60 and last["blas_probes"] >= 1 and last["blas_probe_seconds"] > 0
    assert records[0]["blas_probe_seconds"] <= last["blas_probe_seconds"]
    assert set(last["blas_probe"]) == {"1", "2"} and all(v > 0 for v in last["blas_probe"].values())
    assert (f"thread tuning: the GEMMs on {last['blas_threads']} of 2 thread(s) at the end; "
            f"{last['blas_probes']} probe(s), {last['blas_probe_seconds']:.1f} s of the loop") in r.output


def test_profile_reads_the_peak_at_the_blas_thread_count_it_ended_with(monkeypatch):
    """A --threads 2 run whose tuner kept one BLAS thread (here: one that never keeps two)
    also reads the sgemm peak on one thread, and reports it beside the two-thread peak:
    its GEMM layers ran on one thread."""
    import cubedqn.dqn as dqn
    import cubedqn.profiling as profiling
    from cubedqn.threads import BlasThreadTuner, gemm_threads
    monkeypatch.setattr(dqn, "BlasThreadTuner",  # never keeps two; probes only every 30 s
                        lambda threads, **kw: BlasThreadTuner(threads, block_seconds=0.0, margin=1.0,
                                                              slowdown=1e9))
    counts, peak = [], profiling.peak_gflops

    def peak_noting_threads(*a, **k):
        counts.append(gemm_threads())
        return peak(*a, **k)

    monkeypatch.setattr(profiling, "peak_gflops", peak_noting_threads)
    args = ["profile", "--profile", "cube2-quick", "--hidden", "16", "--batch-size", "16", "--warmup", "0",
            "--threads", "2", "--steps", "300"]
    d = json.loads(run(args + ["--json"]).output)
    assert d["blas_threads"] == 1 and d["threads"] == 2
    # the timed steps all ran at the count kept: the probe ran before them (the step that
    # starts it, then 4 blocks of 4 steps)
    assert d["blas_tuning"]["steps"] == 17 and d["blas_probes"] == 0 and d["blas_probe_seconds"] == 0
    assert d["steps"] == 300  # timed after the probe's steps, not counting them
    assert counts == [2, 1, 2]  # before the run, then at the count kept, then at the count asked for
    assert d["peak_gflops_blas_threads"] > 0 and d["blas"]["gemm_threads"] == 2
    text = run(args).output
    assert "peak of the 1 BLAS thread(s) the run ended with" in text
    few = json.loads(run(args[:-1] + ["5", "--json"]).output)  # fewer timed steps than the probe took
    assert few["steps"] == 5 and few["blas_tuning"]["steps"] == 17
    assert "probed before the timed steps (17 gradient steps" in text and "inside them 0 probe(s)" in text
    one = json.loads(run(args[:-4] + ["--threads", "1", "--steps", "50", "--json"]).output)
    assert one["peak_gflops_blas_threads"] == one["peak_gflops"]  # one thread: the same reading


def test_profile_names_the_first_layer_kernel():
    from cubedqn.nn import MLP, Layout
    from cubedqn.profiling import first_layer_kernel
    layout = Layout(324, 54, (64,), 12)
    assert first_layer_kernel(MLP(layout), MLP(layout).workspace(48)) == "panels"
    assert first_layer_kernel(MLP(layout), MLP(layout).workspace(8)) == "rows"
    assert first_layer_kernel(MLP(layout, sparse=False), MLP(layout, sparse=False).workspace(48)) == "dense"


def test_thread_limit_reaches_numbas_blas():
    """The limit must reach scipy's OpenBLAS (used by njit np.dot), which loads lazily."""
    from threadpoolctl import threadpool_info
    from cubedqn.threads import limit_threads
    with limit_threads(1):
        blas = [i for i in threadpool_info() if i["user_api"] == "blas"]
        assert any("scipy" in i["filepath"] for i in blas)
        assert all(i["num_threads"] == 1 for i in blas)


def test_profile_flops_count_what_the_learner_computes():
    from cubedqn.config import Config
    from cubedqn.dqn import Trainer
    from cubedqn.profiling import step_flops
    tr = Trainer(Config(hidden=(16,), batch_size=8, n_envs=8, learning_starts=16, buffer_size=100,
                        targets="all-actions", input_encoding="cubies"))
    fwd, bwd = step_flops(tr)
    lay = tr.layout
    assert tr.learner.n_rep == 6  # canonical 2x2x2: 6 distinct children per state
    assert fwd == lay.flops_forward(8 * 6) + lay.flops_forward(8)
    assert bwd == lay.flops_backward(8)
    # sampled targets: the Q head's backward from the taken actions alone (1/A of its
    # products); with a dueling head, its two GEMMs
    for dueling, head in ((False, False), (True, True)):
        tr = Trainer(Config(hidden=(16,), batch_size=8, n_envs=8, learning_starts=16, buffer_size=100,
                            targets="double", dueling=dueling))
        lay = tr.layout
        assert step_flops(tr)[1] == lay.flops_backward(8, head=head)
        if not dueling:  # 16 -> 12: one product in 12 of the head's
            assert lay.flops_gemm_backward(8, head=False) == lay.flops_gemm_backward(8) - 4 * 8 * 16 * 11
        # the forward: the online rows of s and (double) the target's rows one head value each
        picked = 0 if dueling else 8
        assert step_flops(tr)[0] == lay.flops_forward(16, picked=picked) + lay.flops_forward(8, picked=picked)
        if not dueling:
            assert lay.flops_forward(8, picked=8) == lay.flops_forward(8) - 2 * 8 * 16 * 11
