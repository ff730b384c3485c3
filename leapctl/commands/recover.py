"""`leapctl recover RUN --out DIR`: the kept weights of a run folder trained by distillation from the dense
model, the mask held, into a new run folder. From Python: `run(RecoverConfig(...))` returns the report;
`leapctl.recover.recover_weights` trains a model in memory."""

import contextlib
from pathlib import Path

import typer

from leapctl.recover.config import DEFAULT_CALIB, RecoverConfig

NAME = "recover"
HELP = ("Train the kept weights of a pruned RUN by distillation from the dense model (the mask held, pruned "
        "weights stay zero; a quantized RUN's weights stay on its 4-bit grid) and write a run folder, ready "
        "for quantize or export.")
Config = RecoverConfig
PLOT = "recover_kl.png"
REPEATS_SHOWN = 2  # the closing line says how often the text was read once the run has read it twice


def run(config: RecoverConfig) -> dict:
    """Read a run folder, train its kept weights and write a new run folder atomically; returns the report.
    Raises `RecoverInterrupted` when a signal stopped the run after its checkpoint (rerun with --resume)."""
    import torch

    from leapctl.compute import native_bf16, resolve_device
    from leapctl.data import training_windows
    from leapctl.errors import LeapctlError
    from leapctl.learn.plots import plot_curve
    from leapctl.learn.state import refuse_bad_start
    from leapctl.models import load_model, resolve_model
    from leapctl.outdir import atomic_output_dir
    from leapctl.recover.train import RecoverySettings, recover_weights
    from leapctl.runs import read_run, save_run

    config.validate()
    source = read_run(config.run)
    teacher_spec = config.teacher or source.masks.model
    if not teacher_spec:
        raise LeapctlError(f"{config.run}'s masks name no dense model: pass --teacher MODEL")
    resolve_model(teacher_spec)
    calib = config.calib or source.calibration_source or DEFAULT_CALIB
    device = resolve_device(config.device)
    autocast = config.autocast if config.autocast is not None else native_bf16(device)
    checkpointing = (config.gradient_checkpointing if config.gradient_checkpointing is not None
                     else device.type == "cuda")
    fingerprint = {**config.fingerprint(autocast), "teacher": teacher_spec, "calib": calib,
                   "lr": config.learning_rate(source.scales is not None)}  # the rate used, default or not
    inputs = (config.run, calib, teacher_spec)
    refuse_bad_start(config.state_dir(), Path(config.out), inputs, config.overwrite, config.resume,
                     fingerprint, "recovery")
    if config.overwrite:  # an unfinished recovery's checkpoint given up: its steps are not this run's
        _clear_state(config.state_dir())

    model, tokenizer = load_model(str(source.path), dtype=torch.float32, device=device)
    teacher, _ = load_model(teacher_spec, dtype=torch.float32, device=device)
    windows = training_windows(calib, tokenizer, teacher, config.steps, config.batch_size, config.seq_len,
                               config.seed, config.text_field)
    grid = (source.scales, source.zeros) if source.scales is not None else None
    lr = config.learning_rate(grid is not None)
    settings = RecoverySettings(config.steps, config.batch_size, lr, config.hidden_weight, config.seed,
                                autocast, checkpointing, config.checkpoint_every, config.progress)
    result = recover_weights(model, teacher, source.masks, windows, settings, config.state_dir(), fingerprint,
                             resume=config.resume, grid=grid)
    del teacher
    kl = [entry["kl"] for entry in result.history]
    last = kl[-10:]
    tokens, text_tokens = config.steps * config.batch_size * config.seq_len, int(windows.numel())
    report = {"command": "recover", "source_run": str(source.path),
              "source": {k: source.report.get(k) for k in ("command", "method", "target_sparsity")},
              "calibration": {"source": calib},
              "recovery": {"teacher": teacher_spec, "steps": config.steps, "batch_size": config.batch_size,
                           "seq_len": config.seq_len, "lr": lr, "hidden_weight": config.hidden_weight,
                           "tokens": tokens, "windows": int(windows.shape[0]), "text_tokens": text_tokens,
                           "passes": round(tokens / text_tokens, 2), "autocast": autocast,
                           "gradient_checkpointing": checkpointing, "device": str(device),
                           "on_grid": grid is not None,
                           "resumed_at_step": result.resumed_at_step, "seconds": round(result.seconds, 3),
                           "kl_first": round(kl[0], 5), "kl_last_10": round(sum(last) / len(last), 5),
                           "history": result.history}}
    if grid is not None:
        report["quantization"] = source.quantization
    with atomic_output_dir(Path(config.out), config.overwrite, inputs) as tmp:
        saved = save_run(tmp, model.to("cpu"), tokenizer, source.masks, report, scales=source.scales,
                         zeros=source.zeros)
        plot_curve(kl, "recovery step", "KL(dense || sparse)", "recovery of the kept weights", tmp / PLOT)
    _clear_state(config.state_dir())
    return saved


def _clear_state(state_dir: Path) -> None:
    from leapctl.learn.state import clear_state

    clear_state(state_dir)
    with contextlib.suppress(OSError):
        state_dir.rmdir()


def main(config: RecoverConfig) -> int:
    from leapctl.recover.train import RecoverInterrupted

    try:
        report = run(config)
    except RecoverInterrupted as stop:
        typer.echo(f"interrupted after step {stop.steps_done}: checkpoint in {config.state_dir()}; rerun "
                   f"with --resume to continue", err=True)
        return 128 + stop.signal_number
    recovery = report["recovery"]
    # the batches are drawn with replacement from the text's windows: a budget many times the text repeats it
    tokens = f"{recovery['tokens']:,} tokens"
    if recovery["passes"] >= REPEATS_SHOWN:
        tokens += f", {recovery['passes']:.1f} times the text's {recovery['text_tokens']:,}"
    typer.echo(f"recovered {len(report['achieved_sparsity']['per_layer'])} pruned layers in "
               f"{recovery['steps']} steps ({tokens}, {recovery['seconds']:.0f} s): KL "
               f"{recovery['kl_first']:.4f} -> {recovery['kl_last_10']:.4f}, sparsity "
               f"{report['achieved_sparsity']['global']:.4f} -> {config.out}")
    return 0
