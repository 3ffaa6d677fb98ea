#!/usr/bin/env bash
# Create .venv and install dsv41 with its dev extras. Idempotent; safe on a fresh machine.
# torch is pinned to the CPU wheel this workplace keeps on disk when no torch is present, so pip
# never pulls a multi-GB CUDA build; any torch>=2.11 already in the venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "torch==2.13.0" || "$VPY" -m pip install -q "torch>=2.11"
fi
"$VPY" -m pip install -q -e ".[dev]"
# a real redis-server for the Redis SWA-pool tests (they skip, saying why, when it cannot be had)
if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null 2>&1 \
    || echo "setup: could not install redis-server; Redis tests will be skipped" >&2
fi
