"""The LEAP training loop, readable top to bottom (in the manner of nanoGPT's train.py).

One process, or N under `torchrun` (DDP, or FSDP2 with `fsdp=True`). Only the mask logits train; the
model's weights are frozen. Each optimizer step takes `batch_size` fresh windows from the stream, split
into micro-batches of `micro_batch_size`; process r handles the r-th contiguous share of the micro-batches.
Every micro-batch draws its own mask noise from (seed, step, global micro-batch index, layer), so the
single-process run and an N-process run see the same noise on the same windows and differ only by the
order of floating-point sums (see the README's DDP note).
"""

import contextlib
import json
import math
import os
import random
import resource
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers.utils import logging as transformers_logging

from leapctl.data import calibration_batch, corpus_ids
from leapctl.errors import LeapctlError
from leapctl.learn.checkpoint import (
    CHECKPOINT_FILE,
    load_checkpoint,
    restore_rng_states,
    rng_states,
    save_checkpoint,
)
from leapctl.learn.config import LearnConfig
from leapctl.learn.loss import regularisers
from leapctl.learn.mask import MaskState, attach_masks, detach_masks, hard_masks, init_logits, soft_mask
from leapctl.learn.schedule import cosine_with_warmup, magnitude_decay, mask_temperature
from leapctl.learn.stream import WindowStream
from leapctl.masks import MaskSet, load_masks
from leapctl.models import decoder_blocks, load_model, model_layout, prunable_linears
from leapctl.outdir import atomic_output_dir, check_output_dir
from leapctl.runs import LOGITS_FILE, mask_source, save_run

METRICS_FILE = "metrics.jsonl"
# An initial mask may miss the target a little (Wanda keeps whole-row counts: 0.595 at 60%); the density
# term and the exact final top-k take care of that, but a mask for another target is a mistake.
INIT_MASKS_SPARSITY_SLACK = 0.02


@dataclass
class LearnResult:
    out: Path | None  # the finished run folder; None when interrupted
    steps_done: int
    interrupted_by: int = 0  # the signal number that stopped the run early, 0 when it finished
    state_dir: Path | None = None


