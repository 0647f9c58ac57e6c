#!/usr/bin/env bash
# BLAS thread tuning (threads.BlasThreadTuner) against fixed thread counts: `profile` of the
# 144-256-256-12 network with --threads 1, --threads 2 --no-tune-blas-threads and --threads 2
# (tuned), alternating, ROUNDS rounds, JSON reports into $OUT. With BUSY=1 a process spins on
# CPU 1 meanwhile (a busy second core; needs taskset). Summary: end-to-end steps/min per run.
#   OUT=runs/tune-busy BUSY=1 bash scripts/bench_blas_tuning.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/blas-tuning}; mkdir -p "$out"
PY=${PYTHON:-python}
spin=""
if [ -n "${BUSY:-}" ]; then taskset -c 1 "$PY" -c "while True: pass" & spin=$!; fi
trap '[ -n "$spin" ] && kill $spin' EXIT
C="--puzzle cube2 --hidden 256,256 --batch-size 64 --targets double --steps 3000 --json"
for i in $(seq 1 "${ROUNDS:-3}"); do
  for v in t1 t2fixed t2tuned; do
    case $v in t1) a="--threads 1";; t2fixed) a="--threads 2 --no-tune-blas-threads";; t2tuned) a="--threads 2";; esac
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$PY" -m cubedqn.cli profile $C $a > "$out/$v-$i.json"
    "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], round(r['steps_per_min']), 'steps/min, BLAS threads kept:', r['blas_threads'])" "$out/$v-$i.json" "$v" "$i"
  done
done
