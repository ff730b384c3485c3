"""`leapctl learn MODEL --sparsity S --out RUN`: LEAP mask learning into a run folder (same layout as
`leapctl prune`). From Python: `run(LearnConfig(...))` returns a `LearnResult`; `leapctl.learn.leap_masks`
learns a mask in memory.

Under `torchrun --nproc-per-node N -m leapctl learn ...` it runs data parallel (DDP; `--fsdp` for FSDP2):
every process loads the model and trains; rank 0 tokenises the corpus once into the state folder, computes
the initial mask and writes the run folder."""

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from leapctl.learn.config import LearnConfig

if TYPE_CHECKING:
    from leapctl.learn.plan import MemoryPlan

NAME = "learn"
HELP = ("Learn a LEAP mask for MODEL at --sparsity and write the pruned checkpoint, masks, report and plots "
        "to --out.")
Config = LearnConfig


@dataclass
class LearnResult:
    out: Path | None  # the finished run folder (rank 0); None when interrupted, on other ranks, with --plan
    steps_done: int
    interrupted_by: int = 0  # the signal number that stopped the run early, 0 when it finished
    state_dir: Path | None = None
    plan: "MemoryPlan | None" = None  # with --plan: the memory plan, and nothing else was done


def run(config: LearnConfig, show_plan: "Callable[[MemoryPlan], None] | None" = None) -> LearnResult:
    """Learn a LEAP mask as `config` says; writes the run folder (rank 0) and returns where. Refuses, before
    loading anything, a run whose memory plan does not fit the device (`show_plan` gets the plan on rank 0
    first); with `plan` returns only the plan.

    Under torchrun, rank 0 tokenises, computes Wanda and the dense perplexities before the process group
    starts (the others wait to join it, up to --dist-timeout-s) and writes the report after it ends, so no
    collective ever waits on work of one process."""
    from transformers.utils import logging as transformers_logging

    from leapctl.compute import DTYPES
    from leapctl.learn.heldout import perplexities, run_texts
    from leapctl.learn.processes import bind_device, shutdown, start_group, world_from_environment
    from leapctl.learn.start import quantize_frozen
    from leapctl.learn.train import LearnInterrupted, autocast_on, train
    from leapctl.models import load_model, model_layout

    world, rank = world_from_environment()
    if config.plan:
        planned = config.world_size or world
        return LearnResult(out=None, steps_done=0, plan=_fitting_plan(config.checked(planned), planned))
    config = _checked(config, world)  # resolved and validated once, here
    device = bind_device(config.device, world)  # before the process group, so NCCL starts on this GPU
    distributed, master = world > 1, rank == 0
    fingerprint = config.fingerprint(autocast_on(config, device))
    _refuse_bad_starts(config, fingerprint)
    plan = _fitting_plan(config, world)
    if show_plan is not None and master:
        show_plan(plan)

    transformers_logging.disable_progress_bar()  # our own progress bars only; errors stay one line
    with _new_state_removed_on_failure(config.state_dir(), master):
        model, tokenizer = load_model(config.model, dtype=DTYPES[config.dtype], device=device)
        layout = model_layout(model, config.include, config.exclude)  # found once, passed down
        scales = quantize_frozen(model, config, layout)
        init = _prepare_start(config, model, tokenizer, device, distributed, layout) if master else None
        texts = run_texts(config, model, tokenizer) if master else {}
        dense_ppl = perplexities(model, texts, config.seq_len, config.progress)
        start_group(device, world, config.dist_timeout_s)
        corpus, init = _read_start(config, distributed, master, init)
        try:
            learned = train(model, tokenizer, corpus, config, init=init, fingerprint=fingerprint,
                            layout=layout)
        except LearnInterrupted as stop:
            shutdown(distributed)
            return LearnResult(out=None, steps_done=stop.steps_done, interrupted_by=stop.signal_number,
                               state_dir=config.state_dir())
    shutdown(distributed)  # every collective is done: rank 0 alone writes the run
    if not master:  # rank 0 writes the run after the group has ended: nothing to wait for
        return LearnResult(out=None, steps_done=config.steps, state_dir=config.state_dir())
    _finish_and_write(config, model, layout, tokenizer, learned, corpus, scales, texts, dense_ppl, device,
                      sharded=distributed and config.fsdp)
    return LearnResult(out=Path(config.out), steps_done=config.steps, state_dir=config.state_dir())


