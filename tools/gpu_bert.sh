#!/usr/bin/env bash
# The BERT-kernel work on a GPU machine, in one call; logs and results go to $OUT (or ./gpu-out),
# each step under a cap (one slow step leaves the others' results), a summary printed last.
#   bash tools/gpu_bert.sh [tests,ops,nps,small,passages]     (default: all five)
# Always first: build the CUDA core with the Hopper kernels.
#   tests     the sm90 GEMM and GELU-unit GPU tests (BERT_TESTS: pytest files; "all": the whole suite)
#   ops       FFN1 per op, cuBLASLt + the GELU pass against the Hopper GELU unit, at MiniLM /
#             bert-base / bge-large shapes (BERT_OPS_PRESETS, BERT_OPS_TOKENS; BERT_OPS_DTYPE=bfloat16
#             and BERT_OPS_ACTIVATION=gelu_tanh for the other units)
#   nps       the body against torch.compile (the default mode and BERT_COMPILE_MODES, default
#             reduce-overhead: the best at bert-base 32 lately; max-autotune-no-cudagraphs costs
#             minutes of autotuning), with the A/B rows of the library's defaults: GELU units off,
#             LayerNorm folding at every batch size / at none, folding off with the units off
#             (BERT_NPS_PRESETS default bert-base-s128, BERT_NPS_BATCHES default 32,256,1024;
#             BERT_NPS_KERNELS=1: each point's kernels and their device time, bench/nps.py --kernels)
#   small     MiniLM and bert-base at 32 sentences, the pooled one-graph call against
#             torch.compile's, with each row's kernels a batch and their summed time
#             (bench/embeddings.py --kernels: the floor, and how close the call gets)
#   passages  patched models on retrieval passages (bench/embeddings.py --passages 512 and 256,
#             a few percent of padding) against torch.compile, checked against fp32 first
# Without the real-models extra, .cache/minilm-tokenizer (the tokenizer's files) stands in for
# the MiniLM tokenizer, as for tools/gpu_embed.sh.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSEDENC_REQUIRE_NATIVE=cuda
[ -d .cache/minilm-tokenizer ] && export FUSEDENC_MINILM_DIR=${FUSEDENC_MINILM_DIR:-$PWD/.cache/minilm-tokenizer}
stages=${1:-tests,ops,nps,small,passages}
steps=()
step() {  # step NAME SECONDS command...: under a cap (SIGINT first: pytest and the benches still report)
  local name=$1 cap=$2 start=$SECONDS; shift 2
  timeout --signal=INT --kill-after=15 "$cap" "$@" > "$OUT/$name.log" 2>&1
  steps+=("$name: rc=$?, $((SECONDS - start)) s")
}

bash "$(dirname "$0")/build_core.sh" "$OUT/build.log" || exit 1
python3 -c "import fusedenc.core as c; print('GELU units:', c.sm90_gelu_epilogue_kernels())" > "$OUT/env.txt" 2>&1

if [[ $stages == *tests* ]]; then
  tests=${BERT_TESTS:-tests/test_sm90_gelu_gpu.py tests/test_sm90_gemm_gpu.py}
  [ "$tests" = all ] && tests=""
  parallel=()
  python3 -c "import xdist" 2>/dev/null && { parallel=(-n 10); export OMP_NUM_THREADS=1; }
  # shellcheck disable=SC2086
  FUSEDENC_REQUIRE_GPU=1 step gpu-tests 420 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs \
    "${parallel[@]}" $tests
fi
if [[ $stages == *ops* ]]; then
  for tokens in ${BERT_OPS_TOKENS:-4096 16384 65536 262144}; do
    variant=(); tag="ffn1-${BERT_OPS_ACTIVATION:-gelu}${BERT_OPS_DTYPE:+-$BERT_OPS_DTYPE}-$tokens"
    [ -n "${BERT_OPS_ACTIVATION:-}" ] && variant+=(--activation "$BERT_OPS_ACTIVATION")
    [ -n "${BERT_OPS_DTYPE:-}" ] && variant+=(--dtype "$BERT_OPS_DTYPE")
    step "ops-$tokens" 120 python3 bench/ops.py --preset "${BERT_OPS_PRESETS:-minilm-s128,bert-base-s128,bge-large-s128}" \
      --tokens "$tokens" --ops ffn1 "${variant[@]}" --out-dir "$OUT" --tag "$tag" --no-progress --step-timeout 60
  done
fi
if [[ $stages == *nps* ]]; then
  for preset in ${BERT_NPS_PRESETS:-bert-base-s128}; do
    step "nps-$preset" 400 python3 bench/nps.py --preset "$preset" --batch-sizes "${BERT_NPS_BATCHES:-32,256,1024}" \
      --impl torch-compile,fusedenc,fusedenc-gelu-pass,fusedenc-folded,fusedenc-unfolded,fusedenc-unfolded-gelu-pass \
      --compile-modes "${BERT_COMPILE_MODES:-reduce-overhead}" ${BERT_NPS_KERNELS:+--kernels} \
      --out-dir "$OUT" --no-plot --no-progress --step-timeout 240
  done
fi
if [[ $stages == *small* ]]; then
  step small 300 python3 bench/embeddings.py --model minilm,bert-base --batch-sizes 32 --kernels \
    --impl compile-ro-pooled,fusedenc-pooled --out-dir "$OUT" --tag small-batch-kernels
fi
if [[ $stages == *passages* ]]; then
  for tokens in 512 256; do
    step "passages-$tokens" 400 python3 bench/embeddings.py --model bert-base,minilm --batch-sizes 32,256 \
      --passages "$tokens" --impl hf-sdpa,compile-pooled,compile-ro-pooled,fusedenc,fusedenc-pooled \
      --out-dir "$OUT" --tag "passages$tokens"
  done
fi

echo "==== steps"; printf '%s\n' "${steps[@]}"; cat "$OUT/env.txt"
[ -f "$OUT/gpu-tests.log" ] && { echo "==== GPU tests"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu-tests.log" | tail -20; }
for f in "$OUT"/ops-*.log; do [ -f "$f" ] && { echo "==== $(basename "$f")"; grep -E "^ *(ffn1|torch|F\.|fusedenc|triton|Hopper)" "$f" | cut -c1-120; }; done
for f in "$OUT"/nps-*.log; do [ -f "$f" ] && { echo "==== $(basename "$f")"; grep -E "^ +[0-9]+ +(torch-compile|fusedenc|gemm-floor)" "$f" | cut -c1-110; }; done
[ -f "$OUT/embeddings_small-batch-kernels.txt" ] && { echo "==== small batches"; grep -E "^  (compile|fusedenc|  )" "$OUT/embeddings_small-batch-kernels.txt"; }
for f in "$OUT"/embeddings_passages*.txt; do [ -f "$f" ] && { echo "==== $(basename "$f")"; grep -E "^(minilm|bert-base)|^  (hf|compile|fusedenc)" "$f" | cut -c1-120; }; done
true  # the summary above says how each step ended
