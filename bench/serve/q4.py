"""Sparse + 4-bit against what a CPU user runs instead: decode speed of one sequence, of 8 clients, and a
400-token prefill, every server in turn in one run on the same machine with the same thread count.

    make bench-setup                         # llama.cpp (llama-cpp-python, built from source) in .venv-bench
    python -m bench.serve --format bitmap-q4 [--models smollm2-135m llama-1b-shape] [--sparsities 0.5 0.6]
        [--servers ...] [--rounds 5] [--max-tokens 48] [--out bench/results/serve/serve_q4]

Servers, per model (each started, measured and stopped before the next; the machine has two cores):
- `vllm-bf16`: stock vLLM on the dense model, bf16;
- `vllm-gptq`: stock vLLM on a dense 4-bit GPTQ checkpoint of it (round to nearest, symmetric, group 64:
  `bench/competitors.write_gptq_checkpoint`), through vLLM's own CPU W4A16 path;
- `llama.cpp-q4_0`, `llama.cpp-f16`: llama-cpp-python's OpenAI-compatible server on GGUFs converted by
  llama.cpp's own converter (Q4_0 by its quantizer), `--n_threads 1`: vLLM binds its CPU worker to one core
  on this 2-core machine (the other is left to the API server), so llama.cpp gets one thread too;
- `leapctl-q4-50`, `leapctl-q4-50-head8`, `leapctl-q4-60-head8`, `leapctl-q4-50-head4`, ...: `leapctl
  serve` on a bitmap-q4 export with its default int8 activations (`-bf16x`: `--activations bf16`)
  (magnitude pruning at 50 or 60%, then `leapctl quantize --method rtn` in groups of `--group-size` (64,
  quantize's default; `-g128` on a server's name: that size for it); lm_head
  as `quantize --lm-head-bits` puts it: 16-bit without a suffix, `-head8` 8 bits (quantize's default),
  `-head4` 4 bits; `-asym`: `--grid asymmetric`, a zero point per group; `-fp32`: vLLM's `--dtype float32`
  instead of bfloat16, for CPUs without native bf16 arithmetic).
  Speed depends on the density, not on which weights are kept; the quality of LEAP/GPTQ variants is
  `python -m bench.quality q4`'s job.
Models: SmolLM2-135M (real) and `llama-1b-shape`, Llama-3.2-1B's decoder shapes with random weights and
SmolLM2's vocabulary (49152, so that its tokenizer decodes every id; Llama-3.2's 128256-entry lm_head would
add 0.5 GB of dense bf16 reads per token to every server alike).

Measured per server: decode_tok_s, one sequence: (N - 1) tokens over the median time of whole N-token
completions minus that of 1-token ones (streamed chunk times came in bursts); output_tok_s with 8 clients:
all generated tokens over the wall time, every request `--max-tokens` long (EOS held off); prefill_s: time
to the first token of three distinct 400-token prompts with one client, median. Writes
OUT.json and OUT.md with the load average before and after, and for leapctl servers the MiB of the worker on
huge pages (its load line).

With --interleave N, only the one-sequence decode, measured another way: every server of a model is started
at once (idle, a vLLM server takes ~1% of a core, llama.cpp's none), then N rounds each measure every server
once (3 whole and 3 one-token completions each, the order rotated every round). On a shared 2-core machine
one server's rate moved from 39 to 57 tok/s within minutes (seventeenth session; the same server, nothing
changed), which made ratios of servers measured minutes apart swing by a third; here each round's ratio to
llama.cpp Q4_0 is of two measurements seconds apart, and the result gives every round's figures, their
medians and the median of the rounds' ratios.

With --profile, each vLLM server (stock or leapctl) then serves one more 1-client request under vLLM's torch
profiler (`/start_profile`), and the result lists the step's time and the ops that take most of it by
their own time (children excluded) per step: the sparse op, the compiled graph's Python wrapper, vLLM's
attention and KV-cache wrappers, ... Profiling adds overhead: compare its steps with each other, not with
the unprofiled tokens/s. The full tables stay under WORK/profile/MODEL/SERVER."""

import argparse
import json
import os
import re
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from transformers import AutoTokenizer

from bench import competitors
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
from leapctl.commands.serve import PLAIN_CHAT_TEMPLATE, server_command, server_env
from leapctl.errors import LeapctlError
from serving import cpu_kernel

