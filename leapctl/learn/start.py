"""What a learning run starts from: the training token stream and the keep-mask the logits start from
(given, read from --init-masks, random, or Wanda on windows of the corpus)."""

from pathlib import Path

import torch

from leapctl.data import corpus_ids, sample_windows
from leapctl.errors import LeapctlError
from leapctl.learn.config import LearnConfig
from leapctl.learn.heldout import split_stream
from leapctl.masks import MaskSet, load_masks
from leapctl.models import ModelLayout
from leapctl.runs import mask_source

# An initial mask may miss the target a little (Wanda keeps whole-row counts: 0.595 at 60%); the density
# term and the exact final top-k take care of that, but a mask for another target is a mistake.
INIT_MASKS_SPARSITY_SLACK = 0.02


def training_corpus(config: LearnConfig, model, tokenizer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the token stream for training, the held-apart tail of a text source or None: learn/heldout.py).
    A text source must hold at least one global batch; `generated` samples `calib_tokens` tokens (default:
    one pass of the whole run, capped at 1M)."""
    one_batch = config.batch_size * config.seq_len
    if config.calib == "generated":
        wanted = config.calib_tokens or min(config.steps * one_batch, 1 << 20)
        ids = corpus_ids("generated", tokenizer, model=model, seed=config.seed + 1,
                         min_tokens=max(wanted, one_batch), generated_seq_len=config.seq_len)
        return ids.cpu(), None
    ids = corpus_ids(config.calib, tokenizer, model=model, seed=config.seed, min_tokens=one_batch)
    ids, tail = split_stream(ids.cpu(), config.calib, config.report_windows, config.seq_len)
    if config.calib_tokens:
        ids = ids[: max(config.calib_tokens, one_batch)]
    return ids, tail


def wanda_init(model, calib: torch.Tensor, config: LearnConfig, device, layout: ModelLayout) -> MaskSet:
    """Wanda's masks (weights left dense) of the layers in `layout`, as `leapctl prune --method wanda`
    computes them."""
    from leapctl.prune.wanda import wanda_masks

    was_training = model.training
    model.eval()
    mask_set = wanda_masks(model, calib, config.sparsity, device=device, in_place=False,
                           progress=config.progress, layout=layout)
    model.train(was_training)
    return mask_set


def initial_keep(model, corpus, config: LearnConfig, layout: ModelLayout, init: MaskSet | None,
                 device) -> dict[str, torch.Tensor]:
    """The keep-mask the logits start from, in the model's layer order (initialisers draw noise layer by
    layer): `init`, else the mask file, else random (ablation), else Wanda on windows of the corpus."""
    linears = layout.linears
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
        init = wanda_init(model, calib, config, device, layout)
    return checked_keep(init, linears, config.sparsity, origin)


def checked_keep(mask_set: MaskSet, linears, sparsity: float, origin: str) -> dict[str, torch.Tensor]:
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


def quantize_frozen(model: torch.nn.Module, config: LearnConfig,
                    layout: ModelLayout) -> dict[str, torch.Tensor] | None:
    """With --bits: every maskable weight rounded to the bitmap-q4 grid (all weights decide the scales,
    since the mask is not known yet); the kept ones then sit on that grid whatever the mask becomes."""
    if config.bits is None:
        return None
    from leapctl.grid import check_group_size, rtn_scales

    linears = layout.linears
    everything = MaskSet(masks={f"{name}.weight": torch.ones(linear.weight.shape, dtype=torch.bool,
                                                              device=linear.weight.device)
                                for name, linear in linears.items()})
    check_group_size(everything, config.group_size)
    return rtn_scales(model, everything, config.group_size)[0]
