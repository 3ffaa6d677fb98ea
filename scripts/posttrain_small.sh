#!/usr/bin/env bash
# Post-training of the shipped models/dsv41-small on the H200: SFT -> RL (effort-length reward, async rollouts)
# and OPD from a larger teacher trained here; each stage is one command that fits a 10-minute device call and
# skips itself when its output has done.json (rerun a stage: delete its folder).
#
#   bash scripts/posttrain_small.sh sft       # SFT of the shipped model; prints before/after accuracy per effort
#   bash scripts/posttrain_small.sh rl        # GRPO from runs/post/sft
#   bash scripts/posttrain_small.sh rl_sync   # the same with batch (synchronous) dispatch: the baseline
#   bash scripts/posttrain_small.sh teacher   # a larger model (dim 512, 12 layers) trained from scratch on the tasks
#   bash scripts/posttrain_small.sh opd       # OPD of runs/post/sft from runs/post/teacher
#   bash scripts/posttrain_small.sh report    # the effort table + plots (runs/post/plots)
#   bash scripts/posttrain_small.sh smoke --device cpu --preset tiny   # every stage, tiny sizes (CPU, ~5 min)
#
# Stages read the previous stage's checkpoint from --run (ignored by git, kept between calls on a warm device
# machine): run them back to back on one machine. `report` copies eval.json, metrics and plots to $OUT when set.
# Step counts: SFT_STEPS, RL_STEPS, T_STEPS (teacher), OPD_STEPS in the environment override the defaults;
# SFT_LR (3e-4), T_LR (3e-4, the teacher) and RL_LR (3e-5, RL and OPD) the learning rates (1e-4 / 1e-5 left the
# 2026-12-02 run under-trained), SFT_BATCH (128) the SFT batch of the student and the teacher; SFT_SECONDS,
# T_SECONDS, RL_SECONDS (RL and its synchronous baseline), OPD_SECONDS stop a stage's training after that many
# seconds (whole steps; 0 = none).
# Options after the stage: --device DEV (default cuda), --preset NAME (random-init student: smoke runs),
# --run DIR (default runs/post).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?stage: sft | rl | rl_sync | teacher | opd | report | smoke}; shift
DEVICE=cuda; PRESET=""; RUN=runs/post
while [[ $# -gt 0 ]]; do
  case $1 in
    --device) DEVICE=$2; shift 2 ;;
    --preset) PRESET=$2; shift 2 ;;
    --run) RUN=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python}
[[ -x .venv/bin/python ]] && PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
dsv41() { "$PY" -m dsv41 "$@"; }
mkdir -p "$RUN"

# sizes: the H200 run, or tiny smoke sizes
if [[ -n $PRESET ]]; then
  SRC=(--preset "$PRESET"); COMMON=(--device "$DEVICE" --eval-problems 4 --max-tokens 12 --digits 2)
  SFT_STEPS=3; RL_STEPS=2; T_STEPS=3; OPD_STEPS=2; SFT_BATCH=8; LOOP=(--prompts-per-step 1 --max-in-flight 16)
  TEACHER_BASE=$PRESET
else
  SRC=(--checkpoint models/dsv41-small); COMMON=(--device "$DEVICE" --eval-problems 256 --max-tokens 96 --digits 2,4)
  # 2026-12-04: batch 64 cost ~1.6 s a step with the teacher beside it, batch 256 ~6 s (both fp32: the step was
  # GPU-bound, not host-bound, so the 4x batch bought no samples/s and 4x fewer steps); bf16 now. 128 between:
  # the time budgets (scripts/gpu_posttrain.sh) stop the stages, the step counts are upper bounds
  SFT_STEPS=${SFT_STEPS:-600}; RL_STEPS=${RL_STEPS:-40}; T_STEPS=${T_STEPS:-1000}; OPD_STEPS=${OPD_STEPS:-30}
  SFT_BATCH=${SFT_BATCH:-128}
  LOOP=(--prompts-per-step 8 --max-in-flight 96 --max-staleness 4 --max-offpolicy 0.8)  # 2026-12-02: 128 / 2 / 0.5 dropped 2/3
  TEACHER_BASE=small
fi

teacher_config() {  # the teacher: the student's preset, wider (dim 512) — stated in its eval.json (teacher_params)
  "$PY" - "$TEACHER_BASE" "$RUN/teacher_config.json" <<'PY'
import json, sys
from dataclasses import asdict
from dsv41 import load_config
c = load_config(sys.argv[1])
d = {k: v for k, v in asdict(c).items() if not k.startswith("_")}
d["dim"] = 2 * c.dim if sys.argv[1] == "tiny" else 512
json.dump(d, open(sys.argv[2], "w"), indent=1)
PY
}

case $STAGE in
  sft) dsv41 sft "${SRC[@]}" "${COMMON[@]}" --steps $SFT_STEPS --batch-size $SFT_BATCH --lr ${SFT_LR:-3e-4} \
      --max-seconds ${SFT_SECONDS:-0} --out "$RUN/sft" ;;
  rl) dsv41 rl --checkpoint "$RUN/sft" "${COMMON[@]}" "${LOOP[@]}" --steps $RL_STEPS --lr ${RL_LR:-3e-5} \
      --max-seconds ${RL_SECONDS:-0} --out "$RUN/rl" ;;
  rl_sync)  # the synchronous baseline: batch dispatch, same steps (issue 21, acceptance 3)
    dsv41 rl --checkpoint "$RUN/sft" "${COMMON[@]}" "${LOOP[@]}" --steps $RL_STEPS --lr ${RL_LR:-3e-5} --dispatch batch \
      --max-seconds ${RL_SECONDS:-0} --out "$RUN/rl_sync" ;;
  teacher)
    teacher_config
    dsv41 sft --config "$RUN/teacher_config.json" "${COMMON[@]}" --steps $T_STEPS --batch-size $SFT_BATCH --lr ${T_LR:-3e-4} --max-seconds ${T_SECONDS:-0} \
      --out "$RUN/teacher" ;;
  opd) dsv41 opd --checkpoint "$RUN/sft" --teacher "$RUN/teacher" "${COMMON[@]}" "${LOOP[@]}" --steps $OPD_STEPS \
      --lr ${RL_LR:-3e-5} --max-seconds ${OPD_SECONDS:-0} --out "$RUN/opd" ;;
  report)
    "$PY" -m dsv41.posttrain.plot "$RUN"
    if [[ -n ${OUT:-} ]]; then  # on the device machine: bring back the small files (no checkpoints)
      for s in sft rl rl_sync teacher opd; do
        [[ -d $RUN/$s ]] && mkdir -p "$OUT/$s" && cp "$RUN/$s"/{eval.json,metrics.jsonl} "$OUT/$s/" 2>/dev/null || true
      done
      cp -r "$RUN/plots" "$OUT/" 2>/dev/null || true
    fi ;;
  smoke)
    for s in sft rl rl_sync teacher opd report; do
      bash "$0" "$s" --device "$DEVICE" ${PRESET:+--preset "$PRESET"} --run "$RUN"
    done ;;
  *) echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