SERVERS = ("vllm-bf16", "vllm-gptq", "llama.cpp-q4_0", "llama.cpp-f16", "leapctl-q4-50",
           "leapctl-q4-50-head8", "leapctl-q4-60-head8", "leapctl-q4-50-head4", "leapctl-q4-60-head4",
           "leapctl-q4-50-head4-bf16x", "leapctl-q4-60-head4-bf16x", "leapctl-q4-50-head8-asym",
           "leapctl-q4-60-head8-asym", "leapctl-q4-60-head8-asym-g128")
VLLM_FLAGS = ["--max-model-len", "1024", "--seed", "0"]
FIRST_ERROR = re.compile(r"ERROR .*?\] (\w+(?:Error|Exception): .+)$", re.MULTILINE)


def vllm_flags(dtype: str = "bfloat16") -> list[str]:
    return ["--dtype", dtype, *VLLM_FLAGS]
# The plugin's load line: how much of the worker the kernel put on huge pages (a leapctl server without them
# decodes several % slower, which single runs cannot tell from the machine's noise).
HUGE_PAGES_NOTE = re.compile(r"; (\d+) MiB of the process on huge pages")


def dense_model(name: str, work: Path) -> Path:
    """The dense Hugging Face folder of a bench model."""
    from leapctl.models import resolve_model

    smollm2 = resolve_model("smollm2-135m")
    if name == "smollm2-135m":
        return smollm2
    if name == "llama-1b-shape":
        return competitors.make_llama_1b_shape(work / "llama-1b-shape", smollm2)
    raise SystemExit(f"unknown model {name!r} (smollm2-135m or llama-1b-shape)")


def q4_export(dense: Path, work: Path, sparsity: float, group_size: int, lm_head_bits: int,
              grid: str = "symmetric") -> Path:
    """prune (magnitude) -> quantize (rtn in groups of `group_size`, lm_head in `lm_head_bits`, on `grid`; no
    scale tuning: speed does not depend on the scales' values) -> export bitmap-q4, each step skipped when its
    output exists."""
    run = work / f"{dense.name}-mag{round(sparsity * 100)}"
    quantized = run.with_name(run.name + ("-q4" if lm_head_bits == 16 else f"-q4-head{lm_head_bits}")
                              + ("-asym" if grid == "asymmetric" else "")
                              + f"-g{group_size}")
    export = quantized.with_name(quantized.name + "-export")
    if not (run / "report.json").is_file():
        leapctl("prune", str(dense), "--method", "magnitude", "--sparsity", str(sparsity), "--out", str(run),
                "--overwrite")
    if not (quantized / "report.json").is_file():
        leapctl("quantize", str(run), "--method", "rtn", "--tune-steps", "0", "--group-size", str(group_size),
                "--out", str(quantized), "--overwrite", "--lm-head-bits", str(lm_head_bits), "--grid", grid)
    if not (export / "manifest.json").is_file():
        leapctl("export", str(quantized), "--format", "bitmap-q4", "--out", str(export), "--overwrite")
    return export


def leapctl_server(name: str, default_group_size: int) -> tuple[float, int, str, int, str, str]:
    """`leapctl-q4-60-head8-asym-g128` -> (sparsity, lm_head bits, grid, group size, activations, dtype)."""
    tags = name.split("-")[2:]
    head = next((bits for bits in (4, 8) if f"head{bits}" in tags), 16)
    group = next((int(tag[1:]) for tag in tags if tag[:1] == "g" and tag[1:].isdigit()), default_group_size)
    return (int(tags[0]) / 100, head, "asymmetric" if "asym" in tags else "symmetric", group,
            "bf16" if "bf16x" in tags else "int8", "float32" if "fp32" in tags else "bfloat16")


