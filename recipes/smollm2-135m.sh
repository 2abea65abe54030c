#!/usr/bin/env bash
# Draft layers for SmolLM2-135M-Instruct, from the released model to a heads file and its evaluation.
#
#   bash recipes/smollm2-135m.sh --quick            # about 10 minutes on a 2-core CPU
#   bash recipes/smollm2-135m.sh                    # the full recipe (hours on a CPU; DEVICE=cuda on a GPU)
#   bash recipes/smollm2-135m.sh --quick runs/mine  # another output folder (default runs/heads-smollm2[-quick])
#
# 1. `train-data`: the model writes continuations of prompts cut from three public-domain books
#    (data/corpus, shipped with the repository) under the paper's sampling; and, from a fourth book it
#    never trains on, held-out text;
# 2. `train-heads`: three root-conditioned draft layers with an 8,192-token draft vocabulary, trained
#    from zero on that text and the books, scored on the held-out text as they train;
# 3. `eval-heads`: their acceptance predicted on the held-out text and measured with `generate`,
#    with the modeled and measured speedup on this machine.
# Each step resumes where it stopped when the script is run again (`--resume` for training).
# TORCHRUN_RANKS=N trains over N torchrun ranks (gloo on CPUs, one GPU each with DEVICE=cuda).
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0
if [[ "${1:-}" == "--quick" ]]; then QUICK=1; shift; fi
OUT="${1:-runs/heads-smollm2$([[ $QUICK == 1 ]] && echo -quick)}"
DEVICE="${DEVICE:-cpu}"
RANKS="${TORCHRUN_RANKS:-1}"
TS=".venv/bin/tokenswift-trt"
BOOKS=(data/corpus/moby_dick.txt.gz data/corpus/war_and_peace.txt.gz data/corpus/iliad.txt.gz)
HELD_OUT_BOOK=data/corpus/pride_and_prejudice.txt.gz

if [[ $QUICK == 1 ]]; then
  SEQUENCES=32; NEW_TOKENS=256; HELD_OUT=12
  TRAIN=(--steps 360 --seq-len 256 --batch 4 --grad-accum 1 --state-cache 96 --lr 5e-3 --warmup-steps 20
         --eval-every 90 --checkpoint-every 90)
  EVAL=(--sequences 8 --seq-len 256 --measure-prompts 4 --measure-tokens 256)
else
  SEQUENCES=2048; NEW_TOKENS=1024; HELD_OUT=16
  TRAIN=(--steps 4000 --seq-len 512 --batch 8 --grad-accum 2 --state-cache 1024 --lr 2e-3 --warmup-steps 100
         --eval-every 250 --checkpoint-every 250)
  EVAL=(--sequences 32 --seq-len 512 --measure-prompts 8 --measure-tokens 1024)
fi

make --no-print-directory models >/dev/null   # models/smollm2-135m (the released GGUF, imported)
mkdir -p "$OUT"

echo "== 1/3 the model writes its training text ($SEQUENCES x $NEW_TOKENS tokens) and held-out text" >&2
$TS train-data --model smollm2-135m $(printf -- '--prompts %s ' "${BOOKS[@]}") --sequences "$SEQUENCES" \
    --new-tokens "$NEW_TOKENS" --seed 0 --device "$DEVICE" --output "$OUT/data.jsonl"
$TS train-data --model smollm2-135m --prompts "$HELD_OUT_BOOK" --sequences "$HELD_OUT" \
    --new-tokens "$NEW_TOKENS" --seed 1000 --device "$DEVICE" --output "$OUT/held-out.jsonl"

echo "== 2/3 train-heads" >&2
RESUME=()
if [[ -f "$OUT/heads/checkpoint.pt" ]]; then RESUME=(--resume); fi
LAUNCH=(.venv/bin/python -m tokenswift_trt)
if [[ "$RANKS" -gt 1 ]]; then
  LAUNCH=(.venv/bin/torchrun --standalone --nproc-per-node "$RANKS" -m tokenswift_trt)
fi
DTYPE=float32
if [[ "$DEVICE" == cuda* ]]; then DTYPE=bfloat16; fi
"${LAUNCH[@]}" train-heads --model-dir models/smollm2-135m --data "$OUT/data.jsonl" \
    $(printf -- '--data %s ' "${BOOKS[@]}") --eval-data "$OUT/held-out.jsonl" --out "$OUT/heads" \
    --root-width 2304 --draft-vocab 8192 --loss sampled "${TRAIN[@]}" --seed 1 \
    --dtype "$DTYPE" --device "$DEVICE" "${RESUME[@]}"

echo "== 3/3 eval-heads on the held-out text" >&2
$TS eval-heads --model smollm2-135m --heads "$OUT/heads/heads.safetensors" --data "$OUT/held-out.jsonl" \
    "${EVAL[@]}" --device "$DEVICE" --out "$OUT/eval.json"
echo "heads: $OUT/heads/heads.safetensors  report: $OUT/heads/train_heads.json, report.png  eval: $OUT/eval.json" >&2
