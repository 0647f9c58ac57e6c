#!/usr/bin/env bash
# Collect the performance numbers quoted in README.md, in one run, into $OUT (runs/perf).
# With CHECKPOINT=<run dir of a cube2 preset run> it also times eval --threads 1 vs 2.
# OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are unset for these commands only (they slow sgemm
# ~2x where set); each output names the BLAS kernel that actually ran.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/perf}; mkdir -p "$out"
run() { env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "$@"; }
PY=${PYTHON:-python}
{ uname -m; lscpu | grep -E "Model name|^CPU\(s\)|Thread|MHz" || true; date -u; } > "$out/machine.txt"
# --bf16: also the opt-in bfloat16 matmuls and the peers' bf16 (rows skipped, with the
# reason, where the CPU has no AVX512_BF16)
run $PY scripts/bench_peers.py --bf16 | tee "$out/peers.txt"
# the same comparison with Adam, the update the issue's profile commands below run
run $PY scripts/bench_peers.py --optimizer adam | tee "$out/peers-adam.txt"
run $PY scripts/bench_replay.py | tee "$out/replay.txt"
# The issue's commands verbatim (with --puzzle and no --profile: plain sticker inputs, Adam,
# i.e. 144-256-256-12), then the same network with clipped momentum, the step the peer
# benchmark times, then the cube2 preset: each at --threads 1 and 2 back to back, PAIRS
# rounds (default 3), the order swapped each round, so that each --threads 2 row is a median
# of pairs timed side by side (a 2-vCPU host's second CPU has slow windows of seconds,
# README, Performance). Round 1's files have no -rN suffix.
PAIRS=${PAIRS:-3}
pair() {  # pair STEM json|text PROFILE-ARGS...: the profile at --threads 1 and 2, in $order
  local stem=$1 kind=$2 t; shift 2
  for t in $order; do
    if [ "$kind" = json ]; then
      run $PY -m cubedqn.cli profile "$@" --threads $t --json > "$out/$stem-t$t$sfx.json"
    else
      run $PY -m cubedqn.cli profile "$@" --threads $t | tee "$out/$stem-t$t$sfx.txt"
    fi
  done
}
round() {  # round R: its files' suffix (none for round 1, else -rR) and its --threads order
  sfx=$([ "$1" = 1 ] || echo "-r$1")
  order=$([ $(($1 % 2)) = 1 ] && echo "1 2" || echo "2 1")
}
for r in $(seq 1 "$PAIRS"); do
  round "$r"
  pair profile-cube2-double json --puzzle cube2 --hidden 256,256 --batch-size 64 --targets double --steps 2000
  pair profile-cube2-double-stickers-momentum json --puzzle cube2 --hidden 256,256 --batch-size 64 --targets double \
    --input-encoding stickers --optimizer momentum --steps 2000
  pair profile-cube3-double json --puzzle cube3 --hidden 1024,512 --batch-size 256 --targets double --steps 300
  pair profile-cube2-preset text --profile cube2 --steps 500
done
for t in 1 2; do
  # acting scores only the greedy states, and 500 steps into the preset's 100,000 epsilon is
  # still ~1: the same profile at the schedule's final 0.05, acting on 95% of the states
  run $PY -m cubedqn.cli profile --profile cube2 --threads $t --steps 500 --epsilon 0.05 | tee "$out/profile-cube2-preset-eps05-t$t.txt"
done
# two threads without the GEMM team (OpenBLAS's own threads, as before stop 33), beside the
# team's two-thread runs above: what the team buys on this host at this hour
run env CUBEDQN_TEAM=0 $PY -m cubedqn.cli profile --puzzle cube2 --hidden 256,256 --batch-size 64 --targets double --threads 2 --steps 2000 --json > "$out/profile-cube2-double-t2-noteam.json"
run env CUBEDQN_TEAM=0 $PY -m cubedqn.cli profile --puzzle cube3 --hidden 1024,512 --batch-size 256 --targets double --threads 2 --steps 300 --json > "$out/profile-cube3-double-t2-noteam.json"
# end to end with every probe of the thread tuner counted (profile probes before its timed
# steps; a training run probes after its first second and every 30 s): the cube2 preset
# trained for a minute on one thread and on two, in TRAIN_PAIRS rounds (default PAIRS) of
# back-to-back pairs like the profiles above (stop 61's second report had its single pair
# at 1.00x, two threads probed slower and one kept, where its first had read 1.56x); the
# last lines give steps, seconds, probes
TRAIN_PAIRS=${TRAIN_PAIRS:-$PAIRS}
for r in $(seq 1 "$TRAIN_PAIRS"); do
  round "$r"
  for t in $order; do
    rm -rf "$out/train-cube2-t$t$sfx"
    run $PY -m cubedqn.cli train --profile cube2 --minutes 1 --threads $t --out "$out/train-cube2-t$t$sfx" \
      > "$out/train-cube2-t$t$sfx.txt"
    grep -E "^trained|^thread tuning" "$out/train-cube2-t$t$sfx.txt"
  done
done
run $PY scripts/bench_startup.py --repeats 2 --compare-ahead | tee "$out/startup.txt"
if [ -n "${CHECKPOINT:-}" ]; then
  # solving 1000 cubes with one and with two threads, alternating, twice
  for r in 1 2; do
    for t in 1 2; do
      for s in "beam --beam-width 64" "astar --beam-width 64" "greedy"; do
        run $PY -m cubedqn.cli eval --checkpoint "$CHECKPOINT" --random-states 1000 --search $s --threads $t --json \
          > "$out/eval-${s%% *}-t$t-r$r.json"
      done
    done
  done
fi
# the issue's targets, met or not, as README's "Where it stands" table
$PY scripts/report_summary.py "$out" | tee "$out/summary.md"
