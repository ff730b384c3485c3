"""Stock vLLM on a masked dense checkpoint against `leapctl serve` on its bitmap export, on CPU, one run.

    python -m bench.serve --format bitmap [--model smollm2-135m] [--method wanda] [--sparsity 0.5]
        [--work DIR] [--dtype bfloat16] [--clients 1 8] [--rounds 5] [--prompt-tokens 64] [--max-tokens 32]
        [--compile] [--profile] [--out bench/results/serve/serve_cpu]

1. Prunes MODEL (`leapctl prune --calib wiki-summaries`) into WORK/<model>-<method><pct> and exports it
   with `--format bitmap` into WORK/...-bitmap, unless they are there already (WORK defaults to
   $LEAPCTL_CACHE/bench/serve_cpu).
2. Builds the dense masked checkpoint for stock vLLM in WORK/...-dense: the run folder's config, tokenizer
   and model.safetensors only (hard links), since vLLM loads every *.safetensors it finds and the run's
   masks.safetensors is not a model shard.
3. Starts each server in turn (never both: the machine has two cores) with the same vLLM flags (--dtype,
   --max-model-len 1024, --seed 0, --enforce-eager unless --compile) and VLLM_CPU_KVCACHE_SPACE=1; the
   sparse one is the command `leapctl serve` runs (`leapctl.commands.serve.server_command`), and both are
   started, checked ready and stopped by serve's own launcher (`running_command`). For each client
   count, that many client threads each stream --rounds completions (greedy, ignore_eos, prompts of
   --prompt-tokens distinct tokens of held-out Wikipedia text, --max-tokens tokens); reported:
   - decode_tok_s: clients x (tokens - 1) / (last token time - first token time), summed over requests
     before dividing: the rate at which the server generates once prefill is done (a mean of per-request
     rates was skewed by a request whose streamed chunks arrived together: 2.07x in one run, 1.32x in the
     next, with the same step time in the profile);
   - output_tok_s: all generated tokens / wall time of the whole client phase (prefill included);
   - the server's memory: the largest sum of RSS (and PSS, sampled every 10 s) over its process group seen
     while it ran.
4. Asks both servers for the same greedy completions without ignore_eos and reports how many agree.
5. With --profile, a last 1-client request runs under vLLM's torch profiler (`--profiler-config`, started
   and stopped through the server's /start_profile and /stop_profile), and the report splits the time
   of a decode step (vLLM's `execute_context_*_generation_*` ranges) into the decoder's linear layers
   (`leap_sparse_cpu::bitmap_linear`, or oneDNN's `_C::onednn_mm` for the dense model), lm_head (oneDNN
   in both) and everything else: what bounds the end-to-end ratio however fast the sparse layers get.

Writes OUT.json and OUT.md with the settings, the load average before and after, and the ratios.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.harness import RESULTS, work_dir
from bench.harness import write_report as write_result
from bench.serve.common import (
    Server,
    free_port,
    has_text,
    leapctl,
    post,
    profiled,
    profiler_config,
    prompts,
    run_clients,
    settings,
    stop_servers_on_sigterm,
    stream_events,
)
from leapctl.commands.serve import PLAIN_CHAT_TEMPLATE, server_command
from serving import cpu_kernel

DENSE_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
               "chat_template.jinja")


def prepare(args) -> tuple[Path, Path]:
    """(dense masked checkpoint, bitmap export), made once in WORK."""
    name = f"{args.model.replace('/', '_')}-{args.method}{round(args.sparsity * 100)}"
    run, export, dense = args.work / name, args.work / f"{name}-bitmap", args.work / f"{name}-dense"
    if not (run / "report.json").is_file():
        print(f"pruning {args.model} with {args.method} to {args.sparsity:.0%} into {run}", flush=True)
        leapctl("prune", args.model, "--method", args.method, "--sparsity", str(args.sparsity),
                "--calib", "wiki-summaries", "--out", str(run), "--overwrite")
    if not (export / "manifest.json").is_file():
        leapctl("export", str(run), "--format", "bitmap", "--out", str(export), "--overwrite")
    if not (dense / "model.safetensors").is_file():
        dense.mkdir(parents=True, exist_ok=True)
        for file in DENSE_FILES:
            if (run / file).is_file() and not (dense / file).exists():
                os.link(run / file, dense / file)
    return dense, export


def stream(server: Server, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: timestamps of the request, its first and its last token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start, first, last, tokens = time.perf_counter(), None, None, 0
    for event in stream_events(server, body):
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        if has_text(event):
            now = time.perf_counter()
            first = first or now
            last = now
    return {"start": start, "first": first, "last": last, "tokens": tokens}


def load_phase(server: Server, model: str, texts: list[list[int]], clients: int, rounds: int,
               max_tokens: int) -> dict:
    results, wall = run_clients(clients, rounds,
                                lambda i: stream(server, model, texts[i % len(texts)], max_tokens))
    decoding = [r for r in results if r["last"] > r["first"]]
    decode_rate = sum(r["tokens"] - 1 for r in decoding) / sum(r["last"] - r["first"] for r in decoding)
    return {"clients": clients, "requests": len(results), "tokens": sum(r["tokens"] for r in results),
            "wall_s": round(wall, 3), "output_tok_s": round(sum(r["tokens"] for r in results) / wall, 2),
            "decode_tok_s": round(clients * decode_rate, 2),
            "ttft_s": round(sum(r["first"] - r["start"] for r in results) / len(results), 3)}


def greedy_answers(server: Server, model: str, texts: list[list[int]], max_tokens: int) -> list[list[int]]:
    answers = []
    for prompt in texts:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        with post(f"{server.base}/v1/completions", body) as response:
            answers.append(json.loads(response.read())["choices"][0]["token_ids"])
    return answers


def profile_decode(server: Server, name: str, prompt: list[int], max_tokens: int, folder: Path) -> dict:
    """Per decode step (ms): the whole step, the decoder's linear layers, lm_head and the rest."""
    rows, step = profiled(server, lambda: stream(server, name, prompt, max_tokens), folder)
    steps = step["calls"]
    per_step = {"step_ms": step["total_ms"], "onednn_ms": rows.get("_C::onednn_mm", {}).get("total_ms", 0.0),
                "sparse_ms": rows.get("leap_sparse_cpu::bitmap_linear", {}).get("total_ms", 0.0)}
    return {"steps": steps, **{key: round(value / steps, 3) for key, value in per_step.items()}}


