"""The LEAP training loop, readable top to bottom (in the manner of nanoGPT's train.py).

`leap_masks(model, tokenizer, corpus, config)` is the loop itself, callable in memory like the one-shot
methods: it learns the mask logits of `model`'s prunable linears (the weights stay frozen), takes the hard
mask, zeros the pruned weights (and, with `reconstruct`, refits the kept ones) and returns the `MaskSet`.
`learn_masks(config)` is `leapctl learn`: start the processes, load the model, tokenise the corpus once
into the state folder, call `leap_masks`, write the run folder.

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
import json
import math
import os
import random
import resource
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers.utils import logging as transformers_logging

from leapctl.compute import resolve_device
from leapctl.data import calibration_batch, corpus_ids, sample_windows
from leapctl.errors import LeapctlError
from leapctl.learn.checkpoint import (
    has_checkpoint,
    load_tensors,
    read_checkpoint,
    restore_rng_states,
    rng_states,
    save_checkpoint,
)
from leapctl.learn.config import PRESET_VALUES, LearnConfig
from leapctl.learn.loss import language_model_and_distillation, regularisers
from leapctl.learn.mask import MaskState, attach_masks, detach_masks, hard_masks, init_logits, soft_mask
from leapctl.learn.schedule import cosine_with_warmup, magnitude_decay, mask_temperature
from leapctl.learn.stream import WindowStream, open_token_file, write_token_file
from leapctl.masks import MaskSet, apply_masks, load_masks, save_masks
from leapctl.models import load_model, model_layout
from leapctl.outdir import atomic_output_dir, check_output_dir
from leapctl.runs import LOGITS_FILE, mask_source, save_run

METRICS_FILE = "metrics.jsonl"
INIT_MASKS_FILE = "init_masks.safetensors"  # the initial keep-masks, computed once and read by every process
# An initial mask may miss the target a little (Wanda keeps whole-row counts: 0.595 at 60%); the density
# term and the exact final top-k take care of that, but a mask for another target is a mistake.
INIT_MASKS_SPARSITY_SLACK = 0.02
# The per-step numbers summed on the device over micro-batches (and processes), read back once per step.
SUMMED = ("lm_loss", "kl", "density", "density_penalty", "magnitude_penalty", "loss")


@dataclass
class LearnedMasks(MaskSet):
    """The `MaskSet` that `leap_masks` returns, with how the run went: `stats` holds the resolved settings,
    the per-step metrics of this process's steps, timing and peak memory (and the final logits with
    `save_logits`)."""

    stats: dict = field(default_factory=dict)


@dataclass
class LearnResult:
    out: Path | None  # the finished run folder; None when interrupted
    steps_done: int
    interrupted_by: int = 0  # the signal number that stopped the run early, 0 when it finished
    state_dir: Path | None = None


class LearnInterrupted(Exception):
    """SIGTERM or SIGINT stopped `leap_masks` after it wrote a checkpoint; `--resume` continues."""

    def __init__(self, steps_done: int, signal_number: int, state_dir: Path | None):
        super().__init__(f"interrupted by signal {signal_number} after step {steps_done}")
        self.steps_done, self.signal_number, self.state_dir = steps_done, signal_number, state_dir


class _StopFlag:
    """SIGTERM / SIGINT only raise a flag; the loop checkpoints at the end of the current step and stops.
    Installed only where there is a checkpoint to write and only from the main thread."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signal = 0
        self._previous = {}

    def __enter__(self):
        if self.enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._raise)
        return self

    def _raise(self, signum, frame):
        self.signal = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ==================================================================================== leapctl learn


