"""`compress`: prune -> (learn) -> recover -> quantize -> evaluate, each stage the real leapctl command run
in a process of its own (its own progress bars and time left, its memory returned when it ends), into a
stage folder of OUT.compress-state. A stage whose folder is complete is not run again, and learn and
recover continue from their checkpoints, so a rerun after an interruption continues where it stopped.
At the end the last stage's run folder becomes OUT (hard links, one atomic exchange) with `compress.json`:
the plan, each stage's time, dense against compressed perplexity and the bytes a decoded token reads."""

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch

from leapctl.compress.config import (
    AUTO,
    HELDOUT_NAME,
    LEARN,
    PRUNE,
    QUANTIZE,
    RECOVER,
    WIKITEXT2_CHARACTERS,
    WIKITEXT2_NAME,
    WIKITEXT2_RAW,
    CompressConfig,
    parse_budget,
)
from leapctl.compress.plan import Plan, auto_budget, make_plan, probe_step, read_plan, write_plan
from leapctl.errors import LeapctlError

SUMMARY_FILE = "compress.json"
EVAL_FILE, EXPORT_DIR = "eval.json", "export"
GROUP_SIZE = 64  # quantize's default group; layers whose columns it does not divide stay dense


def compress(config: CompressConfig, echo=print) -> dict:
    """Run the pipeline `config` names and write OUT; returns the summary written to OUT/compress.json.
    `echo` prints the plan and each stage's header (the command's console)."""
    from leapctl.models import resolve_model
    from leapctl.outdir import check_output_dir

    config.validate()
    resolve_model(config.model)
    inputs = (config.model, config.calib, *config.eval_text)
    check_output_dir(Path(config.out), config.overwrite, inputs)
    state = config.state_dir()
    plan = None if config.overwrite else read_plan(state, config)
    if plan is None:  # a new run, or one with other settings: its stage folders do not belong to this one
        plan = _new_plan(config)
        _clear(state)
        state.mkdir(parents=True)
        write_plan(state, plan)
    echo(plan_table(plan, config))
    seconds, source = {}, None
    for index, stage in enumerate(config.stage_list, 1):
        folder, header = state / stage, f"stage {index}/{len(config.stage_list)}: {stage}"
        if _complete(folder):
            echo(f"{header} finished earlier ({folder}), not run again")
        else:
            echo(header)
            started = time.monotonic()
            _run(_stage_args(stage, config, plan, source, folder))
            seconds[stage] = round(time.monotonic() - started, 1)
        source = folder
    summary = _finish(config, plan, source, seconds, state)
    if not config.keep_stages:
        _clear(state)
    return summary


def _new_plan(config: CompressConfig) -> Plan:
    """The plan for this machine: a minutes budget measured against one probe step of the dense model."""
    from leapctl.compute import native_bf16, resolve_device
    from leapctl.models import load_model

    device = resolve_device(config.device)
    budget = auto_budget(device) if config.budget == AUTO else parse_budget(config.budget)
    model, _ = load_model(config.model, dtype=torch.float32, device=device)
    exclude = _indivisible_linears(model)
    autocast = native_bf16(device)
    step_seconds = probe_step(model, autocast) if budget.minutes is not None else None
    del model
    return make_plan(config, budget, step_seconds, exclude, checkpointing=device.type == "cuda",
                     autocast=autocast)


def _indivisible_linears(model) -> str | None:
    """A regex of the prunable linears whose input columns no 4-bit group divides (stories260K's down_proj,
    172 columns): they stay dense, so that every pruned layer can be quantized and served."""
    import re

    from leapctl.models import model_layout

    names = sorted({name.rsplit(".", 1)[-1] for name, linear in model_layout(model).linears.items()
                    if linear.in_features % GROUP_SIZE})
    return "|".join(rf"\.{re.escape(name)}$" for name in names) or None


def _complete(folder: Path) -> bool:
    from leapctl.outdir import written_by_leapctl

    return folder.is_dir() and written_by_leapctl(folder)