def _checked(config: LearnConfig, world: int) -> LearnConfig:
    """`config` resolved and validated for a real run (which, unlike --plan, needs --out)."""
    from leapctl.errors import LeapctlError

    if config.out is None:
        raise LeapctlError("missing option --out (give it on the command line or in --config FILE)")
    return config.checked(world)


def _fitting_plan(config: LearnConfig, world: int) -> "MemoryPlan":
    """The memory plan of a checked `config`; one line (LeapctlError) when it does not fit the device."""
    from leapctl.errors import LeapctlError
    from leapctl.learn.plan import memory_plan, planned_device_type

    plan = memory_plan(config, world, planned_device_type(config))
    if not plan.fits:
        raise LeapctlError(plan.refusal())
    return plan


def _finish_and_write(config: LearnConfig, model, layout, tokenizer, learned, corpus, scales, texts: dict,
                      dense_ppl: dict, device, sharded: bool) -> None:
    """Rank 0, after the process group: under FSDP2 the trained model is sharded, so a fresh copy is
    pruned; then the sparse perplexities, the run folder and the state folder's cleanup."""
    from leapctl.compute import DTYPES
    from leapctl.learn.heldout import perplexities, report_entry
    from leapctl.learn.start import quantize_frozen
    from leapctl.learn.train import finish_weights
    from leapctl.models import load_model, model_layout

    if sharded:
        del model, layout  # the shards go before the fresh copy comes
        model, _ = load_model(config.model, dtype=DTYPES[config.dtype], device=device)
        layout = model_layout(model, config.include, config.exclude)
        quantize_frozen(model, config, layout)
        if "weights" in learned.stats:  # the weights learned with the mask, gathered at the loop's end
            model.load_state_dict(learned.stats.pop("weights"), strict=False)
        finish_weights(model, learned, corpus, config)
    sparse_ppl = perplexities(model.eval(), texts, config.seq_len, config.progress)
    heldout = report_entry(config, dense_ppl, sparse_ppl) if texts else None
    _write_run(config, model.to("cpu"), layout, tokenizer, learned, scales, heldout)
    _clear_state_after_success(config)


def main(config: LearnConfig) -> int:
    if config.plan:
        typer.echo(run(config).plan.table())
        return 0
    from leapctl.data import check_source

    check_source(config.calib)  # a missing text is one line before the plan's line
    result = run(config, show_plan=lambda plan: typer.echo(plan.summary()))
    if result.interrupted_by:
        typer.echo(f"interrupted after step {result.steps_done}: checkpoint in {result.state_dir}; "
                   f"rerun with --resume to continue", err=True)
        return 128 + result.interrupted_by
    if result.out is not None:
        report = json.loads((result.out / "report.json").read_text())
        peak = report["peak_memory"]
        peak_bytes = peak.get("cuda_max_allocated_bytes", peak["process_max_rss_bytes"])
        typer.echo(f"wrote {result.out}: sparsity {report['achieved_sparsity']['global']:.4f}, final LM loss "
                   f"{report['final'].get('lm_loss', float('nan')):.4f}, "
                   f"{report['tokens_per_s'] or 0:.0f} tokens/s, peak memory {peak_bytes / 2**20:.0f} MiB")
        heldout = report.get("heldout")
        for name, ppl in (heldout or {}).get("texts", {}).items():
            ratio = ppl["sparse"] / ppl["dense"]
            typer.echo(f"perplexity on {name} ({heldout['windows']} x {heldout['seq_len']} tokens): dense "
                       f"{ppl['dense']:.2f}, sparse {ppl['sparse']:.2f} ({ratio:.2f}x)")
    return 0


def _inputs(config: LearnConfig) -> tuple:
    return (config.model, config.calib, config.init_masks)


def _refuse_bad_starts(config: LearnConfig, fingerprint: dict) -> None:
    """Output folder, state folder and checkpoint checked before any work."""
    from leapctl.learn.state import refuse_bad_start

    refuse_bad_start(config.state_dir(), Path(config.out), _inputs(config), config.overwrite, config.resume,
                     fingerprint, "run")


