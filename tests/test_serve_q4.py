"""`leapctl serve` on a bitmap-q4 export: greedy text equals transformers on the dequantized run folder
(fp32), with `--activations bf16` as it is, with int8 (the default, where the CPU runs the int8 kernel)
when every linear's input (prefill and decoding steps) is rounded as `serving.q4_linear.int8_activations`
defines;
and the 4-bit layers hold what the format says. A random Llama with head_dim 32 (vLLM's CPU
attention refuses stories260K's 8) and an intermediate size of 256, which groups of 64 divide."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file
from test_serve_cli import (
    greedy_completion,
    start_leapctl_serve,
    stop_leapctl_serve,
    transformers_greedy,
)

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The little dog was", "Sam had a red ball"]
MAX_TOKENS = 24
MEMORY_LINE = r"leap_sparse: (\d+) sparse linear layers hold (\d+) bytes, ([\d.]+)x of (\d+) dense bytes"


def q4_checkpoint(root, stories260k_dir, head_bits: int, grid: str = "symmetric"):
    """(quantized run folder, its bitmap-q4 export): magnitude 50%, then round to nearest on `grid`, group
    64, with lm_head on the `head_bits` grid too (served through the plugin, untied from the embedding)."""
    from test_serve_cli import magnitude_masks
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from leapctl.commands.export import export
    from leapctl.masks import MaskSet, apply_masks
    from leapctl.quantize import LM_HEAD, quantization_entry, quantize_lm_head, quantize_weights
    from leapctl.runs import save_run

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    masks = MaskSet(masks=magnitude_masks(model, 0.5), model="tiny-llama")
    apply_masks(model, masks)
    scales, zeros = quantize_weights(model, masks, "rtn", 64, grid=grid)
    scales[LM_HEAD], head_zeros = quantize_lm_head(model, head_bits, 64, grid)  # tied: the embedding too
    if head_zeros is not None:
        zeros[LM_HEAD] = head_zeros
    run_dir, export_dir = root / "run", root / "sparse"  # the served model is named after the folder
    run_dir.mkdir()
    entry = quantization_entry(4, 64, "rtn", lm_head_bits=head_bits, grid=grid)
    save_run(run_dir, model, AutoTokenizer.from_pretrained(stories260k_dir), masks, {"quantization": entry},
             scales=scales, zeros=zeros)
    export(str(run_dir), "bitmap-q4", export_dir)
    return run_dir, export_dir


@pytest.fixture(scope="module")
def q4_checkpoints(tmp_path_factory, stories260k_dir):
    return q4_checkpoint(tmp_path_factory.mktemp("q4-serve"), stories260k_dir, 4)


@pytest.fixture(scope="module")
def head8_checkpoints(tmp_path_factory, stories260k_dir):
    return q4_checkpoint(tmp_path_factory.mktemp("q4-head8-serve"), stories260k_dir, 8)


@pytest.fixture(scope="module")
def asymmetric_checkpoints(tmp_path_factory, stories260k_dir):
    return q4_checkpoint(tmp_path_factory.mktemp("q4-asym-serve"), stories260k_dir, 4, "asymmetric")


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """A linear's input as the int8 op multiplies it (groups of 64 columns; decoding steps and prefill)."""
    from serving.q4_linear import int8_activations

    return int8_activations(x, 64).to(x.dtype)


def int8_rows_rounded(x: torch.Tensor) -> torch.Tensor:
    """lm_head's input as the 8-bit lm_head multiplies it (per row, on every path)."""
    from serving.int8_linear import int8_rows_activations

    return int8_rows_activations(x).to(x.dtype)

def test_int8_activations_serve_the_reference_greedy_text(q4_checkpoints, tmp_path):
    from serving import cpu_kernel

    if not cpu_kernel.int8_kernel_available():
        pytest.skip("this CPU lacks AVX-512 VNNI or VBMI2, or GFNI: the layers serve bf16 x")
    run_dir, export_dir = q4_checkpoints
    server = start_leapctl_serve(export_dir, tmp_path / "serve.log")
    try:
        assert "prefill and decoding steps with int8 x" in server.log()
        for prompt in PROMPTS:
            served = greedy_completion(server, "sparse", prompt, MAX_TOKENS)
            expected = transformers_greedy(run_dir, served["prompt_token_ids"], MAX_TOKENS, int8_rounded)
            assert served["token_ids"] == expected, prompt
    finally:
        stop_leapctl_serve(server)


