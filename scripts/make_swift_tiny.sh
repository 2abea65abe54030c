#!/usr/bin/env bash
# Rebuild models/swift-tiny from the public-domain corpus: tokenizer + base model, then draft layers.
# Usage: scripts/make_swift_tiny.sh [CORPUS_DIR]   (MINUTES=35 by default for the base model on CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:-data/corpus}
# data/corpus ships gzip-compressed (`make corpus`): unpack what is missing
for gz in data/corpus/*.txt.gz; do [ -f "${gz%.gz}" ] || gzip -dc "$gz" > "${gz%.gz}"; done
py=.venv/bin/python
cli=.venv/bin/tokenswift-trt
$py -m tools.train_swift_tiny --corpus "$corpus" --out models/swift-tiny --minutes "${MINUTES:-35}"
$cli train-heads --model-dir models/swift-tiny --out runs/swift-tiny-heads --force \
    --data "$corpus/iliad.txt" --data "$corpus/moby_dick.txt" --data "$corpus/war_and_peace.txt" \
    --eval-data "$corpus/pride_and_prejudice.txt" \
    --steps 300 --seq-len 512 --batch 4 --grad-accum 2 --lr 5e-3 --warmup-steps 50
cp runs/swift-tiny-heads/heads.safetensors models/swift-tiny/heads.safetensors
cp runs/swift-tiny-heads/train_heads.json models/swift-tiny/train_heads.json
