"""Recovery: the kept weights of a pruned model trained by distillation from the dense model, the mask held.

LEAP learns which weights to keep with the weights frozen; one-shot pruners keep them as they were. Either
way the kept weights were fitted for a dense network. Training them against the dense model's outputs
(the logits' KL, and with `hidden_weight` each decoder block's output as SquareHead does) is the "short
fine-tuning stage" the LEAP paper names as its extension, and what sparse releases such as
Sparse-Llama-3.1 use to recover quality.

A loop to read top to bottom, like `learn.train` and `quantize.tune`: the teacher's outputs, the student's,
the losses, one AdamW step, then the pruned weights set back to +0.0 (`masks.masked_weight`), so the mask is
exactly what it was. Gradients of pruned weights are zeroed before the optimizer sees them, so clipping
and Adam's moments only see the kept ones. Batches are a pure function of (seed, step): a resumed run
draws the same windows, and with the checkpoint's weights and Adam state it ends bit for bit where an
uninterrupted run ends (one process; threads and hardware unchanged)."""

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from leapctl.distill import model_distillation
from leapctl.errors import LeapctlError
from leapctl.learn.checkpoint import (
    load_tensors,
    read_checkpoint,
    restore_rng_states,
    rng_states,
    save_checkpoint,
)
from leapctl.learn.signals import StopFlag
from leapctl.masks import MaskSet, masked_weight
from leapctl.models import recompute_blocks_in_backward
from leapctl.progress import progress_bar
from leapctl.recover.grid import put_on_grid, take_off_grid
from leapctl.schedule import cosine_with_warmup

BETAS = (0.9, 0.95)
MAX_GRAD_NORM = 1.0
WARMUP_FRACTION = 0.05
BATCH_SEED_STRIDE = 1_000_003  # batches are drawn by a generator seeded with seed * stride + step


@dataclass
class RecoverySettings:
    """What the loop needs, resolved: the command's settings plus the choices made from the hardware."""

    steps: int
    batch_size: int
    lr: float
    hidden_weight: float = 0.0
    seed: int = 0
    autocast: bool = False
    gradient_checkpointing: bool = False
    checkpoint_every: int = 0
    progress: bool = True


@dataclass
class RecoveryResult:
    history: list[dict] = field(default_factory=list)  # per step: kl, hidden, loss, lr
    seconds: float = 0.0  # training time of this process's steps
    resumed_at_step: int | None = None


class RecoverInterrupted(Exception):
    """SIGTERM, SIGINT or SIGHUP stopped `recover_weights` after its checkpoint; `--resume` continues."""

    def __init__(self, steps_done: int, signal_number: int):
        super().__init__(f"interrupted by signal {signal_number} after step {steps_done}")
        self.steps_done, self.signal_number = steps_done, signal_number


@dataclass
class _Loop:
    model: nn.Module
    teacher: nn.Module
    weights: dict[str, nn.Parameter]  # trained weight name -> parameter, in model order
    keep: dict[str, torch.Tensor]  # the same names -> bool keep-mask on the device
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    windows: torch.Tensor
    settings: RecoverySettings
    device: torch.device


Grid = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]  # a quantized run's (scales, zeros)


def recover_weights(model: nn.Module, teacher: nn.Module, masks: MaskSet, windows: torch.Tensor,
                    settings: RecoverySettings, state_dir: Path | None = None,
                    fingerprint: dict | None = None, resume: bool = False,
                    grid: Grid | None = None) -> RecoveryResult:
    """Train the kept weights of every masked linear of `model` (pruned, on its device) in place so that its
    outputs match `teacher`'s (the dense model, same device) on batches of `windows` [n, seq_len]; every
    other parameter stays frozen and every pruned weight stays +0.0. With `state_dir`, a checkpoint is
    written every `checkpoint_every` steps and when a signal stops the run (`RecoverInterrupted`);
    `resume` continues from it after checking `fingerprint`. With `grid` (a quantized run's scales and zero
    points) the weights are trained through their 4-bit grid (`recover.grid`) and end on it."""
    loop = _set_up(model, teacher, masks, windows, settings, grid)
    meta = read_checkpoint(state_dir, fingerprint or {}) if resume else None
    start, generation = _restore(loop, state_dir, meta) if meta else (0, 0)
    result = RecoveryResult(history=list(meta["history"]) if meta else [], resumed_at_step=start or None)
    checkpointed = recompute_blocks_in_backward(model) if settings.gradient_checkpointing else []
    started = time.perf_counter()
    try:
        with StopFlag(state_dir is not None) as stop, \
                progress_bar(settings.progress, eta=True, fields="KL {task.fields[kl]:.4f}") as bar:
            task = bar.add_task("[bold]recover kept weights", total=settings.steps, completed=start,
                                kl=result.history[-1]["kl"] if result.history else float("nan"))
            for step in range(start, settings.steps):
                result.history.append(_step(loop, step))
                bar.update(task, advance=1, kl=result.history[-1]["kl"])
                done = step + 1
                periodic = settings.checkpoint_every and done % settings.checkpoint_every == 0
                if state_dir is not None and (stop.signal or (periodic and done < settings.steps)):
                    _save(loop, state_dir, done, generation, fingerprint or {}, result.history)
                if stop.signal:
                    raise RecoverInterrupted(done, stop.signal)
    finally:
        for module in checkpointed:
            module.training = False
        if checkpointed:
            model.gradient_checkpointing_disable()
        if grid is not None:
            take_off_grid(model, list(loop.weights))
        model.requires_grad_(False)
    result.seconds = time.perf_counter() - started
    return result