def _stage_args(stage: str, config: CompressConfig, plan: Plan, source: Path | None, out: Path) -> list[str]:
    """The leapctl command line of one stage."""
    common = ["--seed", str(config.seed), "--device", config.device, "--out", str(out)]
    if not config.progress:
        common.append("--no-progress")
    shape = ["--batch-size", str(plan.batch_size), "--seq-len", str(plan.seq_len)]
    checkpointing = f"--{'' if plan.gradient_checkpointing else 'no-'}gradient-checkpointing"
    speed = [checkpointing, f"--{'' if plan.autocast else 'no-'}autocast"]
    exclude = ["--exclude", plan.exclude] if plan.exclude else []
    if stage == PRUNE:
        return ["prune", config.model, "--method", "wanda", "--sparsity", str(config.sparsity), "--calib",
                config.calib, "--nsamples", str(plan.prune_samples), "--seq-len", str(1 << 9), *exclude,
                *common]
    resume = ["--resume"] if _has_checkpoint(out, stage) else ["--overwrite"]
    if stage == LEARN:
        return ["learn", config.model, "--sparsity", str(config.sparsity), "--calib", config.calib,
                "--init-masks", str(source), "--steps", str(plan.learn_steps), *shape, *speed,
                *exclude, *resume, *common]
    if stage == RECOVER:
        return ["recover", str(source), "--teacher", config.model, "--calib", config.calib, "--steps",
                str(plan.recover_steps), *shape, *speed, *resume, *common]
    if stage == QUANTIZE:
        # After recovery the tuning distils from the recovered 16-bit model, the one it is the grid's copy of:
        # at 30% / 40% WikiText-2 33.42 / 37.39 against 33.62 / 37.53 from the dense model
        # (bench/results/compress). Without, from the dense model, so that it can win back pruning's loss too.
        teacher = str(source) if source is not None and source.name == RECOVER else config.model
        return ["quantize", str(source), "--teacher", teacher, "--calib", config.calib, "--nsamples",
                str(plan.gptq_samples), *shape, "--tune-steps", str(plan.tune_steps), "--lm-head-bits",
                str(config.lm_head_bits), *speed, "--overwrite", *common]
    raise LeapctlError(f"unknown stage {stage!r}")


def _has_checkpoint(out: Path, stage: str) -> bool:
    from leapctl.learn.checkpoint import has_checkpoint
    from leapctl.learn.config import learn_state_dir
    from leapctl.recover.config import recover_state_dir

    state_dirs = {LEARN: learn_state_dir, RECOVER: recover_state_dir}  # the stages that checkpoint
    return stage in state_dirs and has_checkpoint(state_dirs[stage](out))


def _run(args: list[str]) -> None:
    """One leapctl command in a child process; its failure ends compress with the child's status (the
    child has printed its own one-line error). SIGINT, SIGTERM and SIGHUP are passed on to the child and
    compress waits for it: learn and recover write their checkpoint first, the others remove their
    temporary folder, so that a rerun continues."""
    print(f"$ {' '.join(['leapctl', *args])}", file=sys.stderr, flush=True)
    child = subprocess.Popen([sys.executable, "-m", "leapctl", *args])
    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, lambda signum, _: child.send_signal(signum))
                for sig in forwarded} if main_thread else {}
    try:
        status = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if status != 0:
        raise StageFailed(args[0], status)


class StageFailed(LeapctlError):
    def __init__(self, stage: str, status: int):
        how = f"was stopped by signal {-status}" if status < 0 else f"failed (exit {status})"
        super().__init__(f"stage {stage} {how}; rerun the same command to continue")
        self.status = 128 - status if status < 0 else status


