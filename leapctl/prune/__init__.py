"""One-shot pruning methods in one registry: magnitude, Wanda and SparseGPT.

Every method is `run(model, tokenizer, data, sparsity, **options) -> MaskSet`: it prunes `model` in place
(zeros, and SparseGPT's updated weights) and returns the keep-masks. What `data` is depends on the method
(`Method.data`): nothing for magnitude, calibration windows [nsamples, seq_len] for Wanda and SparseGPT,
a training corpus (token stream or calibration source) for a learned method. LEAP is offered by
`leapctl.learn` (`leapctl.learn.LEAP`, the same kind of `Method`); a table of every method, such as
bench/quality.py's, adds it there, so that `prune/` never imports `learn/`. `prune_model` is the one-shot
entry point `leapctl prune` uses."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from leapctl.errors import LeapctlError
from leapctl.masks import MaskSet, check_sparsity
from leapctl.prune.magnitude import magnitude_masks
from leapctl.prune.sparsegpt import sparsegpt_masks
from leapctl.prune.wanda import wanda_masks


@dataclass(frozen=True)
class Method:
    run: Callable[..., MaskSet]  # run(model, tokenizer, data, sparsity, **options) -> MaskSet
    data: str  # "none", "calibration" (token windows [n, seq_len]) or "corpus" (a token stream or source)
    summary: str


METHODS: dict[str, Method] = {}


def register(name: str, run: Callable[..., MaskSet], data: str, summary: str) -> None:
    """Add a method to the registry (bench/quality.py and `prune_model` look methods up here)."""
    if data not in ("none", "calibration", "corpus"):
        raise ValueError(f"unknown data kind {data!r}")
    METHODS[name] = Method(run, data, summary)


def _magnitude(model, tokenizer, data, sparsity, **options) -> MaskSet:
    return magnitude_masks(model, sparsity, options.get("include"), options.get("exclude"))


def _calibrated(name: str, masks_fn: Callable[..., MaskSet]) -> Callable[..., MaskSet]:
    def run(model, tokenizer, calib_ids, sparsity, **options) -> MaskSet:
        if calib_ids is None:
            raise LeapctlError(f"{name} needs calibration data")
        return masks_fn(model, calib_ids, sparsity, **options)

    return run


register("magnitude", _magnitude, "none", "smallest |W| of each layer")
register("wanda", _calibrated("wanda", wanda_masks), "calibration", "|W| * RMS(x), per output row")
register("sparsegpt", _calibrated("sparsegpt", sparsegpt_masks), "calibration",
         "OBS masks and weight updates per layer")

ONE_SHOT = tuple(name for name, method in METHODS.items() if method.data != "corpus")
CALIBRATED = tuple(name for name, method in METHODS.items() if method.data == "calibration")


def check_method(method: str) -> None:
    """A one-shot method name (`leapctl prune`); LEAP is `leapctl learn`."""
    if method not in ONE_SHOT:
        hint = " (LEAP is `leapctl learn`)" if method == "leap" else ""
        raise LeapctlError(f"unknown pruning method {method!r} (choose from {', '.join(ONE_SHOT)}){hint}")


def prune_model(model: nn.Module, method: str, sparsity: float, calib_ids: torch.Tensor | None = None,
                include: str | None = None, exclude: str | None = None,
                device: str | torch.device | None = None, batch_size: int = 8,
                progress: bool = True) -> MaskSet:
    """Prune the model in place (zeros, and SparseGPT's updated weights) with a one-shot method and return
    the keep-masks. `calib_ids` [nsamples, seq_len] token ids are needed by Wanda and SparseGPT, ignored
    by magnitude."""
    check_method(method)
    check_sparsity(sparsity)
    options = dict(include=include, exclude=exclude)
    if method in CALIBRATED:
        options.update(device=device, batch_size=batch_size, progress=progress)
    return METHODS[method].run(model, None, calib_ids, sparsity, **options)
