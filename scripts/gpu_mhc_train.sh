#!/usr/bin/env bash
# One short GPU call (issue 18): the mHC hand-over's training kernels (kernels/triton/mhc_train.py). First the
# `gpu` tests (gradients vs fp64 at `small` widths, beside the twin; the dispatch; a tiny model vs the twin),
# then the kernel case (forward + backward of one hand-over vs autograd through the twin, and the floor), a
# short sweep of the backward kernel's tiles, and benchmarks/train_peer.py (eager, 16 x 1024) with the twin
# (DSV41_TRITON_MHC_BACKWARD=0) and, when the tests passed, with the kernels (its tests and the train_peer run with the
# kernels ran on an H100 on 2026-12-06 from a session script; this script as a whole has not run): ~3-4 minutes.
# Everything lands in $OUT (logs + JSON).
#
#   bash scripts/gpu_mhc_train.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_mhc_train}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
timeout 240 "$PY" -m pytest -q -s -m gpu -p no:cacheprovider tests/kernels/test_mhc_backward.py \
  > "$OUT/gpu_tests.log" 2>&1
tail -n 20 "$OUT/gpu_tests.log"
timeout 120 "$PY" benchmarks/kernels.py --only mhc_train --engine-contexts --out "$OUT" > "$OUT/kernels.log" 2>&1
tail -n 4 "$OUT/kernels.log"
timeout 150 "$PY" benchmarks/sweep.py mhc_train "mhc_post backward small" \
  '{"block_t": [16, 32], "block_d": [32, 64, 128], "num_warps": [4, 8], "num_stages": [1, 2]}' \
  > "$OUT/sweep.log" 2>&1
tail -n 10 "$OUT/sweep.log"
source scripts/train_peer_fn.sh
DSV41_TRITON_MHC_BACKWARD=0 peer twin 100
if grep -q "passed" "$OUT/gpu_tests.log" && ! grep -q "failed" "$OUT/gpu_tests.log"; then
  peer kernels 100
fi
ls -la "$OUT"
