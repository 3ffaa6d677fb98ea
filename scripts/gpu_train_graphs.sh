#!/usr/bin/env bash
# One GPU call (issue 18): the training step replayed from a CUDA graph (src/dsv41/train/graphs.py). First its `gpu`
# tests (tiny trains 8 steps eagerly and graphed, fp32 and bf16: losses and weights agree), then
# benchmarks/train_peer.py at 16 x 1024 with --cuda-graphs (both models' steps graphed) and, for the comparison, the
# eager run: ~4 minutes. Not run yet (written 2026-12-06 when no device time was left). Logs + JSON in $OUT.
#
#   bash scripts/gpu_train_graphs.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_train_graphs}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/train/test_graphs.py > "$OUT/gpu_tests.log" 2>&1
echo "--- gpu tests (rc $?)"; tail -n 12 "$OUT/gpu_tests.log"
source scripts/train_peer_fn.sh
peer graphs 150 --cuda-graphs
peer eager 150
