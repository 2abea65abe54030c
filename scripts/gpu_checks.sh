#!/usr/bin/env bash
# The GPU checks and benchmarks of docs/kernels.md and docs/gpu.md, in one run on a CUDA machine.
#
#   bash scripts/gpu_checks.sh OUT_DIR prepared [--device cpu] [--stages a,b] [--budget-s S]
#       the prepared check: one call of at most ~9 minutes, most valuable stages first, OUT_DIR/run.json
#       rewritten after every stage (python -m tools.gpu_check; --device cpu: a dry run at
#       tiny sizes); `stash` instead of `prepared` only gathers the carried SmolLM2 parts and builds the
#       kernels (a call that carries parts ahead of the prepared one, scripts/prepare_carry.sh)
#   bash scripts/gpu_checks.sh OUT_DIR [STAGE ...]     stages: env tests kernels steps host loop compile profile syncs
#                                                      divergence e2e e2e-100k e2e-curve e2e-100k-k4 prefix-sweep e2e-picked smollm2 heads compile-4k cascade fused variants iteration invariant e2e-paper
#                                                      (default: env tests kernels steps host loop)
#
# Each stage writes its log (and its bench output folder) under OUT_DIR and has its own time limit,
# so one failing stage does not hide the others' results. Needs a CUDA build of torch, nvcc and
# ninja; installs this checkout with `pip install --no-deps -e .` into the running Python.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:?usage: scripts/gpu_checks.sh OUT_DIR [prepared|stash [OPTIONS] | STAGE ...]}
shift
if [ "${1:-}" = prepared ] || [ "${1:-}" = stash ]; then
    mode=$1
    shift
    export GPU_CHECK_COMMAND="bash scripts/gpu_checks.sh $OUT_DIR $mode${*:+ $*}"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tokenswift_torch_ext}
    if [ "$mode" = stash ]; then set -- --stages carry,env "$@"; fi
    exec "${PYTHON:-python3}" -m tools.gpu_check "$OUT_DIR" "$@"
fi
STAGES=${*:-env tests kernels steps host loop}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tokenswift_torch_ext}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # tools (python -m tools.NAME) import the package from this checkout
CLI=("$PYTHON" -m tokenswift_trt.cli)

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log to OUT_DIR/NAME.log, report the exit code
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s"
    tail -n 25 "$OUT_DIR/$name.log"
}

if ! "$PYTHON" -c "import tokenswift_trt.decode" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT_DIR/install.log" 2>&1 \
        || { echo "install failed"; tail -n 20 "$OUT_DIR/install.log"; exit 1; }
fi