def commands(model: str, dense: Path, work: Path, args) -> dict:
    """Server name -> (kind: vllm or llama.cpp, command_for(port), environment or None for the default)
    for the servers asked for."""
    chosen = {}

    def profiling(server: str) -> list[str]:
        return profiler_config(work / "profile" / model / server) if args.profile else []

    for server in args.servers:
        if server == "vllm-bf16":
            folder = dense
        elif server == "vllm-gptq":
            folder = competitors.write_gptq_checkpoint(dense, work / f"{dense.name}-gptq-g64", 64)
        elif server.startswith("llama.cpp-"):
            kind = server.split("-", 1)[1]
            gguf = competitors.write_gguf(dense, work / f"{dense.name}.{kind}.gguf", kind)
            chosen[server] = ("llama.cpp", lambda port, gguf=gguf, log=work / f"{server}.log":
                              competitors.start_llama_cpp_server(gguf, port, args.threads, log), None)
            continue
        elif server.startswith("leapctl-q4-"):
            sparsity, head, grid, group, activations, dtype = leapctl_server(server, args.group_size)
            export = q4_export(dense, work, sparsity, group, head, grid)
            chosen[server] = ("vllm", lambda port, export=export, extra=profiling(server), dtype=dtype:
                              server_command(export, "127.0.0.1", port, 1,
                                             ["--served-model-name", "model", *vllm_flags(dtype), *extra]),
                              server_env(1, activations=activations))
            continue
        else:
            raise SystemExit(f"unknown server {server!r} (choose from {', '.join(SERVERS)})")
        chosen[server] = ("vllm", lambda port, folder=folder, extra=profiling(server): [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", "model", "--host", "127.0.0.1", "--port", str(port),
            "--chat-template", PLAIN_CHAT_TEMPLATE, *vllm_flags(), *extra], None)
    return chosen


def request_body(kind: str, prompt: tuple[list[int], str], max_tokens: int) -> dict:
    """A streamed greedy completion of exactly `max_tokens` tokens: vLLM takes the token ids and ignores
    EOS; llama-cpp-python's server takes only text (the same ids decoded, which it tokenizes back to as
    many) and holds EOS off with `min_tokens`."""
    ids, text = prompt
    if kind == "llama.cpp":
        return competitors.llama_cpp_completion(text, max_tokens)
    return {"model": "model", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def stream(server: Server, body: dict) -> dict:
    """One streamed completion: timestamps of the request, its first and last token, and its tokens: vLLM's
    final usage count (a token whose text is an unfinished UTF-8 sequence streams no text of its own, which
    made counted chunks come up short with 8 clients), else one per chunk with text (llama.cpp's server)."""
    start, first, last, chunks, usage = time.perf_counter(), None, None, 0, None
    for event in stream_events(server, body):
        if event.get("usage"):
            usage = event["usage"]["completion_tokens"]
        if has_text(event):
            now = time.perf_counter()
            first, last, chunks = first or now, now, chunks + 1
    return {"start": start, "first": first, "last": last, "tokens": chunks if usage is None else usage}


def load_phase(server: Server, kind: str, texts: list, clients: int, rounds: int, max_tokens: int) -> dict:
    """`clients` threads each stream `rounds` completions: generated tokens over the wall time (prefill
    included); `complete` says whether every request got its tokens (llama-cpp-python's server, one
    request at a time, returned concurrent streams short)."""
    results, wall = run_clients(
        clients, rounds, lambda i: stream(server, request_body(kind, texts[i % len(texts)], max_tokens)))
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": round(wall, 3),
            "output_tok_s": round(tokens / wall, 2), "complete": tokens == len(results) * max_tokens}


def timed(server: Server, body: dict) -> float:
    """Seconds for one whole (not streamed) completion."""
    whole = {key: value for key, value in body.items() if key != "stream_options"} | {"stream": False}
    start = time.perf_counter()
    with post(f"{server.base}/v1/completions", whole) as response:
        answer = json.loads(response.read())
    if answer["usage"]["completion_tokens"] != body["max_tokens"]:
        got = answer["usage"]["completion_tokens"]
        raise RuntimeError(f"asked for {body['max_tokens']} tokens, got {got}")
    return time.perf_counter() - start


def one_stream_decode(server: Server, kind: str, texts: list, rounds: int, max_tokens: int) -> float:
    """Decode tok/s of one sequence: (N - 1) tokens over the median time of N-token completions minus the
    median time of 1-token ones, on distinct prompts of the same length (no prefix served from a cache).
    Streamed chunks arrived in bursts on some servers, which made a rate from chunk times swing 2-9x."""
    whole = [timed(server, request_body(kind, texts[2 * r], max_tokens)) for r in range(rounds)]
    first = [timed(server, request_body(kind, texts[2 * r + 1], 1)) for r in range(rounds)]
    return (max_tokens - 1) / (statistics.median(whole) - statistics.median(first))


def new_server(name: str, command_for, env, work: Path) -> Server:
    """Server `name` on a free port, its log WORK/NAME.log (not started yet)."""
    port, log = free_port(), work / f"{name}.log"
    print(f"starting {name} (log {log})", flush=True)
    return Server(command_for(port), log, port, health="/v1/models", env=env)