def learn_masks(config: LearnConfig) -> LearnResult:
    """Learn a LEAP mask as `config` says; writes the run folder (rank 0) and returns where."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config.validate(world)
    if config.out is None:
        raise LeapctlError("learn needs --out")
    device = _start_processes(config, world)
    distributed = world > 1
    master = not distributed or dist.get_rank() == 0
    state_dir = config.state_dir()

    # ---------------------------------------------------------------- refuse bad starts before any work
    check_output_dir(Path(config.out), config.overwrite)
    if config.resume:
        read_checkpoint(state_dir, config.fingerprint(_autocast(config, device)))
    elif has_checkpoint(state_dir) and not config.overwrite:
        raise LeapctlError(
            f"an unfinished run's checkpoint exists in {state_dir}: pass --resume to continue "
            f"it or --overwrite to start over"
        )
    _barrier(distributed)
    if master and not config.resume and state_dir.exists():
        shutil.rmtree(state_dir)  # --overwrite: the old run is given up only now that the new one is valid
    _barrier(distributed)

    # ---------------------------------------------------------------- model, token stream, initial mask
    transformers_logging.disable_progress_bar()  # our own progress bars only; errors stay one line
    model, tokenizer = load_model(config.model, device=device)
    scales = _quantize_frozen(model, config)
    if not config.resume:
        if master:
            write_token_file(state_dir, training_corpus(config, model, tokenizer))
        _barrier(distributed)
    corpus = open_token_file(state_dir)
    init = None
    if not config.resume and config.init != "random" and config.init_masks is None:
        # Wanda on `nsamples` windows of the calibration source, as `leapctl prune --method wanda` computes it
        if master:
            calib = calibration_batch(config.calib, tokenizer, config.nsamples, config.seq_len, config.seed,
                                      model=model)
            init = _wanda(model, calib, config, device)
            if distributed:
                save_masks(state_dir / INIT_MASKS_FILE, init)
        _barrier(distributed)
        if not master:
            init = load_masks(state_dir / INIT_MASKS_FILE)

    try:
        learned = leap_masks(model, tokenizer, corpus, config, init=init)
    except LearnInterrupted as stop:
        _shutdown(distributed)
        return LearnResult(out=None, steps_done=stop.steps_done, interrupted_by=stop.signal_number,
                           state_dir=state_dir)

    # ---------------------------------------------------------------- the run folder
    if master:
        if distributed and config.fsdp:  # the trained model is sharded: rank 0 prunes a fresh copy
            model, _ = load_model(config.model, device=device)
            _quantize_frozen(model, config)
            finish_weights(model, learned, corpus, config)
        model = model.to("cpu").eval()
        metrics = [json.loads(line) for line in (state_dir / METRICS_FILE).read_text().splitlines() if line]
        report = _report(config, learned.stats, metrics)
        with atomic_output_dir(Path(config.out), config.overwrite) as tmp:
            from leapctl.learn.plots import plot_density_per_block, plot_losses

            block_density = _density_per_block(model, learned.masks)
            report["density_per_block"] = block_density
            kept_scales = None
            if scales is not None:
                from leapctl.quantize import quantization_entry

                kept_scales = {name: scales[name] for name in learned.masks}
                report["quantization"] = quantization_entry(config.bits, config.group_size, "rtn, then learn")
            save_run(tmp, model, tokenizer, learned, report, scales=kept_scales)
            shutil.copy(state_dir / METRICS_FILE, tmp / METRICS_FILE)
            plot_density_per_block(block_density, config.density, tmp / "density_per_block.png")
            plot_losses(metrics, tmp / "loss.png")
            if config.save_logits:
                save_file(learned.stats["logits"], str(tmp / LOGITS_FILE))
        if not config.keep_checkpoint:
            shutil.rmtree(state_dir, ignore_errors=True)
    _shutdown(distributed)
    return LearnResult(out=Path(config.out), steps_done=config.steps, state_dir=state_dir)


def _quantize_frozen(model: torch.nn.Module, config: LearnConfig) -> dict[str, torch.Tensor] | None:
    """With --bits: every maskable weight rounded to the bitmap-q4 grid (all weights decide the scales,
    since the mask is not known yet); the kept ones then sit on that grid whatever the mask becomes."""
    if config.bits is None:
        return None
    from leapctl.quantize import check_group_size, rtn_scales

    linears = model_layout(model, config.include, config.exclude).linears
    everything = MaskSet(masks={f"{name}.weight": torch.ones(linear.weight.shape, dtype=torch.bool,
                                                              device=linear.weight.device)
                                for name, linear in linears.items()})
    check_group_size(everything, config.group_size)
    return rtn_scales(model, everything, config.group_size)


def _start_processes(config: LearnConfig, world: int) -> torch.device:
    """The training device, and under torchrun the process group: one backend per device type (gloo for
    CPU tensors, NCCL for CUDA ones), so a collective works wherever its tensor lives."""
    named = resolve_device(config.device)  # the one resolver: cpu, or cuda:N checked to exist
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if named.type == "cuda" else "gloo")
    if named.type != "cuda":
        return named
    # Under torchrun each process takes its local rank's GPU whatever --device names.
    index = int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else named.index
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def training_corpus(config: LearnConfig, model, tokenizer) -> torch.Tensor:
    """The token stream for training. A text source must hold at least one global batch; `generated`
    samples `calib_tokens` tokens (default: one pass of the whole run, capped at 1M)."""
    one_batch = config.batch_size * config.seq_len
    if config.calib == "generated":
        wanted = config.calib_tokens or min(config.steps * one_batch, 1 << 20)
        ids = corpus_ids("generated", tokenizer, model=model, seed=config.seed + 1,
                         min_tokens=max(wanted, one_batch), generated_seq_len=config.seq_len)
    else:
        ids = corpus_ids(config.calib, tokenizer, model=model, seed=config.seed, min_tokens=one_batch)
        if config.calib_tokens:
            ids = ids[: max(config.calib_tokens, one_batch)]
    return ids.cpu()


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
    config = config.resolved()
    distributed = dist.is_available() and dist.is_initialized()
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    config.validate(world)
    master = rank == 0
    device = next(model.parameters()).device
    use_autocast = _autocast(config, device)
    compute_dtype = torch.bfloat16 if use_autocast else torch.float32
    state_dir = config.state_dir()
    meta = read_checkpoint(state_dir, config.fingerprint(use_autocast)) if config.resume else None
    if isinstance(corpus, str):
        corpus = training_corpus(dataclasses.replace(config, calib=corpus), model, tokenizer)
    if meta is not None and meta["tokens"] != len(corpus):
        raise LeapctlError(f"--resume: the checkpoint was trained on {meta['tokens']} tokens, the token "
                           f"stream holds {len(corpus)}")

    # ---------------------------------------------------------------- frozen model, logits, stream
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    np.random.seed(config.seed)
    model.requires_grad_(False)
    layout = model_layout(model, config.include, config.exclude)
    linears = layout.linears
    weight_names = [f"{name}.weight" for name in linears]
    total_weights = sum(linear.weight.numel() for linear in linears.values())
    dense_norm_sum = float(sum(linear.weight.float().norm() for linear in linears.values()))
    stream = WindowStream(corpus, config.seq_len, config.batch_size, config.seed,
                          position=meta["data_position"] if meta else 0)
    logits_dtype = getattr(torch, config.logits_dtype)
    if meta is not None:
        logits = {name: torch.zeros(linears[name[: -len(".weight")]].weight.shape, dtype=logits_dtype,
                                    device=device) for name in weight_names}  # filled from the checkpoint
    else:
        keep = _initial_keep(model, corpus, config, linears, init, device)
        generator = torch.Generator().manual_seed(config.seed)
        start = init_logits(keep, config.init, config.init_scale, generator, logits_dtype)
        logits = {name: t.to(device) for name, t in start.items()}
    mask_state = MaskState(run_seed=config.seed, compute_dtype=compute_dtype,
                           track_norms=config.magnitude_term and config.lambda2 != 0)
    masked = attach_masks(model, linears, logits, mask_state)

    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    train_model = model
    sharded = distributed and config.fsdp
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for block in layout.blocks:
            fully_shard(block)
        fully_shard(model)
    elif distributed:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )

    # ---------------------------------------------------------------- optimizer, schedules, resume
    logit_params = [layer.mask_logits for layer in masked.values()]  # after fully_shard made them shards
    optimizer = torch.optim.AdamW(  # fused: one kernel over all logits, ~5x faster than the loop on CPU
        logit_params, lr=config.lr, betas=(config.beta1, config.beta2), weight_decay=config.weight_decay,
        fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  cosine_with_warmup(config.warmup_steps, config.steps))
    start_step, generation = 0, 0
    if meta is not None:
        _restore(state_dir, meta, weight_names, masked, optimizer, distributed)
        scheduler.load_state_dict(meta["scheduler"])
        restore_rng_states(meta["rng"])
        start_step, generation = meta["step"], meta["generation"] + 1

    micro = config.micro_batch_size or config.batch_size // world
    micro_total = config.batch_size // micro
    micro_local = micro_total // world
    my_micro_batches = range(rank * micro_local, (rank + 1) * micro_local)
    tokens_per_step = config.batch_size * config.seq_len
    metrics_path = state_dir / METRICS_FILE if state_dir is not None else None
    if master and metrics_path is not None:
        state_dir.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(metrics_path, start_step)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_autocast else contextlib.nullcontext()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    writer = _tensorboard_writer(state_dir) if master and state_dir is not None else None

    def checkpoint_now(next_step: int) -> None:
        save_checkpoint(state_dir, _checkpoint_tensors(weight_names, masked, optimizer), {
            "fingerprint": config.fingerprint(use_autocast),
            "step": next_step,
            "generation": generation,
            "data_position": stream.position,
            "scheduler": scheduler.state_dict(),
            "param_groups": [{k: v for k, v in group.items() if k != "params"}
                             for group in optimizer.param_groups],
            "rng": rng_states(),
            "tokens": len(corpus),
        }, distributed)

    # ---------------------------------------------------------------- the loop
    metrics: list[dict] = []
    interrupted = 0
    done = start_step
    run_start = time.perf_counter()
    with _StopFlag(state_dir is not None) as stop, _single_sequences(), \
            _progress_bar(master and config.progress, config.steps, start_step) as bar:
        for step in range(start_step, config.steps):
            step_start = time.perf_counter()
            alpha, tau = mask_temperature(step, config.steps, (config.alpha_start, config.alpha_end),
                                          (config.tau_start, config.tau_end), config.fixed_alpha,
                                          config.fixed_tau)
            mask_state.alpha, mask_state.tau = alpha, tau
            decay = magnitude_decay(step, config.steps) if config.magnitude_term else 0.0
            batch = stream.peek(0, config.batch_size)
            sums = torch.zeros(len(SUMMED), dtype=torch.float64, device=device)
            for position, micro_batch in enumerate(my_micro_batches):
                ids = batch[micro_batch * micro : (micro_batch + 1) * micro].to(device, non_blocking=True)
                last = position == micro_local - 1
                with _no_gradient_sync(train_model, model, distributed and not last, config.fsdp), autocast:
                    teacher = None
                    if config.distill:
                        with torch.no_grad():  # the same frozen model with the masks off
                            mask_state.enabled = False
                            teacher = model(input_ids=ids, use_cache=False).logits
                            mask_state.enabled = True
                    mask_state.start_micro_batch(step, micro_batch)
                    if teacher is not None:
                        logits = train_model(input_ids=ids, use_cache=False).logits
                        lm_loss, kl = language_model_and_distillation(logits, teacher, ids)
                        del logits, teacher
                    else:
                        lm_loss = train_model(input_ids=ids, labels=ids, use_cache=False).loss.float()
                        kl = torch.zeros_like(lm_loss)
                    terms = regularisers(mask_state.mask_sums, mask_state.masked_norms_sq, total_weights,
                                         dense_norm_sum, config.density, config.lambda1, config.lambda2,
                                         decay)
                    task = (1.0 - config.distill) * lm_loss + config.distill * kl
                    loss = task + terms.density_penalty + terms.magnitude_penalty
                    mask_state.recording = False  # checkpoint recomputation in backward must not record
                    (loss / micro_local).backward()
                sums += torch.stack([lm_loss, kl, terms.density, terms.density_penalty,
                                     terms.magnitude_penalty, loss]).detach().double()
            grad_norm = _clip_gradients(logit_params, config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            stream.advance(config.batch_size)

            flag = torch.tensor([stop.signal], dtype=torch.float64, device=device)
            if distributed:
                dist.all_reduce(sums)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            host = torch.cat([sums / micro_total, grad_norm.reshape(1).double(), flag]).tolist()  # the sync
            stop.signal = int(host[-1])
            elapsed = time.perf_counter() - step_start
            record = {"step": step, **dict(zip(SUMMED, host, strict=False)), "grad_norm": host[-2],
                      "alpha": alpha, "tau": tau, "lr": scheduler.get_last_lr()[0],
                      "tokens_per_s": tokens_per_step / elapsed, "step_s": elapsed}
            metrics.append(record)
            if master:
                if metrics_path is not None:
                    with open(metrics_path, "a") as handle:
                        handle.write(json.dumps(record) + "\n")
                if writer is not None:
                    for key, value in record.items():
                        writer.add_scalar(f"learn/{key}", value, step)
                bar.update(record)

            done = step + 1
            if state_dir is not None and (stop.signal or (
                    config.checkpoint_every and done % config.checkpoint_every == 0 and done < config.steps)):
                checkpoint_now(done)
            if stop.signal:
                interrupted = stop.signal
                break
    train_seconds = time.perf_counter() - run_start
    if writer is not None:
        writer.close()
    if interrupted:
        raise LearnInterrupted(done, interrupted, state_dir)

    # ---------------------------------------------------------------- the hard mask, the pruned model
    final = {name: layer.mask_logits.detach()
             for name, layer in zip(weight_names, masked.values(), strict=True)}
    local = {name: (p.to_local() if hasattr(p, "to_local") else p) for name, p in final.items()}
    keep = hard_masks(local, config.density, config.hard_mask, group=dist.group.WORLD if sharded else None)
    masks = {name: _full_cpu(keep[name].to(torch.uint8), final[name]).bool() for name in weight_names}
    stats = {
        "settings": config.fingerprint(use_autocast),
        "world_size": world,
        "device": str(device),
        "resumed_at_step": start_step or None,
        "train_seconds_this_process": train_seconds,
        "tokens_per_s": ((config.steps - start_step) * tokens_per_step / train_seconds
                         if train_seconds else None),
        "peak_memory": _peak_memory(device),
        "final_soft_density_noiseless": _soft_density(final, mask_state, total_weights, sharded),
        "masked_weights": total_weights,
        "metrics": metrics,
    }
    if config.save_logits:
        stats["logits"] = {name: _full_cpu(p, p).float().contiguous() for name, p in final.items()}
    if not sharded:
        model.gradient_checkpointing_disable()
        detach_masks(model, masked)
        model.eval()
    learned = LearnedMasks(
        masks=masks, model=str(getattr(model, "name_or_path", config.model)),
        extra={"method": "leap", "target_sparsity": config.sparsity, "hard_mask": config.hard_mask,
               "preset": config.preset, "steps": config.steps, "batch_size": config.batch_size,
               "seq_len": config.seq_len,
               **{key: getattr(config, key) for key in PRESET_VALUES[config.preset]}},
        stats=stats,
    )
    if not sharded:
        finish_weights(model, learned, corpus, config)
    return learned


def finish_weights(model: torch.nn.Module, masks: MaskSet, corpus, config: LearnConfig) -> None:
    """Zero the pruned weights of the (dense, plain) `model`; with `reconstruct`, first refit the kept ones
    by least squares on `nsamples` windows of the corpus (`reconstruct.py`)."""
    config = config.resolved()
    if config.reconstruct:
        from leapctl.learn.reconstruct import reconstruct_weights

        calib = sample_windows(corpus, config.nsamples, config.seq_len, config.seed)
        reconstruct_weights(model, masks, calib, device=next(model.parameters()).device,
                            progress=config.progress)
    apply_masks(model, masks)


# ------------------------------------------------------------ helpers, in the order the loop uses them


def _autocast(config: LearnConfig, device: torch.device) -> bool:
    return config.autocast if config.autocast is not None else device.type == "cuda"


def _barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def _shutdown(distributed: bool) -> None:
    if distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _wanda(model, calib: torch.Tensor, config: LearnConfig, device) -> MaskSet:
    from leapctl.prune.wanda import wanda_masks

    was_training = model.training
    model.eval()
    mask_set = wanda_masks(model, calib, config.sparsity, include=config.include, exclude=config.exclude,
                           device=device, in_place=False, progress=config.progress)
    model.train(was_training)
    return mask_set


def _initial_keep(model, corpus, config: LearnConfig, linears, init: MaskSet | None,
                  device) -> dict[str, torch.Tensor]:
    """The keep-mask the logits start from, in the model's layer order (initialisers draw noise layer by
    layer): `init`, else the mask file, else random (ablation), else Wanda on windows of the corpus."""
    if init is None and config.init == "random":
        generator = torch.Generator().manual_seed(config.seed)
        keep = {}
        for name, linear in linears.items():
            n = linear.weight.numel()
            flat = torch.zeros(n, dtype=torch.bool)
            flat[torch.randperm(n, generator=generator)[: round(config.density * n)]] = True
            keep[f"{name}.weight"] = flat.view_as(linear.weight)
        return keep
    origin = "the initial mask"
    if init is None and config.init_masks is not None:
        init, origin = load_masks(mask_source(Path(config.init_masks))), f"--init-masks {config.init_masks}"
    if init is None:
        calib = sample_windows(corpus, config.nsamples, config.seq_len, config.seed)
        init = _wanda(model, calib, config, device)
    return _checked_keep(init, linears, config.sparsity, origin)


def _checked_keep(mask_set: MaskSet, linears, sparsity: float, origin: str) -> dict[str, torch.Tensor]:
    """The masks of an earlier run (say `prune --method wanda` or `sparsegpt`), so the initialiser is not
    computed twice; they must cover exactly the layers being learned, near the target sparsity."""
    expected = {f"{name}.weight": tuple(linear.weight.shape) for name, linear in linears.items()}
    if set(mask_set.masks) != set(expected):
        missing = sorted(set(expected) - set(mask_set.masks))
        extra = sorted(set(mask_set.masks) - set(expected))
        raise LeapctlError(f"{origin} does not cover the learned layers "
                           f"(missing {missing[:2]}, extra {extra[:2]})")
    for name, shape in expected.items():
        if tuple(mask_set.masks[name].shape) != shape:
            raise LeapctlError(f"{origin}: {name} has shape {tuple(mask_set.masks[name].shape)}, "
                               f"the model's weight has {shape}")
    achieved = mask_set.sparsity()["global"]
    if abs(achieved - sparsity) > INIT_MASKS_SPARSITY_SLACK:
        raise LeapctlError(f"{origin} has sparsity {achieved:.4f}, the target is {sparsity}")
    return {name: mask_set.masks[name].cpu() for name in expected}


def _checkpoint_tensors(weight_names, masked, optimizer) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint keyed by weight name: logits and AdamW state, as they live (FSDP2
    shards stay shards; DCP writes each process's own)."""
    tensors = {}
    for name, layer in zip(weight_names, masked.values(), strict=True):
        tensors[f"logits.{name}"] = layer.mask_logits.detach()
        for key, value in optimizer.state.get(layer.mask_logits, {}).items():
            tensors[f"{key}.{name}"] = value
    return tensors


