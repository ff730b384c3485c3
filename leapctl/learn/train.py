"""The LEAP training loop, readable top to bottom (in the manner of nanoGPT's train.py).

`leap_masks(model, tokenizer, corpus, config)` learns the mask logits of `model`'s prunable linears (the
weights stay frozen, or with `weight_lr` are learned with them), takes the hard mask, zeros the pruned
weights (and, with `reconstruct`, refits the kept ones) and returns the `MaskSet`; it is callable in memory
like the one-shot methods. `train` is the loop itself, for a config already resolved and validated
(`LearnConfig.checked`); `leapctl learn` (`leapctl.commands.learn`) loads the model, calls it and writes the
run folder.

The loop calls helpers for everything that is not learning: `processes.py` (DDP / FSDP2 set-up),
`checkpoint.py` (resume), `signals.py` (stop at a step's end), `metrics.py` (metrics.jsonl, TensorBoard,
the progress bar), `start.py` (the token stream and the initial mask), `report.py`.

One process, or N under `torchrun` (DDP, or FSDP2 with `fsdp=True`). Each optimizer step takes `batch_size`
fresh windows from the stream, split into micro-batches of `micro_batch_size`; process r handles the r-th
contiguous share of the micro-batches. Every micro-batch draws its own mask noise from (seed, step, global
micro-batch index, layer), so the single-process run and an N-process run see the same noise on the same
windows and differ only by the order of floating-point sums (see the README's DDP note).

GPU discipline: every tensor handed to a collective lives on the training device; the loss terms are summed
on the device and read back once per step (one host sync); the optimizer state comes back through
`Optimizer.load_state_dict`; checkpoints are sharded DCP safetensors without pickle (`checkpoint.py`).
"""

import contextlib
import dataclasses
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from leapctl.data import sample_windows
from leapctl.distill import language_model_and_distillation
from leapctl.errors import LeapctlError
from leapctl.learn.checkpoint import (
    load_tensors,
    read_checkpoint,
    restore_rng_states,
    rng_states,
    save_checkpoint,
)
from leapctl.learn.config import PRESET_VALUES, LearnConfig
from leapctl.learn.loss import regularisers
from leapctl.learn.mask import MaskState, attach_masks, detach_masks, hard_masks, init_logits
from leapctl.learn.metrics import MetricsLog
from leapctl.learn.processes import Processes, full_cpu, no_gradient_sync, shard_block, wrap_model
from leapctl.learn.report import peak_memory, soft_density
from leapctl.learn.signals import StopFlag
from leapctl.learn.start import initial_keep, training_corpus
from leapctl.learn.stream import WindowStream
from leapctl.masks import MaskSet, apply_masks
from leapctl.models import ModelLayout, model_layout
from leapctl.schedule import cosine_with_warmup, magnitude_decay, mask_temperature

# The per-step numbers summed on the device over micro-batches (and processes), read back once per step.
SUMMED = ("lm_loss", "kl", "density", "density_penalty", "magnitude_penalty", "loss")


@dataclass
class LearnedMasks(MaskSet):
    """The `MaskSet` that `leap_masks` returns, with how the run went: `stats` holds the resolved settings,
    the per-step metrics of this process's steps, timing and peak memory (and the final logits with
    `save_logits`). With several processes only rank 0's holds the masks and logits; the others' are empty."""

    stats: dict = field(default_factory=dict)


class LearnInterrupted(Exception):
    """SIGTERM or SIGINT stopped `leap_masks` after it wrote a checkpoint; `--resume` continues."""

    def __init__(self, steps_done: int, signal_number: int, state_dir: Path | None):
        super().__init__(f"interrupted by signal {signal_number} after step {steps_done}")
        self.steps_done, self.signal_number, self.state_dir = steps_done, signal_number, state_dir


