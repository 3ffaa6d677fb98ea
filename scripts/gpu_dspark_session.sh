#!/usr/bin/env bash
# One H200 session for issue 19 when no drafter is at hand: train the drafter of models/dsv41-small, then
# measure with it (GPU tests, the phase breakdown at batch 1 and 64, DSpark vs plain decode). The work runs
# detached (setsid), so it outlives one 10-minute device call; every call (`start` once, then `watch`)
# prints progress and packs what exists into $OUT (logs + results in session.tgz, the drafter in < 16 MiB
# pieces: `cat drafter.tar.* | tar xf - -C models/dsv41-small` puts it next to the model here).
#
#   bash scripts/gpu_dspark_session.sh start   # launch (idempotent), then watch
#   bash scripts/gpu_dspark_session.sh watch   # follow for up to WATCH_S seconds (default 560)
#
# BUDGET_S (default 300): the drafter's training budget. With a drafter in models/dsv41-small/dspark (shipped)
# or in /tmp/dsv41-drafter (left by an earlier call of the lease: scripts/device_tree.sh) it is skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
LOG=runs/log; mkdir -p "$LOG" runs/results
DRAFTER=models/dsv41-small/dspark

pipeline() {
  # the GPU tests need no trained drafter: they share the GPU with the training (correctness only)
  python -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_speculative_gpu.py \
    tests/dspark/test_dspark_drafter_static.py > "$LOG/gputests.log" 2>&1 &
  if [ ! -f "$DRAFTER/config.json" ] && [ -f /tmp/dsv41-drafter/config.json ]; then
    rm -rf "$DRAFTER" && cp -r /tmp/dsv41-drafter "$DRAFTER"
  fi
  if [ ! -f "$DRAFTER/config.json" ]; then
    rm -rf "$DRAFTER"
    OUT=runs/dspark RESULTS=runs/results BUDGET_S=${BUDGET_S:-300} bash scripts/train_dspark_small.sh \
      > "$LOG/train.log" 2>&1 || { touch "$LOG/all.done"; exit 1; }
    cp -r runs/dspark "$DRAFTER"
  fi
  touch "$LOG/drafter.done"
  wait
  for b in 1 64; do  # timed, one at a time
    python benchmarks/spec_phases.py --checkpoint models/dsv41-small --text data/sample --batch "$b" \
      --out runs/results > "$LOG/phases-b$b.log" 2>&1
  done
  python benchmarks/speculative.py --drafter dspark --checkpoint models/dsv41-small --text data/sample \
    --batches 1 64 --out runs/results > "$LOG/speculative.log" 2>&1
  touch "$LOG/all.done"
}

pack() {
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/session.tgz" "$LOG" runs/results runs/dspark/metrics.jsonl runs/dspark/acceptance.png 2>/dev/null
  if [ -f "$LOG/drafter.done" ] && [ -d runs/dspark ] && [ ! -f "$OUT/drafter.tar.aa" ]; then
    (cd runs && tar cf - dspark) | split -b 15M - "$OUT/drafter.tar."
  fi
}

case ${1:-watch} in
  start)
    if [ ! -f "$LOG/started" ]; then
      touch "$LOG/started"
      nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
      setsid bash "$0" _pipeline > "$LOG/pipeline.log" 2>&1 < /dev/null &
      sleep 2
    fi
    exec bash "$0" watch ;;
  _pipeline) pipeline ;;
  watch)
    end=$((SECONDS + ${WATCH_S:-560}))
    while [ $SECONDS -lt $end ] && [ ! -f "$LOG/all.done" ]; do
      sleep 30
      echo "=== $(date +%T) t=${SECONDS}s $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)"
      for f in "$LOG"/*.log; do echo "--- $f"; tail -n 2 "$f" | cut -c1-220; done
    done
    [ -f "$LOG/all.done" ] && { echo "ALL DONE"; for f in "$LOG"/*.log; do echo "--- $f"; tail -n 25 "$f"; done; }
    pack ;;
esac