def _finish(config: CompressConfig, plan: Plan, final: Path, seconds: dict, state: Path) -> dict:
    """Export (the check that the folder serves), evaluate, and write OUT with its summary."""
    from leapctl.compress.report import bytes_per_weight, evaluation_rows
    from leapctl.outdir import atomic_output_dir

    export = state / EXPORT_DIR
    quantized = QUANTIZE in config.stage_list
    if not _complete(export):
        _run(["export", str(final), "--format", "bitmap-q4" if quantized else "bitmap", "--out", str(export),
              "--overwrite"])
    texts = _eval_texts(config, state)
    evaluation = []
    if config.evaluate and texts:
        eval_json = state / EVAL_FILE
        if not eval_json.is_file():
            _run(["eval", config.model, str(final), *[a for t in texts for a in ("--ppl", str(t))],
                  "--seq-len", str(1 << 9), "--json", str(eval_json), *([] if config.progress else
                                                                         ["--no-progress"])])
        evaluation = evaluation_rows(json.loads(eval_json.read_text()))
    summary = {"model": config.model, "sparsity": config.sparsity, "stages": list(config.stage_list),
               "plan": asdict(plan), "stage_seconds": seconds, "evaluation": evaluation,
               "bytes_per_weight": bytes_per_weight(export, final), "export_format": "bitmap-q4" if quantized
               else "bitmap"}
    with atomic_output_dir(Path(config.out), config.overwrite, (config.model, config.calib)) as tmp:
        shutil.copytree(final, tmp, dirs_exist_ok=True, copy_function=_link_or_copy)
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _eval_texts(config: CompressConfig, state: Path) -> list[Path]:
    """The held-apart slice of wiki-summaries (when it is the calibration text), the first characters of
    WikiText-2's test split (when the shared assets hold it) and the user's files."""
    from leapctl.data import WIKI_SUMMARIES, WIKI_SUMMARIES_HELDOUT, load_documents
    from leapctl.paths import assets_dir, write_text_atomically

    texts = []
    if config.calib == WIKI_SUMMARIES:
        heldout = state / HELDOUT_NAME
        if not heldout.is_file():
            documents = load_documents(WIKI_SUMMARIES_HELDOUT)[:HELDOUT_DOCUMENTS]
            write_text_atomically(heldout, "\n\n".join(documents) + "\n")
        texts.append(heldout)
    wikitext = (assets_dir() or state) / WIKITEXT2_RAW
    if wikitext.is_file():
        excerpt = state / WIKITEXT2_NAME
        if not excerpt.is_file():
            write_text_atomically(excerpt, wikitext.read_text(encoding="utf-8")[:WIKITEXT2_CHARACTERS])
        texts.append(excerpt)
    return texts + [Path(text) for text in config.eval_text]


HELDOUT_DOCUMENTS = 60  # about 6k tokens of held-apart summaries: minutes, not tens, on a CPU


def _link_or_copy(source: str, target: str) -> None:
    import os

    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _clear(state: Path) -> None:
    """Remove the state folder of compress (its stage folders and their own state folders)."""
    if state.is_dir():
        shutil.rmtree(state)


def _after(config: CompressConfig, stage: str, earlier: str) -> bool:
    stages = config.stage_list
    return stage in stages and earlier in stages and stages.index(earlier) < stages.index(stage)


def plan_table(plan: Plan, config: CompressConfig) -> str:
    tokens = plan.batch_size * plan.seq_len
    rows = [f"compress {config.model} to {config.sparsity:.0%} sparsity, budget {plan.budget}"
            + (f" (one training step measured at {plan.step_seconds:.1f} s)" if plan.step_seconds else "")]
    for stage in config.stage_list:
        detail = {PRUNE: f"Wanda on {plan.prune_samples} x 512 tokens of {config.calib}",
                  LEARN: f"LEAP, {plan.learn_steps} steps x {tokens:,} tokens",
                  RECOVER: f"{plan.recover_steps} steps x {tokens:,} tokens of distillation"
                           + (" on the 4-bit grid" if _after(config, RECOVER, QUANTIZE) else ""),
                  QUANTIZE: f"4-bit GPTQ on {plan.gptq_samples} x {plan.seq_len}, {plan.tune_steps} "
                            f"steps of scale tuning, lm_head {config.lm_head_bits}-bit"}[stage]
        rows.append(f"  {stage:<9} {detail}")
    if plan.exclude:
        rows.append(f"  left dense (no group of {GROUP_SIZE} divides their columns): {plan.exclude}")
    return "\n".join(rows)
