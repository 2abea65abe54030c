# tokenswift-trt developer entry points. `make demo` and `make test` install into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CLI := $(VENV)/bin/tokenswift-trt
STAMP := $(VENV)/.installed
DEMO_MODEL := models/swift-tiny
RANDOM_MODEL := demo/random-tiny
# the paper's sampling settings (min-p 0.1, θ 1.2) with W, B and the tree scaled to a tiny model on a CPU
DEMO_ARGS := --min-p 0.1 --penalty 1.2 --penalty-window 256 --kv-budget 4096 --tree auto --draft-source verify --ignore-eos --max-new-tokens 4096 --seed 1

.PHONY: install test demo demo-random deploy plugins clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# exactly this CPU wheel (pip takes it from local disk); any other spec can pull a CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q

# swift-tiny: a trained ~9M-parameter Llama (docs/swift-tiny.md); a held-out Pride and Prejudice prompt
demo: install
	$(CLI) demo --model-dir $(DEMO_MODEL) $(DEMO_ARGS)

$(RANDOM_MODEL)/config.json: | install
	$(CLI) random-model --out $(RANDOM_MODEL)

# the same comparison on random weights (no training needed; text is noise)
demo-random: install $(RANDOM_MODEL)/config.json
	$(CLI) demo --model-dir $(RANDOM_MODEL) --temperature 0 --ignore-eos --max-new-tokens 2048

# on a GPU node: build the engine for PRESET and serve it from Triton's NGC container (docs/deploy.md)
deploy: install
	deploy/deploy.sh

# CUDA kernels for sm_80 + sm_90, and the TensorRT plugin library where TensorRT is installed
# (TENSORRT_ROOT=/path/to/TensorRT); docs/kernels.md
NVCC ?= $(shell command -v nvcc || echo /usr/local/bin/nvcc)
plugins:
	cmake -S plugins_cuda -B build/plugins -DCMAKE_CUDA_COMPILER=$(NVCC)
	cmake --build build/plugins -j

clean:
	rm -rf $(VENV) demo build *.egg-info .pytest_cache
