#!/usr/bin/env bash
# One H200 session for issues 19 and 21: post-training (SFT -> RL -> effort tiers; teacher -> OPD) and the
# DSpark drafter's training run side by side (three processes share the GPU: small models, host-bound),
# plus the synchronous-dispatch RL baseline, then the timed benchmarks alone. The work runs detached (setsid), so it outlives one 10-minute device
# call; every call (`start` once, then `watch`) prints progress and packs what exists into $OUT.
#
#   bash scripts/gpu_posttrain_dspark.sh start   # launch (idempotent), then watch
#   bash scripts/gpu_posttrain_dspark.sh watch   # follow the logs for up to WATCH_S seconds (default 560)
#
# runs/ctl.env, when present, is sourced before each later stage (change step counts of a running session).
# DSPARK_BUDGET_S=0 skips the drafter's training and the speculative benchmark (post-training only).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
LOG=runs/log; mkdir -p "$LOG"
ctl() { [ -f runs/ctl.env ] && . runs/ctl.env; true; }

pipeline() {
  export SFT_STEPS=${SFT_STEPS:-800} T_STEPS=${T_STEPS:-800} RL_STEPS=${RL_STEPS:-30} OPD_STEPS=${OPD_STEPS:-20}
  ( ctl; bash scripts/posttrain_small.sh sft && ctl && bash scripts/posttrain_small.sh rl \
      && python scripts/effort_tiers.py runs/post/rl --out runs/post/tiers || touch "$LOG/p1.failed" ) \
      > "$LOG/p1.log" 2>&1 &
  ( ctl; bash scripts/posttrain_small.sh teacher
    while [ ! -f runs/post/sft/done.json ]; do sleep 5; [ -f "$LOG/p1.failed" ] && exit 1; done
    ctl; bash scripts/posttrain_small.sh opd ) > "$LOG/p2.log" 2>&1 &
  ( while [ ! -f runs/post/sft/done.json ]; do sleep 5; [ -f "$LOG/p1.failed" ] && exit 1; done
    ctl; python -m dsv41 rl --checkpoint runs/post/sft --device cuda --eval-problems 64 --max-tokens 96 --digits 2,4 \
      --prompts-per-step 8 --max-in-flight 96 --max-staleness 4 --max-offpolicy 0.8 --steps "$RL_STEPS" --lr "${RL_LR:-3e-5}" --dispatch batch --out runs/post/rl_sync
  ) > "$LOG/p4.log" 2>&1 &  # the synchronous baseline's accuracy at equal steps (issue 21, acceptance 3)
  if [ "${DSPARK_BUDGET_S:-300}" != 0 ]; then  # DSPARK_BUDGET_S=0: post-training only
    ( OUT=runs/dspark RESULTS=runs/results BUDGET_S=${DSPARK_BUDGET_S:-300} bash scripts/train_dspark_small.sh \
        && touch "$LOG/p3.done" ) > "$LOG/p3.log" 2>&1 &
  fi
  wait
  bash scripts/posttrain_small.sh report > "$LOG/report.log" 2>&1
  touch "$LOG/phase1.done"
  # timed, one at a time
  if [ -f "$LOG/p3.done" ]; then
    mkdir -p runs/ckpt_spec && ln -sf "$PWD"/models/dsv41-small/* runs/ckpt_spec/ \
      && ln -sfn "$PWD/runs/dspark" runs/ckpt_spec/dspark
    ( ctl; python benchmarks/speculative.py --drafter dspark --checkpoint runs/ckpt_spec --text data/sample \
        --out runs/results ) > "$LOG/speculative.log" 2>&1
  fi
  ( ctl; python benchmarks/rollouts.py --out runs/results ) > "$LOG/rollouts.log" 2>&1
  python -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_speculative_gpu.py \
    tests/posttrain/test_rollout_gpu.py -s > "$LOG/gputests.log" 2>&1
  touch "$LOG/all.done"
}

pack() {  # what exists so far -> $OUT (one tarball + the drafter in <16 MiB pieces); every output is under runs/
  [ -n "${OUT:-}" ] || return 0
  local files=("$LOG")
  for f in runs/post/*/eval.json runs/post/*/metrics.jsonl runs/post/*/done.json runs/post/plots runs/post/tiers \
           runs/results runs/dspark/metrics.jsonl runs/dspark/acceptance.png runs/dspark/config.json; do
    [ -e "$f" ] && files+=("$f")
  done
  tar czf "$OUT/session.tgz" "${files[@]}" 2>/dev/null
  if [ -f "$LOG/p3.done" ]; then
    (cd runs && tar cf - dspark/*.safetensors dspark/*.json) | split -b 15M - "$OUT/drafter.tar."
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
      sleep 45
      echo "=== $(date +%T) t=${SECONDS}s $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)"
      for f in "$LOG"/*.log; do echo "--- $f"; tail -n 2 "$f" | cut -c1-220; done
    done
    [ -f "$LOG/all.done" ] && echo "ALL DONE"
    pack; ls -la "${OUT:-/tmp}" ;;
esac
