#!/usr/bin/env bash
# On the H200 box (python3 with torch + triton, no install, no internet), one call of ~6 minutes at most:
#   bash scripts/gpu_ckpt.sh [OUT_DIR] [PARTS]     PARTS: any of tests,linears,model (default all three)
# Issue 23's GPU checks, each part under its own `timeout` so a hang cannot eat the call:
#   tests   (<= 150 s) the @pytest.mark.gpu tests of the release format: the FP8 GEMM kernel = the fp64
#           emulation at v41 widths, the FP8 x MXFP4 experts kernel = its emulation, the as-released tiny
#           model with the kernels = its torch twins, and it generates in the engine with CUDA graphs;
#   linears (<= 60 s)  benchmarks/as_released.py: the release's FP8 linear vs BF16 F.linear, one layer at
#           v41 widths, M = 1, 64, 4096;
#   model   (<= 240 s) benchmarks/as_released.py: a 5-layer v41-flash (layers 1, 2, 3, 20, 24: window,
#           Full, Reuse, Reindex, Engram; 384 MXFP4 experts; Engram tables from 1M buckets) written as
#           synthetic release shards (46 GB in $SHARDS, removed at the end), loaded as-released, then
#           prefill + decode through Engine.generate: load time, peak memory, tokens/s.
# Files in OUT_DIR (default $OUT, else /tmp/dsv41-gpu): tests.log, linears.log, model.log and the two
# results JSONs (as_released-<date>-linears.json / -model.json; the model JSON is rewritten after every
# phase, so a time-out keeps what was measured). Exit status 1 if a part failed. Off the GPU:
#   BENCH_ARGS="--device cpu --preset tiny" bash scripts/gpu_ckpt.sh /tmp/ck linears,model
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/dsv41-gpu}}"
parts="${2:-tests,linears,model}"
shards="${SHARDS:-/tmp/dsv41-release-shards}"  # never under OUT_DIR: 46 GB must not travel back
read -r -a extra <<<"${BENCH_ARGS:-}"  # e.g. BENCH_ARGS="--device cpu --preset tiny" for a check off the GPU
mkdir -p "$out"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
status=0
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null | head -1
df -h "$(dirname "$shards")" | tail -1
if [[ $parts == *tests* ]]; then
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -s -rA \
        tests/quant tests/test_checkpoint_released.py >"$out/tests.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    echo "===== tests (exit $rc; 124 = timed out)" >>"$out/tests.log"
    grep -E "max error|relative difference|passed|failed|PASSED|FAILED|Error|=====" "$out/tests.log" | tail -30
fi
if [[ $parts == *linears* ]]; then
    timeout 60 python3 benchmarks/as_released.py --skip-model --out "$out" "${extra[@]}" >"$out/linears.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    echo "===== linears (exit $rc)" >>"$out/linears.log"
    tail -30 "$out/linears.log"
fi
if [[ $parts == *model* ]]; then
    timeout 240 python3 benchmarks/as_released.py --skip-linears --shards "$shards" --out "$out" "${extra[@]}" \
        >"$out/model.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && status=1
    echo "===== model (exit $rc)" >>"$out/model.log"
    tail -15 "$out/model.log"
    rm -rf "$shards"
fi
exit $status