@dataclass
class _Loop:
    """What every step uses, set up once by `train`."""

    config: LearnConfig
    processes: Processes
    device: torch.device
    model: torch.nn.Module  # the frozen model with its masked linears
    train_model: torch.nn.Module  # what the step calls: the model, or its DDP wrapper
    masked: dict  # weight name -> MaskedLinear, in the model's layer order
    mask_state: MaskState
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: WindowStream
    autocast: bool
    total_weights: int
    dense_norm_sum: float

    @property
    def micro(self) -> int:
        return self.config.micro_batch_size or self.config.batch_size // self.processes.world

    @property
    def micro_total(self) -> int:
        return self.config.batch_size // self.micro

    @property
    def micro_local(self) -> int:
        return self.micro_total // self.processes.world

    @property
    def logit_params(self) -> list[torch.Tensor]:
        return [layer.mask_logits for layer in self.masked.values()]  # shards after fully_shard

    @property
    def weight_params(self) -> list[torch.Tensor]:
        """The masked linears' weights (trained with `weight_lr`)."""
        return [layer.weight for layer in self.masked.values()]


# ==================================================================================== the loop


def leap_masks(model: torch.nn.Module, tokenizer, corpus, config: LearnConfig,
               init: MaskSet | None = None) -> LearnedMasks:
    """Learn a LEAP mask for `model` (on its device, weights frozen) and return it; the model ends pruned
    in place (zeros, and refit kept weights with `reconstruct`), except under FSDP2, where it stays sharded
    and `finish_weights` prunes a fresh copy.

    `corpus`: the training token stream (1-D ids, a tensor or a memory-mapped array) or a calibration
    source name (`wiki-summaries`, a file, `generated`, ...) that `tokenizer` turns into one.
    `init`: the keep-mask the logits start from; by default Wanda on `nsamples` windows of the corpus (or
    `config.init_masks`, or random for `init="random"`). With `config.resume` the state comes from the
    checkpoint instead. Under an initialised process group every process calls this with the same corpus.
    Raises `LearnInterrupted` when SIGTERM/SIGINT stopped it (after a checkpoint)."""
    return train(model, tokenizer, corpus, config.checked(Processes.current().world), init)


def train(model: torch.nn.Module, tokenizer, corpus, config: LearnConfig, init: MaskSet | None = None,
          fingerprint: dict | None = None, layout: ModelLayout | None = None) -> LearnedMasks:
    """`leap_masks` for a `config` already resolved and validated; `fingerprint` and the model's `layout`
    when the caller has them. Training takes the layout's linears (each is swapped for a MaskedLinear and
    dropped from `layout.linears`, so nothing keeps the whole weights alive under FSDP2); its block names
    stay usable."""
    processes = Processes.current()
    device = next(model.parameters()).device
    use_autocast = autocast_on(config, device)
    fingerprint = fingerprint or config.fingerprint(use_autocast)
    state_dir = config.state_dir()
    meta = read_checkpoint(state_dir, fingerprint) if config.resume else None
    if isinstance(corpus, str):
        corpus, _ = training_corpus(dataclasses.replace(config, calib=corpus), model, tokenizer)
    if meta is not None and meta["tokens"] != len(corpus):
        raise LeapctlError(f"--resume: the checkpoint was trained on {meta['tokens']} tokens, the token "
                           f"stream holds {len(corpus)}")

    # ---------------------------------------------------------------- frozen model, logits, stream
    _seed_everything(config.seed)
    model.requires_grad_(False)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mask_state = MaskState(run_seed=config.seed, compute_dtype=compute_dtype(config, use_autocast),
                           track_norms=config.magnitude_term and config.lambda2 != 0,
                           train_weights=config.weight_lr > 0, dense_teacher=config.distill > 0)
    if layout is None:
        layout = model_layout(model, config.include, config.exclude)
    masked, total_weights, dense_norm_sum = _masked_model(model, corpus, config, layout, init, meta,
                                                          mask_state, device)
    model.train()
    train_model = wrap_model(model, processes.distributed, config.fsdp, device)
    stream = WindowStream(corpus, config.seq_len, config.batch_size, config.seed,
                          position=meta["data_position"] if meta else 0)

    # ---------------------------------------------------------------- optimizer, schedules, resume
    groups = [{"params": [layer.mask_logits for layer in masked.values()], "lr": config.lr,
               "weight_decay": config.weight_decay}]
    if config.weight_lr:  # the weights learned with the mask: their own rate, no decay, the same schedule
        groups.append({"params": [layer.weight for layer in masked.values()], "lr": config.weight_lr,
                       "weight_decay": 0.0})
    optimizer = torch.optim.AdamW(  # fused: one kernel over all logits, ~5x faster than the loop on CPU
        groups, betas=(config.beta1, config.beta2), fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  cosine_with_warmup(config.warmup_steps, config.steps))
    loop = _Loop(config, processes, device, model, train_model, masked, mask_state, optimizer, scheduler,
                 stream, use_autocast, total_weights, dense_norm_sum)
    start_step, generation = _resume(loop, state_dir, meta)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # ---------------------------------------------------------------- the loop
    done, run_start = start_step, time.perf_counter()
    with StopFlag(state_dir is not None) as stop, _single_sequences(), \
            MetricsLog(state_dir, processes.master, start_step, config.progress, config.steps) as metrics:
        for step in range(start_step, config.steps):
            record = _train_step(loop, step, stop)
            metrics.log(record)
            done = step + 1
            every = config.checkpoint_every
            periodic = every and done % every == 0 and done < config.steps
            if state_dir is not None and (stop.signal or periodic):
                _save_checkpoint(loop, state_dir, done, generation, fingerprint, len(corpus))
            if stop.signal:
                raise LearnInterrupted(done, stop.signal, state_dir)
    train_seconds = time.perf_counter() - run_start

    # ---------------------------------------------------------------- the hard mask, the pruned model
    learned = _learned_masks(loop, fingerprint, metrics.records, start_step, train_seconds)
    if processes.master and not (processes.distributed and config.fsdp):  # rank 0 alone writes the run
        model.gradient_checkpointing_disable()
        detach_masks(model, {name.removesuffix(".weight"): layer for name, layer in masked.items()})
        model.eval()
        finish_weights(model, learned, corpus, config)
    return learned


