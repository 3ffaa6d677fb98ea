#!/usr/bin/env bash
# The README's test command: install everything, then run the CPU test tier.
# pytest's exit code 5 ("no tests collected") is turned into a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest -q --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
