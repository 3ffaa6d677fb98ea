#!/usr/bin/env bash
# On the H200 box, one call: DSpark vs plain decode on the same engine (issue 19, acceptance 3).
#   bash scripts/gpu_speculative.sh [OUT_DIR]
# The drafter is read from models/dsv41-small/dspark/, or copied there first from DRAFTER_DIR (default
# .drafter: a folder of drafter files that travelled to the box in an earlier call of the same lease, when
# the model and its drafter together are larger than what one call carries). Files in OUT_DIR (default
# $OUT, else /tmp/dsv41-gpu): spec.log and benchmarks/speculative.py's JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/dsv41-gpu}}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
if [ ! -f models/dsv41-small/dspark/config.json ]; then
    src="${DRAFTER_DIR:-.drafter}"
    [ -f "$src/config.json" ] || { echo "gpu_speculative: no drafter in models/dsv41-small/dspark or $src" >&2; exit 2; }
    mkdir -p models/dsv41-small/dspark && cp "$src"/* models/dsv41-small/dspark/
fi
timeout "${SPEC_S:-420}" python3 benchmarks/speculative.py --drafter dspark --checkpoint models/dsv41-small \
    --text data/sample --batches ${BATCHES:-1 64} --out "$out" 2>&1 | tee "$out/spec.log" | tail -14
