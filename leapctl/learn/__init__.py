"""LEAP: learnable end-to-end adaptive pruning. `leap_masks(model, tokenizer, corpus, LearnConfig(...))`
learns a mask in memory; `leapctl learn` (load, learn, write the run) is `leapctl.commands.learn.run`.
`LEAP` is the method in the shape of `leapctl.prune.METHODS`' entries, for tables of every method
(bench/quality.py)."""

from leapctl.learn.config import LearnConfig
from leapctl.learn.train import LearnedMasks, LearnInterrupted, leap_masks
from leapctl.masks import MaskSet
from leapctl.prune import Method


def leap_prune(model, tokenizer, corpus, sparsity: float, init: MaskSet | None = None, **settings) -> MaskSet:
    """`leap_masks` as a pruning method: `settings` are `LearnConfig` fields; `init` is the mask to start
    from."""
    name = str(getattr(model, "name_or_path", ""))
    config = LearnConfig(model=name, sparsity=sparsity, **settings)
    return leap_masks(model, tokenizer, corpus, config, init=init)


LEAP = Method(leap_prune, "corpus", "mask logits learned end to end (leapctl learn)")

__all__ = ["LEAP", "LearnConfig", "LearnedMasks", "LearnInterrupted", "leap_masks", "leap_prune"]
