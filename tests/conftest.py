"""Shared fixtures: the real stories260K model from ../shared/assets and tiny random models."""

import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from leapctl.paths import assets_dir
from serving import cpu_kernel

ASSETS = assets_dir()


def require_asset(relative: str) -> Path:
    """Path of a shared asset; skip the test with a reason when the assets are not beside the repo, or fail
    it where they must be (`LEAPCTL_REQUIRE_ASSETS=1`, as `.ci/run` sets)."""
    if ASSETS is None or not (ASSETS / relative).exists():
        message = f"shared asset {relative} not found (set LEAPCTL_ASSETS)"
        if os.environ.get("LEAPCTL_REQUIRE_ASSETS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return ASSETS / relative


def pytest_collection_modifyitems(config, items):
    """Files with the most slow (end-to-end) tests first, each file's tests in their order: `make test`'s two
    workers take whole files as they free up, so the long files must not be the last ones handed out."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])  # stable: a file's tests stay together and in order


@pytest.fixture
def one_thread():
    """Tiny models run faster single-threaded on a shared 2-core machine; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=cpu_kernel.ISAS)
def isa(request, op):
    """Each instruction set of the native CPU kernel in turn (skipped where this CPU cannot run it), for
    the tests of a module that defines the `op` fixture (which loads the kernel)."""
    if request.param not in cpu_kernel.supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} kernel")
    with cpu_kernel.using_isa(request.param) as active:
        yield active


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """torch's thread count set to 1, then 2; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def stories260k_dir() -> Path:
    return require_asset("stories260K/hf")


@pytest.fixture(scope="session")
def tinystories_text() -> str:
    return require_asset("tinystories/valid_excerpt.txt").read_text()


def tiny_config(arch: str):
    """A tiny random config of a supported architecture; small enough for CPU tests."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    if arch == "gemma3":
        return Gemma3TextConfig(**common, head_dim=16, sliding_window=64, query_pre_attn_scalar=16)
    raise ValueError(arch)


def make_tiny_model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch)).eval()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, stories260k_dir):
    """Save a tiny random model of `arch` with the stories260K tokenizer; returns a factory."""
    from transformers import AutoTokenizer

    made: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in made:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            make_tiny_model(arch).save_pretrained(out)
            AutoTokenizer.from_pretrained(stories260k_dir).save_pretrained(out)
            made[arch] = out
        return made[arch]

    return build
