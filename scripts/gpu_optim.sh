#!/usr/bin/env bash
# One short H200 call (issue 18): the GPU tests of the Triton Sinkhorn split backward and of
# bf16 Newton-Schulz, then benchmarks/train_peer.py (eager, 16 x 1024, its peer in each run) with fp32 and
# with bf16 Newton-Schulz (both without the Sinkhorn kernels, =0), and with both defaults when the gpu tests passed.
# 2026-12-04: ~100 s; everything lands in $OUT (logs + one JSON per run).
#
#   bash scripts/gpu_optim.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_optim}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
timeout 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_sinkhorn_backward.py \
  tests/optim/test_ns_dtype.py "tests/engine/test_engine_gpu.py::test_sampling_sampled_rows_never_syncs_with_the_host" \
  > "$OUT/gpu_tests.log" 2>&1
tail -n 3 "$OUT/gpu_tests.log"
source scripts/train_peer_fn.sh
DSV41_TRITON_SINKHORN_BACKWARD=0 peer ns_fp32 130 --ns-dtype fp32
DSV41_TRITON_SINKHORN_BACKWARD=0 peer ns_bf16 100 --ns-dtype bf16
if grep -q "passed" "$OUT/gpu_tests.log" && ! grep -q "failed" "$OUT/gpu_tests.log"; then
  peer defaults 100
fi
ls -la "$OUT"