def measure(model: str, name: str, kind: str, command_for, env, args, texts: list,
            long_prompts: list) -> dict:
    server = new_server(name, command_for, env, args.work)
    started = time.monotonic()
    with server.running():
        start_s = time.monotonic() - started
        stream(server, request_body(kind, texts[-1], 4))  # warm-up
        decode = one_stream_decode(server, kind, texts, args.rounds, args.max_tokens)
        print(f"  {name}: one sequence {decode:.1f} tok/s", flush=True)
        phases = [load_phase(server, kind, texts, clients, args.rounds, args.max_tokens)
                  for clients in args.clients if clients > 1]
        for phase in phases:
            print(f"  {name}: {phase}", flush=True)
        prefill = [stream(server, request_body(kind, prompt, 1)) for prompt in long_prompts]
        prefill_s = statistics.median(r["first"] - r["start"] for r in prefill)
        print(f"  {name}: prefill of {len(long_prompts[0][0])} tokens {prefill_s:.3f} s", flush=True)
        profile = None
        if args.profile and kind == "vllm":
            folder = args.work / "profile" / model / name
            profile = step_profile(*profiled(server, lambda: timed(
                server, request_body(kind, texts[0], args.max_tokens)), folder))
            print(f"  {name}: profiled step {profile['step_ms']} ms: {profile['ops']}", flush=True)
        time.sleep(1.5)
        pages = HUGE_PAGES_NOTE.search(server.log.read_text(errors="replace"))
        return {"start_s": round(start_s, 1), "decode_tok_s": round(decode, 2), "phases": phases,
                "prefill_s": round(prefill_s, 3), "peak_rss_mib": round(server.peak_rss / 2**20),
                "huge_pages_mib": int(pages.group(1)) if pages else None, "profile": profile}


def interleaved(servers: dict, args, texts: list) -> dict:
    """Every server at once, then `args.interleave` rounds of the one-sequence decode of each (order rotated
    per round, each call on prompts no earlier call of that server saw): per server its rates, their median
    and, against llama.cpp-q4_0, each round's ratio and their median."""
    rates, running = {}, {}
    with ExitStack() as stack:
        for name, (kind, command_for, env) in servers.items():
            server = new_server(name, command_for, env, args.work)
            try:
                stack.enter_context(server.running())
            except LeapctlError as exc:
                rates[name] = {"failed": failure(server.log, exc)}
                print(f"  {name}: not served: {rates[name]['failed']}", flush=True)
                continue
            stream(server, request_body(kind, texts[-1], 4))  # warm-up
            running[name] = (server, kind)
        names = list(running)
        got = {name: [] for name in names}
        host = []  # per round: the slowest host read rate around its servers' measurements, GB/s
        probe = HostReadProbe(args.probe_core)
        for r in range(args.interleave):
            reads = []
            for name in names[r % len(names):] + names[:r % len(names)]:
                server, kind = running[name]
                first = 2 * args.rounds * r
                before = probe.rate()
                got[name].append(one_stream_decode(server, kind, texts[first:], args.rounds, args.max_tokens))
                reads.append((before + probe.rate()) / 2)
            host.append(min(reads) / 1e9)
            print(f"  round {r + 1}/{args.interleave}: "
                  + ", ".join(f"{name} {got[name][-1]:.1f}" for name in names)
                  + f"; host read {host[-1]:.1f} GB/s", flush=True)
    reference = got.get("llama.cpp-q4_0")
    quiet = [r for r, rate in enumerate(host) if rate >= QUIET_SHARE * max(host)]
    rates["host"] = {"read_gb_s": [round(x, 2) for x in host], "quiet_rounds": quiet}
    for name in names:
        rates[name] = {"tok_s": [round(x, 2) for x in got[name]],
                       "median_tok_s": round(statistics.median(got[name]), 2)}
        if reference:
            ratios = [a / b for a, b in zip(got[name], reference, strict=True)]
            rates[name] |= {"ratios": [round(x, 3) for x in ratios],
                            "median_ratio": round(statistics.median(ratios), 3),
                            "median_ratio_quiet": round(statistics.median(ratios[r] for r in quiet), 3)}
    return rates


# A round counts as quiet when the host read at least this share of the run's best rate around every server.
QUIET_SHARE = 0.85


