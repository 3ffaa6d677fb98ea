#!/usr/bin/env bash
# On the H200 box, one call: DSpark vs plain decode on the same engine (issue 19, acceptance 3).
#   bash scripts/gpu_speculative.sh [OUT_DIR]
# The drafter is read from models/dsv41-small/dspark/, or copied there first from DRAFTER_DIR (default
# /tmp/dsv41-drafter: where an earlier call of the same lease left it — the model and its drafter together
# are larger than what one call carries; scripts/device_tree.sh). Files in OUT_DIR (default
# $OUT, else /tmp/dsv41-gpu): spec-<dtype>.log and benchmarks/speculative.py's JSON per dtype (DTYPES, default
# fp32), and with PHASES="1 64" benchmarks/spec_phases.py's breakdown at those batches (the first dtype).
# BATCHES (default "1 64") and SPEC_ARGS (more arguments, e.g. "--requests-per-slot 4 --tag r4") pass through.
# The plain engine overlaps its decode steps (the default on CUDA since 2026-12-04); SPEC_ARGS="--spec-overlap"
# lets the speculative engine overlap the plain steps its cost model chooses too.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/dsv41-gpu}}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
if [ ! -f models/dsv41-small/dspark/config.json ]; then
    src="${DRAFTER_DIR:-/tmp/dsv41-drafter}"
    [ -f "$src/config.json" ] || { echo "gpu_speculative: no drafter in models/dsv41-small/dspark or $src" >&2; exit 2; }
    mkdir -p models/dsv41-small/dspark && cp "$src"/* models/dsv41-small/dspark/
fi
for dt in ${DTYPES:-fp32}; do  # DTYPES="fp32 bf16": both
    timeout "${SPEC_S:-420}" python3 benchmarks/speculative.py --drafter dspark --checkpoint models/dsv41-small \
        --text data/sample --batches ${BATCHES:-1 64} --dtype "$dt" --out "$out" ${SPEC_ARGS:-} 2>&1 \
        | tee -a "$out/spec-$dt.log" | tail -4
done
for b in ${PHASES:-}; do  # PHASES="1 64": the phase breakdown too (benchmarks/spec_phases.py)
    python3 benchmarks/spec_phases.py --checkpoint models/dsv41-small --text data/sample --batch "$b" \
        --dtype "${DTYPES%% *}" --out "$out" 2>&1 | tee "$out/phases-b$b.log" | tail -16
done
