"""Speed and memory of one LEAP mask-learning step against one plain full-parameter fine-tuning step.

Both run on the same randomly initialised Qwen2.5-0.5B-shaped model (or a smaller shape of the same
family on CPU), the same batch and sequence length, AdamW, in this one script run; each variant runs in
its own child process so that its peak memory is its own. The learn step is the real loop,
`leapctl.learn.leap_masks` (masked linears, regularisers, fused AdamW on the logits, gradient clipping,
one host sync per step, gradient checkpointing per block, bf16 autocast on CUDA, or on CPU with
--autocast), timed by its own per-step clock; the fine-tuning step trains every weight with the same
checkpointing, autocast, optimizer and clipping.

    python -m bench.learn_speed                       # CPU: the `small` shape
    python -m bench.learn_speed --shape full --device cuda --batch 8 --seq-len 4096

Writes bench/results/learn_speed/learn_speed.json and .md. The GPU targets of the issue: learn at >= 0.8x the
fine-tuning step's tokens/s and >= 3x the paper's 26k tokens/s per H100."""

import argparse
import json
import multiprocessing as mp
import platform
import resource
import time
from pathlib import Path

import torch

from bench.harness import RESULTS
from bench.shapes import MODEL_SHAPES

_QWEN = MODEL_SHAPES["Qwen2.5-0.5B"]
SHAPES = {
    # Qwen2.5-0.5B: hidden 896, MLP 4864, 24 blocks, 14 heads, 2 KV heads, vocab 151936 (bench/shapes.py)
    "full": dict(hidden_size=_QWEN.hidden, intermediate_size=_QWEN.intermediate,
                 num_hidden_layers=_QWEN.layers, num_attention_heads=_QWEN.heads,
                 num_key_value_heads=_QWEN.kv_heads, vocab_size=_QWEN.vocab),
    # the same proportions at a quarter of the width and a sixth of the depth, with a 16k vocabulary
    "small": dict(hidden_size=224, intermediate_size=1216, num_hidden_layers=4, num_attention_heads=7,
                  num_key_value_heads=1, vocab_size=16384),
}  # fmt: skip
PAPER_TOKENS_PER_S_PER_H100 = 26_000


def build_model(shape: str, device: torch.device):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device)


