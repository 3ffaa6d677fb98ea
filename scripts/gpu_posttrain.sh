#!/usr/bin/env bash
# One H200 session for issue 21: the stages of
# scripts/posttrain_small.sh, detached (setsid) so the work outlives one 10-minute device call; every call
# (`start` once, then `watch`) prints progress and packs what exists into $OUT.
#
#   bash scripts/gpu_posttrain.sh start   # launch (idempotent), then watch
#   bash scripts/gpu_posttrain.sh watch   # follow the logs for up to WATCH_S seconds (default 560)
#   SMOKE=1 PYTHON=.venv/bin/python bash scripts/gpu_posttrain.sh _pipeline   # the same stages, tiny, on the CPU
#
# Order: the student's SFT and the teacher's SFT side by side (training only; their times are not measured),
# then one at a time, alone on the GPU, so their times are measurements: RL (sample dispatch), the server's
# effort tiers on it, OPD, the synchronous RL baseline (batch dispatch, same budget), the plots,
# benchmarks/rollouts.py (acceptance order: what matters most runs first). Step counts and batches: scripts/posttrain_small.sh. (The 2026-12-02 run put four
# processes on the GPU at once: a host-bound decode step then waits for the others' kernels, and rollouts ran
# ~40x slower than the engine's measured step.)
# The detached work lives only while the machine is held: a `watch` call must follow the last call within the
# device's idle window (30 s), or the machine goes back and the run is lost (2026-12-04: it was, after 9 min).
# The server (effort tiers) needs fastapi, uvicorn and pydantic, which the box lacks: download their cp312
# wheels into .whl (the device README's pip download line; the versions of .venv: fastapi starlette uvicorn
# pydantic pydantic_core opentelemetry-api annotated-types typing-inspection typing_extensions, ~3 MiB), park the
# drafter and models/dsv41-tiny-vl (scripts/device_tree.sh park drafter; park vl), carry .whl, and start with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#   EXTRA_SITE=/tmp/site WATCH_S=540 bash scripts/gpu_posttrain.sh start
# runs/ctl.env, when present, is sourced before each later stage (change step counts of a running session).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${EXTRA_SITE:+:$EXTRA_SITE} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
LOG=runs/log; mkdir -p "$LOG"
PY=${PYTHON:-python3}
ctl() { [ -f runs/ctl.env ] && . runs/ctl.env; true; }
stage() {  # stage NAME TIMEOUT_S COMMAND...: one timed stage, its log, a .done or .failed marker
  local name=$1 limit=$2; shift 2
  ctl
  echo "$(date +%T) start $name" >> "$LOG/stages.txt"
  local t0=$SECONDS
  if timeout "$limit" "$@" > "$LOG/$name.log" 2>&1; then touch "$LOG/$name.done"; r=ok; else touch "$LOG/$name.failed"; r=failed; fi
  echo "$(date +%T) $r $name $((SECONDS - t0)) s" >> "$LOG/stages.txt"
}

pipeline() {
  # each stage's training has a time budget (evaluations outside it), so the whole run fits ~22 minutes;
  # SMOKE=1: every stage at tiny sizes on the CPU (checks this script end to end, ~5 min).
  # 2026-12-04 (fp32 training and rollouts, one eager prefill per request): SFT 26 steps of 256 in 240 s, every
  # evaluation 0.000, the stages 417 / 474 / 236 / 101 / 241 / 236 s, rollouts.py cut at 300 s. Now bf16 (autocast
  # training, bf16 engines) and batched prefill: more training time, less evaluation time.
  export SFT_SECONDS=${SFT_SECONDS:-300} T_SECONDS=${T_SECONDS:-360} RL_SECONDS=${RL_SECONDS:-150} \
         OPD_SECONDS=${OPD_SECONDS:-150}
  local S=() TIERS=(--problems 256) BENCH=(--modes batch,sample --steps 8)
  if [ -n "${SMOKE:-}" ]; then
    S=(--device cpu --preset tiny); TIERS=(--device cpu --problems 4 --max-tokens 16)
    BENCH=(--device cpu --preset tiny --steps 2 --prompts-per-step 2 --modes batch,sample)
  fi
  stage sft 900 bash scripts/posttrain_small.sh sft "${S[@]}" &
  local sft=$!
  stage teacher 1200 bash scripts/posttrain_small.sh teacher "${S[@]}" &
  wait $sft; [ -f "$LOG/sft.done" ] || return 1
  stage rl 600 bash scripts/posttrain_small.sh rl "${S[@]}"
  [ -f "$LOG/rl.done" ] && stage tiers 300 "$PY" scripts/effort_tiers.py runs/post/rl "${TIERS[@]}" --out runs/post/tiers
  wait  # the teacher
  [ -f "$LOG/teacher.done" ] && stage opd 600 bash scripts/posttrain_small.sh opd "${S[@]}"
  stage rl_sync 600 bash scripts/posttrain_small.sh rl_sync "${S[@]}"
  stage report 120 bash scripts/posttrain_small.sh report
  touch "$LOG/phase1.done"
  stage rollouts 240 "$PY" benchmarks/rollouts.py "${BENCH[@]}" --out runs/results
  # last and alone, so it cannot cost the stages above: the opt-in Triton Sinkhorn backward's first GPU run
  # (issue 18; enable it by default once this passes and train_peer.py measures it)
  [ -z "${SMOKE:-}" ] && stage sinkhorn_gpu 180 "$PY" -m pytest -q -m gpu -p no:cacheprovider \
    tests/kernels/test_sinkhorn_backward.py
  touch "$LOG/all.done"
}

pack() {  # what exists so far -> $OUT (one tarball); every output is under runs/
  [ -n "${OUT:-}" ] || return 0
  local files=("$LOG")
  for f in runs/post/*/eval.json runs/post/*/metrics.jsonl runs/post/*/done.json runs/post/plots runs/post/tiers \
           runs/results; do
    [ -e "$f" ] && files+=("$f")
  done
  tar czf "$OUT/session.tgz" "${files[@]}" 2>/dev/null
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
      sleep 40
      echo "=== $(date +%T) t=${SECONDS}s $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)"
      for f in "$LOG"/*.log; do echo "--- $f $(tr '\r' '\n' < "$f" | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c1-200)"; done
      for f in runs/post/*/metrics.jsonl; do [ -f "$f" ] && echo "--- $f $(tail -n 1 "$f" | cut -c1-200)"; done
      pack  # every poll: a call cut short (device budget, limit) still returns the latest files
    done
    [ -f "$LOG/all.done" ] && echo "ALL DONE"
    cat "$LOG/stages.txt" 2>/dev/null
    pack; ls -la "${OUT:-/tmp}" ;;
  *) echo "gpu_posttrain: start | watch" >&2; exit 2 ;;
esac
