#!/usr/bin/env bash
# Run a list of GPU tests under one compute-sanitizer tool in several concurrent
# shards on one GPU, for one device call (10 minutes at most).
#
#   bash tools/sanitize_shards.sh --tool racecheck [--shards N] [--timeout SECONDS] [--no-build] LIST
#
# LIST holds pytest node ids, one a line (tools/sanitize_coverage.py --remaining
# writes it: the tests a tool has not yet covered).  They are dealt round-robin to
# N shards (default 6); each shard is one tools/sanitize.sh run in $OUT/shard-<i>.
# Outputs, in $OUT (default ./sanitize-out):
#   sanitize-summary.txt         every shard's summary, after one header
#   sanitize-<tool>-covered.txt  the tests the shards covered (see sanitize.sh), to append to
#                                reports/<tool>-covered.txt
#   host-memory.txt              host memory used (all, and per shard) and GPU use, every 10 s
#                                (FUSEDENC_SANITIZE_MONITOR_S)
#   sanitize-logs.tgz            the shards' logs (the sanitizer's reports, pytest's output)
#
# Exit status: 0 every shard finished with no problem; 3 no problem, but some shard was cut short
# by its limit (expected: the covered list says how far each got); 1 a shard found a problem (a
# report in our kernels, a failed test, a killed or crashed process): it covers nothing, the others
# still count; 2 bad arguments.
#
# Why shards: racecheck over the regular tests is slow (tools/sanitize.sh, header) and a test
# that does not finish inside one call's limit is not covered.  For small tests, whose time is
# mostly Python and pytest, concurrent processes covered about twice the tests of one process
# (2026-11-22: 74 tests in 460 s from six shards against 30-47 from one).  Tests that take
# minutes keep the GPU busy alone, and shards only split it: use one or two for those
# (reports/sanitize-2026-11-22e-h100.txt: one shard finished seven in a call, two shards four
# or five).  Host memory is the other limit: six shards of ordinary tests stay near 50 GB of
# the machine's 128 GiB, but a few tests grow a racecheck process by tens of GB, and the OOM
# killer ends the largest shard (seen 2026-11-22: test_threads_on_separate_streams_match_serial
# and test_graph_runner_matches_eager beside other shards; test_t82_stack_at_depth even alone).
# Give those a call of their own; FUSEDENC_SANITIZE_STACKS_S (tools/sanitize.sh) shows where
# their memory grows, beside host-memory.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/sanitize-out}

tool=""
shards=6
limit=470
build=1
list=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tool) tool="$2"; shift 2 ;;
    --shards) shards="$2"; shift 2 ;;
    --timeout) limit="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    -*) echo "sanitize_shards.sh: unknown option $1" >&2; exit 2 ;;
    *) list="$1"; shift ;;
  esac
done
case "$tool" in memcheck|racecheck) ;; *) echo "sanitize_shards.sh: --tool memcheck or racecheck" >&2; exit 2 ;; esac
[[ "$shards" =~ ^[1-9][0-9]*$ ]] || { echo "sanitize_shards.sh: --shards takes a positive count, not '$shards'" >&2; exit 2; }
[ -n "$list" ] && [ -r "$list" ] || { echo "sanitize_shards.sh: a readable list of node ids is required" >&2; exit 2; }
mapfile -t tests < <(bash tools/sanitize.sh --print-tests "$list")
[ ${#tests[@]} -gt 0 ] || { echo "sanitize_shards.sh: $list names no tests" >&2; exit 2; }
[ "$shards" -gt ${#tests[@]} ] && shards=${#tests[@]}
mkdir -p "$OUT"

if [ $build -eq 1 ]; then
  bash tools/build_core.sh "$OUT/build.log" || exit 1
fi

# Round-robin, so the neighbours in a list (a file's largest cases come together) spread out.
for ((i = 0; i < shards; i++)); do
  rm -rf "$OUT/shard-$i"; mkdir -p "$OUT/shard-$i"
  : > "$OUT/shard-$i/tests.txt"
done
for ((j = 0; j < ${#tests[@]}; j++)); do
  echo "${tests[$j]}" >> "$OUT/shard-$((j % shards))/tests.txt"
done

# Each shard in its own session, so that its processes (sanitizer, pytest, subprocesses) can be
# summed: the OOM killer takes the largest shard, and host-memory.txt says which one grew.
pids=()
for ((i = 0; i < shards; i++)); do
  OUT="$OUT/shard-$i" setsid bash tools/sanitize.sh --no-build --tools "$tool" --timeout "$limit" \
    --tests-file "$OUT/shard-$i/tests.txt" > "$OUT/shard-$i/driver.txt" 2>&1 &
  pids+=($!)
done
interval=${FUSEDENC_SANITIZE_MONITOR_S:-10}
# The tests run on the first visible GPU; nvidia-smi ignores CUDA_VISIBLE_DEVICES and would print
# a line for every GPU of a larger machine (it takes an index or a UUID, as that variable does).
gpu=${CUDA_VISIBLE_DEVICES:-0}; gpu=${gpu%%,*}
( while sleep "$interval"; do
    per_shard=$(for pid in "${pids[@]}"; do ps -o rss= -s "$pid" 2>/dev/null | awk '{s += $1} END {printf "%d ", s / 1048576}'; done)
    echo "$(date +%T) host $(free -g | awk 'NR==2{print $3}') GB (shards: ${per_shard% }), gpu $(nvidia-smi -i "${gpu:-0}" --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null)"
  done > "$OUT/host-memory.txt" ) &
monitor=$!
# sanitize.sh exits 0 (finished, no problem), 3 (no problem, cut short by the limit: the usual
# case here, the covered list says how far it got) or 1 (a problem: see its summary).
codes=()
for pid in "${pids[@]}"; do wait "$pid"; codes+=($?); done
kill "$monitor" 2>/dev/null
overall=0
verdict=()
for ((i = 0; i < shards; i++)); do
  case "${codes[$i]}" in
    0) verdict+=("finished, no problem") ;;
    3) verdict+=("cut short by the limit, no problem"); [ $overall -eq 0 ] && overall=3 ;;
    *) verdict+=("A PROBLEM (exit ${codes[$i]}): covers nothing"); overall=1 ;;
  esac
done

summary="$OUT/sanitize-summary.txt"
{
  echo "fusedenc compute-sanitizer shards: $tool, ${#tests[@]} tests from $list in $shards shards, ${limit}s each"
  echo "git: ${FUSEDENC_SOURCE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  echo "peak host memory: $(awk '{print $3}' "$OUT/host-memory.txt" | sort -n | tail -1) GB (per shard, every ${interval} s: host-memory.txt)"
  for ((i = 0; i < shards; i++)); do
    echo
    echo "#### shard $i ($(wc -l < "$OUT/shard-$i/tests.txt") tests): ${verdict[$i]}"
    # The selection line lists every node id: the shard's tests.txt has them.
    grep -v "^selection:" "$OUT/shard-$i/sanitize-summary.txt" 2>/dev/null || echo "(no summary: see shard-$i/driver.txt)"
  done
} > "$summary"
cat "$OUT"/shard-*/sanitize-"$tool"-covered.txt 2>/dev/null | sort -u > "$OUT/sanitize-$tool-covered.txt"
(cd "$OUT" && tar czf sanitize-logs.tgz shard-* && rm -rf shard-*)
cat "$summary"
echo
echo "covered: $(wc -l < "$OUT/sanitize-$tool-covered.txt") of ${#tests[@]} tests"
exit $overall
