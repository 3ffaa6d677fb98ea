#!/usr/bin/env bash
# What travels to the device machine is capped at 64 MiB (/work/.library/device/README.md); the shipped model
# (52 MiB) and its DSpark drafter (24 MiB) do not fit together. Park one of them outside the checkout for a
# call, and put it back right after:
#
#   bash scripts/device_tree.sh park drafter   # a call that needs the model only (most of them)
#   bash scripts/device_tree.sh park model     # a call whose command copies the drafter to /tmp on the box
#   bash scripts/device_tree.sh park vl        # models/dsv41-tiny-vl too (4 MiB: room for carried wheels)
#   bash scripts/device_tree.sh unpark         # everything back (idempotent)
#   bash scripts/device_tree.sh size           # MiB that would travel now
#
# A call that needs both (the speculative benchmark): park model and vl → `bash scripts/gpu_speculative.sh` (with
# the model parked it copies the drafter to /tmp/dsv41-drafter and runs the drafter's GPU tests) → unpark, park
# drafter and vl (60 MiB) → at once (the box keeps /tmp for 30 s of idle) `bash scripts/gpu_speculative.sh` again
# (it copies the drafter back in and runs the benchmark).
set -euo pipefail
cd "$(dirname "$0")/.."
PARK=${PARK:-/tmp/dsv41-park}
MODEL=models/dsv41-small
case ${1:-size} in
  park)
    mkdir -p "$PARK"
    case ${2:-} in
      drafter) [ -d "$MODEL/dspark" ] && mv "$MODEL/dspark" "$PARK/dspark" ;;
      model) for f in "$MODEL"/model-*.safetensors; do [ -e "$f" ] && mv "$f" "$PARK/"; done ;;
      vl) [ -d models/dsv41-tiny-vl ] && mv models/dsv41-tiny-vl "$PARK/dsv41-tiny-vl" ;;
      *) echo "device_tree: park drafter|model|vl" >&2; exit 2 ;;
    esac ;;
  unpark)
    [ -d "$PARK/dspark" ] && { [ -e "$MODEL/dspark" ] && { echo "device_tree: $MODEL/dspark exists" >&2; exit 2; }
                              mv "$PARK/dspark" "$MODEL/dspark"; }
    for f in "$PARK"/model-*.safetensors; do [ -e "$f" ] && mv "$f" "$MODEL/"; done
    [ -d "$PARK/dsv41-tiny-vl" ] && { [ -e models/dsv41-tiny-vl ] && { echo "device_tree: models/dsv41-tiny-vl exists" >&2; exit 2; }
                                      mv "$PARK/dsv41-tiny-vl" models/dsv41-tiny-vl; }
    git status --short -- models | grep . && { echo "device_tree: models/ differs from git" >&2; exit 1; } ;;
  size) ;;
  *) echo "device_tree: park drafter|model|vl, unpark or size" >&2; exit 2 ;;
esac
set +o pipefail  # parked files are tracked and absent: du skips them (exit 123), the total is still right
{ git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -cb 2>/dev/null | tail -1 \
  | awk '{printf "device_tree: %.1f MiB would travel (limit 64)\n", $1 / 1048576}'