def decode_split(dense: dict, sparse: dict) -> dict:
    """ms per decode step (the prompt's prefill step spread over them): the sparse model runs only lm_head
    through oneDNN, so that is lm_head's time in both; the dense model's other oneDNN time is its decoder."""
    lm_head = sparse["onednn_ms"]
    split = {"dense": {"step": dense["step_ms"], "decoder_linears": dense["onednn_ms"] - lm_head},
             "sparse": {"step": sparse["step_ms"], "decoder_linears": sparse["sparse_ms"]}}
    for part in split.values():
        part["lm_head"] = lm_head
        part["other"] = part["step"] - part["decoder_linears"] - lm_head
    return {name: {k: round(v, 2) for k, v in part.items()} for name, part in split.items()}


def run_server(name: str, command_for, args, texts: list[list[int]], greedy: list[list[int]]) -> dict:
    """Start the server that `command_for(port)` describes, measure it, stop it."""
    port = free_port()
    command = command_for(port)
    if args.profile:
        command += profiler_config(args.work / f"profile-{name}")
    log = args.work / f"{name}.log"
    print(f"starting {name}: {' '.join(command)} (log {log})", flush=True)
    server = Server(command, log, port, pss=True)
    started = time.monotonic()
    with server.running():
        start_s = time.monotonic() - started
        stream(server, name, texts[0], 4)  # warm-up
        phases = []
        for clients in args.clients:
            phases.append(load_phase(server, name, texts, clients, args.rounds, args.max_tokens))
            print(f"  {name}: {phases[-1]}", flush=True)
        answers = greedy_answers(server, name, greedy, args.max_tokens)
        profile = profile_decode(server, name, texts[0], args.max_tokens, args.work / f"profile-{name}") \
            if args.profile else None
        time.sleep(1.5)  # one more memory sample after the load
        log_text = log.read_text(errors="replace")
        layer_line = next((line for line in log_text.splitlines() if "sparse linear layers hold" in line),
                          None)
        return {"start_s": round(start_s, 1), "phases": phases, "answers": answers,
                "peak_rss_mib": round(server.peak_rss / 2**20),
                "peak_pss_mib": round(server.peak_pss / 2**20),
                "layer_memory_line": layer_line, "profile": profile}


