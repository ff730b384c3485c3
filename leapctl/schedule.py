"""Schedules advanced once per optimizer step (never per micro-batch): the learning rate of every training
loop here (`learn`, `recover`, `quantize`'s scale tuning), and LEAP's mask temperature pair alpha
(25 -> 350) and tau (4 -> 0.05) and magnitude term's decay. Its own module so that those packages share it
without importing one another."""

import math


def linear(start: float, end: float, step: int, total_steps: int) -> float:
    """`start` at step 0, `end` at the last step (total_steps - 1), linear in between."""
    if total_steps <= 1:
        return end
    return start + (end - start) * step / (total_steps - 1)


def mask_temperature(
    step: int,
    total_steps: int,
    alpha: tuple[float, float],
    tau: tuple[float, float],
    fixed_alpha: bool = False,
    fixed_tau: bool = False,
) -> tuple[float, float]:
    """(alpha, tau) for this step; the `fixed_*` ablations hold the start value."""
    a = alpha[0] if fixed_alpha else linear(alpha[0], alpha[1], step, total_steps)
    t = tau[0] if fixed_tau else linear(tau[0], tau[1], step, total_steps)
    return a, t


def magnitude_decay(step: int, total_steps: int) -> float:
    """The authors' (1 - step / T) factor on the magnitude term: full weight at first, zero at the end."""
    return 1.0 - step / total_steps


def cosine_with_warmup(warmup_steps: int, total_steps: int):
    """Learning-rate multiplier for `LambdaLR`: linear warm-up over `warmup_steps`, then cosine to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(total_steps - warmup_steps, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup_steps, span) / span))

    return factor
