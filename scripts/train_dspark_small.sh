#!/usr/bin/env bash
# Train the DSpark drafter of the shipped models/dsv41-small within a wall-clock budget (H200) and report
# the held-out greedy acceptance length per verification length (issue 19, acceptance 2).
#
#   bash scripts/train_dspark_small.sh                               # H200: ~6 min of training, bf16
#   BUDGET_S=300 OUT=runs/dspark bash scripts/train_dspark_small.sh  # other budget / output folder
#   bash scripts/train_dspark_small.sh --device cpu --steps 2        # CPU smoke (tiny sizes, /tmp output)
#
# Extra arguments go to `dsv41 train-dspark` (later ones win). Data: .corpus/tok when present (the
# pre-tokenized corpus of scripts/build_corpus.py), else the shipped data/sample; held-out prompts come
# from its validation split. Writes OUT (default models/dsv41-small/dspark: the drafter in the release's
# format, metrics.jsonl, acceptance.png) and RESULTS/dspark_small.json.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
MODEL=${MODEL:-models/dsv41-small}
RESULTS=${RESULTS:-benchmarks/results}
DATA=${DATA:-}
if [ -z "$DATA" ]; then
  if [ -d .corpus/tok ]; then DATA=.corpus/tok; else DATA=data/sample; fi
fi
SMOKE=0
for a in "$@"; do [ "$a" = "cpu" ] || [ "$a" = "--device=cpu" ] && SMOKE=1; done
if [ "$SMOKE" = 1 ]; then  # a few small steps on the CPU, never over the shipped drafter
  OUT=${OUT:-$(mktemp -d /tmp/dspark-smoke.XXXX)}
  RESULTS=$OUT
  SIZES=(--batch_size 2 --seq_len 128 --n_anchors 8 --eval_prompts 2 --eval_prompt_len 32 --eval_new_tokens 16
         --progress false --threads 2)
else
  OUT=${OUT:-$MODEL/dspark}
  SIZES=(--batch_size 16 --seq_len 512 --n_anchors 64 --eval_prompts 32 --eval_prompt_len 64 --eval_new_tokens 128
         --progress false --log_every 50 --eval_every 1000)
fi
START=$(date +%s)
"$PY" -m dsv41 train-dspark --model "$MODEL" --out "$OUT" --data "$DATA" --device cuda --dtype bf16 \
  --steps 20000 --budget_s "${BUDGET_S:-360}" --lr 1e-3 --lr_final 1e-4 --warmup 0.03 "${SIZES[@]}" "$@"
END=$(date +%s)
"$PY" - "$OUT" "$RESULTS" "$((END - START))" <<'PYEOF'
import datetime, json, sys
from pathlib import Path
import torch
out, results, wall = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
start = records[0]
evals = [r for r in records if r["type"] in ("eval", "eval_saved")]
final = evals[-1]
float_eval = [r for r in evals if r["type"] == "eval"][-1]
train = [r for r in records if r["type"] == "train"]
device = torch.cuda.get_device_name() if torch.cuda.is_available() and "cuda" in start["device"] else start["device"]
summary = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "device": device, "backbone": start["train_config"]["model"], "drafter_params": start["drafter_params"],
    "steps": final["step"], "train_seconds": round(final["train_seconds"], 1), "wall_seconds": wall,
    "data": start["train_config"]["data"], "block_size": start["train_config"]["block_size"],
    "held_out_anchors": final["anchors"],
    "tau_per_verification_length": final["tau"], "tau_float_drafter": float_eval["tau"],
    "conditional_acceptance": final["conditional_acceptance"], "mean_confidence": final["mean_confidence"],
    "last_train": {k: train[-1][k] for k in ("total", "ce", "l1", "confidence", "tau", "accept")} if train else None,
    "target": "tau(5) >= 2.5",
}
results.mkdir(parents=True, exist_ok=True)
(results / "dspark_small.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"\nDSpark drafter of {summary['backbone']} on {device}: {summary['steps']} steps, "
      f"{summary['train_seconds']} s training, {wall} s wall")
print("mean acceptance length per verification (held out, greedy; 1 = no draft accepted)")
print("  k (drafts verified) | tau(k) as saved | tau(k) float")
for k, v in final["tau"].items():
    print(f"  {k:>19} | {v:15.3f} | {float_eval['tau'][k]:.3f}")
print(f"wrote {results / 'dspark_small.json'}")
PYEOF
