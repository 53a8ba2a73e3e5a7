#!/usr/bin/env bash
# Run the GPU test suite (or a selection of it) under compute-sanitizer and
# write a per-tool summary of the errors it found.
#
#   bash tools/sanitize.sh [--tools memcheck,racecheck] [--timeout SECONDS] [--no-build]
#                          [--tests-file FILE] [pytest args...]
#   bash tools/sanitize.sh --print-k TOOL     the -k of the default selection under TOOL
#   bash tools/sanitize.sh --print-tests FILE the node ids that --tests-file FILE runs
#
# --tests-file FILE adds the node ids in FILE (one a line) to the pytest args: how
# tools/sanitize_shards.sh hands each shard its share of a list of tests.
#
# Without pytest args it runs the default selection below.  Each tool runs
# pytest once, under `timeout`, so that one device command (10 minutes at most)
# can hold the build and both tools: pass a smaller selection (files, -k) and
# call it several times when the whole suite does not fit.  Outputs, in $OUT
# (default ./sanitize-out):
#   sanitize-summary.txt           per tool: errors, racecheck hazards, pytest's result line, exit codes
#   sanitize-<tool>-pytest.log     pytest's output under the tool
#   sanitize-<tool>-<pid>.log      the sanitizer's report per process (subprocesses included)
#   sanitize-<tool>-covered.txt    "<node id> passed|skipped" for each test that ran to its end, written
#                                  only when the run found nothing in our kernels and no test failed
#                                  (a run cut short by its time limit still covers the tests it finished):
#                                  what reports/<tool>-covered.txt accumulates across device calls
# Environment:
#   FUSEDENC_SANITIZE_FLAGS="..."  more compute-sanitizer options (after ours; the summary names them)
#   FUSEDENC_SANITIZE_STACKS_S=N   every N s, each pytest process writes its Python stack to
#                                  $OUT/stacks-<pid>.txt (tools/pytest_stack_dumps.py): which test line
#                                  ran while host memory grew (tools/sanitize_shards.sh: host-memory.txt)
# Exit status: 0 every tool's run finished with no problem; 1 a problem in some run (a report in
# our kernels, a sanitizer failure, a killed or crashed process, a failed test); 3 no problem, but
# a run was cut short by its time limit (it covers the tests it finished); 2 bad arguments.
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
#             checks every kernel, the vendor libraries' too, and the summary sorts its reports
#             by kernel: ours (a failure) and the libraries' (LIBRARY_KERNELS below: cuBLASLt's
#             nvjet/xmma/cutlass GEMMs, cuDNN, PyTorch's flash/memory-efficient attention;
#             listed, not a failure).  On Hopper those synchronize shared memory through TMA
#             and mbarriers, which racecheck does not model, so it reports hazards in them
#             (seen: 72,064 in cuBLASLt's nvjet kernels and cuDNN's SDPA kernel) that we cannot
#             act on.  Skipping them would be ~10x faster, but compute-sanitizer 2025.3.1's
#             kernel filters (--kernel-name, --kernel-name-exclude, any pattern) make racecheck
#             fail with "Internal Sanitizer Error: The Sanitizer failed to handle a hardware
#             exception" on the first kernel of a process that has loaded a Triton kernel or
#             runs our tests (reproduced 2026-11-22 on an H100 with one triton_short call and
#             with the ops tests; the same runs without a filter are clean), so none is used.
#             So racecheck over the regular tests is slow (their GPU references are large cuBLAS
#             GEMMs: ~30 s a test for the 4097-row Triton GEMM tests, hours for the suite), and
#             tests/test_kernel_sweep_gpu.py exists for it: every launch configuration of our
#             kernels against CPU references, ~20 s under racecheck:
#                 bash tools/sanitize.sh --tools racecheck tests/test_kernel_sweep_gpu.py -m gpu
#             The suite's coverage is built over many calls: reports/racecheck-covered.txt,
#             tools/sanitize_coverage.py (what is left) and tools/sanitize_shards.sh (runs it).
#             Under racecheck the concurrency tests (8 threads on 8 streams, a graph replay beside
#             eager calls, concurrent first use) are deselected: racecheck's host-side state for
#             them outgrows a 128 GiB machine (the OOM killer ended the process at 127.9 GB,
#             2026-11-22).  memcheck runs them.  FUSEDENC_SANITIZE_CONCURRENCY=1 keeps them, for a
#             machine with more host memory; on a 256 GiB H200 machine two still outgrew it and the
#             third hung with the GPU idle (reports/sanitize-2026-11-22f-h100.txt, call 7).
#   An "Internal Sanitizer Error" line is counted as an error: the tool failed, nothing was checked.
#   tests with "tune" in their names (tune attention/gemm in a subprocess: timing runs with
#             their own time limits) are deselected under both tools.
#   pytest runs with -v, -rfE and per-test times, so a run stopped by its time limit still says
#             which tests passed or failed and how long each took; errors are counted from the
#             reports themselves, as a process killed by the limit writes no ERROR SUMMARY line.
#   torch.compile tests are deselected by default (Triton compilation under the sanitizer takes
#             minutes and checks nothing of ours); the fuzz tests run FUSEDENC_FUZZ_EXAMPLES=5.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/sanitize-out}

