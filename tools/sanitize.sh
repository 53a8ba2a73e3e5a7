#!/usr/bin/env bash
# Run the GPU test suite (or a selection of it) under compute-sanitizer and
# write a per-tool summary of the errors it found.
#
#   bash tools/sanitize.sh [--tools memcheck,racecheck] [--timeout SECONDS] [--no-build] [pytest args...]
#
# Without pytest args it runs the default selection below.  Each tool runs
# pytest once, under `timeout`, so that one device command (10 minutes at most)
# can hold the build and both tools: pass a smaller selection (files, -k) and
# call it several times when the whole suite does not fit.  Outputs, in $OUT
# (default ./sanitize-out):
#   sanitize-summary.txt           per tool: errors, racecheck hazards, pytest's result line, exit codes
#   sanitize-<tool>-pytest.log     pytest's output under the tool
#   sanitize-<tool>-<pid>.log      the sanitizer's report per process (subprocesses included)
#
# Choices, and why:
#   --target-processes all   the tests start subprocesses (determinism, env vars): check them too
#   --report-api-errors no   PyTorch and cuBLASLt probe the runtime with calls that fail by design
#                            (counted as errors otherwise); FUSEDENC_SANITIZE_API_ERRORS=explicit to see them
#   --print-limit 100        a broken kernel repeats the same report per thread
#   --error-exitcode 86      a process with sanitizer errors exits 86 (told apart from test failures)
#   memcheck: PYTORCH_NO_CUDA_MEMORY_CACHING=1, so every tensor is its own cudaMalloc and an
#             access past a tensor's end is an error (the caching allocator would hide it inside
#             its 2 MiB blocks).  PyTorch refuses CUDA-graph capture without the caching allocator,
#             so under memcheck tests with "graph" or "captur" in their names are deselected;
#             FUSEDENC_SANITIZE_CACHING=1 keeps the caching allocator (and those tests) instead.
#   racecheck checks shared-memory hazards (the LayerNorm kernel's cross-warp reduction, the
#             Triton kernels); it runs with the caching allocator, graph tests included.  It
#             skips the vendor libraries' kernels (--kernel-name-exclude, LIBRARY_KERNELS below:
#             cuBLASLt's nvjet/xmma/cutlass GEMMs, cuDNN, PyTorch's flash/memory-efficient
#             attention): on Hopper they synchronize shared memory through TMA and mbarriers,
#             which racecheck does not model, so it reports hazards in every one of them (seen:
#             72,064 in cuBLASLt's nvjet kernels and cuDNN's SDPA kernel), none of which we can
#             act on, and checking them makes a run ~10x slower.  memcheck checks every kernel.
#             FUSEDENC_SANITIZE_LIBRARY_KERNELS=1 checks them under racecheck too.
#   tests with "tune" in their names (tune attention/gemm in a subprocess: timing runs with
#             their own time limits) are deselected under both tools.
#   pytest runs with -v and -rfE, so a run stopped by its time limit still says which tests
#             passed or failed; errors are counted from the reports themselves, as a process
#             killed by the limit writes no ERROR SUMMARY line.
#   torch.compile tests are deselected by default (Triton compilation under the sanitizer takes
#             minutes and checks nothing of ours); the fuzz tests run FUSEDENC_FUZZ_EXAMPLES=5.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/sanitize-out}
mkdir -p "$OUT"

tools="memcheck,racecheck"
limit=270
build=1
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tools) tools="$2"; shift 2 ;;
    --timeout) limit="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    *) args+=("$1"); shift ;;
  esac
done

SANITIZER=${COMPUTE_SANITIZER:-}
if [ -z "$SANITIZER" ]; then
  for c in compute-sanitizer /usr/local/cuda/bin/compute-sanitizer "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"; do
    if command -v "$c" > /dev/null 2>&1; then SANITIZER=$(command -v "$c"); break; fi
  done
fi
if [ -z "$SANITIZER" ]; then
  echo "compute-sanitizer not found (set COMPUTE_SANITIZER=/path/to/compute-sanitizer)" | tee "$OUT/sanitize-summary.txt"
  exit 2
fi

export PYTHONUNBUFFERED=1 FUSEDENC_REQUIRE_GPU=1
export FUSEDENC_CUDA_ARCHITECTURES=${FUSEDENC_CUDA_ARCHITECTURES:-90}
export FUSEDENC_FUZZ_EXAMPLES=${FUSEDENC_FUZZ_EXAMPLES:-5}
if [ $build -eq 1 ]; then
  if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/sanitize-build.log" 2>&1; then
    tail -40 "$OUT/sanitize-build.log"; echo "BUILD FAILED" | tee "$OUT/sanitize-summary.txt"; exit 1
  fi
fi

