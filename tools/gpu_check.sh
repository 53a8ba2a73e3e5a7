#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA core, run the GPU test suite, run
# the host-overhead benchmark.  Logs go to $OUT (or ./gpu-out); a short
# summary is printed last.  Usage: bash tools/gpu_check.sh [pytest args...]
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSEDENC_REQUIRE_GPU=1 FUSEDENC_REQUIRE_NATIVE=cuda

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/env.txt" 2>&1

bash "$(dirname "$0")/build_core.sh" "$OUT/build.log" || exit 1

# Workers of pytest-xdist where it is installed, one torch thread each: on a 16-core H200 host
# the GPU suite takes ~3 minutes this way against ~11 in one process (bench/NOTES.md).
parallel=()
if python3 -c "import xdist" 2>/dev/null; then
  parallel=(-n "${FUSEDENC_TEST_WORKERS:-10}"); export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
fi
# A wall-clock cap so a hang still leaves a log and a summary behind (SIGINT:
# pytest stops cleanly and still prints its summary).
timeout --signal=INT --kill-after=20 "${FUSEDENC_GPU_TEST_TIMEOUT:-3000}" \
  python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=15 --junitxml="$OUT/gpu-tests.xml" "${parallel[@]}" "$@" > "$OUT/gpu-tests.log" 2>&1
tests_rc=$?
if [ -n "${FUSEDENC_SKIP_CPU_TESTS:-}" ]; then
  cpu_rc=skipped; echo "skipped (FUSEDENC_SKIP_CPU_TESTS)" > "$OUT/cpu-tests.log"
else
  python3 -m pytest -m "not gpu" -q -p no:cacheprovider -rfE "${parallel[@]}" > "$OUT/cpu-tests.log" 2>&1
  cpu_rc=$?
fi
python3 bench/host_overhead.py --json "$OUT/host_overhead.json" > "$OUT/host_overhead.txt" 2>&1
if [ -n "${FUSEDENC_OPS_BENCH:-}" ]; then  # the per-op benchmark too (about two minutes)
  python3 bench/ops.py --out-dir "$OUT" --no-progress --step-timeout 120 > "$OUT/ops.log" 2>&1
  ops_rc=$?
fi

echo "==== environment"; cat "$OUT/env.txt"
echo "==== GPU tests (rc=$tests_rc$( [ $tests_rc -eq 124 ] && echo ', TIMED OUT'))"; grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -3
[ $tests_rc -ne 0 ] && grep -E "^(FAILED|ERROR)" "$OUT/gpu-tests.log" | head -30
sed -n '/GPU tests skipped on this GPU machine/,/^=/p' "$OUT/gpu-tests.log" | head -40
grep -E "^short run:" "$OUT/gpu-tests.log"
echo "==== CPU tests on the GPU machine (rc=$cpu_rc)"; tail -1 "$OUT/cpu-tests.log"
echo "==== host overhead"; cat "$OUT/host_overhead.txt"
[ -n "${FUSEDENC_OPS_BENCH:-}" ] && { echo "==== ops benchmark (rc=$ops_rc)"; tail -5 "$OUT/ops.log"; }
exit $tests_rc
