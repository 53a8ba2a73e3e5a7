#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA core (if not built) and run the
# end-to-end nps benchmark for the given presets (default t82,bt4), writing
# JSON, table and plot to $OUT (or ./gpu-out).  Presets run in one process so
# they share the measured ceilings; each step is bounded by --step-timeout so a
# hung kernel ends the run with a message instead of the device's time limit.
# Usage: bash tools/gpu_bench.sh [PRESETS] [extra nps.py args...]
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSEDENC_REQUIRE_NATIVE=cuda
export FUSEDENC_CUDA_ARCHITECTURES=${FUSEDENC_CUDA_ARCHITECTURES:-90}
presets=${1:-t82,bt4}
shift || true
if ! python3 -c "import fusedenc._C" 2>/dev/null; then
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
python3 bench/nps.py --preset "$presets" --out-dir "$OUT" --no-progress --step-timeout 150 "$@" > "$OUT/nps-$presets.log" 2>&1
rc=$?
grep -v "^\[" "$OUT/nps-$presets.log" | tail -80
exit $rc
