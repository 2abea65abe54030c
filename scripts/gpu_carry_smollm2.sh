#!/usr/bin/env bash
# Prepares .gpu_carry/ for taking the SmolLM2 preset to a lent GPU (docs/gpu.md, "Taking SmolLM2 to a
# lent GPU"): the installed GGUF in three parts of ~31 MiB (a device call carries 64 MiB, the working tree ~27 of
# them), the `gguf` package (pure Python; the GPU image lacks it), the held-out book for prompts and the
# training books for the `heads` stage (.gpu_carry/books).
#
#   bash scripts/gpu_carry_smollm2.sh
#
# Then, back to back so that the machine stays warm and keeps what came before: the first call carries
# `.gpu_carry/smol.part0`, `.gpu_carry/py` and `.gpu_carry/book.txt` (and runs other stages), each next
# call the next part; the call with the last part runs `bash scripts/gpu_checks.sh OUT smollm2`, which
# joins the parts, checks the sha256 and imports the model there. Carry `.gpu_carry/books` too (with any
# part) before the `heads` stage.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BOOK=${BOOK:-../shared/corpus/pride_and_prejudice.txt}
CORPUS=${CORPUS:-../shared/corpus}
gguf=$("$PY" -c "from tokenswift_trt.builder.smollm2 import find_smollm2_gguf; print(find_smollm2_gguf())") \
    || { echo "the SmolLM2 GGUF is not installed: run make models"; exit 1; }
[ -f "$BOOK" ] || { echo "$BOOK not found: set BOOK to a text file to cut prompts from"; exit 1; }
rm -rf .gpu_carry && mkdir -p .gpu_carry/py
split -n 3 -d -a 1 "$gguf" .gpu_carry/smol.part
cp -r "$("$PY" -c 'import gguf, os; print(os.path.dirname(gguf.__file__))')" .gpu_carry/py/
cp "$BOOK" .gpu_carry/book.txt
mkdir -p .gpu_carry/books  # the training books, for the `heads` stage (5.2 MiB)
for name in iliad moby_dick war_and_peace; do
    [ -f "$CORPUS/$name.txt" ] && cp "$CORPUS/$name.txt" .gpu_carry/books/
done
exclude=$(git rev-parse --git-path info/exclude)  # ignored, so that only `carry` takes it along
grep -qx '/.gpu_carry/' "$exclude" 2>/dev/null || echo '/.gpu_carry/' >>"$exclude"
ls -l .gpu_carry