def _restore(state_dir: Path, meta: dict, weight_names, masked, optimizer, distributed: bool) -> None:
    """Logits into the parameters (shards under FSDP2) and AdamW's state through `load_state_dict`, which
    puts every tensor where this optimizer keeps it (fused AdamW: `step` on the parameter's device)."""
    templates, slots = {}, {}
    for index, (name, layer) in enumerate(zip(weight_names, masked.values(), strict=True)):
        param = layer.mask_logits
        templates[f"logits.{name}"] = param.detach()
        slots[index] = {"step": torch.zeros((), dtype=torch.float32),
                        "exp_avg": torch.zeros_like(param.detach()),
                        "exp_avg_sq": torch.zeros_like(param.detach())}
        for key, value in slots[index].items():
            templates[f"{key}.{name}"] = value
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


def _truncate_metrics(path: Path, start_step: int) -> None:
    """On resume, forget metric lines of steps after the checkpoint (they will be run again)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] < start_step]
    path.write_text("".join(line + "\n" for line in keep))


def _tensorboard_writer(state_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(state_dir / "tensorboard"))


def _no_gradient_sync(train_model, model, skip_sync: bool, fsdp: bool):
    """Gradient accumulation: no all-reduce until the last micro-batch of the step."""
    if not skip_sync:
        return contextlib.nullcontext()
    if fsdp:
        return _fsdp_no_sync(model)
    return train_model.no_sync()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _clip_gradients(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the logits' total gradient norm to `max_norm` (0: no clipping); returns the norm before
    clipping, as a tensor on the device (no host sync). FSDP2 shards give a DTensor: made whole."""
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _full_cpu(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole of a layer-sized tensor on the CPU: `tensor` is this process's shard when `like` (the
    parameter) is an FSDP2 DTensor (every process must call this then), else the whole tensor already."""
    if hasattr(like, "device_mesh"):
        from torch.distributed.tensor import DTensor

        if not isinstance(tensor, DTensor):
            tensor = DTensor.from_local(tensor, like.device_mesh, like.placements, shape=like.shape,
                                        stride=like.stride())
        tensor = tensor.full_tensor()
    return tensor.detach().cpu()


def _soft_density(final: dict, mask_state: MaskState, total_weights: int, sharded: bool) -> float:
    """Mean noiseless soft mask at the last step's temperature, over all masked weights."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in final.values()]
    kept = torch.stack([soft_mask(p, mask_state.alpha, mask_state.tau, None).sum() for p in local]).sum()
    if sharded:
        dist.all_reduce(kept)
    return float(kept) / total_weights


