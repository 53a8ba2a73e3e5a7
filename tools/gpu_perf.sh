#!/usr/bin/env bash
# One call on the GPU machine for the performance issue: build; optionally
# run GPU tests (FUSEDENC_PERF_TESTS="pytest args") and measure a user
# attention table (FUSEDENC_PERF_TUNE_ATTENTION=1; else the shipped table
# runs); measure the GEMM candidates into a gemm tuning table (both into a
# fresh FUSEDENC_CONFIG_DIR, so nothing stale is read); time the per-op
# microbenchmarks that the levers touch; then run the nps comparison with
# those tables loaded.  Every step is capped so that one slow step
# still leaves the others' results.  Everything lands in $OUT/perf.tgz (the
# device returns at most 8 files), and a summary is printed last.
# Usage: FUSEDENC_SOURCE_COMMIT=<the commit you sent> bash tools/gpu_perf.sh
# (FUSEDENC_PERF_NPS="t82 bt4" picks the nps steps; FUSEDENC_PERF_QUICK=1, see below)
# (the device's copy of .git can be stale: the result files take the commit from it)
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSEDENC_REQUIRE_NATIVE=cuda
export FUSEDENC_CUDA_ARCHITECTURES=${FUSEDENC_CUDA_ARCHITECTURES:-90}
export FUSEDENC_CONFIG_DIR="$WORK/config"
mkdir -p "$FUSEDENC_CONFIG_DIR"

step() {  # step NAME SECONDS command...: runs it under a cap, logs to $WORK/NAME.log
  local name=$1 cap=$2; shift 2
  local start=$(date +%s)
  timeout --signal=INT --kill-after=15 "$cap" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $(( $(date +%s) - start ))s" | tee -a "$WORK/steps.txt"
}

if ! python3 -c "import fusedenc._C" 2>/dev/null; then
  step build 120 python3 -m pip install --no-build-isolation --no-deps -e .
fi
if [ -n "${FUSEDENC_PERF_TESTS:-}" ]; then  # GPU tests first (pytest args, e.g. "tests/test_attention_gpu.py")
  FUSEDENC_REQUIRE_GPU=1 step gpu-tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE $FUSEDENC_PERF_TESTS
fi
if [ -n "${FUSEDENC_PERF_TUNE_ATTENTION:-}" ]; then  # a measured user table instead of the shipped one
  # batch*heads up to 16384: the presets' large batches (t82 at 256 positions is 6144) are
  # where the short-sequence kernel wins; --quick stops at 4096.
  step tune-attention 150 python3 -m fusedenc.tune attention --dtype float16 --head-dims 32,64,128 \
    --seq-lens 64,128,256,512 --batch-heads 512,4096,16384 --json "$WORK/attention-measurements.json"
fi
# The batch sizes the nps steps below run (each call merges into the same file).  Where
# cuBLASLt has no epilogue for the activation (swish, mish, exact GELU), tune gemm also
# compiles and times the Triton FFN1 kernel's configs: about a minute per preset.
# FUSEDENC_PERF_QUICK=1: only the large batches (t82 256 and 1024, bt4 256), no per-op
# step, no bert-base: about half the device time.
if [ -n "${FUSEDENC_PERF_QUICK:-}" ]; then
  t82_batches=256,1024; bt4_batches=256; nps=" ${FUSEDENC_PERF_NPS:-t82 bt4} "; t82_modes=default
else
  t82_batches=1,16,64,256,1024; bt4_batches=64,256; nps=" ${FUSEDENC_PERF_NPS:-t82 bt4 bert} "
  t82_modes=default,reduce-overhead
fi
step tune-gemm-t82 150 python3 -m fusedenc.tune gemm --preset t82 --batch-sizes $t82_batches
step tune-gemm-bt4 80 python3 -m fusedenc.tune gemm --preset bt4 --batch-sizes $bt4_batches
if [[ $nps == *" bert "* ]]; then
  step tune-gemm-bert 80 python3 -m fusedenc.tune gemm --preset bert-base --batch-sizes 16,32,256
fi
if [ -z "${FUSEDENC_PERF_QUICK:-}" ]; then
  step ops 40 python3 bench/ops.py --preset t82,bt4,bert-base --ops ffn1,attention --out-dir "$WORK" --no-progress --step-timeout 30
fi
[[ $nps == *" t82 "* ]] && step nps-t82 160 python3 bench/nps.py --preset t82 --batch-sizes $t82_batches \
  --compile-modes $t82_modes --out-dir "$WORK" --no-progress --step-timeout 120
[[ $nps == *" bt4 "* ]] && step nps-bt4 60 python3 bench/nps.py --preset bt4 --batch-sizes $bt4_batches \
  --out-dir "$WORK" --no-progress --step-timeout 60
[[ $nps == *" bert "* ]] && step nps-bert 70 python3 bench/nps.py --preset bert-base-s128 --batch-sizes 16,32,256 \
  --out-dir "$WORK" --no-progress --step-timeout 60
(cd "$WORK" && tar czf "$OUT/perf.tgz" .)  # the tables the run used are in config/

echo "==== steps"; cat "$WORK/steps.txt"
[ -f "$WORK/gpu-tests.log" ] && { echo "==== GPU tests"; grep -E "^(FAILED|ERROR)|passed|failed" "$WORK/gpu-tests.log" | tail -15; }
for f in "$WORK"/tune-gemm-*.log; do echo "==== $(basename "$f")"; grep -E "  ffn1:|=> |^wrote" "$f" | cut -c1-130; done
for f in "$WORK"/nps-*.log; do echo "==== $(basename "$f")"; grep -E "^ +[0-9]+ +(torch-compile|fusedenc|gemm-floor)" "$f" | cut -c1-100; done
echo "==== ops"; grep -E "^ +(ffn1|attention|torch|F\.|fusedenc|triton)" "$WORK/ops.log" | cut -c1-130 | head -30