def _set_up(model: nn.Module, teacher: nn.Module, masks: MaskSet, windows: torch.Tensor,
            settings: RecoverySettings, grid: Grid | None) -> _Loop:
    """Freeze everything but the masked weights (their latents on `grid`), hook their gradients to the
    mask, build AdamW."""
    device = next(model.parameters()).device
    params = dict(model.named_parameters())
    missing = sorted(set(masks.masks) - set(params))
    if missing:
        raise LeapctlError(f"the masks name {missing[0]}, which the model does not have")
    model.requires_grad_(False)
    model.eval()
    teacher.requires_grad_(False)
    teacher.eval()
    keep = {name: masks.masks[name].to(device) for name in params if name in masks.masks}
    weights = put_on_grid(model, keep, *grid) if grid is not None else {name: params[name] for name in keep}
    for name, weight in weights.items():
        weight.requires_grad_(True)
        weight.register_hook(lambda grad, kept=keep[name]: masked_weight(grad, kept))
    optimizer = torch.optim.AdamW(list(weights.values()), lr=settings.lr, betas=BETAS, weight_decay=0.0,
                                  fused=True)
    warmup = max(1, round(settings.steps * WARMUP_FRACTION))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(warmup, settings.steps))
    return _Loop(model, teacher, weights, keep, optimizer, scheduler, windows, settings, device)


def step_batch(windows: torch.Tensor, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """The windows of `step`: a pure function of (seed, step), so a resumed run draws the same ones."""
    generator = torch.Generator().manual_seed(seed * BATCH_SEED_STRIDE + step)
    return windows[torch.randint(windows.shape[0], (batch_size,), generator=generator)]


def distillation_losses(student: nn.Module, teacher: nn.Module, ids: torch.Tensor,
                        hidden_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, KL, hidden) of one batch, the two models run here (the teacher without gradients; under the
    caller's autocast): KL(teacher || student) over the next-token positions, from the final hidden states
    and the frozen output heads a chunk of positions at a time (`distill.model_distillation`), and (when
    `hidden_weight` > 0) SquareHead's per-block loss, each block output's squared error over the dense
    output's mean square, averaged over blocks."""
    kl, sparse, dense = model_distillation(student, teacher, ids, output_hidden_states=hidden_weight > 0)
    if not hidden_weight:
        zero = torch.zeros((), dtype=torch.float32, device=kl.device)
        return kl, kl, zero
    terms = [(s.float() - t.float()).pow(2).mean() / t.float().pow(2).mean().clamp_min(1e-12)
             for s, t in zip(sparse.hidden_states[1:], dense.hidden_states[1:], strict=True)]
    hidden = torch.stack(terms).mean()
    return kl + hidden_weight * hidden, kl, hidden


def _step(loop: _Loop, step: int) -> dict:
    """One optimizer step; returns its record (the step's one host sync)."""
    settings = loop.settings
    ids = step_batch(loop.windows, settings.batch_size, settings.seed, step).to(loop.device)
    autocast = (torch.autocast(loop.device.type, dtype=torch.bfloat16) if settings.autocast
                else contextlib.nullcontext())
    with autocast:
        loss, kl, hidden = distillation_losses(loop.model, loop.teacher, ids, settings.hidden_weight)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(loop.weights.values()), MAX_GRAD_NORM)
    lr = loop.scheduler.get_last_lr()[0]
    loop.optimizer.step()
    loop.scheduler.step()
    loop.optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, weight in loop.weights.items():
            weight.copy_(masked_weight(weight, loop.keep[name]))
    values = torch.stack([loss.detach(), kl.detach(), hidden.detach()]).tolist()
    return {"step": step, "loss": values[0], "kl": values[1], "hidden": values[2], "lr": lr}


def _save(loop: _Loop, state_dir: Path, done: int, generation: int, fingerprint: dict,
          history: list[dict]) -> None:
    tensors = {}
    for name, weight in loop.weights.items():
        tensors[f"weight.{name}"] = weight.detach()
        for key, value in loop.optimizer.state.get(weight, {}).items():
            tensors[f"{key}.{name}"] = value
    save_checkpoint(state_dir, tensors, {
        "fingerprint": fingerprint, "step": done, "generation": generation,
        "scheduler": loop.scheduler.state_dict(),
        "param_groups": [{k: v for k, v in group.items() if k != "params"}
                         for group in loop.optimizer.param_groups],
        "rng": rng_states(), "history": history,
    }, distributed=False)


def _restore(loop: _Loop, state_dir: Path, meta: dict) -> tuple[int, int]:
    """Weights, AdamW's state and the schedule from the checkpoint; returns (first step, generation)."""
    templates, slots = {}, {}
    for index, (name, weight) in enumerate(loop.weights.items()):
        templates[f"weight.{name}"] = weight.detach()
        slots[index] = {"step": torch.zeros((), dtype=torch.float32, device=loop.device),
                        "exp_avg": torch.zeros_like(weight.detach()),
                        "exp_avg_sq": torch.zeros_like(weight.detach())}
        for key, value in slots[index].items():
            templates[f"{key}.{name}"] = value
    load_tensors(state_dir, meta, templates, distributed=False)
    groups = [{**saved, "params": group["params"]} for saved, group in
              zip(meta["param_groups"], loop.optimizer.state_dict()["param_groups"], strict=True)]
    loop.optimizer.load_state_dict({"state": slots, "param_groups": groups})
    loop.scheduler.load_state_dict(meta["scheduler"])
    restore_rng_states(meta["rng"])
    return meta["step"], meta["generation"] + 1
