"""Layer-wise sequential calibration: block i is calibrated on what the pruned blocks before it produce.

The reference runs the whole model (its own forward, its own masks and rotary tables) after pruning
each block, hooks the next block's linears, and applies Wanda's formula to what they saw."""

import pytest
import torch
from conftest import tiny_config

from leapctl.models import decoder_blocks, prunable_linears
from leapctl.prune import prune_model
from leapctl.prune.wanda import wanda_keep_mask, wanda_masks


def _model(arch: str):
    """Tiny random model; Gemma3 gets one sliding-window and one full-attention block and sequences longer
    than its window, so a block given the other block's mask or rotary table would compute differently."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch)
    if arch == "gemma3":
        config.layer_types = ["sliding_attention", "full_attention"]
        config.sliding_window = 16
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _linear_inputs(model, names: list[str], calib: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inputs each named linear receives in a full forward of the model."""
    modules = dict(model.named_modules())
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    hooks = [modules[name].register_forward_hook(lambda _m, inp, _o, n=name: seen[n].append(inp[0].detach()))
             for name in names]
    try:
        with torch.no_grad():
            model(calib)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: torch.cat(chunks).reshape(-1, modules[name].in_features) for name, chunks in seen.items()}


def _reference_wanda(model, calib: torch.Tensor, sparsity: float, sequential: bool) -> dict:
    """Wanda block by block with full-model forwards; `sequential=False` calibrates on the dense model."""
    linears = prunable_linears(model)
    masks = {}
    dense_inputs = _linear_inputs(model, list(linears), calib) if not sequential else None
    for index in range(len(decoder_blocks(model))):
        names = [name for name in linears if f".layers.{index}." in name]
        inputs = _linear_inputs(model, names, calib) if sequential else dense_inputs
        for name in names:
            x = inputs[name].float()
            keep = wanda_keep_mask(linears[name].weight, x.pow(2).mean(dim=0), sparsity)
            masks[f"{name}.weight"] = keep
        for name in names:
            with torch.no_grad():
                linears[name].weight.mul_(masks[f"{name}.weight"])
    return masks


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_wanda_is_calibrated_on_the_pruned_earlier_blocks(arch):
    calib = torch.randint(0, 512, (4, 40), generator=torch.Generator().manual_seed(1))
    ours = prune_model(_model(arch), "wanda", 0.5, calib, batch_size=3, progress=False).masks
    sequential = _reference_wanda(_model(arch), calib, 0.5, sequential=True)
    for name, keep in sequential.items():
        assert torch.equal(ours[name], keep), name
    # The check can tell: calibrating block 1 on the dense model's activations gives other masks.
    dense_calibrated = _reference_wanda(_model(arch), calib, 0.5, sequential=False)
    later = [name for name in sequential if ".layers.1." in name]
    assert any(not torch.equal(sequential[name], dense_calibrated[name]) for name in later)


def test_in_place_false_leaves_the_weights_dense_with_the_same_masks():
    calib = torch.randint(0, 512, (4, 40), generator=torch.Generator().manual_seed(2))
    model = _model("llama")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    dense_kept = wanda_masks(model, calib, 0.5, in_place=False, progress=False)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    pruned = wanda_masks(model, calib, 0.5, progress=False)
    for name, keep in pruned.masks.items():
        assert torch.equal(dense_kept.masks[name], keep), name


def test_include_and_exclude_choose_the_layers():
    calib = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))
    model = _model("qwen2")
    masks = prune_model(model, "sparsegpt", 0.5, calib, include=r"mlp\.", exclude=r"down_proj",
                        progress=False).masks
    expected = [f"model.layers.{i}.mlp.{proj}_proj.weight" for i in range(2) for proj in ("gate", "up")]
    assert sorted(masks) == sorted(expected)
    attention = model.model.layers[0].self_attn.q_proj.weight
    assert int((attention == 0).sum()) == 0
