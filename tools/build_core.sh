#!/usr/bin/env bash
# Build and install the package (editable) with its CUDA core, for the scripts that run on the
# GPU machine:
#   bash tools/build_core.sh LOG
# The build's output goes to LOG; on failure its last lines and "BUILD FAILED" are printed and
# the exit status is 1.  It builds for FUSEDENC_CUDA_ARCHITECTURES, 90 (the H100) unless set:
# one architecture instead of the package's three keeps the build short inside a device call.
set -uo pipefail
log=$(realpath -m "${1:?usage: bash tools/build_core.sh LOG}")
cd "$(dirname "$0")/.."
export FUSEDENC_CUDA_ARCHITECTURES=${FUSEDENC_CUDA_ARCHITECTURES:-90}
if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$log" 2>&1; then
  tail -40 "$log"
  echo "BUILD FAILED"
  exit 1
fi