def _train_step(loop: _Loop, step: int, stop: StopFlag) -> dict:
    """One optimizer step over `batch_size` windows (this process's micro-batches, gradients accumulated);
    returns the step's record. `stop.signal` becomes the one all processes agree on, read back with the
    loss terms (the step's one host sync)."""
    config, device = loop.config, loop.device
    step_start = time.perf_counter()
    alpha, tau = mask_temperature(step, config.steps, (config.alpha_start, config.alpha_end),
                                  (config.tau_start, config.tau_end), config.fixed_alpha, config.fixed_tau)
    loop.mask_state.alpha, loop.mask_state.tau = alpha, tau
    decay = magnitude_decay(step, config.steps) if config.magnitude_term else 0.0
    batch = loop.stream.peek(0, config.batch_size)
    sums = torch.zeros(len(SUMMED), dtype=torch.float64, device=device)
    rank, micro, micro_local = loop.processes.rank, loop.micro, loop.micro_local
    for position, micro_batch in enumerate(range(rank * micro_local, (rank + 1) * micro_local)):
        ids = batch[micro_batch * micro : (micro_batch + 1) * micro].to(device, non_blocking=True)
        last = position == micro_local - 1
        sums += _micro_batch(loop, ids, step, micro_batch, decay, last)
    grad_norm = _clip_gradients(loop.logit_params, config.max_grad_norm)
    if config.weight_lr:  # clipped on their own: their gradients' scale is not the logits'
        _clip_gradients(loop.weight_params, config.max_grad_norm)
    loop.optimizer.step()
    loop.scheduler.step()
    loop.optimizer.zero_grad(set_to_none=True)
    loop.stream.advance(config.batch_size)

    flag = torch.tensor([stop.signal], dtype=torch.float64, device=device)
    if loop.processes.distributed:
        dist.all_reduce(sums)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    host = torch.cat([sums / loop.micro_total, grad_norm.reshape(1).double(), flag]).tolist()  # the sync
    elapsed = time.perf_counter() - step_start
    record = {"step": step, **dict(zip(SUMMED, host, strict=False)), "grad_norm": host[-2],
              "alpha": alpha, "tau": tau, "lr": loop.scheduler.get_last_lr()[0],
              "tokens_per_s": config.batch_size * config.seq_len / elapsed, "step_s": elapsed}
    stop.signal = int(host[-1])
    return record


