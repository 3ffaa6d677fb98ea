#!/usr/bin/env bash
# Train the shipped `small` model in one stretch sized to a wall-clock budget (run on the H200).
#
#   RUN=runs/small RESULTS=benchmarks/results BUDGET_S=380 bash scripts/train_small.sh
#
# 1. measures training tokens/s of `small` (benchmarks/train_step.py) and sizes the run to BUDGET_S;
# 2. trains on the pre-tokenized corpus in .corpus/tok (scripts/build_corpus.py output, tokenized with
#    data/tokenizer.json), bf16 autocast, QAT switched on for the last 10% of tokens;
# 3. exports the final checkpoint in the compact FP8/MXFP4 format (what models/dsv41-small ships).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
RUN=${RUN:-runs/small}
RESULTS=${RESULTS:-benchmarks/results}
BUDGET_S=${BUDGET_S:-380}
BATCH=${BATCH:-16}
SEQ=${SEQ:-1024}
PY=${PYTHON:-python3}
TPS=$("$PY" benchmarks/train_step.py --preset small --batch "$BATCH" --seq "$SEQ" --steps 4 --warmup 2 \
      --out "$RESULTS" | sed -n 's/^small .*: \([0-9]*\) tok\/s.*/\1/p' | head -1)
STEPS=$(( TPS * BUDGET_S / (BATCH * SEQ) ))
QAT=$(( STEPS * BATCH * SEQ * 9 / 10 ))
echo "measured ${TPS} tok/s -> ${STEPS} steps (QAT from ${QAT} tokens)"
"$PY" -m dsv41 train --preset small --data .corpus/tok --out "$RUN" --seq_len="$SEQ" --batch_size="$BATCH" \
  --steps="$STEPS" --lr=3e-3 --lr_final=3e-4 --warmup=0.02 --dtype=bf16 --device=cuda --eval_every=100 \
  --eval_batches=16 --save_every=0 --log_every=10 --progress=false --qat_from_tokens="$QAT"
"$PY" - "$RUN" <<'PYEOF'
import sys
from pathlib import Path
from dsv41.checkpoint import load_checkpoint, save_checkpoint
run = Path(sys.argv[1])
latest = run / "latest"
ckpt = latest.resolve() if latest.is_symlink() else run / latest.read_text().strip()
model = load_checkpoint(ckpt)
tok = (ckpt / "tokenizer.json").read_text()
save_checkpoint(model, run / "export", fmt="compact", max_shard_bytes=15 * 2**20, extra_files={"tokenizer.json": tok})
print("exported", run / "export")
PYEOF