class HostReadProbe:
    """How fast the host lets one core read DRAM now: torch.sum over 512 MB (far beyond the L3) on the core
    vLLM's worker is bound to, in a thread of this process pinned there for the read. It is what that core
    gets, DRAM and time on the core alike: on the shared 2-core machine of the sixteenth to eighteenth
    sessions the rate fell from ~20 to 6.7 GB/s within a minute while nothing of ours ran, and every server's
    tokens/s fell with it; with three idle servers up it read 0.9-10 GB/s. Each round's figures come with
    it."""

    def __init__(self, core: int) -> None:
        import torch

        self.core, self.buffer = core, torch.ones(128 << 20)

    def rate(self) -> float:
        """Bytes/s of one read (after pinning this thread for it; its affinity is restored)."""
        import torch

        old, threads = os.sched_getaffinity(0), torch.get_num_threads()
        os.sched_setaffinity(0, {self.core})
        torch.set_num_threads(1)
        try:
            start = time.perf_counter()
            self.buffer.sum()
            return self.buffer.numel() * 4 / (time.perf_counter() - start)
        finally:
            os.sched_setaffinity(0, old)
            torch.set_num_threads(threads)


def interleaved_markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"One-sequence decode ({s['max_tokens']} tokens after a {s['prompt_tokens']}-token prompt, EOS "
             f"ignored), every server of a model running at once and measured in turn, {s['interleave']} "
             f"rounds of {s['rounds']} completions each, order rotated per round; "
             f"{machine_line(result)}.", ""]
    for model, servers in result["models"].items():
        host = servers.get("host")
        quiet = f"x llama.cpp Q4_0, {len(host['quiet_rounds'])} quiet rounds | " if host else ""
        lines += [f"### {model}", "", "| server | median tok/s | median of the rounds' x llama.cpp Q4_0 | "
                  f"{quiet}lowest - highest round x | tok/s per round |",
                  "| --- " * (5 + bool(host)) + "|"]
        for name, got in servers.items():
            if name == "host":
                continue
            if "failed" in got:
                lines.append(f"| {name} | not served: {got['failed']} |" + " |" * (3 + bool(host)))
                continue
            span = (f"{min(got['ratios']):.2f} - {max(got['ratios']):.2f}" if "ratios" in got else "")
            ratio = f"{got['median_ratio']:.2f}" if "median_ratio" in got else ""
            quiet_ratio = (f"{got['median_ratio_quiet']:.2f} | " if "median_ratio_quiet" in got
                           else " | " * bool(host))
            lines.append(f"| {name} | {got['median_tok_s']:.1f} | {ratio} | {quiet_ratio}{span} | "
                         f"{' '.join(f'{x:.1f}' for x in got['tok_s'])} |")
        if host:
            reads = " ".join(f"{x:.1f}" for x in host["read_gb_s"])
            quiet_rounds = " ".join(str(r + 1) for r in host["quiet_rounds"])
            lines += ["", f"Host read rate per round (GB/s, one core, torch.sum over 512 MB, the slowest "
                          f"around the round's servers): {reads}; quiet rounds (>= {QUIET_SHARE:.0%} of the "
                          f"best): {quiet_rounds}."]
        lines.append("")
    return "\n".join(lines)


def failure(log: Path, error: Exception) -> str:
    """Why a server never became ready: the first exception its log reports, else the launcher's error."""
    found = FIRST_ERROR.search(log.read_text(errors="replace")) if log.is_file() else None
    return found.group(1).strip() if found else str(error)


def step_profile(rows: dict[str, dict], step: dict, top: int = 8) -> dict:
    """ms per decode step (the prompt's one prefill step spread over them): the whole step and the `top`
    ops by their own time (children excluded), with their calls per step."""
    steps = step["calls"]
    ops = sorted(((name, row) for name, row in rows.items() if not name.startswith("execute_context")),
                 key=lambda item: -item[1]["self_ms"])[:top]
    return {"steps": steps, "step_ms": round(step["total_ms"] / steps, 3),
            "ops": {name: {"self_ms": round(row["self_ms"] / steps, 3),
                           "calls": round(row["calls"] / steps, 1)} for name, row in ops}}


