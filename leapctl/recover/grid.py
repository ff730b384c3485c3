"""Quantization-aware recovery: the kept weights of a quantized run trained on their 4-bit grid.

`quantize` puts each kept weight on `scale * (code - zero)` after the weights are final, so the rounding
error is never trained against. Here each masked linear's weight becomes a parametrization of an fp32
latent weight (started at the quantized values): the forward rounds the latent to its group's grid (the
run's fp16 scales and zero points, fixed) and the backward passes the gradient straight through to the
latent, so training moves codes wherever the latent crosses a level boundary. At the end each weight is
set to the rounded latent exactly as `quantize` writes it (`grid.round_to_grid`), so export reads
codes and scales bit for bit."""

import torch
from torch import nn
from torch.nn.utils import parametrize

from leapctl.grid import round_to_grid
from leapctl.masks import masked_weight


class OnGrid(nn.Module):
    """A latent weight seen through its 4-bit grid: rounded in the forward, straight-through backward,
    pruned entries +0.0."""

    def __init__(self, scales: torch.Tensor, zeros: torch.Tensor | None, keep: torch.Tensor):
        super().__init__()
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("keep", keep)

    def quantized(self, latent: torch.Tensor) -> torch.Tensor:
        """The latent on the grid, exactly as `quantize` writes a weight."""
        return masked_weight(round_to_grid(latent, self.scales, self.zeros), self.keep)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return latent + (self.quantized(latent) - latent).detach()


def put_on_grid(model: nn.Module, keep: dict[str, torch.Tensor], scales: dict[str, torch.Tensor],
                zeros: dict[str, torch.Tensor] | None) -> dict[str, nn.Parameter]:
    """Parametrize every masked weight named in `keep` by its grid; returns the latent parameters to train
    (name -> parameter, started at the quantized values)."""
    latents = {}
    for name, kept in keep.items():
        module = model.get_submodule(name.removesuffix(".weight"))
        device = module.weight.device
        zero = zeros.get(name) if zeros else None
        grid = OnGrid(scales[name].to(device), None if zero is None else zero.to(device), kept)
        parametrize.register_parametrization(module, "weight", grid)
        latents[name] = module.parametrizations.weight.original
    return latents


@torch.no_grad()
def take_off_grid(model: nn.Module, names: list[str]) -> None:
    """Remove the parametrizations, leaving each weight as its rounded latent (the exact grid values)."""
    for name in names:
        module = model.get_submodule(name.removesuffix(".weight"))
        grid = module.parametrizations.weight[0]
        final = grid.quantized(module.parametrizations.weight.original)
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
        module.weight.copy_(final)