# The default selection: every GPU test except the long stress tests (100k calls, a
# third of the GPU's memory, two subprocesses: hours under memcheck) and torch.compile.
DEFAULT_K="not stress and not oversized and not processes and not compile"
# memcheck runs without PyTorch's caching allocator unless FUSEDENC_SANITIZE_CACHING=1 (header).
memcheck_uncached=1
[ "${FUSEDENC_SANITIZE_CACHING:-0}" = "1" ] && memcheck_uncached=0
# The -k terms each tool adds to the user's selection (reasons in the header): one definition,
# used by the runs below; --print-k prints the default selection's under a tool, the suite
# that tools/sanitize_coverage.py counts a tool's coverage against.
tool_k() {
  local k="not tune"
  if [ "$1" = "memcheck" ] && [ $memcheck_uncached -eq 1 ]; then
    k="$k and not graph and not captur"
  elif [ "$1" = "racecheck" ] && [ "${FUSEDENC_SANITIZE_CONCURRENCY:-0}" != "1" ]; then  # host memory: see the header
    k="$k and not eight_threads and not beside_eager and not concurrent_first_use"
  fi
  echo "$k"
}

# The node ids of a list file, one a line: comments and blank lines skipped, a ledger's outcome
# word dropped (node ids may hold spaces: "[129-32-at most 128]").  --tests-file reads a list
# with it; --print-tests prints one, for tools/sanitize_shards.sh to deal out.
tests_in() {
  grep -vE '^[[:space:]]*(#|$)' "$1" | sed -E 's/ (passed|skipped|ran)$//'
}

tools="memcheck,racecheck"
limit=270
build=1
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tools) tools="$2"; shift 2 ;;
    --timeout) limit="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    --tests-file)
      [ -r "$2" ] || { echo "sanitize.sh: --tests-file $2: not readable" >&2; exit 2; }
      mapfile -t listed < <(tests_in "$2")
      args+=("${listed[@]}"); shift 2 ;;
    --print-tests)
      [ -r "$2" ] || { echo "sanitize.sh: --print-tests $2: not readable" >&2; exit 2; }
      tests_in "$2"; exit 0 ;;
    --print-k)
      case "$2" in memcheck|racecheck) echo "($DEFAULT_K) and $(tool_k "$2")"; exit 0 ;;
        *) echo "sanitize.sh: --print-k takes memcheck or racecheck, not '$2'" >&2; exit 2 ;; esac ;;
    *) args+=("$1"); shift ;;
  esac
done
mkdir -p "$OUT"

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
export FUSEDENC_FUZZ_EXAMPLES=${FUSEDENC_FUZZ_EXAMPLES:-5}
if [ $build -eq 1 ]; then
  bash tools/build_core.sh "$OUT/sanitize-build.log" || { echo "BUILD FAILED" > "$OUT/sanitize-summary.txt"; exit 1; }
fi

