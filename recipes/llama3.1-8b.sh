#!/usr/bin/env bash
# Draft layers for Llama 3.1 8B (or another Llama/Qwen checkpoint) on one 8-GPU node.
#
#   MODEL_DIR=/models/llama3.1-8b PROMPTS=/data/books bash recipes/llama3.1-8b.sh [OUT]
#
# MODEL_DIR: the Hugging Face checkpoint; PROMPTS: text to cut prompts from (.txt/.jsonl/.parquet/.csv
# files or folders; the bundled books, data/corpus, by default); HELD_OUT: text for the held-out
# evaluation that training never sees; GPUS: ranks (default 8). Every step runs over torchrun, one
# GPU per rank, and resumes where it stopped when the script is run again. The time it takes is
# modeled in docs/bench/modeled-8b-training (not yet run on a GPU node).
set -euo pipefail
cd "$(dirname "$0")/.."

: "${MODEL_DIR:?set MODEL_DIR to the Hugging Face model directory}"
OUT="${1:-runs/heads-llama3.1-8b}"
GPUS="${GPUS:-8}"
PROMPTS="${PROMPTS:-data/corpus/moby_dick.txt.gz data/corpus/war_and_peace.txt.gz data/corpus/iliad.txt.gz}"
HELD_OUT="${HELD_OUT:-data/corpus/pride_and_prejudice.txt.gz}"
RUN=(.venv/bin/torchrun --standalone --nproc-per-node "$GPUS" -m tokenswift_trt)
SAMPLING=(--min-p 0.1 --penalty 1.2 --penalty-window 1024)   # the paper's
mkdir -p "$OUT"

echo "== 1/3 the model writes its training text and held-out text" >&2
"${RUN[@]}" train-data --model-dir "$MODEL_DIR" $(printf -- '--prompts %s ' $PROMPTS) --sequences 8192 \
    --prompt-tokens 128 --new-tokens 2048 --max-batch 32 --seed 0 "${SAMPLING[@]}" --device cuda \
    --method ar --output "$OUT/data.jsonl"
"${RUN[@]}" train-data --model-dir "$MODEL_DIR" $(printf -- '--prompts %s ' $HELD_OUT) --sequences 64 \
    --prompt-tokens 128 --new-tokens 2048 --max-batch 32 --seed 1000 "${SAMPLING[@]}" --device cuda \
    --method ar --output "$OUT/held-out.jsonl"

echo "== 2/3 train-heads on $GPUS GPUs" >&2
RESUME=()
if [[ -f "$OUT/heads/checkpoint.pt" ]]; then RESUME=(--resume); fi
"${RUN[@]}" train-heads --model-dir "$MODEL_DIR" --data "$OUT/data.jsonl" --eval-data "$OUT/held-out.jsonl" \
    --out "$OUT/heads" --root-width 4096 --draft-vocab 16384 --loss sampled --teacher-window 1024 \
    --steps 6000 --seq-len 2048 --batch 4 --grad-accum 4 --lr 1e-3 --warmup-steps 200 \
    --eval-every 500 --checkpoint-every 250 --seed 1 --dtype bfloat16 --device cuda "${RESUME[@]}"

echo "== 3/3 eval-heads on the held-out text" >&2
.venv/bin/tokenswift-trt eval-heads --model-dir "$MODEL_DIR" --heads "$OUT/heads/heads.safetensors" \
    --data "$OUT/held-out.jsonl" --sequences 32 --seq-len 2048 --measure-prompts 8 --measure-tokens 1024 \
    "${SAMPLING[@]}" --device cuda --dtype bfloat16 --out "$OUT/eval.json"
echo "heads: $OUT/heads/heads.safetensors (serve with --heads, or make deploy HEADS=...)" >&2
