"""Sparse + 4-bit against what a CPU user runs instead: decode speed of one sequence, of 8 clients, and a
400-token prefill, every server in turn in one run on the same machine with the same thread count.

    make bench-setup                         # llama.cpp (llama-cpp-python, built from source) in .venv-bench
    python bench/serve_q4.py [--models smollm2-135m llama-1b-shape] [--sparsities 0.5 0.6]
                             [--servers ...] [--rounds 5] [--max-tokens 48] [--out bench/results/serve_q4]

Servers, per model (each started, measured and stopped before the next; the machine has two cores):
- `vllm-bf16`: stock vLLM on the dense model, bf16;
- `vllm-gptq`: stock vLLM on a dense 4-bit GPTQ checkpoint of it (round to nearest, symmetric, group 64:
  `bench/competitors.write_gptq_checkpoint`), through vLLM's own CPU W4A16 path;
- `llama.cpp-q4_0`, `llama.cpp-f16`: llama-cpp-python's OpenAI-compatible server on GGUFs converted by
  llama.cpp's own converter (Q4_0 by its quantizer), `--n_threads 1`: vLLM binds its CPU worker to one core
  on this 2-core machine (the other is left to the API server), so llama.cpp gets one thread too;
- `leapctl-q4-50`, `leapctl-q4-60`: `leapctl serve` on a bitmap-q4 export (magnitude pruning, then
  `leapctl quantize --method rtn`, group 64). Speed depends on the density, not on which weights are kept;
  quality of LEAP/GPTQ variants is bench/quality_q4.py's job.
Models: SmolLM2-135M (real) and `llama-1b-shape`, Llama-3.2-1B's decoder shapes with random weights and
SmolLM2's vocabulary (49152, so that its tokenizer decodes every id; Llama-3.2's 128256-entry lm_head would
add 0.5 GB of dense bf16 reads per token to every server alike).

Measured per server: decode_tok_s (1 client and 8): generated tokens after the first over the time after the
first, summed over requests (`serve_cpu.load_phase`), every request `--max-tokens` long (EOS ignored);
prefill_s: time to the first token of three distinct 400-token prompts with one client, median. Writes
OUT.json and OUT.md with the load average before and after."""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import competitors  # noqa: E402
from cpu_kernels import device_name  # noqa: E402
from serve_cpu import Server, free_port, leapctl, load_phase, prompts, stream  # noqa: E402

from leapctl.serve import PLAIN_CHAT_TEMPLATE, server_command  # noqa: E402
from serving import cpu_kernel  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SERVERS = ("vllm-bf16", "vllm-gptq", "llama.cpp-q4_0", "llama.cpp-f16", "leapctl-q4-50", "leapctl-q4-60")
VLLM_FLAGS = ["--dtype", "bfloat16", "--max-model-len", "1024", "--seed", "0"]


def dense_model(name: str, work: Path) -> Path:
    """The dense Hugging Face folder of a bench model."""
    from leapctl.models import resolve_model

    smollm2 = resolve_model("smollm2-135m")
    if name == "smollm2-135m":
        return smollm2
    if name == "llama-1b-shape":
        return competitors.make_llama_1b_shape(work / "llama-1b-shape", smollm2)
    raise SystemExit(f"unknown model {name!r} (smollm2-135m or llama-1b-shape)")


def q4_export(dense: Path, work: Path, sparsity: float, group_size: int) -> Path:
    """prune (magnitude) -> quantize (rtn) -> export bitmap-q4, each step skipped when its output exists."""
    stem = work / f"{dense.name}-mag{round(sparsity * 100)}"
    run, quantized, export = stem, stem.with_name(stem.name + "-q4"), stem.with_name(stem.name + "-q4-export")
    if not (run / "report.json").is_file():
        leapctl("prune", str(dense), "--method", "magnitude", "--sparsity", str(sparsity), "--out", str(run),
                "--overwrite")
    if not (quantized / "report.json").is_file():
        leapctl("quantize", str(run), "--method", "rtn", "--group-size", str(group_size), "--out",
                str(quantized), "--overwrite")
    if not (export / "manifest.json").is_file():
        leapctl("export", str(quantized), "--format", "bitmap-q4", "--out", str(export), "--overwrite")
    return export