def _rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run_variant(variant: str, args: dict, results) -> None:
    """One variant in a child process: warm-up steps, then timed steps; tokens/s and peak memory.

    `learn` runs the real loop, `leap_masks` (random initial mask, distillation as `--distill` says: the
    preset's 1.0 by default, one extra no-grad forward per micro-batch), and times its steps
    from the loop's own per-step clock; `finetune` trains every weight with the same checkpointing,
    autocast, fused AdamW, gradient clipping at 1.0 and one host read of the loss per step."""
    torch.set_num_threads(args["threads"]) if args["threads"] else None
    device = torch.device(args["device"])
    model = build_model(args["shape"], device)
    autocast_on = args["autocast"] if args["autocast"] is not None else device.type == "cuda"
    total_steps = args["warmup"] + args["steps"]
    tokens_per_step = args["batch"] * args["seq_len"]
    rss_before = _rss_now()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base_allocated = torch.cuda.memory_allocated(device)
    if variant == "learn":
        from leapctl.learn import LearnConfig, leap_masks

        generator = torch.Generator().manual_seed(0)
        corpus = torch.randint(0, SHAPES[args["shape"]]["vocab_size"], (total_steps * tokens_per_step,),
                               generator=generator)
        config = LearnConfig(model=f"random {args['shape']}", sparsity=0.5, steps=total_steps,
                             batch_size=args["batch"], seq_len=args["seq_len"], init="random",
                             distill=args["distill"], gradient_checkpointing=args["checkpointing"],
                             autocast=autocast_on,
                             checkpoint_every=0, progress=False)
        learned = leap_masks(model, None, corpus, config)
        seconds = sum(m["step_s"] for m in learned.stats["metrics"][args["warmup"]:]) / args["steps"]
        trainable = learned.stats["masked_weights"]
    else:
        params = list(model.parameters())
        if args["checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
        ids = torch.randint(0, SHAPES[args["shape"]]["vocab_size"], (args["batch"], args["seq_len"]),
                            device=device)

        def step() -> float:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_on):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss.float()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()  # the one host read a training loop makes to log its loss

        for _ in range(args["warmup"]):
            step()
        start = time.perf_counter()
        for _ in range(args["steps"]):
            step()
        seconds = (time.perf_counter() - start) / args["steps"]
        trainable = sum(p.numel() for p in params)
    result = {"seconds_per_step": seconds, "tokens_per_s": tokens_per_step / seconds,
              "trainable_parameters": trainable,
              "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "rss_before_steps_bytes": rss_before}  # fmt: skip
    if device.type == "cuda":
        result["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        result["cuda_allocated_before_steps_bytes"] = base_allocated
    results[variant] = result


def _growth(result: dict) -> int:
    """Peak memory minus what was held before the first step (model, Python, torch)."""
    if "cuda_peak_allocated_bytes" in result:
        return result["cuda_peak_allocated_bytes"] - result["cuda_allocated_before_steps_bytes"]
    return result["process_peak_rss_bytes"] - result["rss_before_steps_bytes"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    parser.add_argument(
        "--no-checkpointing", action="store_true", help="disable per-block checkpointing in both"
    )
    parser.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None,
                        help="bf16 autocast in both steps (default: on CUDA only)")
    parser.add_argument("--distill", type=float, default=None,
                        help="LEAP's distillation weight (default: the auto preset's, 1.0; 0 turns it off)")
    parser.add_argument("--out", type=Path, default=RESULTS / "learn_speed" / "learn_speed")
    options = parser.parse_args(argv)
    args = dict(shape=options.shape, device=options.device, batch=options.batch, seq_len=options.seq_len,
                warmup=options.warmup, steps=options.steps, threads=options.threads,
                checkpointing=not options.no_checkpointing, autocast=options.autocast,
                distill=options.distill)  # fmt: skip
    context = mp.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        for variant in ("finetune", "learn"):
            child = context.Process(target=run_variant, args=(variant, args, results))
            child.start()
            child.join()
            if child.exitcode != 0:
                raise SystemExit(f"{variant} step failed (exit {child.exitcode})")
        results = dict(results)
    learn, finetune = results["learn"], results["finetune"]
    cpu_name = f"CPU {platform.machine()}, {options.threads or torch.get_num_threads()} threads"
    summary = {
        "settings": args,
        "shape": SHAPES[options.shape],
        "device": torch.cuda.get_device_name() if options.device.startswith("cuda") else cpu_name,
        "torch": torch.__version__,
        "finetune": finetune,
        "learn": learn,
        "learn_over_finetune_tokens_per_s": learn["tokens_per_s"] / finetune["tokens_per_s"],
        "learn_over_paper_tokens_per_s": learn["tokens_per_s"] / PAPER_TOKENS_PER_S_PER_H100,
    }
    memory_key = (
        "cuda_peak_allocated_bytes" if "cuda_peak_allocated_bytes" in learn else "process_peak_rss_bytes"
    )
    summary["learn_over_finetune_peak_memory"] = learn[memory_key] / finetune[memory_key]
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    rows = [
        "| step | tokens/s | s/step | trainable params | peak memory (MiB) | growth during steps (MiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("finetune", "learn"):
        r = results[name]
        rows.append(f"| {name} | {r['tokens_per_s']:.0f} | {r['seconds_per_step']:.3f} | "
                    f"{r['trainable_parameters']:,} | {r[memory_key] / 2**20:.0f} | "
                    f"{_growth(r) / 2**20:.0f} |")  # fmt: skip
    table = "\n".join(rows)
    text = (
        f"shape `{options.shape}` {SHAPES[options.shape]}, batch {options.batch} x {options.seq_len} tokens, "
        f"device {summary['device']}, checkpointing {args['checkpointing']}, autocast {args['autocast']} "
        f"(None: on CUDA only), memory: {memory_key}\n\n"
        f"{table}\n\n"
        f"learn / finetune tokens/s: {summary['learn_over_finetune_tokens_per_s']:.2f}; "
        f"peak memory ratio: {summary['learn_over_finetune_peak_memory']:.2f}; "
        f"learn / paper's 26k tokens/s: {summary['learn_over_paper_tokens_per_s']:.3f}\n"
    )
    options.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
