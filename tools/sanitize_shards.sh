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
#   host-memory.txt              host memory used and GPU use, every 10 s
#   sanitize-logs.tgz            the shards' logs (the sanitizer's reports, pytest's output)
#
# Why shards: racecheck over the regular tests is slow (tools/sanitize.sh, header) and a test
# that does not finish inside one call's limit is not covered.  Concurrent processes kept the
# H100 at 100% and covered about twice the tests of one process in the same time
# (2026-11-22: 74 tests in 460 s from six shards against 30-47 from one).  Six racecheck
# processes peaked at 66 GB of the machine's 128 GiB: more shards risk the OOM killer.
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
mapfile -t tests < <(grep -vE '^[[:space:]]*(#|$)' "$list" | sed -E 's/ (passed|skipped|ran)$//')
[ ${#tests[@]} -gt 0 ] || { echo "sanitize_shards.sh: $list names no tests" >&2; exit 2; }
[ "$shards" -gt ${#tests[@]} ] && shards=${#tests[@]}
mkdir -p "$OUT"

if [ $build -eq 1 ]; then
  if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
  fi
fi

# Round-robin, so the neighbours in a list (a file's largest cases come together) spread out.
for ((i = 0; i < shards; i++)); do
  rm -rf "$OUT/shard-$i"; mkdir -p "$OUT/shard-$i"
  : > "$OUT/shard-$i/tests.txt"
done
for ((j = 0; j < ${#tests[@]}; j++)); do
  echo "${tests[$j]}" >> "$OUT/shard-$((j % shards))/tests.txt"
done

( while sleep 10; do
    echo "$(date +%T) host $(free -g | awk 'NR==2{print $3}') GB, gpu $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null)"
  done > "$OUT/host-memory.txt" ) &
monitor=$!
pids=()
for ((i = 0; i < shards; i++)); do
  OUT="$OUT/shard-$i" bash tools/sanitize.sh --no-build --tools "$tool" --timeout "$limit" \
    --tests-file "$OUT/shard-$i/tests.txt" > "$OUT/shard-$i/driver.txt" 2>&1 &
  pids+=($!)
done
overall=0
for pid in "${pids[@]}"; do wait "$pid" || overall=1; done
kill "$monitor" 2>/dev/null

summary="$OUT/sanitize-summary.txt"
{
  echo "fusedenc compute-sanitizer shards: $tool, ${#tests[@]} tests from $list in $shards shards, ${limit}s each"
  echo "git: ${FUSEDENC_SOURCE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  echo "peak host memory: $(awk '{print $3}' "$OUT/host-memory.txt" | sort -n | tail -1) GB"
  for ((i = 0; i < shards; i++)); do
    echo
    echo "#### shard $i ($(wc -l < "$OUT/shard-$i/tests.txt") tests)"
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