def markdown(result: dict) -> str:
    s = result["settings"]
    dense, sparse = result["servers"]["dense"], result["servers"]["sparse"]
    lines = [f"{s['model']} pruned with {s['method']} to {s['sparsity']:.0%}, {s['dtype']}, "
             f"{'torch.compile (vLLM default)' if s['compile'] else '--enforce-eager'}, "
             f"{s['prompt_tokens']}-token prompts, {s['max_tokens']} generated tokens (ignore_eos), "
             f"{s['rounds']} requests per client; {s['device']}; load average (1 min) "
             f"{result['load_before']:.2f} before, {result['load_after']:.2f} after. One run.", "",
             "| clients | stock vLLM, dense masked: decode tok/s | leapctl serve, bitmap: decode tok/s "
             "| ratio | dense output tok/s | sparse output tok/s | ratio |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for d, p in zip(dense["phases"], sparse["phases"], strict=True):
        lines.append(f"| {d['clients']} | {d['decode_tok_s']:.1f} | {p['decode_tok_s']:.1f} | "
                     f"{p['decode_tok_s'] / d['decode_tok_s']:.2f} | {d['output_tok_s']:.1f} | "
                     f"{p['output_tok_s']:.1f} | {p['output_tok_s'] / d['output_tok_s']:.2f} |")
    lines += ["", f"Server memory (process group, peak): dense RSS {dense['peak_rss_mib']} MiB / PSS "
              f"{dense['peak_pss_mib']} MiB; sparse RSS {sparse['peak_rss_mib']} MiB / PSS "
              f"{sparse['peak_pss_mib']} MiB.",
              f"Sparse layers: `{sparse['layer_memory_line'].split('leap_sparse: ', 1)[-1]}`"
              if sparse["layer_memory_line"] else "",
              f"Greedy answers ({len(dense['answers'])} prompts, {s['max_tokens']} tokens): "
              f"{result['greedy_equal']} identical; start-up {dense['start_s']} s dense, "
              f"{sparse['start_s']} s sparse."]
    if result.get("decode_split"):
        lines += ["", "Time of one decode step (ms, vLLM's torch profiler, 1 client; profiling adds some "
                  "overhead):", "", "| server | step | decoder linears | lm_head | everything else |",
                  "| --- | --- | --- | --- | --- |"]
        for name, label in (("dense", "stock vLLM, dense masked"), ("sparse", "leapctl serve, bitmap")):
            part = result["decode_split"][name]
            lines.append(f"| {label} | {part['step']:.2f} | {part['decoder_linears']:.2f} | "
                         f"{part['lm_head']:.2f} | {part['other']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    stop_servers_on_sigterm()
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve --format bitmap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--method", default="wanda", choices=["magnitude", "wanda", "sparsegpt"])
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--work", type=Path, default=work_dir("serve_cpu"))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--compile", action="store_true", help="leave torch.compile on (vLLM's default)")
    parser.add_argument("--profile", action="store_true", help="split a decode step's time (torch profiler)")
    parser.add_argument("--out", default=str(RESULTS / "serve" / "serve_cpu"))
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if not cpu_kernel.load():
        sys.exit(f"the native kernel is unavailable: {cpu_kernel.unavailable_reason()}")
    dense_dir, export_dir = prepare(args)
    texts = prompts(dense_dir, max(args.clients) * args.rounds, args.prompt_tokens)
    greedy = prompts(dense_dir, max(args.clients) * args.rounds + 6, args.prompt_tokens)[-6:]
    flags = ["--dtype", args.dtype, "--max-model-len", "1024", "--seed", "0"]
    if not args.compile:
        flags.append("--enforce-eager")
    load_before = os.getloadavg()[0]
    def stock(port: int) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(dense_dir),
                "--served-model-name", "dense", "--host", "127.0.0.1", "--port", str(port),
                "--chat-template", PLAIN_CHAT_TEMPLATE, *flags]

    def leapctl_serve(port: int) -> list[str]:
        return server_command(export_dir, "127.0.0.1", port, 1,
                              ["--served-model-name", "sparse", *flags])

    servers = {"dense": run_server("dense", stock, args, texts, greedy),
               "sparse": run_server("sparse", leapctl_serve, args, texts, greedy)}
    result = {"settings": settings(args), "load_before": load_before, "load_after": os.getloadavg()[0],
              "servers": servers,
              "decode_split": decode_split(servers["dense"]["profile"], servers["sparse"]["profile"])
              if args.profile else None,
              "greedy_equal": sum(a == b for a, b in zip(servers["dense"]["answers"],
                                                         servers["sparse"]["answers"], strict=True))}
    write_result(Path(args.out), result, markdown(result))


if __name__ == "__main__":
    main()
