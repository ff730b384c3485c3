"""The demo's whole chain on a tiny model, as a user runs it: `leapctl prune` -> `leapctl learn` (from the
prune run's masks) -> `leapctl export` -> `leapctl validate` -> `leapctl serve`, answering like stock vLLM
on the learn run folder itself. The model is a random Llama with head size 32 (vLLM's CPU attention
refuses stories260K's 8) and the stories260K tokenizer; every mask comes from prune/learn."""

import subprocess
import sys

import pytest
from test_serve_cli import (
    greedy_completion,
    save_tiny_llama,
    start_leapctl_serve,
    start_stock_vllm,
    stop_leapctl_serve,
)

from leapctl.runs import read_run

pytestmark = pytest.mark.slow
PROMPTS = ["Once upon a time", "The little dog was"]


def leapctl(*args) -> None:
    done = subprocess.run([sys.executable, "-m", "leapctl", *map(str, args)], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"leapctl {args[0]} failed:\n{done.stdout}\n{done.stderr}"


def test_prune_learn_export_validate_serve(stories260k_dir, tmp_path):
    model = save_tiny_llama(tmp_path / "model", stories260k_dir)
    wanda, leap, export = tmp_path / "wanda", tmp_path / "leap", tmp_path / "export"
    leapctl("prune", model, "--method", "wanda", "--sparsity", "0.5", "--calib", "generated",
            "--nsamples", "16", "--seq-len", "64", "--out", wanda, "--no-progress")
    leapctl("learn", model, "--sparsity", "0.5", "--calib", "generated", "--init-masks", wanda,
            "--steps", "6", "--batch-size", "4", "--seq-len", "64", "--out", leap, "--no-progress")
    learned = read_run(leap)
    assert learned.report["method"] == "leap"
    assert learned.masks.sparsity()["global"] == pytest.approx(0.5, abs=1e-3)
    leapctl("export", leap, "--format", "bitmap", "--out", export)
    leapctl("validate", export)

    dense = start_stock_vllm(leap, tmp_path / "stock.log")  # the run folder as it is
    try:
        expected = {p: greedy_completion(dense, "dense", p, 16)["token_ids"] for p in PROMPTS}
    finally:
        dense.kill()
    sparse = start_leapctl_serve(export, tmp_path / "sparse.log")
    try:
        for prompt in PROMPTS:
            assert greedy_completion(sparse, "export", prompt, 16)["token_ids"] == expected[prompt], prompt
    finally:
        stop_leapctl_serve(sparse)
