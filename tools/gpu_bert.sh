#!/usr/bin/env bash
# The BERT-kernel work on a GPU machine, in one call: build the CUDA core (with the Hopper
# kernels), the GPU tests of the epilogue GEMMs and GELU units, FFN1 per op (cuBLASLt + the GELU
# pass against the Hopper GELU unit) at the encoder shapes, then the nps comparison with the
# A/B rows of the library's defaults (fusedenc-gelu-unit: the GELU units on; fusedenc-folded /
# fusedenc-unfolded: LayerNorm folding at every batch size / at none; both switches together)
# beside torch.compile.  Logs and results go to $OUT (or ./gpu-out); each
# step is capped so one slow step leaves the others' results; a summary is printed last.
# The small stage: MiniLM at 32 sentences, the pooled one-graph call against torch.compile's,
# with each row's GPU kernels a batch and their summed time (bench/embeddings.py --kernels: the
# floor a small batch could reach, and how close the call gets).  Without the real-models extra,
# .cache/minilm-tokenizer (the tokenizer's files) stands in, as for tools/gpu_embed.sh.
# The passages stage: patched Hugging Face models on retrieval passages (bench/embeddings.py
# --passages: runs of sentences up to 256 / 512 tokens, a few percent of padding) against
# torch.compile, embeddings checked against fp32 first.
#   bash tools/gpu_bert.sh [tests,ops,nps,small,passages]
# BERT_NPS_PRESETS (default bert-base-s128) and BERT_NPS_BATCHES (default 32,256,1024) pick the
# nps runs; BERT_OPS_PRESETS and BERT_OPS_TOKENS the per-op shapes; BERT_TESTS the pytest files
# (default: the sm90 GEMM and GELU tests; "all" runs the whole GPU suite, as tools/gpu_check.sh).
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
  for tokens in ${BERT_OPS_TOKENS:-4096 16384 65536}; do
    step "ops-$tokens" 120 python3 bench/ops.py --preset "${BERT_OPS_PRESETS:-minilm-s128,bert-base-s128,bge-large-s128}" \
      --tokens "$tokens" --ops ffn1 --out-dir "$OUT" --tag "ffn1-gelu-$tokens" --no-progress --step-timeout 60
  done
fi
if [[ $stages == *nps* ]]; then
  for preset in ${BERT_NPS_PRESETS:-bert-base-s128}; do
    step "nps-$preset" 400 python3 bench/nps.py --preset "$preset" --batch-sizes "${BERT_NPS_BATCHES:-32,256,1024}" \
      --impl torch-compile,fusedenc,fusedenc-gelu-unit,fusedenc-folded,fusedenc-unfolded,fusedenc-unfolded-gelu-unit --compile-modes max-autotune-no-cudagraphs \
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
