#!/usr/bin/env bash
# On the H200 box, one call (~5–9 min): the training path of issue 18 on the GPU.
#   bash scripts/gpu_train.sh [OUT_DIR] [PARTS]     PARTS: any of tests,attention,peer,compile (default tests,attention)
# tests:     the fused sparse training attention kernel vs its torch twin (fp32 ≤ 1e-5, bf16 vs float64)
# attention: benchmarks/train_attention.py — one small-width layer and the whole small training step,
#            kernel vs twin (time, peak memory)
# peer:      benchmarks/train_peer.py — small vs the dense HF Llama peer at 16 × 1024, then 16K–64K context
#            (longer than the rest: give it its own call)
# compile:   every Block compiled whole on CUDA (tests/train/test_compile.py, gpu) and train_peer.py --compile at
#            16 × 1024 against the peer (no long contexts)
# Files in OUT_DIR (default $OUT, else /tmp/dsv41-gpu): tests.log, attention.log, peer.log and the results JSONs.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/dsv41-gpu}}"
parts="${2:-tests,attention}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
status=0
if [[ $parts == *tests* ]]; then
timeout 180 python3 -m pytest -q -m gpu tests/kernels/test_sparse_train.py -p no:cacheprovider -s --tb=short \
    >"$out/tests.log" 2>&1
rc=$?
[ $rc -ne 0 ] && status=1
echo "===== gpu tests (exit $rc)" >>"$out/tests.log"
tail -15 "$out/tests.log"
fi
if [[ $parts == *attention* ]]; then
timeout 300 python3 benchmarks/train_attention.py --out "$out" >"$out/attention.log" 2>&1
tail -12 "$out/attention.log"
fi
if [[ $parts == *peer* ]]; then
timeout 560 python3 benchmarks/train_peer.py --out "$out" >"$out/peer.log" 2>&1
tail -12 "$out/peer.log"
fi
if [[ $parts == *compile* ]]; then
timeout 200 python3 -m pytest -q -m gpu tests/train/test_compile.py -p no:cacheprovider -s --tb=short \
    >"$out/compile-tests.log" 2>&1 || status=1
tail -6 "$out/compile-tests.log"
timeout 400 python3 benchmarks/train_peer.py --compile --contexts --out "$out" >"$out/compile-peer.log" 2>&1
tail -8 "$out/compile-peer.log"
fi
exit $status