@contextlib.contextmanager
def _new_state_removed_on_failure(state_dir: Path, master: bool) -> Iterator[None]:
    """A state folder this run creates is removed again when the run fails before its first checkpoint: it
    holds only a token stream (and metrics) that nothing can resume from. A folder that was there before (an
    earlier run's checkpoint, a named --checkpoint-dir) is left as it is; so is any folder with a checkpoint.
    Rank 0 alone writes the folder, so it alone removes it."""
    from leapctl.learn.checkpoint import has_checkpoint
    from leapctl.learn.state import clear_state

    created = master and not state_dir.exists()
    try:
        yield
    except BaseException:
        if created and not has_checkpoint(state_dir):
            clear_state(state_dir)
            with contextlib.suppress(OSError):
                state_dir.rmdir()  # only when nothing else is in it
        raise


def _prepare_start(config: LearnConfig, model, tokenizer, device, distributed: bool, layout):
    """Rank 0, before the process group starts: tokenise the corpus into the state folder and compute the
    Wanda mask (saved there for the other processes under torchrun); returns the mask, or None."""
    from leapctl.data import calibration_batch
    from leapctl.learn.heldout import save_tail
    from leapctl.learn.start import training_corpus, wanda_init
    from leapctl.learn.state import INIT_MASKS_FILE, clear_state
    from leapctl.learn.stream import write_token_file
    from leapctl.masks import save_masks

    if config.resume:
        return None
    state_dir = config.state_dir()
    # Everything that reads the user's inputs comes first: an old checkpoint (--overwrite) is given up only
    # once the new run has its token stream and initial mask in hand.
    ids, tail = training_corpus(config, model, tokenizer)
    init = None
    if _wanda(config):  # on `nsamples` windows of the calibration source, as `leapctl prune` does
        calib = calibration_batch(config.calib, tokenizer, config.nsamples, config.seq_len, config.seed,
                                  model=model)
        init = wanda_init(model, calib, config, device, layout)
    clear_state(state_dir)
    write_token_file(state_dir, ids)
    if tail is not None:
        save_tail(state_dir, tail)
    if distributed and init is not None:
        save_masks(state_dir / INIT_MASKS_FILE, init)
    return init


def _read_start(config: LearnConfig, distributed: bool, master: bool, init):
    """(memory-mapped token stream, initial mask or None) once rank 0 has prepared them: the others read
    the mask that rank 0 saved."""
    from leapctl.learn.processes import barrier
    from leapctl.learn.state import INIT_MASKS_FILE
    from leapctl.learn.stream import open_token_file
    from leapctl.masks import load_masks

    barrier(distributed)
    state_dir = config.state_dir()
    if _wanda(config) and not master:
        init = load_masks(state_dir / INIT_MASKS_FILE)
    return open_token_file(state_dir), init


def _wanda(config: LearnConfig) -> bool:
    return not config.resume and config.init != "random" and config.init_masks is None


def _write_run(config: LearnConfig, model, layout, tokenizer, learned, scales,
               heldout: dict | None) -> None:
    """The run folder, atomically: checkpoint, masks (and scales), report, metrics, plots, logits."""
    from safetensors.torch import save_file

    from leapctl.learn.metrics import METRICS_FILE, read_metrics
    from leapctl.learn.plots import plot_density_per_block, plot_losses
    from leapctl.learn.report import density_per_block, learn_report
    from leapctl.outdir import atomic_output_dir
    from leapctl.runs import LOGITS_FILE, save_run

    state_dir = config.state_dir()
    metrics = read_metrics(state_dir)
    report = learn_report(config, learned.stats, metrics)
    if heldout is not None:
        report["heldout"] = heldout
    with atomic_output_dir(Path(config.out), config.overwrite, _inputs(config)) as tmp:
        block_density = density_per_block(layout, learned.masks)
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


def _clear_state_after_success(config: LearnConfig) -> None:
    from leapctl.learn.state import clear_state

    if config.keep_checkpoint:
        return
    state_dir = config.state_dir()
    clear_state(state_dir)
    if config.checkpoint_dir is None:  # the default folder is ours; a named one stays
        with contextlib.suppress(OSError):
            state_dir.rmdir()  # only when nothing else is in it