class _StopFlag:
    """SIGTERM / SIGINT only raise a flag; the loop checkpoints at the end of the current step and stops."""

    def __init__(self):
        self.signal = 0
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._raise)
        return self

    def _raise(self, signum, frame):
        self.signal = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def learn_masks(config: LearnConfig) -> LearnResult:
    """Learn a LEAP mask as `config` says; writes the run folder (rank 0) and returns where."""
    # ---------------------------------------------------------------- processes and devices
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config.validate(world)
    if config.device == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device_type = torch.device(config.device).type
    if distributed and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    rank = dist.get_rank() if distributed else 0
    master = rank == 0
    if device_type == "cuda":
        if distributed:
            index = int(os.environ.get("LOCAL_RANK", "0"))
        else:
            index = 0 if config.device == "auto" else torch.device(config.device).index or 0
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    use_autocast = config.autocast if config.autocast is not None else device_type == "cuda"
    compute_dtype = torch.bfloat16 if use_autocast else torch.float32
    logits_dtype = getattr(torch, config.logits_dtype)

    # ---------------------------------------------------------------- refuse bad starts before any work
    state_dir = config.state_dir()
    check_output_dir(Path(config.out), config.overwrite)
    has_checkpoint = (state_dir / CHECKPOINT_FILE).is_file()
    if config.resume:
        resumed = load_checkpoint(state_dir, config.fingerprint())
    else:
        if has_checkpoint and not config.overwrite:
            raise LeapctlError(
                f"an unfinished run's checkpoint exists in {state_dir}: pass --resume to continue "
                f"it or --overwrite to start over"
            )
        resumed = None
    _barrier(distributed)
    if master and not config.resume and state_dir.exists():
        shutil.rmtree(state_dir)  # --overwrite: the old run is given up only now that the new one is valid
    _barrier(distributed)

    # ---------------------------------------------------------------- model (frozen) and data
    transformers_logging.disable_progress_bar()  # our own progress bars only; errors stay one line
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    np.random.seed(config.seed)
    model, tokenizer = load_model(config.model, device=device)
    model.requires_grad_(False)
    linears = prunable_linears(model, config.include, config.exclude)
    weight_names = [f"{name}.weight" for name in linears]
    total_weights = sum(linear.weight.numel() for linear in linears.values())
    dense_norm_sum = sum(float(linear.weight.float().norm()) for linear in linears.values())

    if resumed is not None:
        corpus = resumed["corpus"]
    else:
        corpus = _broadcast_object(
            _build_corpus(config, model, tokenizer, device) if master else None, distributed
        )
    stream = WindowStream(
        corpus,
        config.seq_len,
        config.batch_size,
        config.seed,
        position=resumed["data_position"] if resumed else 0,
    )

    # ---------------------------------------------------------- logits: from Wanda, or from the checkpoint
    if resumed is not None:
        logits = {
            name: resumed["logits"][name].to(device=device, dtype=logits_dtype) for name in weight_names
        }
    else:
        keep = _initial_keep_masks(config, model, tokenizer, linears, device) if master else None
        keep = _broadcast_object(keep, distributed)
        generator = torch.Generator().manual_seed(config.seed)
        logits = {
            name: t.to(device)
            for name, t in init_logits(keep, config.init, config.init_scale, generator, logits_dtype).items()
        }
    mask_state = MaskState(
        run_seed=config.seed,
        compute_dtype=compute_dtype,
        track_norms=config.magnitude_term and config.lambda2 != 0,
    )
    masked = attach_masks(model, linears, logits, mask_state)

    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    train_model = model
    if distributed and config.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in decoder_blocks(model):
            fully_shard(block)
        fully_shard(model)
    elif distributed:
        train_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device_type == "cuda" else None
        )

    # ---------------------------------------------------------------- optimizer and schedules
    logit_params = [layer.mask_logits for layer in masked.values()]  # after fully_shard made them shards
    optimizer = torch.optim.AdamW(  # fused: one kernel over all logits, ~5x faster than the loop on CPU
        logit_params,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        weight_decay=config.weight_decay,
        fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_with_warmup(config.warmup_steps, config.steps)
    )
    start_step = 0
    if resumed is not None:
        _load_training_state(model, optimizer, resumed, weight_names, masked)
        scheduler.load_state_dict(resumed["scheduler"])
        restore_rng_states(resumed["rng"])
        start_step = resumed["step"]

    micro = config.micro_batch_size or config.batch_size // world
    micro_total = config.batch_size // micro
    micro_local = micro_total // world
    my_micro_batches = range(rank * micro_local, (rank + 1) * micro_local)
    tokens_per_step = config.batch_size * config.seq_len
    metrics_path = state_dir / METRICS_FILE
    if master:
        state_dir.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(metrics_path, start_step)
    if use_autocast:
        autocast = torch.autocast(device_type, dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext()
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    writer = _tensorboard_writer(state_dir) if master else None

    def checkpoint_now(next_step: int) -> None:
        state = _gather_training_state(model, optimizer, weight_names, masked)
        if master:
            save_checkpoint(
                state_dir,
                {
                    "fingerprint": config.fingerprint(),
                    "step": next_step,
                    "data_position": stream.position,
                    "logits": state["logits"],
                    "optimizer": state["optimizer"],
                    "scheduler": scheduler.state_dict(),
                    "rng": rng_states(),
                    "corpus": corpus,
                },
            )
        _barrier(distributed)

    # ---------------------------------------------------------------- the loop
    interrupted = 0
    run_start = time.perf_counter()
    with _StopFlag() as stop, _progress_bar(master and config.progress, config.steps, start_step) as bar:
        for step in range(start_step, config.steps):
            step_start = time.perf_counter()
            alpha, tau = mask_temperature(
                step,
                config.steps,
                (config.alpha_start, config.alpha_end),
                (config.tau_start, config.tau_end),
                config.fixed_alpha,
                config.fixed_tau,
            )
            mask_state.alpha, mask_state.tau = alpha, tau
            decay = magnitude_decay(step, config.steps) if config.magnitude_term else 0.0
            batch = stream.peek(0, config.batch_size)
            sums = torch.zeros(
                5, dtype=torch.float64
            )  # lm loss, density, density pen., magnitude pen., total
            for position, micro_batch in enumerate(my_micro_batches):
                ids = batch[micro_batch * micro : (micro_batch + 1) * micro].to(device)
                mask_state.start_micro_batch(step, micro_batch)
                last = position == micro_local - 1
                with _no_gradient_sync(train_model, model, distributed and not last, config.fsdp), autocast:
                    lm_loss = train_model(input_ids=ids, labels=ids, use_cache=False).loss.float()
                    terms = regularisers(
                        mask_state.mask_sums,
                        mask_state.masked_norms_sq,
                        total_weights,
                        dense_norm_sum,
                        config.density,
                        config.lambda1,
                        config.lambda2,
                        decay,
                    )
                    loss = lm_loss + terms.density_penalty + terms.magnitude_penalty
                    mask_state.recording = False  # checkpoint recomputation in backward must not record
                    (loss / micro_local).backward()
                sums += torch.tensor(
                    [
                        lm_loss.item(),
                        terms.density.item(),
                        terms.density_penalty.item(),
                        terms.magnitude_penalty.item(),
                        loss.item(),
                    ],
                    dtype=torch.float64,
                )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            stream.advance(config.batch_size)

            if distributed:
                dist.all_reduce(sums)
                flag = torch.tensor([stop.signal], dtype=torch.int64)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                stop.signal = int(flag)
            sums /= micro_total
            elapsed = time.perf_counter() - step_start
            record = {
                "step": step,
                "lm_loss": sums[0].item(),
                "density": sums[1].item(),
                "density_penalty": sums[2].item(),
                "magnitude_penalty": sums[3].item(),
                "loss": sums[4].item(),
                "alpha": alpha,
                "tau": tau,
                "lr": scheduler.get_last_lr()[0],
                "tokens_per_s": tokens_per_step / elapsed,
                "step_s": elapsed,
            }
            if master:
                with open(metrics_path, "a") as handle:
                    handle.write(json.dumps(record) + "\n")
                if writer is not None:
                    for key, value in record.items():
                        writer.add_scalar(f"learn/{key}", value, step)
                bar.update(record)

            done = step + 1
            if stop.signal or (
                config.checkpoint_every and done % config.checkpoint_every == 0 and done < config.steps
            ):
                checkpoint_now(done)
            if stop.signal:
                interrupted = stop.signal
                break
    train_seconds = time.perf_counter() - run_start
    if writer is not None:
        writer.close()
    if interrupted:
        _shutdown(distributed)
        return LearnResult(out=None, steps_done=done, interrupted_by=interrupted, state_dir=state_dir)

    # ---------------------------------------------------------------- the hard mask and the run folder
    final = _gather_training_state(model, optimizer, weight_names, masked, with_optimizer=False)["logits"]
    out = None
    if master:
        keep = hard_masks(final, config.density, config.hard_mask)
        model_cpu = _plain_model(model, masked, distributed and config.fsdp, config)
        mask_set = MaskSet(
            masks={name: keep[name].cpu() for name in weight_names},
            model=config.model,
            extra={"method": "leap", "target_sparsity": config.sparsity, "hard_mask": config.hard_mask},
        )
        metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
        report = _report(
            config, world, device, metrics, train_seconds, start_step, total_weights, final, mask_state
        )
        with atomic_output_dir(Path(config.out), config.overwrite) as tmp:
            from leapctl.learn.plots import plot_density_per_block, plot_losses

            block_density = _density_per_block(model_cpu, keep)
            report["density_per_block"] = block_density
            save_run(tmp, model_cpu, tokenizer, mask_set, report)
            shutil.copy(metrics_path, tmp / METRICS_FILE)
            plot_density_per_block(block_density, config.density, tmp / "density_per_block.png")
            plot_losses(metrics, tmp / "loss.png")
            if config.save_logits:
                save_file({name: t.float().contiguous() for name, t in final.items()}, str(tmp / LOGITS_FILE))
        out = Path(config.out)
        if not config.keep_checkpoint:
            shutil.rmtree(state_dir, ignore_errors=True)
    _shutdown(distributed)
    return LearnResult(out=out, steps_done=config.steps, state_dir=state_dir)


# ------------------------------------------------------------ helpers, in the order the loop uses them


def _barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def _shutdown(distributed: bool) -> None:
    if distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _broadcast_object(obj, distributed: bool):
    """Rank 0's object on every rank (the corpus and the initial keep-masks are built once)."""
    if not distributed:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _build_corpus(config: LearnConfig, model, tokenizer, device) -> torch.Tensor:
    """The token stream for training. A text source must hold at least one global batch; `generated`
    samples `calib_tokens` tokens (default: one pass of the whole run, capped at 1M)."""
    one_batch = config.batch_size * config.seq_len
    if config.calib == "generated":
        wanted = config.calib_tokens or min(config.steps * one_batch, 1 << 20)
        ids = corpus_ids(
            "generated",
            tokenizer,
            model=model,
            seed=config.seed + 1,
            min_tokens=max(wanted, one_batch),
            generated_seq_len=config.seq_len,
        )
    else:
        ids = corpus_ids(config.calib, tokenizer, model=model, seed=config.seed, min_tokens=one_batch)
        if config.calib_tokens:
            ids = ids[: max(config.calib_tokens, one_batch)]
    return ids.cpu()


def _initial_keep_masks(config: LearnConfig, model, tokenizer, linears, device) -> dict[str, torch.Tensor]:
    """The keep-mask the logits start from: Wanda at the target sparsity, or random for the ablation."""
    if config.init == "random":
        generator = torch.Generator().manual_seed(config.seed)
        keep = {}
        for name, linear in linears.items():
            n = linear.weight.numel()
            flat = torch.zeros(n, dtype=torch.bool)
            flat[torch.randperm(n, generator=generator)[: round(config.density * n)]] = True
            keep[f"{name}.weight"] = flat.view_as(linear.weight)
        return keep
    if config.init_masks is not None:
        return _keep_masks_from_file(Path(config.init_masks), linears, config.sparsity)
    from leapctl.prune.wanda import wanda_masks

    calib = calibration_batch(
        config.calib, tokenizer, config.nsamples, config.seq_len, config.seed, model=model
    )
    was_training = model.training
    model.eval()
    mask_set = wanda_masks(
        model,
        calib,
        config.sparsity,
        include=config.include,
        exclude=config.exclude,
        device=device,
        in_place=False,
        progress=config.progress,
    )
    model.train(was_training)
    return mask_set.masks


def _keep_masks_from_file(path: Path, linears, sparsity: float) -> dict[str, torch.Tensor]:
    """Masks of an earlier run (say `prune --method wanda` or `sparsegpt`), so the initialiser is not
    computed twice; they must cover exactly the layers being learned, near the target sparsity."""
    mask_set = load_masks(mask_source(path))
    expected = {f"{name}.weight": tuple(linear.weight.shape) for name, linear in linears.items()}
    if set(mask_set.masks) != set(expected):
        missing = sorted(set(expected) - set(mask_set.masks))
        extra = sorted(set(mask_set.masks) - set(expected))
        raise LeapctlError(f"--init-masks {path} does not cover the learned layers "
                           f"(missing {missing[:2]}, extra {extra[:2]})")
    for name, shape in expected.items():
        if tuple(mask_set.masks[name].shape) != shape:
            raise LeapctlError(f"--init-masks {path}: {name} has shape {tuple(mask_set.masks[name].shape)}, "
                               f"the model's weight has {shape}")
    achieved = mask_set.sparsity()["global"]
    if abs(achieved - sparsity) > INIT_MASKS_SPARSITY_SLACK:
        raise LeapctlError(f"--init-masks {path} has sparsity {achieved:.4f}, the target is {sparsity}")
    # in the model's layer order, as Wanda yields them: initialisers draw noise layer by layer
    return {name: mask_set.masks[name] for name in expected}


def _truncate_metrics(path: Path, start_step: int) -> None:
    """On resume, forget metric lines of steps after the checkpoint (they will be run again)."""
    if not path.is_file():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] < start_step
    ]
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


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A plain CPU copy of a (possibly FSDP-sharded) tensor; every rank must call it."""
    if hasattr(tensor, "full_tensor"):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu().clone()


def _gather_training_state(model, optimizer, weight_names, masked, with_optimizer: bool = True) -> dict:
    """Logits and optimizer state as full CPU tensors keyed by weight name (identical on every rank)."""
    logits = {
        name: _full(layer.mask_logits) for name, layer in zip(weight_names, masked.values(), strict=True)
    }
    state = {"logits": logits}
    if with_optimizer:
        per_param = []
        for layer in masked.values():
            slot = optimizer.state.get(layer.mask_logits, {})
            per_param.append(
                {
                    key: (
                        _full(value)
                        if torch.is_tensor(value) and value.dim()
                        else value.detach().cpu().clone()
                        if torch.is_tensor(value)
                        else value
                    )
                    for key, value in slot.items()
                }
            )
        state["optimizer"] = {
            "state": per_param,
            "param_groups": [
                {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
            ],
        }
    return state


@torch.no_grad()
def _load_training_state(model, optimizer, resumed: dict, weight_names, masked) -> None:
    """Put checkpointed logits and AdamW moments back (before any FSDP sharding happened, or into shards)."""
    for name, layer in zip(weight_names, masked.values(), strict=True):
        _copy_into(layer.mask_logits, resumed["logits"][name])
    for layer, saved in zip(masked.values(), resumed["optimizer"]["state"], strict=True):
        if not saved:
            continue
        param = layer.mask_logits
        slot = {}
        for key, value in saved.items():
            if torch.is_tensor(value) and value.dim():
                target = torch.zeros_like(param, dtype=value.dtype)
                _copy_into(target, value)
                slot[key] = target
            else:
                slot[key] = value.clone() if torch.is_tensor(value) else value
        optimizer.state[param] = slot
    for group, saved in zip(optimizer.param_groups, resumed["optimizer"]["param_groups"], strict=True):
        group.update(saved)


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full tensor into `target`, which may be an FSDP shard (DTensor)."""
    if hasattr(target, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        target.copy_(
            distribute_tensor(full.to(target.device, target.dtype), target.device_mesh, target.placements)
        )
    else:
        target.copy_(full.to(target.device, target.dtype))


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
                "learn",
                total=self.total,
                completed=self.completed,
                lm=math.nan,
                density=math.nan,
                alpha=0.0,
                tau=0.0,
                tps=0.0,
            )
        return self

    def update(self, record: dict) -> None:
        if self.enabled:
            self.progress.update(
                self.task,
                advance=1,
                lm=record["lm_loss"],
                density=record["density"],
                alpha=record["alpha"],
                tau=record["tau"],
                tps=record["tokens_per_s"],
            )

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.stop()