def machine_line(result: dict) -> str:
    """The device, the thread counts and the load around the run, as both tables state them."""
    s = result["settings"]
    return (f"{s['device']}; llama.cpp with {s['threads']} thread(s), vLLM's CPU worker bound to one core; "
            f"load average (1 min) {result['load_before']:.2f} before, {result['load_after']:.2f} after")


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"Decode of one sequence and of 8 clients ({s['max_tokens']} tokens after a "
             f"{s['prompt_tokens']}-token prompt, EOS ignored, {s['rounds']} requests per client) and "
             f"prefill of {s['prefill_tokens']} tokens; {machine_line(result)}. One run.", ""]
    for model, servers in result["models"].items():
        reference = servers.get("llama.cpp-q4_0")
        reference = None if reference is None or "failed" in reference else reference
        lines += [f"### {model}", "", "| server | decode tok/s, one sequence | x llama.cpp Q4_0 | "
                  "output tok/s, 8 clients | prefill s | peak RSS MiB | huge pages MiB |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, got in servers.items():
            if "failed" in got:
                lines.append(f"| {name} | not served: {got['failed']} | | | | | |")
                continue
            ratio = got["decode_tok_s"] / reference["decode_tok_s"] if reference else float("nan")
            many = next((p for p in got["phases"]), None)
            crowd = "" if many is None else f"{many['output_tok_s']:.1f}" + ("" if many["complete"] else
                                                                              " (short answers)")
            pages = "" if got.get("huge_pages_mib") is None else got["huge_pages_mib"]
            lines.append(f"| {name} | {got['decode_tok_s']:.1f} | {ratio:.2f} | {crowd} | "
                         f"{got['prefill_s']:.3f} | {got['peak_rss_mib']} | {pages} |")
        lines.append("")
        for name, got in servers.items():
            if got.get("profile"):
                profile = got["profile"]
                ops = "; ".join(f"{op} {row['self_ms']:.2f} ({row['calls']:g} calls)"
                                for op, row in profile["ops"].items())
                lines.append(f"- {name}, profiled step {profile['step_ms']:.2f} ms, own time per step: {ops}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    stop_servers_on_sigterm()
    parser = argparse.ArgumentParser(prog="python -m bench.serve --format bitmap-q4",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-1b-shape"])
    parser.add_argument("--servers", nargs="+", default=list(SERVERS))
    parser.add_argument("--work", type=Path, default=work_dir("serve_q4"))
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prefill-tokens", type=int, default=400)
    parser.add_argument("--threads", type=int, default=1,
                        help="llama.cpp threads (vLLM's worker has one core)")
    parser.add_argument("--group-size", type=int, default=64,
                        help="of every leapctl server without its own -gN")
    parser.add_argument("--profile", action="store_true",
                        help="then one 1-client request under vLLM's torch profiler: where a step goes")
    parser.add_argument("--probe-core", type=int, default=0,
                        help="with --interleave: the core the host read probe runs on (vLLM's worker's)")
    parser.add_argument("--interleave", type=int, default=0, metavar="N",
                        help="only the one-sequence decode: every server at once, N rounds of each in turn")
    parser.add_argument("--out", default=str(RESULTS / "serve" / "serve_q4"))
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    if not cpu_kernel.load():
        sys.exit(f"the native kernel is unavailable: {cpu_kernel.unavailable_reason()}")
    load_before = os.getloadavg()[0]
    results = {}
    for model in args.models:
        dense = dense_model(model, args.work)
        servers = commands(model, dense, args.work, args)
        # one stream of held-out text cut into distinct prompts: no server can serve a prefix from its cache
        count = max(max(args.clients) * args.rounds, 2 * args.rounds * max(1, args.interleave) + 1)
        ids = prompts(dense, 1, count * args.prompt_tokens + 3 * args.prefill_tokens)[0]
        tokenizer = AutoTokenizer.from_pretrained(dense)
        cut = [ids[i * args.prompt_tokens:(i + 1) * args.prompt_tokens] for i in range(count)]
        rest = ids[count * args.prompt_tokens:]
        cut_long = [rest[i * args.prefill_tokens:(i + 1) * args.prefill_tokens] for i in range(3)]
        texts = [(p, tokenizer.decode(p)) for p in cut]
        long_prompts = [(p, tokenizer.decode(p)) for p in cut_long]
        if args.interleave:
            results[model] = interleaved(servers, args, texts)
            continue
        results[model] = {}
        for name, (kind, command_for, env) in servers.items():
            try:
                results[model][name] = measure(model, name, kind, command_for, env, args, texts, long_prompts)
            except LeapctlError as exc:  # a server that cannot run here (vLLM's GPTQ on AVX2) spoils no other
                reason = failure(args.work / f"{name}.log", exc)
                print(f"  {name}: not served: {reason}", flush=True)
                results[model][name] = {"failed": reason}
    result = {"settings": settings(args), "load_before": load_before, "load_after": os.getloadavg()[0],
              "models": results}
    write_result(Path(args.out), result, (interleaved_markdown if args.interleave else markdown)(result))


if __name__ == "__main__":
    main()