def _micro_batch(loop: _Loop, ids: torch.Tensor, step: int, micro_batch: int, decay: float,
                 last: bool) -> torch.Tensor:
    """Forward and backward of one micro-batch (the teacher first, with the masks off, when distilling);
    returns its SUMMED terms as a device tensor."""
    config, mask_state, model = loop.config, loop.mask_state, loop.model
    skip_sync = loop.processes.distributed and not last
    autocast = (torch.autocast(loop.device.type, dtype=torch.bfloat16) if loop.autocast
                else contextlib.nullcontext())
    with no_gradient_sync(loop.train_model, model, skip_sync, config.fsdp), autocast:
        teacher = None
        if config.distill:
            with torch.no_grad():  # the same frozen model with the masks off
                mask_state.enabled = False
                teacher = model(input_ids=ids, use_cache=False).logits
                mask_state.enabled = True
        mask_state.start_micro_batch(step, micro_batch)
        if teacher is not None:
            logits = loop.train_model(input_ids=ids, use_cache=False).logits
            lm_loss, kl = language_model_and_distillation(logits, teacher, ids)
            del logits, teacher
        else:
            lm_loss = loop.train_model(input_ids=ids, labels=ids, use_cache=False).loss.float()
            kl = torch.zeros_like(lm_loss)
        terms = regularisers(mask_state.mask_sums, mask_state.masked_norms_sq, loop.total_weights,
                             loop.dense_norm_sum, config.density, config.lambda1, config.lambda2, decay)
        task = (1.0 - config.distill) * lm_loss + config.distill * kl
        loss = task + terms.density_penalty + terms.magnitude_penalty
        mask_state.recording = False  # checkpoint recomputation in backward must not record
        (loss / loop.micro_local).backward()
    return torch.stack([lm_loss, kl, terms.density, terms.density_penalty, terms.magnitude_penalty,
                        loss]).detach().double()


def _learned_masks(loop: _Loop, fingerprint: dict, metrics: list[dict], start_step: int,
                   train_seconds: float) -> LearnedMasks:
    """The hard mask from the final logits (top-k over all processes' shards) and the run's statistics."""
    config, sharded = loop.config, loop.processes.distributed and loop.config.fsdp
    final = {name: layer.mask_logits.detach() for name, layer in loop.masked.items()}
    local = {name: (p.to_local() if hasattr(p, "to_local") else p) for name, p in final.items()}
    keep = hard_masks(local, config.density, config.hard_mask, group=dist.group.WORLD if sharded else None)
    master = loop.processes.master  # every process gathers (a collective under FSDP2); rank 0 alone keeps,
    # since only it prunes and writes the run: host RAM holds one whole copy, not one per process
    masks = _gathered({name: keep[name].to(torch.uint8) for name in final}, final, master,
                      lambda whole: whole.view(torch.bool))
    tokens_per_step = config.batch_size * config.seq_len
    stats = {
        "settings": fingerprint,
        "world_size": loop.processes.world,
        "device": str(loop.device),
        "resumed_at_step": start_step or None,
        "train_seconds_this_process": train_seconds,
        "tokens_per_s": ((config.steps - start_step) * tokens_per_step / train_seconds
                         if train_seconds else None),
        "peak_memory": peak_memory(loop.device),
        "final_soft_density_noiseless": soft_density(final, loop.mask_state, loop.total_weights, sharded),
        "masked_weights": loop.total_weights,
        "metrics": metrics,
    }
    if config.save_logits:
        stats["logits"] = _gathered(final, final, master, lambda whole: whole.float().contiguous())
    if sharded and config.weight_lr:  # the trained weights, whole, for the fresh copy rank 0 prunes
        stats["weights"] = _gathered({name: layer.weight.detach() for name, layer in loop.masked.items()},
                                     {name: layer.weight for name, layer in loop.masked.items()}, master)
    return LearnedMasks(
        masks=masks, model=str(getattr(loop.model, "name_or_path", config.model)),
        extra={"method": "leap", "target_sparsity": config.sparsity, "hard_mask": config.hard_mask,
               "preset": config.preset, "steps": config.steps, "batch_size": config.batch_size,
               "seq_len": config.seq_len,
               **({"weight_lr": config.weight_lr} if config.weight_lr else {}),
               **{key: getattr(config, key) for key in PRESET_VALUES[config.preset]}},
        stats=stats,
    )