# The vendor libraries' kernels (see the header): cuBLASLt's GEMMs, cuDNN, PyTorch's attention kernels.
# Ours are layer_norm_kernel, bias_activation_kernel (csrc/kernels) and the Triton kernels
# _short_attention_kernel and _linear_act_kernel, none of which matches.
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
  gpu=${CUDA_VISIBLE_DEVICES:-0}; gpu=${gpu%%,*}  # the tests' GPU: the first visible one
  nvidia-smi -i "${gpu:-0}" --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  python3 -c "import torch, fusedenc; print('torch', torch.__version__, 'cuda', torch.version.cuda, '|', fusedenc.backend())" 2>&1
  echo "selection: ${args[*]}"
  # FUSEDENC_SOURCE_COMMIT names the code where .git is not its own (a copied working tree)
  echo "git: ${FUSEDENC_SOURCE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')}"
  echo
} > "$summary"

# What every tool's run shares: the caller's extra sanitizer options, and the stack dumps.
read -r -a more_flags <<< "${FUSEDENC_SANITIZE_FLAGS:-}"
stack_env=()
plugin=()
rm -f "$OUT"/stacks-*.txt
if [ -n "${FUSEDENC_SANITIZE_STACKS_S:-}" ]; then
  stack_env=("PYTHONPATH=$PWD/tools${PYTHONPATH:+:$PYTHONPATH}" "FUSEDENC_DUMP_STACKS_S=$FUSEDENC_SANITIZE_STACKS_S"
             "FUSEDENC_DUMP_STACKS_DIR=$OUT")
  plugin=(-p pytest_stack_dumps)
fi