def _plain_model(model, masked, fsdp: bool, config: LearnConfig):
    """The model with plain linears back, on the CPU, for `save_run`. Under FSDP the model is sharded,
    so rank 0 loads a fresh copy instead (the weights never changed)."""
    if fsdp:
        fresh, _ = load_model(config.model)
        return fresh
    model.gradient_checkpointing_disable()
    detach_masks(model, masked)
    return model.to("cpu").eval()


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


@torch.no_grad()
def _report(
    config: LearnConfig,
    world: int,
    device,
    metrics: list[dict],
    train_seconds: float,
    start_step: int,
    total_weights: int,
    final_logits: dict,
    mask_state: MaskState,
) -> dict:
    soft = sum(
        float(soft_mask(p, mask_state.alpha, mask_state.tau, None).sum()) for p in final_logits.values()
    )
    steps_here = config.steps - start_step
    return {
        "method": "leap",
        "target_sparsity": config.sparsity,
        "settings": {
            **config.fingerprint(),
            "micro_batch_size": config.micro_batch_size or config.batch_size // world,
            "gradient_checkpointing": config.gradient_checkpointing,
            "fsdp": config.fsdp,
        },
        "world_size": world,
        "device": str(device),
        "steps": config.steps,
        "resumed_at_step": start_step or None,
        "tokens_trained": config.steps * config.batch_size * config.seq_len,
        "train_seconds_this_process": train_seconds,
        "tokens_per_s": steps_here * config.batch_size * config.seq_len / train_seconds
        if train_seconds
        else None,
        "peak_memory": _peak_memory(device),
        "final": {key: metrics[-1][key] for key in ("lm_loss", "density", "loss")} if metrics else {},
        "final_soft_density_noiseless": soft / total_weights,
        "masked_weights": total_weights,
        "magnitude_term": "-lambda2 * (1 - step/T) * sum_l ||M_l*W_l||_F / sum_l ||W_l||_F"
        if config.magnitude_term
        else None,
    }
