"""Layer-wise sequential calibration, shared by Wanda and SparseGPT.

The calibration batch runs through the embeddings once; then each decoder block in turn is moved to
the compute device, its linears collect input statistics from the block's inputs, they are pruned, and
the block's outputs are recomputed with the pruned weights to become the next block's inputs. So block
i is calibrated on what the already-pruned blocks 0..i-1 produce, and only one block is on the device at
a time. All linears of a block are calibrated on the same (dense-within-block) forward pass, as the
Wanda and SparseGPT reference code does.

The keyword arguments each block receives (rotary position embeddings, attention masks) are recorded
per block by swapping every block for a recorder and running the base model once: Gemma3 gives
sliding-window and full-attention blocks different masks and rotary tables, so block 0's arguments
would be wrong for the others."""

import re
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from leapctl.compute import resolve_device
from leapctl.errors import LeapctlError
from leapctl.masks import MaskSet
from leapctl.models import ModelLayout, final_norm, model_layout
from leapctl.progress import progress_bar


class LayerPruner(Protocol):
    """Collects a linear layer's input statistics, then prunes it."""

    def add_batch(self, inputs: torch.Tensor) -> None:
        """Accumulate statistics from the layer's inputs [..., in_features]."""

    def prune(self, sparsity: float) -> torch.Tensor:
        """Write the pruned weight into the layer and return the keep-mask (True = kept)."""


class _BlockRecorder(nn.Module):
    """Stands in for a decoder block: records the call's arguments and passes hidden states through."""

    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self.calls.append((hidden_states, args, kwargs))
        return hidden_states


def _modules_outside(root: nn.Module, blocks: nn.ModuleList) -> list[nn.Module]:
    """The largest submodules that do not contain the decoder blocks (embeddings, rotary tables, norms)."""
    if root is blocks:
        return []
    if not any(module is blocks for module in root.modules()):
        return [root]
    found = []
    for child in root.children():
        found.extend(_modules_outside(child, blocks))
    return found


def _device_of(module: nn.Module) -> torch.device | None:
    for tensor in [*module.parameters(), *module.buffers()]:
        return tensor.device
    return None


@torch.no_grad()
def capture_block_inputs(model: nn.Module, layout: ModelLayout, calib_ids: torch.Tensor, device: torch.device,
                         batch_size: int) -> tuple[torch.Tensor, list[list[tuple]]]:
    """Hidden states entering block 0 [n, seq, hidden] on `device`, and per block per batch the
    (args, kwargs) the model passes to that block."""
    blocks, prefix = layout.blocks, layout.prefix
    owner = model.get_submodule(prefix.rsplit(".", 1)[0]) if "." in prefix else model
    outside = _modules_outside(model, blocks)
    homes = [_device_of(m) for m in outside]
    originals = list(blocks)
    records: list[list] = [[] for _ in originals]
    for module in outside:
        module.to(device)
    try:
        for index in range(len(originals)):
            blocks[index] = _BlockRecorder(records[index])
        for start in range(0, calib_ids.shape[0], batch_size):
            owner(input_ids=calib_ids[start:start + batch_size].to(device), use_cache=False)
    finally:
        for index, block in enumerate(originals):
            blocks[index] = block
        for module, home in zip(outside, homes, strict=True):
            if home is not None:
                module.to(home)
    hidden = torch.cat([call[0] for call in records[0]])
    block_args = [[(args, kwargs) for _, args, kwargs in calls] for calls in records]
    return hidden, block_args


def _collect(pruner: LayerPruner) -> Callable:
    def hook(_module: nn.Module, inputs: tuple, _output: torch.Tensor) -> None:
        pruner.add_batch(inputs[0])

    return hook


