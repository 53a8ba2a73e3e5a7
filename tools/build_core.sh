#!/usr/bin/env bash
# Build and install the package (editable) with its CUDA core, for the scripts that run on the
# GPU machine:
#   bash tools/build_core.sh LOG
# The build's output goes to LOG; on failure its last lines and "BUILD FAILED" are printed and
# the exit status is 1.  It builds for FUSEDENC_CUDA_ARCHITECTURES, 90 (the H100) unless set:
# one architecture instead of the package's three keeps the build short inside a device call.
# The CUDA core or nothing (FUSEDENC_GPU=cuda: never a silent pure-Python build), with the Hopper
# kernels or nothing (FUSEDENC_SM90_BUILD=on where 90 is an architecture: numbers measured without
# them are ~13% slower on an H100), and with the 16-lane reductions tests/test_warp_width_gpu.py
# runs (FUSEDENC_WARP_TESTS=1).  Each can be overridden from the environment.
set -uo pipefail
log=$(realpath -m "${1:?usage: bash tools/build_core.sh LOG}")
cd "$(dirname "$0")/.."
export FUSEDENC_CUDA_ARCHITECTURES=${FUSEDENC_CUDA_ARCHITECTURES:-90}
export FUSEDENC_GPU=${FUSEDENC_GPU:-cuda}
case ";${FUSEDENC_CUDA_ARCHITECTURES// /;};" in
  *";90;"*|*";90a;"*) export FUSEDENC_SM90_BUILD=${FUSEDENC_SM90_BUILD:-on} ;;
esac
export FUSEDENC_WARP_TESTS=${FUSEDENC_WARP_TESTS:-1}
# CUTLASS's headers: the nvidia-cutlass wheel's when installed, else unpacked by bootstrap.py from
# the wheel in .cache/wheels (carried to a machine without internet) or from PyPI.
if [ -z "${FUSEDENC_CUTLASS_INCLUDE:-}" ] && ! python3 -c "import cutlass_library" 2>/dev/null; then
  FUSEDENC_CUTLASS_INCLUDE=$(python3 bootstrap.py cutlass-headers) || { echo "BUILD FAILED: no CUTLASS headers"; exit 1; }
  export FUSEDENC_CUTLASS_INCLUDE
fi
if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$log" 2>&1; then
  tail -40 "$log"
  echo "BUILD FAILED"
  exit 1
fi
