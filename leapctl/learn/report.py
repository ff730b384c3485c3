"""The report of a learning run (`report.json`), and the numbers only it needs."""

import math
import resource

import torch
import torch.distributed as dist

from leapctl.learn.config import LearnConfig
from leapctl.learn.mask import MaskState, soft_mask
from leapctl.models import ModelLayout


def soft_density(final: dict, mask_state: MaskState, total_weights: int, sharded: bool) -> float:
    """Mean noiseless soft mask at the last step's temperature, over all masked weights."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in final.values()]
    kept = torch.stack([soft_mask(p, mask_state.alpha, mask_state.tau, None).sum() for p in local]).sum()
    if sharded:
        dist.all_reduce(kept)
    return float(kept) / total_weights


def density_per_block(layout: ModelLayout, keep: dict[str, torch.Tensor]) -> list[float]:
    """Kept fraction of the masked weights of each decoder block (the paper's allocation figure); only the
    layout's block names are read, so a layout whose linears `train` has taken serves."""
    blocks = len(layout.blocks)
    kept, total = [0] * blocks, [0] * blocks
    for name, mask in keep.items():
        index = layout.block_index(name)
        kept[index] += int(mask.sum())
        total[index] += mask.numel()
    return [k / t if t else math.nan for k, t in zip(kept, total, strict=True)]


def peak_memory(device: torch.device) -> dict:
    peak = {"process_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        peak["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        peak["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return peak


def learn_report(config: LearnConfig, stats: dict, metrics: list[dict]) -> dict:
    """`config` is resolved; `stats` from `LearnedMasks.stats`, `metrics` the per-step records."""
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