# the SmolLM2 stages need models/smollm2-135m (`make models`; on a node without internet, copy it there in
# parts: `tokenswift-trt pack`, see docs/cli.md) and the books of CORPUS
CORPUS=${CORPUS:-data/corpus}
# data/corpus ships gzip-compressed (`make corpus`): unpack what is missing
for gz in data/corpus/*.txt.gz; do [ -f "${gz%.gz}" ] || gzip -dc "$gz" > "${gz%.gz}"; done
SMOLLM2_IMPORT="test -f models/smollm2-135m/config.json || { echo 'models/smollm2-135m is missing: run make models \
    (on a node without internet: tokenswift-trt pack, docs/cli.md)'; exit 1; }"

for name in $STAGES; do
    case $name in
    env)
        stage env 120 bash -c "nvidia-smi; nvcc --version | tail -n 2; $PYTHON - <<'EOF'
import time, torch
from tokenswift_trt.kernels import ops as kernels
p = torch.cuda.get_device_properties(0)
print('torch', torch.__version__, 'cuda', torch.version.cuda, p.name, p.multi_processor_count, 'SMs')
start = time.time()
status = kernels.load_cuda_kernels(verbose=True)
print('kernels loaded:', status.loaded, status.reason, f'{time.time() - start:.1f}s')
EOF"
        ;;
    tests)
        stage tests 300 "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
            tests/plugins_cuda/test_cuda_kernels.py tests/decode/test_static_step.py tests/model/test_sampling.py \
            tests/kernels/test_kernels.py tests/model/test_model.py tests/tools/test_bench_kernels.py \
            tests/bench/test_steps.py tests/model/test_kv_cache.py tests/kernels/test_transfer.py \
            tests/decode/test_device_loop.py tests/kernels/test_fused_elementwise.py tests/kernels/test_cascade.py \
            tests/kernels/test_triton_prefix.py tests/kernels/test_triton_linear.py tests/kernels/test_triton_aligned.py
        ;;
    kernels)
        stage kernels 100 "$PYTHON" -m tools.bench_kernels --tree-sizes 1,64,128 --contexts 4096,32768,131072 \
            --out "$OUT_DIR/kernels"
        ;;
    steps)
        stage steps 300 "${CLI[@]}" bench-steps --model llama3.1-8b --device cuda --dtype bfloat16 \
            --contexts 4096,32768,65536,102400 --tree-sizes 1,41,121 --kv-budget 4096 \
            --gen-len 20480,40960,61440,81920,102400 --prefix-len 4096 \
            --out "$OUT_DIR/steps"
        ;;
    host)
        stage host 120 bash -c "for tree in 1,3,3,3 auto; do $PYTHON -m tools.bench_host --model-dir models/swift-tiny \
            --prompt-file models/swift-tiny/prompt.txt --max-new-tokens 1024 --min-p 0.1 --penalty 1.2 \
            --penalty-window 256 --kv-budget 1024 --tree \$tree --ignore-eos --seed 1 --device cuda \
            --dtype bfloat16; done"
        ;;
    loop)  # host time per iteration: the host loop vs the device loop (one CUDA graph per iteration)
        stage loop 200 bash -c "for flags in '--tree 3,3,3 --draft-source verify' '--tree 3,3,3 --device-loop'; do \
            $PYTHON -m tools.bench_host --model-dir models/swift-tiny --prompt-file models/swift-tiny/prompt.txt \
            --max-new-tokens 1024 --min-p 0.1 --penalty 1.2 --penalty-window 256 --ignore-eos --seed 1 \
            --device cuda --dtype bfloat16 \$flags; done"
        ;;
    compile)  # AR and verify steps through torch.compile inside the graphs, against the floor
        stage compile 500 "${CLI[@]}" bench-steps --model llama3.1-8b --device cuda --dtype bfloat16 \
            --contexts 4096,102400 --tree-sizes 1,64 --kv-budget 4096 --compile-steps --out "$OUT_DIR/steps-compiled"
        ;;
    profile)
        stage profile 400 "$PYTHON" -m tools.gpu_profile
        ;;
    syncs)
        stage syncs 200 "$PYTHON" -m tools.gpu_profile --syncs-only --tiny-tokens 128
        ;;
    invariant)  # bf16 with batch-invariant products, norms and aligned attention: do TokenSwift's tokens follow AR's; cost
        stage invariant 400 bash -c "$PYTHON -m tools.ar_divergence --device cuda --kernel batch_invariant=on \
            --dtypes bfloat16 --tokens 512 && $PYTHON -m tools.gpu_variants_ab --contexts 4096,102400 --tree-sizes 1,64 \
            --variants kernel+fused,kernel+fused+products,kernel+fused+invariant --rounds 2 --out $OUT_DIR/invariant"
        ;;
    divergence)  # where TokenSwift's tokens part from AR's per dtype (bf16 verify vs 1-token steps round differently)
        stage divergence 400 bash -c "$PYTHON -m tools.ar_divergence --device cuda --dtypes float32,bfloat16 --tokens 512 \
            && $PYTHON -m tools.ar_divergence --device cuda --dtypes bfloat16 --tokens 512 --full-precision-reductions"
        ;;
    e2e)  # whole generations of the 8B shape (random weights), AR and the device loop taking turns
        stage e2e 480 "${CLI[@]}" bench --model llama3.1-8b --random-weights --device cuda --dtype bfloat16 \
            --tree 3,3,3 --device-loop --gen-len 4096,16384 --prefix-len 4096 --interleave 2048 --no-extras \
            --min-p 0.1 --penalty 1.2 --penalty-window 1024 --seed 1 --out "$OUT_DIR/e2e"
        ;;
    e2e-100k)  # the same iteration at a 4K and a ~100K context: 1,024 new tokens after each prompt length
        stage e2e-100k 300 "${CLI[@]}" bench --model llama3.1-8b --random-weights --device cuda --dtype bfloat16 \
            --tree 3,3,3 --device-loop --gen-len 1024 --prefix-len 4096,98304 --interleave 512 --no-extras \
            --min-p 0.1 --penalty 1.2 --penalty-window 1024 --seed 1 --out "$OUT_DIR/e2e-100k"
        ;;
    e2e-curve)  # the iteration at four prompt lengths; bench models a 94K-token generation from 4K from them
        stage e2e-curve 420 "${CLI[@]}" bench --model llama3.1-8b --random-weights --device cuda --dtype bfloat16 \
            --tree 3,3,3 --ngram-topk 4 --device-loop --gen-len 512 --prefix-len 4096,32768,65536,98304 \
            --interleave 256 --no-extras --min-p 0.1 --penalty 1.2 --penalty-window 1024 --seed 1 \
            --out "$OUT_DIR/e2e-curve"
        ;;
    e2e-100k-k4)  # the same with 4 n-gram branches: 52 slots (bucket 64) instead of 100 (bucket 128)
        stage e2e-100k-k4 300 "${CLI[@]}" bench --model llama3.1-8b --random-weights --device cuda --dtype bfloat16 \
            --tree 3,3,3 --ngram-topk 4 --device-loop --gen-len 1024 --prefix-len 4096,98304 --interleave 512 \
            --no-extras --min-p 0.1 --penalty 1.2 --penalty-window 1024 --seed 1 --out "$OUT_DIR/e2e-100k-k4"
        ;;
    prefix-sweep)  # the Triton prefix block's launches (tiles, warps, stages) side by side; the best -> prefix.env
        stage prefix-sweep 300 "$PYTHON" -m tools.triton_prefix_sweep --out "$OUT_DIR/prefix-sweep"
        grep '^--kernel cascade_prefix=' "$OUT_DIR/prefix-sweep.log" >"$OUT_DIR/prefix.env" || true
        ;;
    e2e-picked)  # e2e-100k-k4 with the cascade switches and threshold the variants stage measured best
        "$PYTHON" -m tools.pick_cascade "$OUT_DIR/variants/variants.json" >"$OUT_DIR/picked.env" \
            || echo "# nothing picked: defaults" >"$OUT_DIR/picked.env"
        if grep -q 'cascade_prefix=triton' "$OUT_DIR/picked.env" && [ -s "$OUT_DIR/prefix.env" ]; then
            cat "$OUT_DIR/prefix.env" >>"$OUT_DIR/picked.env"  # the sweep's launch for the Triton prefix
        fi
        cat "$OUT_DIR/picked.env"
        stage e2e-picked 300 bash -c "${CLI[*]} bench \$(grep -v '^#' $OUT_DIR/picked.env) --model llama3.1-8b --random-weights \
            --device cuda --dtype bfloat16 --tree 3,3,3 --ngram-topk 4 --device-loop --gen-len 1024 \
            --prefix-len 4096,98304 --interleave 512 --no-extras --min-p 0.1 --penalty 1.2 --penalty-window 1024 \
            --seed 1 --out $OUT_DIR/e2e-picked"
        ;;
    smollm2)  # the SmolLM2 preset with its trained layers: real acceptance on the GPU (needs models/smollm2-135m)
        stage smollm2 480 bash -c "$SMOLLM2_IMPORT || exit 1; for flags in '--tree 3,3,3 --device-loop' '--tree 3,3,3 --ngram-topk 4 \
            --device-loop' ''; do ${CLI[*]} bench --model smollm2-135m --prompt-file $CORPUS/pride_and_prejudice.txt \
            --device cuda --dtype bfloat16 \$flags --gen-len 1024,4096 --prefix-len 512 --min-p 0.1 \
            --penalty 1.2 --penalty-window 256 --seed 1 --ignore-eos --no-extras --interleave 512 \
            --out $OUT_DIR/smollm2\${flags//[^a-z0-9]/}; done"
        ;;
    heads)  # a GPU-scale training of SmolLM2's draft layers from the committed ones: more of the model's own
        # text (a new seed), train-heads on it and the books, then layer 1's agreement with the model's samples for
        # the committed and the new file side by side. Needs models/smollm2-135m and the books in CORPUS; ~8 minutes.
        # The new heads are written to OUT_DIR/heads/run/heads.safetensors.
        books=(--data $CORPUS/iliad.txt --data $CORPUS/moby_dick.txt
            --data $CORPUS/war_and_peace.txt)
        mkdir -p "$OUT_DIR/heads"
        stage heads-import 120 bash -c "$SMOLLM2_IMPORT"
        stage heads-text 180 "$PYTHON" -m tools.generate_corpus --model-dir models/smollm2-135m "${books[@]}" \
            --out "$OUT_DIR/heads/generated.jsonl" --sequences 384 --batch 192 --new-tokens 1024 --seed 1 --device cuda
        stage heads-train 300 "${CLI[@]}" train-heads --model-dir models/smollm2-135m \
            --data "$OUT_DIR/heads/generated.jsonl" "${books[@]}" --eval-data $CORPUS/pride_and_prejudice.txt \
            --out "$OUT_DIR/heads/run" --steps 1200 --seq-len 1024 --batch 16 --grad-accum 1 --lr 1e-3 \
            --warmup-steps 50 --checkpoint-every 100 --root-width 2304 --draft-vocab 8192 --state-cache 2000 \
            --loss sampled --init-heads models/heads/smollm2-135m.safetensors --device cuda
        rm -f "$OUT_DIR/heads/run/checkpoint.pt"  # 60 MB of optimizer state; the heads file is what comes back
        # both scores at once on the machine's CPU cores (each generates its 1,536 tokens there)
        stage heads-agree 150 bash -c "OMP_NUM_THREADS=8 $PYTHON -m tools.first_level_agreement \
            --heads models/heads/smollm2-135m.safetensors --prompt-file $CORPUS/pride_and_prejudice.txt >$OUT_DIR/heads/agree-committed.txt & \
            OMP_NUM_THREADS=8 $PYTHON -m tools.first_level_agreement --heads $OUT_DIR/heads/run/heads.safetensors \
            --prompt-file $CORPUS/pride_and_prejudice.txt >$OUT_DIR/heads/agree-new.txt; wait; tail -n 3 $OUT_DIR/heads/agree-*.txt"
        ;;
    compile-4k)  # eager and compiled steps side by side at 4K only (one context compiles in ~2-3 minutes)
        stage compile-4k 240 bash -c "for flags in '' --compile-steps; do ${CLI[*]} bench-steps --model llama3.1-8b \
            --device cuda --dtype bfloat16 --contexts 4096 --tree-sizes 1,64 --kv-budget 4096 \$flags \
            --out $OUT_DIR/steps-4k\${flags:+-compiled}; done"
        ;;
    cascade)  # the FlashAttention cascade's GPU tests, then its steps against the tree-attention kernel's
        stage cascade 480 bash -c "$PYTHON -m pytest -q -p no:cacheprovider -rs tests/kernels/test_cascade.py \
            tests/decode/test_static_step.py && for attention in kernel flash_cascade; do \
            ${CLI[*]} bench-steps --kernel cuda_attention=\$attention --model llama3.1-8b --device cuda \
            --dtype bfloat16 --contexts 4096,102400 --tree-sizes 1,64,128 --kv-budget 4096 \
            --out $OUT_DIR/steps-\$attention; done"
        ;;
    fused)  # the fused add + RMSNorm and rotary kernels' GPU tests, then steps without and with them
        stage fused 300 bash -c "$PYTHON -m pytest -q -p no:cacheprovider -rs tests/kernels/test_fused_elementwise.py && \
            for fused in 0 1; do ${CLI[*]} bench-steps --kernel fused_elementwise=\$fused --model llama3.1-8b --device cuda \
            --dtype bfloat16 --contexts 4096 --tree-sizes 1,64 --kv-budget 4096 --host-overhead-ms 2.5 \
            --out $OUT_DIR/steps-fused-\$fused; done"
        ;;
    variants)  # the cascade's and the fused kernels' GPU tests, then the variants' steps in one process
        stage variants 480 bash -c "$PYTHON -m pytest -q -p no:cacheprovider -rs tests/kernels/test_cascade.py \
            tests/kernels/test_fused_elementwise.py tests/kernels/test_triton_prefix.py tests/kernels/test_triton_linear.py \
            tests/kernels/test_triton_aligned.py; \
            $PYTHON -m tools.gpu_variants_ab --contexts 4096,102400 \
            --tree-sizes 1,64,128 --rounds 2 --out $OUT_DIR/variants"
        ;;
    iteration)  # where the device loop's iteration goes, phase by phase, at 4K and 98K (setup, replay, labels)
        stage iteration 300 bash -c "$PYTHON -m tools.gpu_iteration_profile \
            \$(if [ -f $OUT_DIR/picked.env ]; then grep -v '^#' $OUT_DIR/picked.env; fi) \
            --contexts 4096,98304 --out $OUT_DIR/iteration"
        ;;
    e2e-paper)  # the same with the paper's tree, drafted on the partial cache by the host loop
        stage e2e-paper 480 "${CLI[@]}" bench --model llama3.1-8b --random-weights --device cuda --dtype bfloat16 \
            --tree 1,3,3,3 --gen-len 4096,16384 --prefix-len 4096 --interleave 2048 --no-extras \
            --min-p 0.1 --penalty 1.2 --penalty-window 1024 --seed 1 --out "$OUT_DIR/e2e-paper"
        ;;
    *) echo "unknown stage $name (env tests kernels steps host loop compile profile syncs divergence e2e e2e-100k e2e-curve e2e-100k-k4 prefix-sweep e2e-picked smollm2 heads compile-4k cascade fused variants iteration invariant e2e-paper)"; exit 2 ;;
    esac
done
