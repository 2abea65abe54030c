#!/usr/bin/env bash
# Deploy a TokenSwift engine on a GPU node (A100/H100) in Triton's NGC container, then health-check it.
#   make deploy PRESET=llama3.1-8b [BACKEND=torch|onnx|tensorrt] [ENGINE_DIR=...] [TRITON_IMAGE=...] [DRY_RUN=1]
#              [HEADS=FILE] [NO_DRAFTS=1]
# Needs: docker with the NVIDIA container toolkit, a checkpoint under $TOKENSWIFT_HOME/<preset>
# (or RANDOM_WEIGHTS=1), and this repository checked out on the node. The checkpoint needs draft
# layers (the released TokenSwift layers, or `tokenswift-trt train-heads`): give them with HEADS=FILE;
# without any, build and serve refuse unless NO_DRAFTS=1 (the engine then runs at AR speed).
set -euo pipefail
cd "$(dirname "$0")/.."

preset=${PRESET:-llama3.1-8b}
backend=${BACKEND:-torch}
engine=${ENGINE_DIR:-$PWD/engines/$preset}
image=${TRITON_IMAGE:-nvcr.io/nvidia/tritonserver:24.10-py3}
name=${DEPLOY_NAME:-tokenswift-$preset}
http=${HTTP_PORT:-8000}; grpc=${GRPC_PORT:-8001}; metrics=${METRICS_PORT:-8002}
instances=${INSTANCES:-1}
max_batch=${MAX_BATCH:-8}
no_drafts=${NO_DRAFTS:+--no-drafts}
heads=${HEADS:+--heads $HEADS}
run() { if [ -n "${DRY_RUN:-}" ]; then echo "+ $*"; else "$@"; fi; }

if [ -z "${DRY_RUN:-}" ]; then
  command -v docker >/dev/null || { echo "deploy: docker is not installed on this node" >&2; exit 2; }
  docker info >/dev/null 2>&1 || { echo "deploy: no Docker engine is running (docker info failed)" >&2; exit 2; }
  command -v nvidia-smi >/dev/null || { echo "deploy: no NVIDIA driver (nvidia-smi) on this node" >&2; exit 2; }
fi

# 1. the engine (TensorRT plans must be built inside the serving container: same GPU and TensorRT)
if [ ! -f "$engine/tokenswift.json" ] && [ "$backend" != tensorrt ]; then
  random=${RANDOM_WEIGHTS:+--random-weights}
  run .venv/bin/tokenswift-trt build --model "$preset" --backend "$backend" --out "$engine" $random $heads $no_drafts
fi

# 2. Triton's container with this repository and the engine mounted; `serve` uses its tritonserver
setup="pip install --quiet /opt/tokenswift-trt[onnx]"
if [ "$backend" = tensorrt ] && [ ! -f "$engine/tokenswift.json" ]; then
  setup="$setup tensorrt && tokenswift-trt build --model $preset --backend tensorrt --out /engine ${RANDOM_WEIGHTS:+--random-weights} $no_drafts"
fi
run docker rm -f "$name" >/dev/null 2>&1 || true
run docker run -d --name "$name" --gpus all --shm-size 4g --restart unless-stopped \
  -p "$http:8000" -p "$grpc:8001" -p "$metrics:8002" \
  -v "$PWD:/opt/tokenswift-trt:ro" -v "$engine:/engine" ${TOKENSWIFT_HOME:+-v "$TOKENSWIFT_HOME:/models:ro" -e TOKENSWIFT_HOME=/models} \
  "$image" bash -c "$setup && tokenswift-trt serve --engine /engine --host 0.0.0.0 --device cuda --instances $instances --max-batch $max_batch $no_drafts"

# 3. health check (bounded)
if [ -z "${DRY_RUN:-}" ]; then
  for _ in $(seq 1 180); do
    if curl -sf "http://127.0.0.1:$http/v2/health/ready" >/dev/null; then
      echo "deploy: ready at http://$(hostname -f):$http (gRPC :$grpc, metrics :$metrics)"
      exit 0
    fi
    sleep 5
  done
  echo "deploy: not ready after 15 minutes; see: docker logs $name" >&2
  exit 1
fi