def commands(model: str, dense: Path, work: Path, args) -> dict:
    """Server name -> (served model name, command_for(port)) for the servers asked for."""
    chosen = {}
    for server in args.servers:
        if server == "vllm-bf16":
            folder = dense
        elif server == "vllm-gptq":
            folder = competitors.write_gptq_checkpoint(dense, work / f"{dense.name}-gptq-g64", 64)
        elif server.startswith("llama.cpp-"):
            kind = server.split("-", 1)[1]
            gguf = competitors.write_gguf(dense, work / f"{dense.name}-{kind}.gguf", kind)
            chosen[server] = ("llama", lambda port, gguf=gguf: competitors.llama_cpp_server_command(
                gguf, port, args.threads))
            continue
        elif server.startswith("leapctl-q4-"):
            sparsity = int(server.rsplit("-", 1)[1]) / 100
            export = q4_export(dense, work, sparsity, args.group_size)
            chosen[server] = ("sparse", lambda port, export=export: server_command(
                export, "127.0.0.1", port, 1, ["--served-model-name", "sparse", *VLLM_FLAGS]))
            continue
        else:
            raise SystemExit(f"unknown server {server!r} (choose from {', '.join(SERVERS)})")
        chosen[server] = ("dense", lambda port, folder=folder: [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", "dense", "--host", "127.0.0.1", "--port", str(port),
            "--chat-template", PLAIN_CHAT_TEMPLATE, *VLLM_FLAGS])
    return chosen


def measure(name: str, served: str, command_for, args, texts: list[list[int]],
            long_prompts: list[list[int]]) -> dict:
    port = free_port()
    log = args.work / f"{name}.log"
    print(f"starting {name} (log {log})", flush=True)
    server = Server(command_for(port), log, port)
    try:
        start_s = server.wait_ready()
        stream(server, served, texts[0], 4)  # warm-up
        phases = []
        for clients in args.clients:
            phases.append(load_phase(server, served, texts, clients, args.rounds, args.max_tokens))
            print(f"  {name}: {phases[-1]}", flush=True)
        prefill = [stream(server, served, prompt, 1) for prompt in long_prompts]
        prefill_s = statistics.median(r["first"] - r["start"] for r in prefill)
        print(f"  {name}: prefill of {len(long_prompts[0])} tokens {prefill_s:.3f} s", flush=True)
        time.sleep(1.5)
        return {"start_s": round(start_s, 1), "phases": phases, "prefill_s": round(prefill_s, 3),
                "peak_rss_mib": round(server.peak_rss / 2**20)}
    finally:
        server.stop()


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"Decode of one sequence and of 8 clients ({s['max_tokens']} tokens after a "
             f"{s['prompt_tokens']}-token prompt, EOS ignored, {s['rounds']} requests per client) and "
             f"prefill of {s['prefill_tokens']} tokens; {s['device']}; llama.cpp with {s['threads']} "
             f"thread(s), vLLM's CPU worker bound to one core; load average (1 min) "
             f"{result['load_before']:.2f} before, {result['load_after']:.2f} after. One run.", ""]
    for model, servers in result["models"].items():
        reference = servers.get("llama.cpp-q4_0")
        lines += [f"### {model}", "", "| server | decode tok/s, 1 client | x llama.cpp Q4_0 | 8 clients | "
                  "prefill s | peak RSS MiB |", "| --- | --- | --- | --- | --- | --- |"]
        for name, got in servers.items():
            one = next(p for p in got["phases"] if p["clients"] == 1)["decode_tok_s"]
            many = next((p["decode_tok_s"] for p in got["phases"] if p["clients"] > 1), float("nan"))
            ratio = one / next(p for p in reference["phases"] if p["clients"] == 1)["decode_tok_s"] \
                if reference else float("nan")
            lines.append(f"| {name} | {one:.1f} | {ratio:.2f} | {many:.1f} | {got['prefill_s']:.3f} | "
                         f"{got['peak_rss_mib']} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-1b-shape"])
    parser.add_argument("--servers", nargs="+", default=list(SERVERS))
    cache = Path(os.environ.get("LEAPCTL_CACHE", Path.home() / ".cache" / "leapctl"))
    parser.add_argument("--work", type=Path, default=cache / "bench" / "serve_q4")
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prefill-tokens", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1,
                        help="llama.cpp threads (vLLM's worker has one core)")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "serve_q4"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if not cpu_kernel.load():
        sys.exit(f"the native kernel is unavailable: {cpu_kernel.unavailable_reason()}")
    load_before = os.getloadavg()[0]
    results = {}
    for model in args.models:
        dense = dense_model(model, args.work)
        servers = commands(model, dense, args.work, args)
        # one stream of held-out text cut into distinct prompts: no server can serve a prefix from its cache
        count = max(args.clients) * args.rounds
        ids = prompts(dense, 1, count * args.prompt_tokens + 3 * args.prefill_tokens)[0]
        texts = [ids[i * args.prompt_tokens:(i + 1) * args.prompt_tokens] for i in range(count)]
        rest = ids[count * args.prompt_tokens:]
        long_prompts = [rest[i * args.prefill_tokens:(i + 1) * args.prefill_tokens] for i in range(3)]
        results[model] = {name: measure(name, served, command_for, args, texts, long_prompts)
                          for name, (served, command_for) in servers.items()}
    result = {"settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "device": device_name()},
              "load_before": load_before, "load_after": os.getloadavg()[0], "models": results}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
