#!/usr/bin/env bash
# The CUDA path on a real GPU, in one go: the CUDA tests (simulator and GPU), the GPU step
# benchmark (scripts/bench_cuda.py), `cubedqn profile --device cuda` at the issue's shapes
# and for the cube2 preset, and a one-minute cube2-quick training run on the GPU with its
# evaluation. Outputs go to $OUT (runs/cuda). Runs from the repository root without an
# install (PYTHONPATH), so it works on a machine where nothing can be installed.
# OLD=<dir holding another tree's cubedqn/, profiles/ and these scripts/>: also A/B the
# CUDA step and the presets end to end against it, alternating. SKIP_STARTUP, SKIP_TRAIN,
# SKIP_AB_PRESETS=1 leave those parts out; TRAIN_MINUTES (1), BENCH_ARGS, AB_STEPS (300).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/cuda}; mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
cli() { $PY -m cubedqn.cli "$@"; }
step() { echo "== $*"; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)" ; date -u
  $PY -c "import sys, numba, numpy, scipy, click; from numba import cuda; import importlib.metadata as m
print(sys.version.split()[0], 'numba', numba.__version__, 'numba-cuda', m.version('numba-cuda'), 'numpy', numpy.__version__,
      'scipy', scipy.__version__, 'click', click.__version__); print(cuda.get_current_device().name)"
} 2>&1 | tee "$out/machine.txt"

TIMEFORMAT="%R s wall"
[ -z "${SKIP_STARTUP:-}" ] && step "start-up: cubedqn profile --device cuda, cold (Numba compiles CPU and GPU kernels) then warm"
[ -z "${SKIP_STARTUP:-}" ] && for run in cold warm; do
  echo "$run:"; time cli profile --profile cube2-quick --steps 50 --warmup 5 --device cuda --json > "$out/$run-profile.json"
done 2>&1 | tee "$out/startup.txt"

step "tests: tests/cuda_sim on the GPU (the simulator half runs in CI)"
CUBEDQN_CUDA_TESTS=gpu timeout ${TEST_TIMEOUT:-300} $PY -m pytest -q -p no:cacheprovider -o addopts= tests/cuda_sim -rs \
  2>&1 | tee "$out/tests.txt" | tail -15

step "benchmark: scripts/bench_cuda.py"
$PY scripts/bench_cuda.py --launches ${BENCH_ARGS:-} 2>&1 | tee "$out/bench_cuda.txt"
if [ -n "${OLD:-}" ]; then
  # A/B against another tree (OLD=<dir> holding its cubedqn/ and these scripts/), alternating
  for r in 1 2; do
    for tree in "$OLD" .; do
      echo "-- $tree (round $r)"
      PYTHONPATH=$tree $PY "$tree/scripts/bench_cuda.py" --only "cubedqn cuda" --reps 9 2>&1 | grep -E "^cubedqn|^[0-9]"
    done
  done 2>&1 | tee "$out/ab.txt"
  # and the presets end to end (acting, environments, replay and the step), alternating
  [ -z "${SKIP_AB_PRESETS:-}" ] && for r in 1 2; do
    for tree in "$OLD" .; do
      for p in cube2 cube3; do
        (cd "$tree" && PYTHONPATH=. $PY -m cubedqn.cli profile --profile $p --device cuda --steps ${AB_STEPS:-300} --json) \
          > "$out/ab-$p-$(basename "$(cd "$tree" && pwd)")-$r.json"
        $PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], 'train_step_ms %.3f steps_per_min %.0f' % (d['train_step_ms'], d['steps_per_min']), {k: round(v, 3) for k, v in d['phases'].items() if v})" \
          "$out/ab-$p-$(basename "$(cd "$tree" && pwd)")-$r.json"
      done
    done
  done 2>&1 | tee "$out/ab-presets.txt"
fi

step "profile --device cuda"
cli profile --puzzle cube2 --hidden 256,256 --batch-size 64 --targets double --device cuda --steps 2000 --json \
  > "$out/profile-cube2-double-cuda.json"
cli profile --puzzle cube3 --hidden 1024,512 --batch-size 256 --targets double --device cuda --steps 500 --json \
  > "$out/profile-cube3-double-cuda.json"
cli profile --profile cube2 --device cuda --steps 500 2>&1 | tee "$out/profile-cube2-preset-cuda.txt"
cli profile --profile cube2 --device cpu --threads 1 --steps 500 2>&1 | tee "$out/profile-cube2-preset-cpu.txt"
$PY - "$out" <<'EOF'
import json, sys
for n in ("cube2-double", "cube3-double"):
    d = json.load(open(f"{sys.argv[1]}/profile-{n}-cuda.json"))
    print(n, "cuda", {k: d.get(k) for k in ("train_step_ms", "steps_per_min", "device")})
EOF

if [ -z "${SKIP_TRAIN:-}" ]; then
  step "train: cube2-quick on the GPU (TRAIN_MINUTES, default one minute), then greedy evaluation of 1000 random cubes"
  cli train --profile cube2-quick --device cuda --minutes ${TRAIN_MINUTES:-1} --out "$out/quick-cuda" 2>&1 | tee "$out/train.txt" | tail -12
  cli eval --checkpoint "$out/quick-cuda" --random-states 1000 2>&1 | tee "$out/eval.txt" | tail -3
fi