# The default selection: every GPU test except the long stress tests (100k calls, a
# third of the GPU's memory, two subprocesses: hours under memcheck) and torch.compile.
DEFAULT_K="not stress and not oversized and not processes and not compile"
# Kernels racecheck skips by default (see the header): the GEMM, cuDNN and PyTorch attention kernels.
LIBRARY_KERNELS="nvjet|xmma|cutlass|cublas|gemm|gemv|cudnn|flash_fwd|fmha"
if [ ${#args[@]} -eq 0 ]; then
  args=(tests -m gpu -k "$DEFAULT_K")
fi

# Splits args into the -k expression (if any) and the rest, so a tool can AND its own terms in.
user_k=""
rest=()
i=0
while [ $i -lt ${#args[@]} ]; do
  a="${args[$i]}"
  if [ "$a" = "-k" ]; then
    i=$((i + 1)); user_k="${args[$i]}"
  elif [[ "$a" == -k* ]]; then
    user_k="${a#-k}"
  else
    rest+=("$a")
  fi
  i=$((i + 1))
done

summary="$OUT/sanitize-summary.txt"
{
  echo "fusedenc compute-sanitizer run, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "sanitizer: $("$SANITIZER" --version 2>/dev/null | grep -i version | head -1)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  python3 -c "import torch, fusedenc; print('torch', torch.__version__, 'cuda', torch.version.cuda, '|', fusedenc.backend())" 2>&1
  echo "selection: ${args[*]}"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo
} > "$summary"

overall=0
IFS=',' read -r -a tool_list <<< "$tools"
for tool in "${tool_list[@]}"; do
  rm -f "$OUT"/sanitize-"$tool"-*.log
  k="${user_k:+($user_k) and }not tune"
  env_extra=()
  if [ "$tool" = "memcheck" ] && [ "${FUSEDENC_SANITIZE_CACHING:-0}" != "1" ]; then
    env_extra=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
    k="$k and not graph and not captur"
  fi
  tool_flags=()
  if [ "$tool" = "racecheck" ]; then
    tool_flags=(--racecheck-report analysis)
    [ "${FUSEDENC_SANITIZE_LIBRARY_KERNELS:-0}" != "1" ] && tool_flags+=(--kernel-name-exclude "regex=$LIBRARY_KERNELS")
  fi
  kargs=()
  [ -n "$k" ] && kargs=(-k "$k")
  start=$(date +%s)
  env "${env_extra[@]}" timeout --signal=INT --kill-after=30 "$limit" \
    "$SANITIZER" --tool "$tool" --target-processes all --report-api-errors "${FUSEDENC_SANITIZE_API_ERRORS:-no}" \
    --print-limit 100 --error-exitcode 86 "${tool_flags[@]}" \
    --log-file "$OUT/sanitize-$tool-%p.log" \
    python3 -m pytest -v -rfE -p no:cacheprovider --maxfail=20 "${rest[@]}" "${kargs[@]}" \
    > "$OUT/sanitize-$tool-pytest.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  # "========= ERROR SUMMARY: 3 errors" once per process; racecheck also prints
  # "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)".
  errors=$(cat "$OUT"/sanitize-"$tool"-*.log 2>/dev/null | grep -E "ERROR SUMMARY: [0-9]+ error" | sed -E 's/.*ERROR SUMMARY: ([0-9]+) error.*/\1/' | awk '{s += $1} END {print s + 0}')
  processes=$(cat "$OUT"/sanitize-"$tool"-*.log 2>/dev/null | grep -cE "ERROR SUMMARY")
  hazards=$(cat "$OUT"/sanitize-"$tool"-*.log 2>/dev/null | grep -E "RACECHECK SUMMARY" | sed -E 's/.*SUMMARY: ([0-9]+) hazard.*/\1/' | awk '{s += $1} END {print s + 0}')
  # The reports themselves: a process stopped by the time limit prints no summary line.
  reports=$(cat "$OUT"/sanitize-"$tool"-*.log 2>/dev/null | grep -cE "^========= (Invalid|Error|Program hit|Warning: Race|Address)")
  [ "$reports" -gt "$errors" ] && errors=$reports
  [ "$tool" = racecheck ] && [ "$reports" -gt "$hazards" ] && hazards=$reports
  result=$(grep -E "[0-9]+ (passed|failed|error)" "$OUT/sanitize-$tool-pytest.log" | tail -1)
  ran=$(grep -cE "(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)( |$)" "$OUT/sanitize-$tool-pytest.log")
  last=$(grep -E "(PASSED|FAILED|ERROR|SKIPPED)( |$)" "$OUT/sanitize-$tool-pytest.log" | tail -1 | cut -d' ' -f1)
  status="finished"
  [ $rc -eq 124 ] || [ $rc -eq 130 ] || [ $rc -eq 137 ] && status="TIMED OUT after ${limit}s (partial)"
  {
    echo "== $tool: $errors errors in $processes process(es)$([ "$tool" = racecheck ] && echo ", $hazards hazards")"
    echo "   pytest: ${result:-no result line}; $ran tests reported, the last: ${last:-none}"
    echo "   exit code $rc ($status), ${secs}s; -k: ${k:-none}${env_extra:+; ${env_extra[*]}}"
    if [ "$errors" != "0" ] || [ "$hazards" != "0" ]; then
      echo "   first reports:"
      cat "$OUT"/sanitize-"$tool"-*.log | grep -E "^========= (Invalid|Error|Race|Warning|Address|Program hit|Saved host)" | sort | uniq -c | sort -rn | head -15 | sed 's/^/     /'
    fi
    grep -E "(^(FAILED|ERROR) )|( FAILED( |$))" "$OUT/sanitize-$tool-pytest.log" | sort -u | head -10 | sed 's/^/   /'
    echo
  } >> "$summary"
  if [ "$errors" != "0" ] || [ "$hazards" != "0" ] || [ $rc -ne 0 ]; then overall=1; fi
done

cat "$summary"
exit $overall