def _gathered(tensors: dict[str, torch.Tensor], params: dict[str, torch.Tensor], keep: bool,
              convert=lambda whole: whole) -> dict[str, torch.Tensor]:
    """Each of `tensors` whole on the CPU (`full_cpu` against the parameter of the same name), converted one
    layer at a time; every process must call this, and only the one with `keep` keeps them (others get {})."""
    whole = {}
    for name, tensor in tensors.items():
        gathered = full_cpu(tensor, params[name])
        if keep:
            whole[name] = convert(gathered)
    return whole


def finish_weights(model: torch.nn.Module, masks: MaskSet, corpus, config: LearnConfig) -> None:
    """Zero the pruned weights of the (dense, plain) `model`; with `reconstruct`, first refit the kept ones
    by least squares on `nsamples` windows of the corpus (`reconstruct.py`). `config` is resolved."""
    if config.reconstruct:
        from leapctl.learn.reconstruct import reconstruct_weights

        calib = sample_windows(corpus, config.nsamples, config.seq_len, config.seed)
        reconstruct_weights(model, masks, calib, device=next(model.parameters()).device,
                            progress=config.progress)
    apply_masks(model, masks)


# ------------------------------------------------------------ helpers, in the order the loop uses them


def autocast_on(config: LearnConfig, device: torch.device) -> bool:
    """bf16 autocast: as `--autocast` says, else on CUDA only. Not by default on a CPU with native bf16: there
    it is faster, but the bf16 rounding of the sums moves masks between a one-process and an N-process run
    (their equality is what the DDP tests check); `compress` passes it where the CPU multiplies bf16."""
    return config.autocast if config.autocast is not None else device.type == "cuda"


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def compute_dtype(config: LearnConfig, autocast: bool) -> torch.dtype:
    """The dtype of the masked matmuls: bf16 under autocast or with bf16 frozen weights (the rest of the
    model then runs in bf16 too), else fp32. The soft mask is fp32 either way."""
    return torch.bfloat16 if autocast or config.dtype == "bfloat16" else torch.float32


def _masked_model(model, corpus, config: LearnConfig, layout: ModelLayout, init: MaskSet | None,
                  meta: dict | None, mask_state: MaskState, device: torch.device) -> tuple[dict, int, float]:
    """Swap every prunable linear of `model` for a `MaskedLinear` with its logits, block by block; under
    FSDP2 each block is sharded as soon as its layers have their logits, so the whole logits of one block
    at most exist at a time, and nothing here outlives this call (the plain linears, the keep-masks, the
    initial logits), so the whole weights and logits are freed as the blocks are sharded.
    Returns (weight name -> MaskedLinear in layer order, number of masked weights, sum of their norms)."""
    linears = layout.linears  # emptied below, block by block
    total_weights = sum(linear.weight.numel() for linear in linears.values())
    dense_norm_sum = float(sum(linear.weight.float().norm() for linear in linears.values()))
    logits = _start_logits(model, corpus, config, layout, init, meta, device)
    shard = Processes.current().distributed and config.fsdp
    masked, first = {}, 0
    for index, block in enumerate(layout.blocks):
        names = [name for name in list(linears) if layout.block_index(name) == index]
        block_logits = {f"{name}.weight": next(logits) for name in names}
        attached = attach_masks(model, {name: linears.pop(name) for name in names}, block_logits, mask_state,
                                first_index=first)
        del block_logits
        masked.update({f"{name}.weight": layer for name, layer in attached.items()})
        first += len(names)
        if shard:
            shard_block(block)
    return masked, total_weights, dense_norm_sum


def _start_logits(model, corpus, config: LearnConfig, layout: ModelLayout, init: MaskSet | None,
                  meta: dict | None, device: torch.device) -> Iterator[torch.Tensor]:
    """The mask logits of each linear in layer order, made on the device one at a time: from the initial
    keep-mask, or zeros that the checkpoint fills."""
    logits_dtype = getattr(torch, config.logits_dtype)
    if meta is not None:
        for shape in [linear.weight.shape for linear in layout.linears.values()]:  # before the caller pops
            yield torch.zeros(shape, dtype=logits_dtype, device=device)
        return
    keep = initial_keep(model, corpus, config, layout, init, device)
    generator = torch.Generator().manual_seed(config.seed)  # one stream, drawn layer by layer in order
    for name in list(keep):
        yield init_logits({name: keep.pop(name)}, config.init, config.init_scale, generator,
                          logits_dtype)[name].to(device)