def _block_output(block: nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    out = block(hidden, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _batch_slices(block_args: list[tuple], batch_size: int) -> list[slice]:
    return [slice(i * batch_size, (i + 1) * batch_size) for i in range(len(block_args))]


def _propagate(block: nn.Module, hidden: torch.Tensor, slices: list[slice], block_args: list[tuple]) -> None:
    """Replace `hidden` by the block's output, one batch at a time."""
    for part, (args, kwargs) in zip(slices, block_args, strict=True):
        hidden[part] = _block_output(block, hidden[part], args, kwargs)


def _feed_final_norm(model: nn.Module, layout: ModelLayout, hidden: torch.Tensor, slices: list[slice],
                     on_batch: Callable[[torch.Tensor], None], compute: torch.device) -> None:
    """Give `on_batch` the last block's output `hidden` through the final norm: what lm_head receives."""
    norm = final_norm(model, layout)
    home = _device_of(norm)
    norm.to(compute)
    for part in slices:
        on_batch(norm(hidden[part]))
    if home is not None:
        norm.to(home)


@torch.no_grad()
def prune_sequentially(model: nn.Module, calib_ids: torch.Tensor,
                       make_pruner: Callable[[nn.Linear], LayerPruner], sparsity: float, method: str,
                       include: str | None = None, exclude: str | None = None,
                       device: str | torch.device | None = None, batch_size: int = 8,
                       in_place: bool = True, progress: bool = True,
                       layout: ModelLayout | None = None,
                       lm_head_inputs: Callable[[torch.Tensor], None] | None = None) -> MaskSet:
    """Prune every prunable linear block by block, each block calibrated on the pruned blocks' outputs.
    `layout`: the model's layout when the caller has found it (then include/exclude are already in it).
    `lm_head_inputs`: given, it receives what lm_head gets from the pruned blocks (the last block's output
    through the final norm), one batch at a time, so that lm_head is calibrated without a second pass.

    With `in_place=False` the model keeps its dense weights: each block's original weights come back once
    its pruned outputs have been computed, so the masks are the same but the model is untouched."""
    if calib_ids.dim() != 2 or calib_ids.shape[0] == 0 or calib_ids.shape[1] == 0:
        raise LeapctlError(f"calibration batch must be [nsamples, seq_len] token ids, "
                           f"got shape {tuple(calib_ids.shape)}")
    compute = resolve_device(device)
    if layout is None:
        layout = model_layout(model, include, exclude)
    blocks = layout.blocks
    hidden, block_args = capture_block_inputs(model, layout, calib_ids, compute, batch_size)
    slices = _batch_slices(block_args[0], batch_size)
    masks: dict[str, torch.Tensor] = {}
    with progress_bar(progress) as bar:
        task = bar.add_task(f"{method} {sparsity:.0%}: decoder blocks", total=len(blocks))
        for index, block in enumerate(blocks):
            home = _device_of(block)
            block.to(compute)
            mine = layout.block_linears(index)
            dense = {} if in_place else {name: lin.weight.detach().clone() for name, lin in mine.items()}
            if mine:
                pruners = {name: make_pruner(linear) for name, linear in mine.items()}
                hooks = [lin.register_forward_hook(_collect(pruners[name])) for name, lin in mine.items()]
                try:
                    for part, (args, kwargs) in zip(slices, block_args[index], strict=True):
                        _block_output(block, hidden[part], args, kwargs)
                finally:
                    for hook in hooks:
                        hook.remove()
                for name, pruner in pruners.items():
                    masks[f"{name}.weight"] = pruner.prune(sparsity).cpu()
                del pruners
            _propagate(block, hidden, slices, block_args[index])
            for name, weight in dense.items():
                mine[name].weight.copy_(weight)
            block.to(home)
            bar.advance(task)
    if lm_head_inputs is not None:
        _feed_final_norm(model, layout, hidden, slices, lm_head_inputs, compute)
    return MaskSet(masks=masks, model=str(getattr(model, "name_or_path", "")),
                   extra={"method": method, "target_sparsity": sparsity})


class _Unchanged:
    """A linear outside the mask set: calibrated with the others, changed never."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear

    def add_batch(self, inputs: torch.Tensor) -> None:
        pass

    def prune(self, sparsity: float) -> torch.Tensor:
        return torch.ones(self.linear.weight.shape, dtype=torch.bool)


def update_under_masks(model: nn.Module, calib_ids: torch.Tensor, mask_set: MaskSet,
                       make_updater: Callable[[nn.Linear, torch.Tensor, str], LayerPruner], method: str,
                       device: str | torch.device | None = None, batch_size: int = 8,
                       progress: bool = True,
                       lm_head_inputs: Callable[[torch.Tensor], None] | None = None) -> None:
    """`prune_sequentially` with the masks given: each linear of `mask_set` gets
    `make_updater(linear, mask, weight_name)` (GPTQ's quantizer, the least-squares refit), whose `prune`
    rewrites the kept weights and returns the mask unchanged; every block is calibrated on what the
    already-updated blocks produce, and `lm_head_inputs` (`prune_sequentially`'s) on what they all do."""
    if calib_ids is None:
        raise LeapctlError(f"{method} needs calibration data")
    names = {id(model.get_submodule(name.removesuffix(".weight"))): name for name in mask_set.masks}

    def make(linear: nn.Linear) -> LayerPruner:
        name = names.get(id(linear))
        if name is None:
            return _Unchanged(linear)
        return make_updater(linear, mask_set.masks[name].to(linear.weight.device), name)

    include = "|".join(re.escape(name.removesuffix(".weight")) + "$" for name in mask_set.masks)
    prune_sequentially(model, calib_ids, make, mask_set.sparsity()["global"], method, include=include,
                       device=device, batch_size=batch_size, progress=progress, lm_head_inputs=lm_head_inputs)


@torch.no_grad()
def feed_lm_head_inputs(model: nn.Module, calib_ids: torch.Tensor, on_batch: Callable[[torch.Tensor], None],
                        device: str | torch.device | None = None, batch_size: int = 8) -> None:
    """Give `on_batch` what lm_head receives on the calibration windows (the last block's output through the
    final norm), one batch at a time; the model runs block by block on `device`, as the layer-wise methods
    run it, so it need not fit there whole. (`prune_sequentially(lm_head_inputs=...)` gives the same from
    the pass that updates the blocks.)"""
    compute = resolve_device(device)
    layout = model_layout(model)
    hidden, block_args = capture_block_inputs(model, layout, calib_ids, compute, batch_size)
    slices = _batch_slices(block_args[0], batch_size)
    for index, block in enumerate(layout.blocks):
        home = _device_of(block)
        block.to(compute)
        _propagate(block, hidden, slices, block_args[index])
        block.to(home)
    _feed_final_norm(model, layout, hidden, slices, on_batch, compute)