def test_greedy_text_equals_transformers_on_the_dequantized_run(q4_checkpoints, tmp_path):
    run_dir, export_dir = q4_checkpoints
    server = start_leapctl_serve(export_dir, tmp_path / "serve.log", extra_leapctl=["--activations", "bf16"])
    try:
        for prompt in PROMPTS:
            served = greedy_completion(server, "sparse", prompt, MAX_TOKENS)
            expected = transformers_greedy(run_dir, served["prompt_token_ids"], MAX_TOKENS)
            assert served["token_ids"] == expected, prompt
        found = re.search(MEMORY_LINE, server.log())
        assert found, server.log()[-2000:]
        assert "prefill and decoding steps with bf16 x" in server.log() or "native" not in server.log()
        tensors = load_file(export_dir / "model.safetensors")
        held = sum(t.numel() * t.element_size() for key, t in tensors.items()
                   if key.endswith((".bitmap", ".codes", ".scales", ".row_offsets")))
        weights = sum(int(t.prod()) for key, t in tensors.items() if key.endswith(".shape"))
        assert int(found.group(2)) == held  # the layers hold exactly the stored tensors
        assert int(found.group(4)) == 4 * weights  # against fp32 dense (the test serves --dtype float32)
        # 50% sparse layers within the format's budget (0.45 B/weight) plus lm_head with every weight kept
        # (1/8 + 1/2 + 2/64 B/weight); 4 bytes of row offsets per row of 128 columns on top
        vocab_weights = 512 * 128
        budget = 0.45 * (weights - vocab_weights) + (0.125 + 0.5 + 2 / 64) * vocab_weights
        assert held <= budget + 4 * weights / 128
    finally:
        stop_leapctl_serve(server)


def test_an_8_bit_lm_head_serves_the_reference_greedy_text(head8_checkpoints, tmp_path):
    """lm_head in int8-rows (quantize's default) through the native int8 op in decoding steps (vLLM's int8
    GEMM where that op cannot run): its input rounded per row, the 4-bit layers' per group where the int8
    kernel runs."""
    from serving import cpu_kernel
    from serving.int8_linear import native_int8_available

    run_dir, export_dir = head8_checkpoints
    config = json.loads((export_dir / "config.json").read_text())["quantization_config"]
    assert config["lm_head_format"] == "int8-rows"
    linear_input = int8_rounded if cpu_kernel.int8_kernel_available() else None
    server = start_leapctl_serve(export_dir, tmp_path / "serve.log")
    try:
        for prompt in PROMPTS:
            served = greedy_completion(server, "sparse", prompt, MAX_TOKENS)
            expected = transformers_greedy(run_dir, served["prompt_token_ids"], MAX_TOKENS, linear_input,
                                           head_input=int8_rows_rounded)
            assert served["token_ids"] == expected, prompt
        found = re.search(MEMORY_LINE, server.log())
        assert found, server.log()[-2000:]
        assert int(found.group(1)) == 2 * 4 + 1  # qkv, o, gate_up and down in each block, and lm_head
        # where the native kernel multiplies, the line says what the kernel put on huge pages (this model's
        # tensors are all under 2 MiB, so any figure; a 1B-shaped model's ~450 MB of layers show there)
        from serving import huge_pages

        native = "native CPU kernel" in server.log() and huge_pages.enabled()
        assert bool(re.search(r"; \d+ MiB of the process on huge pages", server.log())) == native
        hidden = json.loads((export_dir / "config.json").read_text())["hidden_size"]
        assert ("8-bit lm_head: native int8 op" in server.log()) == native_int8_available(hidden)
    finally:
        stop_leapctl_serve(server)


@pytest.mark.parametrize("activations", ["int8", "bf16"])
def test_the_asymmetric_grid_serves_the_reference_greedy_text(asymmetric_checkpoints, tmp_path, activations):
    """Zero points per row and group on every 4-bit layer, lm_head included (its dense layout): the int8
    kernel (decoding steps and prefill) and the bf16 one both serve transformers' greedy text."""
    from serving import cpu_kernel

    if activations == "int8" and not cpu_kernel.int8_kernel_available():
        pytest.skip("this CPU lacks AVX-512 VNNI or VBMI2, or GFNI: the layers serve bf16 x")
    run_dir, export_dir = asymmetric_checkpoints
    config = json.loads((export_dir / "config.json").read_text())["quantization_config"]
    assert config["grid"] == "asymmetric"
    server = start_leapctl_serve(export_dir, tmp_path / "serve.log",
                                 extra_leapctl=["--activations", activations])
    try:
        assert f"prefill and decoding steps with {activations} x" in server.log()
        for prompt in PROMPTS:
            served = greedy_completion(server, "sparse", prompt, MAX_TOKENS)
            expected = transformers_greedy(run_dir, served["prompt_token_ids"], MAX_TOKENS,
                                           int8_rounded if activations == "int8" else None)
            assert served["token_ids"] == expected, prompt
    finally:
        stop_leapctl_serve(server)
