"""End-to-end tuning of a quantized model's scales: after `gptq` or `rtn` has put the kept weights on the
grid, every group scale (and every normalisation weight) is learned against the whole model's output, codes
and masks fixed, by distillation from the dense model, as LEAP learns its masks.

GPTQ fits each layer to its own inputs; what it cannot see is how the layers' rounding errors add up. A
few hundred steps of Adam on the log of each fp16 scale (1/64 of the weights' count at G = 64) recover much
of that: on stories260K, LEAP 50% + GPTQ 4-bit went from +7.7% perplexity over the 16-bit model to under
+5% (`python -m bench.quality q4`). Scales are rounded to fp16 at the end, so the weights stay exactly
`scale * (code - 7.5)` in fp32 and `export --format bitmap-q4` reads them bit for bit.

A training loop to read top to bottom, like `learn.train`: the teacher's final hidden states, the student's,
the KL between their heads' logits a chunk of positions at a time (`distill.model_distillation`), a cosine
learning rate, one Adam step."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from leapctl.distill import model_distillation
from leapctl.models import recompute_blocks_in_backward
from leapctl.progress import progress_bar
from leapctl.schedule import cosine_with_warmup

NORM_LR_FACTOR = 0.1  # normalisation weights are O(1) multipliers: a tenth of the log-scales' step


@dataclass
class TuneResult:
    scales: dict[str, torch.Tensor]  # fp16, per weight name
    kl: list[float]  # KL(teacher || student) per step, before each update
    norms: int  # normalisation tensors tuned alongside


class GroupScaled(nn.Module):
    """A quantized weight as `levels * exp(log_gain) * scale`, the levels (code - 7.5, 0 where pruned) and
    the starting scales fixed: only the per-group gain learns, so masks and codes cannot move."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.group_size = weight.shape[1] // scales.shape[1]
        scale = scales.float().to(weight.device)
        spread = scale.repeat_interleave(self.group_size, dim=1)
        safe = torch.where(spread > 0, spread, torch.ones((), device=spread.device))
        self.register_buffer("levels", torch.where(weight != 0, weight.float() / safe, torch.zeros(())))
        self.register_buffer("scale", scale)
        self.log_gain = nn.Parameter(torch.zeros_like(scale))

    def tuned_scales(self) -> torch.Tensor:
        return (self.scale * self.log_gain.exp()).to(torch.float16)

    def weight(self, scales: torch.Tensor) -> torch.Tensor:
        """The levels times `scales` [rows, groups], spread over each group's columns."""
        return self.levels * scales.float().to(self.levels.device).repeat_interleave(self.group_size, dim=1)

    def forward(self, _original: torch.Tensor) -> torch.Tensor:
        return self.weight(self.scale * self.log_gain.exp())


def normalisation_weights(model: nn.Module) -> list[nn.Parameter]:
    """The weights of every RMSNorm/LayerNorm: per-channel gains just before the quantized linears."""
    return [module.weight for module in model.modules()
            if "Norm" in type(module).__name__ and isinstance(getattr(module, "weight", None), nn.Parameter)]


def _sharing_modules(model: nn.Module, module: nn.Module) -> list[nn.Module]:
    """`module` and every other module whose weight is the same tensor (a tied input embedding)."""
    return [module] + [other for other in model.modules()
                       if other is not module and getattr(other, "weight", None) is module.weight]


def tune_scales(model: nn.Module, teacher: nn.Module, scales: dict[str, torch.Tensor],
                calib_ids: torch.Tensor, steps: int, lr: float, batch_size: int, seed: int = 0,
                progress: bool = True, autocast: bool = False, checkpointing: bool = False) -> TuneResult:
    """Learn `scales` (fp16 per weight name, lm_head's included) and the normalisation weights of `model`
    (fp32, kept weights on the grid) in place, from `teacher`'s logits on random batches of the calibration
    windows `calib_ids` [n, seq_len]. A weight tied to another module (lm_head and the input embedding) gets
    one parametrization on both, so the tie holds while tuning and after. `autocast`: both models' matmuls
    in bf16 (the scales, their gradients and the KL stay fp32). `checkpointing`: each decoder block recomputed
    in the backward instead of holding its activations (a model whose Hugging Face class supports it), as
    `learn` does. Returns the new fp16 scales."""
    owners = {name: _sharing_modules(model, model.get_submodule(name.removesuffix(".weight")))
              for name in scales}
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    grouped = {name: GroupScaled(modules[0].weight.detach(), scales[name])
               for name, modules in owners.items()}
    for name, modules in owners.items():
        for module in modules:
            parametrize.register_parametrization(module, "weight", grouped[name])
    gains = [g.log_gain for g in grouped.values()]
    norms = normalisation_weights(model)
    for parameter in (*gains, *norms):
        parameter.requires_grad_(True)
    optimizer = torch.optim.Adam([{"params": gains, "lr": lr}, {"params": norms, "lr": lr * NORM_LR_FACTOR}])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(0, steps))
    teacher.eval()
    checkpointed = recompute_blocks_in_backward(model) if checkpointing else []
    generator = torch.Generator().manual_seed(seed)
    history = []
    with progress_bar(progress, eta=True, fields="KL {task.fields[kl]:.4f}") as bar:
        task = bar.add_task("[bold]tune scales", total=steps, kl=float("nan"))
        for _ in range(steps):
            batch = calib_ids[torch.randint(calib_ids.shape[0], (batch_size,), generator=generator)]
            batch = batch.to(next(model.parameters()).device)
            with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=autocast):
                kl, _, _ = model_distillation(model, teacher, batch)
            optimizer.zero_grad(set_to_none=True)
            kl.backward()
            optimizer.step()
            schedule.step()
            history.append(float(kl.detach()))
            bar.update(task, advance=1, kl=history[-1])
    for module in checkpointed:
        module.training = False
    if checkpointing:
        model.gradient_checkpointing_disable()
    new_scales = dict(scales)
    with torch.no_grad():
        for name, modules in owners.items():
            new_scales[name] = grouped[name].tuned_scales().cpu()
            weight = grouped[name].weight(new_scales[name])
            for module in modules:  # each gives back the same original tensor when tied
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
            modules[0].weight.copy_(weight)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return TuneResult(scales=new_scales, kl=history, norms=len(norms))


__all__ = ["TuneResult", "tune_scales"]
