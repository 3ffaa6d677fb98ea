#!/usr/bin/env bash
# On a CUDA machine (the H200 box: python3 with torch + triton, no install needed):
#   bash scripts/gpu_check.sh [OUT_DIR] [benchmarks/kernels.py args...]
# Runs every GPU test file in its own process (a kernel fault leaves a sticky CUDA error that would
# fail every later test of the same process), then the kernel + engine benchmark. Three files go to
# OUT_DIR (default: $OUT, else /tmp/dsv41-gpu): tests.log (every test file's output under a header),
# bench.log and the results JSON — few, so that a device tool that returns a handful of files keeps
# them all. Exit status: 1 if a test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/dsv41-gpu}}"
shift || true
mkdir -p "$out"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
status=0
: >"$out/tests.log"
for f in $(grep -l "mark.gpu\|^gpu = " tests/*/*.py tests/*.py 2>/dev/null | sort -u); do
    log="$(mktemp)"
    python3 -m pytest -q -m gpu "$f" -p no:cacheprovider --tb=short >"$log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && [ $rc -ne 5 ] && status=1  # 5 = no GPU test in that file
    { echo "===== $f (exit $rc)"; cat "$log"; } >>"$out/tests.log"
    printf '%-45s %s\n' "$f" "$(grep -E 'passed|failed|skipped|no tests ran' "$log" | tail -1)"
    rm -f "$log"
done
python3 benchmarks/kernels.py --out "$out" "$@" >"$out/bench.log" 2>&1 || status=1
grep -E " ms |ceilings|engine decode|FAILED|wrote" "$out/bench.log"
exit $status