class _progress_bar:
    """Rich progress bar with the run's live numbers; a no-op when disabled (tests, non-zero ranks)."""

    def __init__(self, enabled: bool, total: int, completed: int):
        self.enabled, self.total, self.completed = enabled, total, completed

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("learn"),
                BarColumn(bar_width=16),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn(
                    "lm {task.fields[lm]:.3f} dens {task.fields[density]:.3f} "
                    "α {task.fields[alpha]:.0f} τ {task.fields[tau]:.2f} {task.fields[tps]:.0f} tok/s"
                ),
                console=Console(stderr=True),
            )
            self.progress.start()
            self.task = self.progress.add_task(
                "learn", total=self.total, completed=self.completed, lm=math.nan, density=math.nan, alpha=0.0,
                tau=0.0, tps=0.0,
            )
        return self

    def update(self, record: dict) -> None:
        if self.enabled:
            self.progress.update(self.task, advance=1, lm=record["lm_loss"], density=record["density"],
                                 alpha=record["alpha"], tau=record["tau"], tps=record["tokens_per_s"])

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.stop()


def _density_per_block(model, keep: dict[str, torch.Tensor]) -> list[float]:
    """Kept fraction of the masked weights of each decoder block (the paper's allocation figure)."""
    layout = model_layout(model)
    blocks = len(layout.blocks)
    kept, total = [0] * blocks, [0] * blocks
    for name, mask in keep.items():
        index = layout.block_index(name)
        kept[index] += int(mask.sum())
        total[index] += mask.numel()
    return [k / t if t else math.nan for k, t in zip(kept, total, strict=True)]


