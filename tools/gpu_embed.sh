#!/usr/bin/env bash
# The embedding work on a GPU machine: build the CUDA core (always: an importable module may be
# a stale build), the sentence-transformers, one-graph and padding-free GPU tests, then sentence-transformers'
# encode() loop against fusedenc (bench/st_loop.py), a file of texts to a file of embeddings
# (bench/embed_file.py: the command against sentence-transformers' script, each a process) and
# the Ray actor's work without Ray (bench/distributed.py --actor-only).  Logs and results go
# to $OUT (or ./gpu-out); a summary is printed last.  Without the real all-MiniLM-L6-v2
# installed, a folder of its tokenizer's files (tokenizer.json, vocab.txt,
# tokenizer_config.json, special_tokens_map.json) in .cache/minilm-tokenizer lets the models
# run with random weights of their shapes.
#   bash tools/gpu_embed.sh [tests,loop,file,actor] [st_loop args...]
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSEDENC_REQUIRE_NATIVE=cuda
[ -d .cache/minilm-tokenizer ] && export FUSEDENC_MINILM_DIR=${FUSEDENC_MINILM_DIR:-$PWD/.cache/minilm-tokenizer}
stages=${1:-tests,loop,file,actor}
shift || true
bash "$(dirname "$0")/build_core.sh" "$OUT/build.log" || exit 1
summary=()
if [[ $stages == *tests* ]]; then
  FUSEDENC_REQUIRE_GPU=1 timeout -s INT 360 python3 -m pytest -q -p no:cacheprovider -rfE \
    tests/test_sentence_transformers_gpu.py tests/test_hf_gpu.py tests/test_embed_gpu.py tests/test_varlen_gpu.py \
    > "$OUT/gpu-tests.log" 2>&1
  summary+=("GPU tests (rc=$?): $(grep -E 'passed|failed' "$OUT/gpu-tests.log" | tail -1)")
fi
if [[ $stages == *loop* ]]; then
  timeout -s INT 420 python3 bench/st_loop.py --batch-sizes 32,128 --reps 3 \
    --impl compile,st-plain,st-compile,st-patched,corpus --out-dir "$OUT" "$@" > "$OUT/st_loop.log" 2>&1
  summary+=("st_loop (rc=$?)")
fi
if [[ $stages == *file* ]]; then
  timeout -s INT 360 python3 bench/embed_file.py --model minilm,bert-base --texts 200000 --out-dir "$OUT" > "$OUT/embed_file.log" 2>&1
  summary+=("embed_file (rc=$?)")
fi
if [[ $stages == *actor* ]]; then
  for shape in minilm bert-base; do
    timeout -s INT 150 python3 bench/distributed.py --actor-only --random "$shape" --device cuda --texts 20000 \
      --blocks 1024,4096,16384 --out-dir "$OUT" > "$OUT/actor-$shape.log" 2>&1
    summary+=("actor $shape (rc=$?)")
  done
fi
echo "==== summary"; printf '%s\n' "${summary[@]}"
cat "$OUT"/st_loop_*.txt "$OUT"/embed_file_*.txt 2>/dev/null
cat "$OUT"/distributed_actor_*.txt 2>/dev/null
true  # the summary above says how each stage ended (a stage not run leaves no file to show)
