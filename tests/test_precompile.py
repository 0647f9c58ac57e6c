"""precompile.py: the second process that compiles the learner's kernels on a cold start."""

import os
import subprocess
import sys

import numpy as np
import pytest

from cubedqn import precompile
from cubedqn.config import Config


def tiny(**kw):
    base = dict(hidden=(32,), n_envs=16, batch_size=16, learning_starts=64, buffer_size=2000, steps=4,
                depth_max=3, curriculum_eval_n=16, seed=5)
    base.update(kw)
    return Config(**base)


def test_switched_off_or_warm_starts_nothing(monkeypatch):
    monkeypatch.setenv("CUBEDQN_COMPILE_AHEAD", "0")
    assert not precompile.enabled() and precompile.start(tiny()) is None
    monkeypatch.setenv("CUBEDQN_COMPILE_AHEAD", "1")
    monkeypatch.setattr(precompile, "learner_cached", lambda: True)
    assert precompile.start(tiny()) is None


def test_the_learner_counts_as_cached_once_compiled(tmp_path):
    """learner_cached reads the backward kernel's cache index: not there in a fresh cache
    folder (another process), there once this session has run a learner."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    fresh = subprocess.run([sys.executable, "-c", "from cubedqn import precompile; print(precompile.learner_cached())"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0 and fresh.stdout.strip() == "False", fresh.stderr[-2000:]
    from cubedqn.dqn import Trainer
    Trainer(tiny(steps=1)).run()
    assert precompile.learner_cached()


@pytest.mark.parametrize("kw", [dict(), dict(targets="dqn", dueling=True), dict(
    targets="all-actions", input_encoding="pairs", input_symmetry=48, sparse_update=True),
    dict(lomo=True, optimizer="sgd"), dict(grad_accum=2, prioritized_replay=True, optimizer="momentum"),
    dict(precision="float64", puzzle="cube3", hidden=(16, 16))])
def test_compile_learner_runs_the_configs_learner(kw):
    """What the second process runs, in this one: the config's learner, a greedy search and
    two gradient steps on made-up cubes, whatever the targets, inputs and optimizer."""
    learner = precompile.compile_learner(tiny(**kw))
    assert learner.updates == 2 and np.all(np.isfinite(learner.online.params))


def test_the_second_process_runs_and_reports_failure(monkeypatch):
    monkeypatch.setattr(precompile, "enabled", lambda: True)
    monkeypatch.setattr(precompile, "learner_cached", lambda: False)
    ahead = precompile.start(tiny())
    assert ahead is not None and ahead.poll() is None  # importing numba alone takes it a second
    assert ahead.wait(timeout=300) and ahead.failure is None and ahead.poll() is True
    ahead.stop()

    class Broken(Config):
        def to_dict(self):
            return dict(super().to_dict(), no_such_setting=1)
    ahead = precompile.start(Broken(**vars(tiny())))
    assert not ahead.wait(timeout=300)
    assert ahead.failure.startswith("it exited with status 1") and "no_such_setting" in ahead.failure
    ahead.stop()


@pytest.mark.skipif(not precompile.enabled(), reason="needs two CPUs (and CUBEDQN_COMPILE_AHEAD not 0)")
@pytest.mark.parametrize("config", [["--profile", "cube2-quick"],  # all-actions targets: no one-call step
                                    ["--puzzle", "cube2", "--hidden", "64,64", "--learning-starts", "256"]])
def test_a_cold_start_compiles_ahead_and_leaves_nothing_to_compile(tmp_path, config):
    """A first `train` on a fresh Numba cache starts the second process; the next run loads
    every kernel (NUMBA_DEBUG_CACHE reports no save), starts none, and trains the same bits.
    With double targets the first run may begin on the per-part step while the second
    process compiles the one-call step, and waits for it at its end. Every step is clipped
    (--max-grad-norm 0.1), so the norm's bits reach the parameters: the first run's update
    kernels are compiled in its own process, the second's loaded (sums.py)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), CUBEDQN_COMPILE_AHEAD="1")
    args = [sys.executable, "-m", "cubedqn.cli", "train", *config, "--steps", "3", "--max-grad-norm", "0.1", "--out"]
    cold = subprocess.run(args + [str(tmp_path / "cold")], env=env, capture_output=True, text=True, timeout=900)
    assert cold.returncode == 0, cold.stderr[-2000:]
    assert "a second process compiles the learner's" in cold.stdout and "did not finish" not in cold.stderr
    warm = subprocess.run(args + [str(tmp_path / "warm")], env=dict(env, NUMBA_DEBUG_CACHE="1"),
                          capture_output=True, text=True, timeout=900)
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert "second process" not in warm.stdout
    assert "data saved to" not in warm.stdout + warm.stderr
    a, b = (np.load(tmp_path / run / "model.npz") for run in ("cold", "warm"))
    assert np.array_equal(a["params"], b["params"])


def test_profile_warms_up_with_the_second_process(monkeypatch):
    """`cubedqn profile` on a cold cache: the trainer's warm-up waits for the second process
    (a stand-in here) before the profile's own warm-up steps, and stops it."""
    from ahead_stand_in import AheadStandIn
    from cubedqn.profiling import profile_training
    stand_in = AheadStandIn()
    monkeypatch.setattr(precompile, "start", lambda cfg: stand_in)
    report = profile_training(tiny(), steps=3, warmup=2)
    assert stand_in.waited and stand_in.stopped and report["train_step_ms"] > 0


def test_cache_saves_hold_the_lock_and_name_their_own_data_files(tmp_path):
    """lock_cache_saves: a save waits while another holder has the cache folder's lock (the
    other process), and two signatures of one function get two data files, each loading its
    own data."""
    import fcntl
    import threading
    import time
    from numba.core.caching import IndexDataCacheFile
    precompile.lock_cache_saves()
    precompile.lock_cache_saves()  # idempotent: one lock, not two nested
    assert IndexDataCacheFile.save.locked and IndexDataCacheFile.flush.locked
    index = IndexDataCacheFile(str(tmp_path), "kernel-1.py311", ("stamp", 1))
    held = threading.Event()

    def hold():
        with open(tmp_path / precompile.LOCK_NAME, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            held.set()
            time.sleep(0.5)
    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    t = time.perf_counter()
    index.save("signature a", b"machine code a")
    assert time.perf_counter() - t >= 0.4
    holder.join()
    index.save("signature b", b"machine code b")
    assert index.load("signature a") == b"machine code a" and index.load("signature b") == b"machine code b"
    assert len(list(tmp_path.glob("kernel-1.py311.*.nbc"))) == 2


def test_the_module_run_by_hand_is_a_one_line_error():
    r = subprocess.run([sys.executable, "-m", "cubedqn.precompile"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "cubedqn.precompile: error: expected CONFIG_JSON PARENT_PID (train and profile start this process "
        "themselves; it is not a command)"]
