#!/usr/bin/env bash
# On the H200 box, one call: DSpark vs plain decode on the same engine (issue 19, acceptance 3).
#   bash scripts/gpu_speculative.sh [OUT_DIR]
# The drafter is read from models/dsv41-small/dspark/, or copied there first from DRAFTER_DIR (default
# /tmp/dsv41-drafter: where an earlier call of the same lease left it — the model and its drafter together
# are larger than what one call carries; scripts/device_tree.sh). Files in OUT_DIR (default
# $OUT, else /tmp/dsv41-gpu): spec-<dtype>.log and benchmarks/speculative.py's JSON per dtype (DTYPES, default
# fp32), and with PHASES="1 64" benchmarks/spec_phases.py's breakdown at those batches (the first dtype).
# BATCHES (default "1 64") and SPEC_ARGS (more arguments, e.g. "--requests-per-slot 4 --tag r4") pass through.
# Both engines overlap their plain decode steps (the default on CUDA: the plain engine since 2026-12-04, the
# speculative one since 2026-12-07); SPEC_ARGS="--spec-overlap off" (or --plain-overlap off) measures without.
# The model and its drafter are larger together than what one call carries (scripts/device_tree.sh): the first
# call of a lease runs with the model parked — this script then stages the drafter in DRAFTER_DIR for the next
# call and runs the drafter's own GPU tests (the Markov kernel, the drafter's graphs = eager) —, the second with the
# drafter parked (`device_tree.sh park drafter; device_tree.sh park vl`) runs the benchmark.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/dsv41-gpu}}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
if ! ls models/dsv41-small/model-*.safetensors >/dev/null 2>&1 && [ -f models/dsv41-small/dspark/config.json ]; then
    dst="${DRAFTER_DIR:-/tmp/dsv41-drafter}"
    mkdir -p "$dst" && cp models/dsv41-small/dspark/* "$dst/"
    echo "gpu_speculative: the model is parked; drafter staged in $dst for the next call"
    for f in tests/kernels/test_markov.py tests/dspark/test_dspark_drafter_static.py; do
        timeout 120 python3 -m pytest -q -m gpu "$f" -p no:cacheprovider --tb=short 2>&1 | tee -a "$out/tests.log" | tail -2
    done
    exit 0
fi
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
