#!/usr/bin/env bash
# One call on a GPU machine (two GPUs give the multi-GPU rows): build the CUDA core, time
# positions -> moves (bench/lc0_positions.py) for synthetic T82 and BT4 nets, and run the
# positions/evaluator GPU tests.  Logs and results go to $OUT (or ./gpu-out); a short summary
# is printed last.  Steps are capped so that a slow one still leaves the others' results.
# Usage: bash tools/gpu_positions.sh [nets, default "t82 bt4"]
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSEDENC_REQUIRE_GPU=1 FUSEDENC_REQUIRE_NATIVE=cuda
nets=${1:-t82 bt4}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nproc
} > "$OUT/env.txt" 2>&1
start=$(date +%s)
bash "$(dirname "$0")/build_core.sh" "$OUT/build.log" || exit 1
echo "build: $(( $(date +%s) - start )) s" >> "$OUT/env.txt"
devices=""
[ "$(nvidia-smi -L | wc -l)" -ge 2 ] && devices="--devices cuda:0,cuda:1"
first=${nets%% *}
timeout --signal=INT 200 python3 bench/lc0_positions.py --synthetic "$first" $devices --compare-switch --out-dir "$OUT" > "$OUT/bench-$first.log" 2>&1
echo "bench $first: rc $? at $(( $(date +%s) - start )) s" >> "$OUT/env.txt"
timeout --signal=INT 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/test_lc0_positions_gpu.py \
  tests/test_lc0_evaluator.py ${FUSEDENC_EXTRA_GPU_TESTS:-tests/test_lc0_network.py} > "$OUT/gpu-tests.log" 2>&1
tests_rc=$?
echo "tests: rc $tests_rc at $(( $(date +%s) - start )) s" >> "$OUT/env.txt"
for net in ${nets#"$first"}; do
  timeout --signal=INT 200 python3 bench/lc0_positions.py --synthetic "$net" $devices --out-dir "$OUT" > "$OUT/bench-$net.log" 2>&1
  echo "bench $net: rc $? at $(( $(date +%s) - start )) s" >> "$OUT/env.txt"
done
rm -f "$OUT"/*.epd "$OUT"/*.pb.gz
echo "==== environment"; cat "$OUT/env.txt"
echo "==== GPU tests (rc=$tests_rc)"; tail -3 "$OUT/gpu-tests.log"
for net in $nets; do echo "==== $net"; grep -v "^\[" "$OUT/bench-$net.log" | tail -14; done
exit $tests_rc