overall=0
IFS=',' read -r -a tool_list <<< "$tools"
for tool in "${tool_list[@]}"; do
  rm -f "$OUT"/sanitize-"$tool"-*.log
  k="${user_k:+($user_k) and }$(tool_k "$tool")"
  env_extra=()
  if [ "$tool" = "memcheck" ] && [ $memcheck_uncached -eq 1 ]; then
    env_extra=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
  fi
  tool_flags=()
  if [ "$tool" = "racecheck" ]; then
    tool_flags=(--racecheck-report analysis)
  fi
  tool_flags+=("${more_flags[@]}")
  env_extra+=("${stack_env[@]}")
  kargs=()
  [ -n "$k" ] && kargs=(-k "$k")
  start=$(date +%s)
  env "${env_extra[@]}" timeout --signal=INT --kill-after=30 "$limit" \
    "$SANITIZER" --tool "$tool" --target-processes all --report-api-errors "${FUSEDENC_SANITIZE_API_ERRORS:-no}" \
    --print-limit 100 --error-exitcode 86 "${tool_flags[@]}" \
    --log-file "$OUT/sanitize-$tool-%p.log" \
    python3 -m pytest -v -rfE -p no:cacheprovider "${plugin[@]}" -o console_output_style=times --maxfail=20 "${rest[@]}" "${kargs[@]}" \
    > "$OUT/sanitize-$tool-pytest.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  # "========= ERROR SUMMARY: 3 errors" once per process; racecheck also prints
  # "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)".
  logs=("$OUT"/sanitize-"$tool"-[0-9]*.log)
  summed=$(cat "${logs[@]}" 2>/dev/null | grep -E "ERROR SUMMARY: [0-9]+ error" | sed -E 's/.*ERROR SUMMARY: ([0-9]+) error.*/\1/' | awk '{s += $1} END {print s + 0}')
  processes=$(cat "${logs[@]}" 2>/dev/null | grep -cE "(ERROR|RACECHECK) SUMMARY")
  # The reports themselves, as a process stopped by the time limit prints no summary line:
  # "========= Invalid __global__ read ...", "Error: Race reported between Read access at <kernel>+0x..",
  # "Internal Sanitizer Error: ..." (the tool failed: nothing after it was checked).
  cat "${logs[@]}" 2>/dev/null | grep -E "^========= (Invalid|Error|Program hit|Warning: Race|Address|Internal Sanitizer Error)" > "$OUT/sanitize-$tool-reports.txt"
  reports=$(wc -l < "$OUT/sanitize-$tool-reports.txt")
  internal=$(grep -c "Internal Sanitizer Error" "$OUT/sanitize-$tool-reports.txt")
  # "Error: process didn't terminate successfully": a process killed or crashed, not a report
  # about a kernel (under racecheck, the OOM killer: see the header).  It fails the run all the same.
  killed=$(grep -c "process didn't terminate successfully" "$OUT/sanitize-$tool-reports.txt")
  library=0
  if [ "$tool" = racecheck ]; then  # races in the vendor libraries' kernels are listed, not counted (header)
    library=$(grep -E "Race reported" "$OUT/sanitize-$tool-reports.txt" | grep -cE "access at [^ ]*($LIBRARY_KERNELS)")
  fi
  ours=$((reports - library - killed))
  if [ "$tool" = memcheck ] && [ $((summed - killed)) -gt "$ours" ]; then ours=$((summed - killed)); fi
  result=$(grep -E "[0-9]+ (passed|failed|error)" "$OUT/sanitize-$tool-pytest.log" | tail -1)
  ran=$(grep -cE "(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)( |$)" "$OUT/sanitize-$tool-pytest.log")
  last=$(grep -E "(PASSED|FAILED|ERROR|SKIPPED)( |$)" "$OUT/sanitize-$tool-pytest.log" | tail -1 | cut -d' ' -f1)
  status="finished"
  [ $rc -eq 124 ] || [ $rc -eq 130 ] || [ $rc -eq 137 ] && status="TIMED OUT after ${limit}s (partial)"
  {
    echo "== $tool: $ours reports in fusedenc or PyTorch kernels ($internal of them internal sanitizer errors)$([ "$tool" = racecheck ] && echo ", $library race reports in vendor library kernels (not counted)"); $processes process(es) finished"
    [ "$killed" -gt 0 ] && echo "   $killed process(es) killed or crashed (\"process didn't terminate successfully\": out of host memory?): the run covers nothing"
    echo "   pytest: ${result:-no result line}; $ran tests reported, the last: ${last:-none}"
    echo "   exit code $rc ($status), ${secs}s; -k: ${k:-none}${env_extra:+; ${env_extra[*]}}"
    echo "   sanitizer options: --tool $tool ${tool_flags[*]}"
    if [ "$reports" -gt 0 ]; then
      echo "   reports (count, first line):"
      sed -E 's/\+0x[0-9a-f]+//g' "$OUT/sanitize-$tool-reports.txt" | sort | uniq -c | sort -rn | head -15 | sed 's/^/     /'
    fi
    grep -E "(^(FAILED|ERROR) )|( FAILED( |$))" "$OUT/sanitize-$tool-pytest.log" | sort -u | head -10 | sed 's/^/   /'
    echo
  } >> "$summary"
  # Failed or errored tests, from -v's per-test lines and -rfE's summary (a run cut short has no result line).
  failed=$(grep -cE "( (FAILED|ERROR)( |$))|(^(FAILED|ERROR) )" "$OUT/sanitize-$tool-pytest.log")
  # A problem: any report in our kernels, a sanitizer failure, a killed or crashed process, a
  # failed test, or an exit code that is none of these (86 alone is the sanitizer's: the library
  # kernels' races set it too).  A run cut short by its limit with no problem is "short".
  problem=0
  if [ "$ours" -ne 0 ] || [ "$killed" -ne 0 ] || [ "$failed" -ne 0 ]; then
    problem=1
  elif [ "$status" = finished ] && [ $rc -ne 0 ] && [ $rc -ne 86 ]; then
    problem=1
  fi
  if [ $problem -eq 1 ]; then
    overall=1
  elif [ "$status" != finished ] && [ $overall -eq 0 ]; then
    overall=3
  fi
  # The tests this run covers: none after a problem; a run cut short covers the tests it finished.
  covered="$OUT/sanitize-$tool-covered.txt"
  rm -f "$covered"
  if [ $problem -eq 0 ]; then
    grep -E "^[^ ]+::.* (PASSED|SKIPPED)( |$)" "$OUT/sanitize-$tool-pytest.log" \
      | sed -E 's/^(.*::.*) (PASSED|SKIPPED)( .*)?$/\1 \L\2/' > "$covered"
  fi
done

cat "$summary"
exit $overall
