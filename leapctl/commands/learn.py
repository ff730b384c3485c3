"""`leapctl learn`: LEAP mask learning into a run folder (same layout as `leapctl prune`).

Under `torchrun --nproc-per-node N -m leapctl learn ...` it runs data parallel (DDP; `--fsdp` for FSDP2)."""

import json
from pathlib import Path

import typer

from leapctl.cli import app


@app.command()
def learn(
    model: str = typer.Argument(
        ..., help="Local Hugging Face folder, hub id, or built-in name (smollm2-135m)."
    ),
    sparsity: float = typer.Option(
        0.5, "--sparsity", help="Target fraction of zeros over all masked weights."
    ),
    out: Path = typer.Option(
        ..., "--out", help="Output folder (checkpoint, masks.safetensors, report, plots)."
    ),
    calib: str = typer.Option(
        "wiki-summaries",
        "--calib",
        help="Training text: file, folder, .jsonl, saved dataset, wiki-summaries or generated (sampled "
        "from the model).",
    ),
    steps: int = typer.Option(100, "--steps", help="Optimizer steps."),
    batch_size: int = typer.Option(8, "--batch-size", help="Global batch in sequences per optimizer step."),
    micro_batch_size: int = typer.Option(
        0, "--micro-batch-size", help="Sequences per forward on one process (0: the whole share)."
    ),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per training sequence."),
    preset: str = typer.Option(
        "auto", "--preset",
        help="auto (learns from step 1 at any budget: +-0.5 logits, lr 0.4/sqrt(steps), no "
        "magnitude term) or paper (+-3, lr 1e-2, magnitude term); explicit flags override it.",
    ),
    lr: float | None = typer.Option(
        None, "--lr", help="Peak AdamW learning rate of the logits (default: preset)."
    ),
    warmup_steps: int = typer.Option(5, "--warmup-steps", help="Linear warm-up before the cosine decay."),
    beta1: float = typer.Option(0.9, "--beta1"),
    beta2: float = typer.Option(0.95, "--beta2"),
    weight_decay: float = typer.Option(0.0, "--weight-decay"),
    alpha_start: float = typer.Option(25.0, "--alpha-start", help="Logit scale alpha at the first step."),
    alpha_end: float | None = typer.Option(
        None, "--alpha-end", help="Logit scale alpha at the last step (default: preset; paper 350)."
    ),
    tau_start: float = typer.Option(4.0, "--tau-start", help="Temperature tau at the first step."),
    tau_end: float | None = typer.Option(
        None, "--tau-end", help="Temperature tau at the last step (default: preset; paper 0.05)."
    ),
    fixed_alpha: bool = typer.Option(False, "--fixed-alpha", help="Ablation: hold alpha at --alpha-start."),
    fixed_tau: bool = typer.Option(False, "--fixed-tau", help="Ablation: hold tau at --tau-start."),
    lambda1: float = typer.Option(7.0, "--lambda1", help="Weight of |global density - target density|."),
    lambda2: float = typer.Option(10.0, "--lambda2", help="Weight of the (decaying) kept-magnitude ratio."),
    magnitude: bool | None = typer.Option(
        None, "--magnitude/--no-magnitude", help="The decaying magnitude term (default: preset; paper: on)."
    ),
    max_grad_norm: float = typer.Option(
        1.0, "--max-grad-norm", help="Clip the logits' gradient norm (the authors' 1.0); 0 turns it off."
    ),
    distill: float | None = typer.Option(
        None, "--distill",
        help="Weight d of KL(dense || masked) against the same model with the masks off; the LM loss gets "
        "1 - d (default: preset).",
    ),
    reconstruct: bool | None = typer.Option(
        None, "--reconstruct/--no-reconstruct",
        help="After the hard mask, refit the kept weights by least squares per layer on --nsamples windows "
        "(default: preset).",
    ),
    init: str = typer.Option(
        "wanda", "--init", help="wanda (+-scale), wanda-small (authors' code) or random."
    ),
    init_scale: float | None = typer.Option(
        None, "--init-scale", help="s of the +-s Wanda initialisation (default: preset)."
    ),
    init_masks: Path | None = typer.Option(
        None, "--init-masks", help="Start from this mask file (a prune run's masks.safetensors), not Wanda."
    ),
    nsamples: int = typer.Option(
        128, "--nsamples", help="Calibration sequences for the Wanda initialisation and the reconstruction."
    ),
    calib_tokens: int = typer.Option(
        0,
        "--calib-tokens",
        help="Training corpus size in tokens (0: whole text "
        "source; for generated: one pass of the run, at most 1M).",
    ),
    hard_mask: str = typer.Option(
        "global",
        "--hard-mask",
        help="global (exact density, top-k over all "
        "layers), per-layer (exact density in each layer) or positive (P > 0).",
    ),
    logits_dtype: str = typer.Option("float32", "--logits-dtype", help="float32 or bfloat16 logits."),
    autocast: bool | None = typer.Option(
        None,
        "--autocast/--no-autocast",
        help="bf16 autocast of the matmuls (default: on CUDA, off on CPU; CPUs with AMX run it faster).",
    ),
    gradient_checkpointing: bool = typer.Option(
        True,
        "--gradient-checkpointing/--no-gradient-checkpointing",
        help="Recompute each decoder block in the backward.",
    ),
    include: str | None = typer.Option(None, "--include", help="Regex: mask only matching linear names."),
    exclude: str | None = typer.Option(None, "--exclude", help="Regex: skip matching linear names."),
    seed: int = typer.Option(0, "--seed", help="Seed of data order, noise and initialisation."),
    checkpoint_every: int = typer.Option(
        50,
        "--checkpoint-every",
        help="Steps between checkpoints (0: never; SIGTERM/SIGINT always checkpoint).",
    ),
    checkpoint_dir: Path | None = typer.Option(
        None, "--checkpoint-dir", help="Where the unfinished run lives (default OUT.learn-state)."
    ),
    resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace the output folder and any old checkpoint."
    ),
    keep_checkpoint: bool = typer.Option(
        False, "--keep-checkpoint", help="Keep the checkpoint after success."
    ),
    save_logits: bool = typer.Option(
        False, "--save-logits", help="Also write the trained logits (mask_logits.safetensors) into --out."
    ),
    fsdp: bool = typer.Option(False, "--fsdp", help="Under torchrun: shard with FSDP2 instead of DDP."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the progress bar."),
) -> None:
    """Learn a LEAP mask for MODEL at --sparsity and write the pruned checkpoint, masks, report and plots."""
    from leapctl.learn import LearnConfig, learn_masks

    config = LearnConfig(
        model=model,
        out=out,
        sparsity=sparsity,
        calib=calib,
        nsamples=nsamples,
        calib_tokens=calib_tokens,
        steps=steps,
        batch_size=batch_size,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        preset=preset,
        lr=lr,
        warmup_steps=warmup_steps,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        alpha_start=alpha_start,
        alpha_end=alpha_end,
        tau_start=tau_start,
        tau_end=tau_end,
        fixed_alpha=fixed_alpha,
        fixed_tau=fixed_tau,
        lambda1=lambda1,
        lambda2=lambda2,
        magnitude_term=magnitude,
        max_grad_norm=max_grad_norm,
        distill=distill,
        reconstruct=reconstruct,
        init=init,
        init_scale=init_scale,
        init_masks=init_masks,
        hard_mask=hard_mask,
        logits_dtype=logits_dtype,
        autocast=autocast,
        gradient_checkpointing=gradient_checkpointing,
        include=include,
        exclude=exclude,
        seed=seed,
        checkpoint_every=checkpoint_every,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        overwrite=overwrite,
        keep_checkpoint=keep_checkpoint,
        save_logits=save_logits,
        fsdp=fsdp,
        device=device,
        progress=progress,
    )
    result = learn_masks(config)
    if result.interrupted_by:
        typer.echo(
            f"interrupted after step {result.steps_done}: checkpoint in {result.state_dir}; "
            f"rerun with --resume to continue",
            err=True,
        )
        raise typer.Exit(128 + result.interrupted_by)
    if result.out is not None:
        report = json.loads((result.out / "report.json").read_text())
        peak = report["peak_memory"]
        peak_bytes = peak.get("cuda_max_allocated_bytes", peak["process_max_rss_bytes"])
        typer.echo(
            f"wrote {result.out}: sparsity {report['achieved_sparsity']['global']:.4f}, final LM loss "
            f"{report['final'].get('lm_loss', float('nan')):.4f}, "
            f"{report['tokens_per_s'] or 0:.0f} tokens/s, "
            f"peak memory {peak_bytes / 2**20:.0f} MiB"
        )
