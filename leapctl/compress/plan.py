"""The plan of a `compress` run: how many steps and samples each stage gets from the budget, written once to
the state folder so that a rerun continues with the same numbers.

A minutes budget is converted into steps from one measured training step on this machine (`probe_step`: the
dense model's forward, then a forward and backward, at the stages' batch shape, in bf16 autocast where the
device has it), so the same `--budget 35` means more steps on a faster machine, never a longer run. The
stages' costs are counted in recovery steps, measured on SmolLM2-135M on two Zen 5 cores (bench/results/
compress): a recovery step costs `RECOVER_STEP_COST` probes, a LEAP step `LEARN_STEP_COST` recovery steps;
prune, GPTQ, export and the evaluation together about `FIXED_STEPS`. The probe runs once, at the start: on a
machine busier then than later the run ends early (fewer steps), never late."""

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from leapctl.compress.config import LEARN, QUANTIZE, RECOVER, Budget, CompressConfig
from leapctl.errors import LeapctlError

BATCH_SIZE, SEQ_LEN = 4, 256  # every training stage's step: 1,024 tokens
PRUNE_SAMPLES, PRUNE_SEQ_LEN = 32, 512  # Wanda's calibration (the demo's)
GPTQ_SAMPLES = 32  # GPTQ's calibration windows of SEQ_LEN tokens
LEARN_SHARE = 0.5  # of the training steps, when both learn and recover run
TUNE_SHARE, MIN_TUNE_STEPS, MAX_TUNE_STEPS = 0.2, 10, 200  # quantize's scale tuning, in training steps
RECOVER_STEP_COST = 1.15  # a recovery step in probe steps (AdamW, the mask, the KL; 5.4 s against 4.8)
LEARN_STEP_COST = 1.2  # one LEAP step in recovery steps (18.7 against 15.0 s on a loaded core)
FIXED_STEPS = 50  # prune + GPTQ + export + evaluation, in recovery steps (SmolLM2-135M, Zen 5: ~280 s)
GPU_TOKENS = 20_000_000  # the auto budget on a GPU
CPU_MINUTES = 35.0  # the auto budget on a CPU
PLAN_FILE = "plan.json"


@dataclass
class Plan:
    budget: str
    step_seconds: float | None  # measured, for a minutes budget
    learn_steps: int
    recover_steps: int
    tune_steps: int
    gptq_samples: int = GPTQ_SAMPLES
    prune_samples: int = PRUNE_SAMPLES
    batch_size: int = BATCH_SIZE
    seq_len: int = SEQ_LEN
    gradient_checkpointing: bool = False
    autocast: bool = False  # bf16 where the device multiplies it in hardware (`compute.native_bf16`)
    exclude: str | None = None  # linears left dense: no 4-bit group divides their columns
    settings: dict | None = None  # what the plan was made for; a rerun with other settings starts over


def auto_budget(device: torch.device) -> Budget:
    return Budget(tokens=GPU_TOKENS) if device.type == "cuda" else Budget(minutes=CPU_MINUTES)


def probe_step(model: torch.nn.Module, autocast: bool) -> float:
    """Seconds of one training step's arithmetic (a no-grad forward, then a forward and backward) at the
    stages' batch shape; the faster of two after a warm-up."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (BATCH_SIZE, SEQ_LEN), generator=generator).to(device)
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.requires_grad_(True)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
            logits = model(input_ids=ids, use_cache=False).logits
        logits.float().logsumexp(-1).mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    model.requires_grad_(False)
    return min(times[1:])


def make_plan(config: CompressConfig, budget: Budget, step_seconds: float | None, exclude: str | None,
              checkpointing: bool, autocast: bool = False) -> Plan:
    """Steps per stage from the budget: what is left after the fixed stages, split between learn and
    recover, a share of it for quantize's scale tuning."""
    stages = config.stage_list
    if budget.tokens is not None:
        steps = budget.tokens // (BATCH_SIZE * SEQ_LEN)
    else:
        steps = int(budget.minutes * 60 / (step_seconds * RECOVER_STEP_COST)) - FIXED_STEPS
    training = [stage for stage in (LEARN, RECOVER) if stage in stages]
    tuned = stages[-1] == QUANTIZE  # recover after quantize trains on the grid instead of the scales
    tune = min(MAX_TUNE_STEPS, max(MIN_TUNE_STEPS, round(TUNE_SHARE * steps))) if tuned else 0
    left = steps - tune
    learn = recover = 0
    if training == [LEARN]:
        learn = int(left / LEARN_STEP_COST)
    elif training == [RECOVER]:
        recover = left
    elif training:
        learn = int(left * LEARN_SHARE / LEARN_STEP_COST)
        recover = left - round(learn * LEARN_STEP_COST)
    if training and min(s for s, stage in ((learn, LEARN), (recover, RECOVER)) if stage in training) < 10:
        need = (FIXED_STEPS + tune + 10 * len(training) * 1.5) * RECOVER_STEP_COST * (step_seconds or 0) / 60
        raise LeapctlError(f"--budget {budget} leaves fewer than 10 steps for {' and '.join(training)}"
                           + (f" (this machine needs about {need:.0f} min)" if step_seconds else ""))
    return Plan(str(budget), step_seconds, learn, recover, tune, gradient_checkpointing=checkpointing,
                autocast=autocast, exclude=exclude, settings=plan_settings(config))


def plan_settings(config: CompressConfig) -> dict:
    """The settings a plan (and the stage folders made by it) belongs to."""
    return {"model": config.model, "sparsity": config.sparsity, "budget": config.budget,
            "stages": list(config.stage_list), "calib": config.calib, "seed": config.seed,
            "lm_head_bits": config.lm_head_bits}


def read_plan(state_dir: Path, config: CompressConfig) -> Plan | None:
    """The plan an earlier run of the same settings wrote, else None."""
    path = state_dir / PLAN_FILE
    try:
        plan = Plan(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return plan if plan.settings == plan_settings(config) else None


def write_plan(state_dir: Path, plan: Plan) -> None:
    from leapctl.paths import write_text_atomically

    write_text_atomically(state_dir / PLAN_FILE, json.dumps(asdict(plan), indent=2) + "\n")
