"""The demo's whole chain on a tiny model, as a user runs it: `leapctl prune` -> `leapctl learn` (from the
prune run's masks) -> `leapctl quantize` (its defaults: GPTQ with the mask fixed, then scale tuning) ->
`leapctl export --format bitmap-q4` -> `leapctl validate` -> `leapctl serve`, answering like transformers on
the quantized run folder; and the demo's `--no-quantize` chain (a bitmap export of the learn run, answering
like transformers on the learn run folder itself; test_serve.py compares the bitmap path with stock vLLM).
The model is a random Llama with head size 32 (vLLM's CPU attention refuses stories260K's 8) and the
stories260K tokenizer; every mask comes from prune/learn."""

import subprocess
import sys

import pytest
from test_serve_cli import (
    greedy_completion,
    save_tiny_llama,
    start_leapctl_serve,
    stop_leapctl_serve,
    transformers_greedy,
)
from test_serve_q4 import int8_rounded, int8_rows_rounded

from leapctl.runs import read_run

pytestmark = pytest.mark.slow
PROMPTS = ["Once upon a time", "The little dog was"]


def leapctl(*args) -> None:
    done = subprocess.run([sys.executable, "-m", "leapctl", *map(str, args)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"leapctl {args[0]} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def learn_run(stories260k_dir, tmp_path_factory):
    """prune -> learn, as the demo runs them (an intermediate size that 4-bit groups of 64 divide)."""
    root = tmp_path_factory.mktemp("demo-chain")
    model = save_tiny_llama(root / "model", stories260k_dir, intermediate_size=256)
    wanda, leap = root / "wanda", root / "leap"
    leapctl("prune", model, "--method", "wanda", "--sparsity", "0.5", "--calib", "generated",
            "--nsamples", "16", "--seq-len", "64", "--out", wanda, "--no-progress")
    leapctl("learn", model, "--sparsity", "0.5", "--calib", "generated", "--init-masks", wanda,
            "--steps", "6", "--batch-size", "4", "--seq-len", "64", "--out", leap, "--no-progress")
    learned = read_run(leap)
    assert learned.report["method"] == "leap"
    assert learned.masks.sparsity()["global"] == pytest.approx(0.5, abs=1e-3)
    return leap


def test_quantize_export_validate_serve(learn_run, tmp_path):
    from serving import cpu_kernel

    q4_run, export = tmp_path / "q4", tmp_path / "export"
    leapctl("quantize", learn_run, "--nsamples", "8", "--seq-len", "64", "--batch-size", "4",
            "--tune-steps", "10", "--out", q4_run, "--no-progress")
    assert read_run(q4_run).masks.sparsity() == read_run(learn_run).masks.sparsity()  # the mask is fixed
    leapctl("export", q4_run, "--format", "bitmap-q4", "--out", export)
    leapctl("validate", export)

    # The served 4-bit layers round x to int8 per group where the CPU runs the int8 kernel (the default),
    # multiply it as it is elsewhere; the 8-bit lm_head (quantize's default) rounds it per row everywhere.
    linear_input = int8_rounded if cpu_kernel.int8_kernel_available() else None
    sparse = start_leapctl_serve(export, tmp_path / "sparse.log")
    try:
        for prompt in PROMPTS:
            served = greedy_completion(sparse, "export", prompt, 16)
            expected = transformers_greedy(q4_run, served["prompt_token_ids"], 16, linear_input,
                                           head_input=int8_rows_rounded)
            assert served["token_ids"] == expected, prompt
    finally:
        stop_leapctl_serve(sparse)


def test_no_quantize_export_validate_serve(learn_run, tmp_path):
    export = tmp_path / "export"
    leapctl("export", learn_run, "--format", "bitmap", "--out", export)
    leapctl("validate", export)

    sparse = start_leapctl_serve(export, tmp_path / "sparse.log")
    try:
        for prompt in PROMPTS:
            served = greedy_completion(sparse, "export", prompt, 16)
            expected = transformers_greedy(learn_run, served["prompt_token_ids"], 16)  # the run as it is
            assert served["token_ids"] == expected, prompt
    finally:
        stop_leapctl_serve(sparse)
