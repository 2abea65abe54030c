# tokenswift-trt developer entry points. `make demo` and `make test` install into .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CLI := $(VENV)/bin/tokenswift-trt
STAMP := $(VENV)/.installed
DEMO_MODEL := demo/random-tiny

.PHONY: install test demo clean

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

$(DEMO_MODEL)/config.json: | install
	$(CLI) random-model --out $(DEMO_MODEL)

demo: install $(DEMO_MODEL)/config.json
	$(CLI) demo --model-dir $(DEMO_MODEL) --temperature 0 --ignore-eos --max-new-tokens 2048

clean:
	rm -rf $(VENV) demo build *.egg-info .pytest_cache