def _resume(loop: _Loop, state_dir: Path | None, meta: dict | None) -> tuple[int, int]:
    """(first step, checkpoint generation): from the checkpoint with `--resume`, else (0, 0)."""
    if meta is None:
        return 0, 0
    _restore(state_dir, meta, loop.masked, loop.optimizer, loop.processes.distributed,
             weights=loop.config.weight_lr > 0)
    loop.scheduler.load_state_dict(meta["scheduler"])
    restore_rng_states(meta["rng"])
    return meta["step"], meta["generation"] + 1


def _save_checkpoint(loop: _Loop, state_dir: Path, next_step: int, generation: int, fingerprint: dict,
                     tokens: int) -> None:
    optimizer = loop.optimizer
    save_checkpoint(state_dir, _checkpoint_tensors(loop.masked, optimizer, loop.config.weight_lr > 0), {
        "fingerprint": fingerprint,
        "step": next_step,
        "generation": generation,
        "data_position": loop.stream.position,
        "scheduler": loop.scheduler.state_dict(),
        "param_groups": [{k: v for k, v in group.items() if k != "params"}
                         for group in optimizer.param_groups],
        "rng": rng_states(),
        "tokens": tokens,
    }, loop.processes.distributed)


def _checkpoint_tensors(masked: dict, optimizer, weights: bool) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint keyed by weight name: logits and AdamW state, and with `weights` the
    trained weights and theirs, as they live (FSDP2 shards stay shards; DCP writes each process's own)."""
    tensors = {}
    for name, layer in masked.items():
        tensors[f"logits.{name}"] = layer.mask_logits.detach()
        for key, value in optimizer.state.get(layer.mask_logits, {}).items():
            tensors[f"{key}.{name}"] = value
        if weights:
            tensors[f"weight.{name}"] = layer.weight.detach()
            for key, value in optimizer.state.get(layer.weight, {}).items():
                tensors[f"weight_{key}.{name}"] = value
    return tensors


def _restore(state_dir: Path, meta: dict, masked: dict, optimizer, distributed: bool, weights: bool) -> None:
    """Logits (and with `weights` the trained weights) into the parameters (shards under FSDP2) and AdamW's
    state through `load_state_dict`, which puts every tensor where this optimizer keeps it (fused AdamW:
    `step` on the parameter's device). The optimizer numbers its parameters group by group: the logits,
    then the weights."""
    templates, slots = {}, {}
    kinds = [("logits", "", "mask_logits")] + ([("weight", "weight_", "weight")] if weights else [])
    index = 0
    for prefix, state_prefix, attribute in kinds:
        for name, layer in masked.items():
            param = getattr(layer, attribute)
            templates[f"{prefix}.{name}"] = param.detach()
            slots[index] = {"step": torch.zeros((), dtype=torch.float32),
                            "exp_avg": torch.zeros_like(param.detach()),
                            "exp_avg_sq": torch.zeros_like(param.detach())}
            for key, value in slots[index].items():
                templates[f"{state_prefix}{key}.{name}"] = value
            index += 1
    load_tensors(state_dir, meta, templates, distributed)
    groups = [{**saved, "params": group["params"]} for saved, group in
              zip(meta["param_groups"], optimizer.state_dict()["param_groups"], strict=True)]
    optimizer.load_state_dict({"state": slots, "param_groups": groups})


@contextlib.contextmanager
def _single_sequences():
    """Every training window is one contiguous sequence (the positions the model derives, 0..T-1), so tell
    transformers there is no packing instead of letting it test the positions on the device and read the
    answer back: a host sync in every forward (`masking_utils.find_packed_sequence_indices`, which returns
    None for such inputs anyway). Without that function there is nothing to skip."""
    from transformers import masking_utils

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _clip_gradients(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the logits' total gradient norm to `max_norm` (0: no clipping); returns the norm before
    clipping, as a tensor on the device (no host sync). FSDP2 shards give a DTensor: made whole."""
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
