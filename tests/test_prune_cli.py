"""`leapctl prune` end to end on a tiny model, and its bad-input errors: one line, exit 2, nothing written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leapctl.masks import load_masks
from leapctl.runs import MASKS_FILE

CALIB_TEXT = ("Once upon a time there was a little dog who liked to run in the park with his friends. " * 40)


def run_prune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leapctl", "prune", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(CALIB_TEXT)
    return path


@pytest.mark.slow
def test_prune_writes_checkpoint_masks_and_report(tiny_checkpoint, calib_file, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    result = run_prune(str(tiny_checkpoint("llama")), "--method", "sparsegpt", "--sparsity", "0.5",
                       "--calib", str(calib_file), "--nsamples", "4", "--seq-len", "32", "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "sparsegpt" and report["target_sparsity"] == 0.5
    assert report["calibration"] == {"source": str(calib_file), "nsamples": 4, "seq_len": 32, "seed": 0,
                                     "tokens": 128}
    assert report["achieved_sparsity"]["global"] == 0.5  # 64- and 128-wide layers: every group halves exactly
    assert len(report["achieved_sparsity"]["per_layer"]) == 14
    masks = load_masks(out / MASKS_FILE)
    model = AutoModelForCausalLM.from_pretrained(out)
    params = dict(model.named_parameters())
    for name, keep in masks.masks.items():
        assert torch.all(params[name][~keep] == 0), name
        assert int(keep.sum()) == keep.numel() // 2
    assert (out / "tokenizer_config.json").is_file()

    again = run_prune(str(tiny_checkpoint("llama")), "--method", "magnitude", "--sparsity", "0.6",
                      "--out", str(out), "--overwrite")
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "report.json").read_text())["method"] == "magnitude"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporary folder left beside it


def _bad_inputs(model: str, calib: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    empty = tmp / "empty.txt"
    empty.write_text("")
    short = tmp / "short.txt"
    short.write_text("A tiny story.")
    corrupt = tmp / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    full = tmp / "full"
    full.mkdir()
    (full / "keep.txt").write_text("existing results")
    base = ["--calib", str(calib), "--nsamples", "2", "--seq-len", "16"]
    return {
        "sparsity_one": ([model, "--method", "wanda", "--sparsity", "1.0", *base], "sparsity"),
        "sparsity_zero": ([model, "--method", "wanda", "--sparsity", "0", *base], "sparsity"),
        "method": ([model, "--method", "obs", "--sparsity", "0.5", *base], "method"),
        "missing_model": ([str(tmp / "nope"), "--method", "magnitude", "--sparsity", "0.5"], "model"),
        "corrupt_model": ([str(corrupt), "--method", "magnitude", "--sparsity", "0.5"], "config"),
        "empty_calib": ([model, "--method", "wanda", "--sparsity", "0.5", "--calib", str(empty)], "no text"),
        "short_calib": ([model, "--method", "sparsegpt", "--sparsity", "0.5", "--calib", str(short),
                         "--seq-len", "64"], "tokens"),
        "out_not_empty": ([model, "--method", "magnitude", "--sparsity", "0.5", "--out", str(full)],
                          "not empty"),
    }


SLOW = pytest.mark.slow  # these load a model (or its tokenizer) before failing


@pytest.mark.parametrize("case", ["sparsity_one", "sparsity_zero", "method", "out_not_empty", "missing_model",
                                  *(pytest.param(case, marks=SLOW)
                                    for case in ("corrupt_model", "empty_calib", "short_calib"))])
def test_bad_input_is_one_line_and_exit_2(case, tiny_checkpoint, calib_file, tmp_path):
    args, words = _bad_inputs(str(tiny_checkpoint("llama")), calib_file, tmp_path)[case]
    out = tmp_path / "out"
    if "--out" not in args:
        args = [*args, "--out", str(out)]
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_prune(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary folder
    if case == "out_not_empty":
        assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["keep.txt"]


def test_usage_errors_exit_2(tmp_path):
    result = run_prune("some-model", "--sparsity", "0.5", "--out", str(tmp_path / "o"))  # no --method
    assert result.returncode == 2
    assert not (tmp_path / "o").exists()
