#!/usr/bin/env bash
# On the H200 box (python3 with torch + triton + transformers, no install needed), one call:
#   bash scripts/gpu_engine.sh [OUT_DIR] [PARTS]     PARTS: any of tests,kernels,sweep,peer,load,prefill (default
#                                                   tests,peer,load; a device call of 10 minutes fits tests,peer,
#                                                   tests,load or kernels,prefill)
# The engine's GPU checks, then the engine benchmarks of issue 15: the GPU tests of the engine and of the
# kernels it added (graph replay = eager, no host sync in the decode step, dense MoE in a graph, RoPE /
# RoPE + FP4 / RMSNorm / SwiGLU kernels = twins), then benchmarks/peer_decode.py (decode grid vs the
# dense peer's three paths, prefill, profiles) and benchmarks/decode_load.py (token gaps under four 32K
# prompts). Files in OUT_DIR (default $OUT, else /tmp/dsv41-gpu): tests.log, peer.log, load.log and the
# two results JSONs (peer_decode.py saves each cell as it finishes: 4K first, with the overlap cells). Exit
# status 1 if a test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/dsv41-gpu}}"
parts="${2:-tests,peer,load}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
status=0
if [[ $parts == *tests* ]]; then
: >"$out/tests.log"
# one pytest process (one CUDA start-up, one Triton cache) for every GPU test the engine relies on
# (~4 minutes on the H100: 2026-12-06's 150 s slice timed out; the newest first)
timeout 330 python3 -m pytest -q -m gpu tests/engine/test_static_prefill.py tests/model/test_moe.py tests/engine/test_engine_gpu.py \
    tests/kernels/test_rope_norm.py tests/kernels/test_swiglu.py tests/engine/test_engine_kernels.py \
    tests/kernels/test_router.py "tests/kernels/test_attention.py::test_gpu_matches_twin" tests/kernels/test_mhc_split_epilogue.py \
    -p no:cacheprovider --tb=short --durations=8 >>"$out/tests.log" 2>&1
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 5 ] && status=1
echo "===== gpu tests (exit $rc)" >>"$out/tests.log"
tail -30 "$out/tests.log"
fi
if [[ $parts == *kernels* ]]; then
# the GPU tests of the kernels the engine's prefill and decode run (sparse attention, indexer scores and top-k,
# the MoE router): ~3 minutes
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_attention.py tests/kernels/test_indexer.py \
    tests/kernels/test_router.py -p no:cacheprovider --tb=short --durations=5 >"$out/kernels.log" 2>&1
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 5 ] && status=1
echo "===== kernel gpu tests (exit $rc)" >>"$out/kernels.log"
tail -8 "$out/kernels.log"
fi
if [[ $parts == *sweep* ]]; then
# the replay's mHC hand-over at 128 tokens: d split + finish (the default) against one unsplit pass with the split in
# it (`split_in_pass`); ~1 minute
timeout 120 python3 benchmarks/sweep.py mhc "mhc_post_split small replay M=128" \
    '{"split": [1, 2, 3, 6], "split_in_pass": [false, true], "block_t": [16, 32, 64]}' >"$out/sweep.log" 2>&1
tail -8 "$out/sweep.log"
fi
if [[ $parts == *peer* ]]; then
# the grid with the peer's three paths, then prefill (host path in one chunk, StaticPrefill) and the TTFT, in one
# run (results/peer_decode-2026-12-06-grid.json: ~4 minutes on the H100)
timeout 450 python3 benchmarks/peer_decode.py --batches 64 1 16 --contexts 4096 32768 131072 \
    --overlap-cells 64x4096 1x4096 16x4096 64x32768 64x131072 --prefill 8192 32768 --prefill-chunk 32768 \
    --static-prefill --ttft 32768 --compile-cells 1x4096 --profile 64x4096 --out "$out" >"$out/peer.log" 2>&1
tail -25 "$out/peer.log"
fi
if [[ $parts == *prefill* ]]; then
# one prompt at 8K / 32K: the host path in one chunk (wall vs queued time) and StaticPrefill, the engine's path
# for whole runs (encoder-only and exact from CUDA graphs: wall and device time), the peer's prefill, and the
# time to first token through Engine.step() with and without static prefill; ~3 minutes
timeout 330 python3 benchmarks/peer_decode.py --contexts --prefill 8192 32768 --prefill-chunk 32768 --ttft 32768 \
    --static-prefill --profile-prefill --compile-cells --overlap-cells --profile --out "$out" >"$out/prefill.log" 2>&1
grep -E '^(prefill|ttft) ' "$out/prefill.log" | cut -c1-2000
fi
if [[ $parts == *load* ]]; then
# layer-sliced prefill (Engine(prefill_layers=)): one layer pass per step beside the streams (2 and 4 passes
# gave larger gaps on 2026-12-02); gaps as a client sees them (--gaps emitted, no device sync per step)
timeout 420 python3 benchmarks/decode_load.py --budgets 256 512 --layers 1 --out "$out" >"$out/load.log" 2>&1
tail -8 "$out/load.log"
fi
exit $status