def _peak_memory(device: torch.device) -> dict:
    peak = {"process_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        peak["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        peak["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return peak


def _report(config: LearnConfig, stats: dict, metrics: list[dict]) -> dict:
    config = config.resolved()
    return {
        "method": "leap",
        "target_sparsity": config.sparsity,
        "preset": config.preset,
        "settings": {**stats["settings"], "gradient_checkpointing": config.gradient_checkpointing,
                     "fsdp": config.fsdp,
                     "micro_batch_size": config.micro_batch_size or config.batch_size // stats["world_size"]},
        "world_size": stats["world_size"],
        "device": stats["device"],
        "steps": config.steps,
        "resumed_at_step": stats["resumed_at_step"],
        "tokens_trained": config.steps * config.batch_size * config.seq_len,
        "train_seconds_this_process": stats["train_seconds_this_process"],
        "tokens_per_s": stats["tokens_per_s"],
        "peak_memory": stats["peak_memory"],
        "final": {key: metrics[-1][key] for key in ("lm_loss", "kl", "density", "loss")} if metrics else {},
        "final_soft_density_noiseless": stats["final_soft_density_noiseless"],
        "masked_weights": stats["masked_weights"],
        "magnitude_term": "-lambda2 * (1 - step/T) * sum_l ||M_l*W_l||_F / sum_l ||W_l||_F"
        if config.magnitude_term else None,
    }
