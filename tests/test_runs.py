"""Run folders (leapctl.runs): the layout stock loaders accept, old and new folders read alike, and
`leapctl apply-mask` as a library call and through the CLI."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from leapctl.commands.apply_mask import ApplyMaskConfig
from leapctl.commands.apply_mask import run as apply_mask
from leapctl.errors import LeapctlError
from leapctl.masks import MaskSet, load_masks, save_masks
from leapctl.models import load_model, prunable_linears
from leapctl.runs import LEGACY_MASKS_FILE, MASKS_FILE, mask_source, masks_file, read_run


def random_mask(rows: int, cols: int, density: float, seed: int) -> torch.Tensor:
    return torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed)) < density


@pytest.fixture(scope="module")
def tiny_masks(tiny_checkpoint, tmp_path_factory):
    """A 50% random mask on every prunable weight of the tiny Llama."""
    model, _ = load_model(str(tiny_checkpoint("llama")))
    masks = {f"{name}.weight": random_mask(*layer.weight.shape, 0.5, seed=i)
             for i, (name, layer) in enumerate(prunable_linears(model).items())}
    path = tmp_path_factory.mktemp("masks") / "masks.safetensors"
    save_masks(path, MaskSet(masks, model="tiny-llama", extra={"method": "random"}))
    return path, masks


def test_apply_mask_run(tiny_checkpoint, tiny_masks, tmp_path):
    masks_path, masks = tiny_masks
    source = str(tiny_checkpoint("llama"))
    out = tmp_path / "pruned"
    report = apply_mask(ApplyMaskConfig(source, masks_path, out))
    dense, _ = load_model(source)
    pruned, tokenizer = load_model(str(out))
    dense_params, pruned_params = dict(dense.named_parameters()), dict(pruned.named_parameters())
    for name, value in dense_params.items():
        expected = torch.where(masks[name], value, torch.zeros(())) if name in masks else value
        assert torch.equal(pruned_params[name], expected), name
    assert tokenizer.eos_token_id == 2
    assert all(torch.equal(load_masks(out / MASKS_FILE).masks[n], m) for n, m in masks.items())
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk == report and report["command"] == "apply-mask" and report["masks_model"] == "tiny-llama"
    zeros = sum(int((~m).sum()) for m in masks.values())
    total = sum(m.numel() for m in masks.values())
    assert report["achieved_sparsity"]["global"] == pytest.approx(zeros / total)
    with pytest.raises(LeapctlError, match="not empty"):
        apply_mask(ApplyMaskConfig(source, masks_path, out))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_apply_mask_run_keeps_the_checkpoint_dtype(tiny_checkpoint, tiny_masks, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tiny_checkpoint("llama")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path / "bf16")
    apply_mask(ApplyMaskConfig(str(tmp_path / "bf16"), tiny_masks[0], tmp_path / "out"))
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    name = next(iter(tiny_masks[1]))
    assert not weights[name][~tiny_masks[1][name]].any()  # pruned positions are zero


def test_mask_for_another_model_leaves_nothing_behind(tiny_checkpoint, tmp_path):
    masks_path = tmp_path / "other.safetensors"
    save_masks(masks_path, MaskSet({"model.layers.9.mlp.up_proj.weight": random_mask(128, 64, 0.5, 0)}))
    with pytest.raises(LeapctlError, match="which the model does not have"):
        apply_mask(ApplyMaskConfig(str(tiny_checkpoint("llama")), masks_path, tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.safetensors"]


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leapctl", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_cli_apply_mask(tiny_checkpoint, tiny_masks, tmp_path):
    out = tmp_path / "cli-out"
    done = run_cli("apply-mask", str(tiny_checkpoint("llama")), str(tiny_masks[0]), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "global sparsity" in done.stdout
    assert (out / "model.safetensors").is_file() and (out / MASKS_FILE).is_file()


def test_cli_bad_inputs_are_one_line(tiny_checkpoint, tiny_masks, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("not ours to replace")
    exists = run_cli("apply-mask", str(tiny_checkpoint("llama")), str(tiny_masks[0]),
                     "--out", str(tmp_path / "taken"))
    offline = run_cli("apply-mask", "leapctl-tests/no-such-model", str(tiny_masks[0]),
                      "--out", str(tmp_path / "b"), env={"HF_HUB_OFFLINE": "1"})
    expected = ((exists, "use --overwrite"), (offline, "could not fetch 'leapctl-tests/no-such-model'"))
    for done, words in expected:
        assert done.returncode == 2
        assert done.stderr.startswith("error: ") and done.stderr.strip().count("\n") == 0, done.stderr
        assert words in done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]


def test_run_folder_top_level_holds_only_the_checkpoint_s_weights(tiny_checkpoint, tiny_masks, tmp_path):
    """vLLM loads every *.safetensors at a folder's top when it has no index: no masks may sit there."""
    out = tmp_path / "run"
    apply_mask(ApplyMaskConfig(str(tiny_checkpoint("llama")), tiny_masks[0], out))
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert masks_file(out) == out / MASKS_FILE
    assert mask_source(out) == out / MASKS_FILE  # a run folder stands for its mask file


def test_folders_of_the_older_layout_are_still_read(tiny_checkpoint, tiny_masks, tmp_path):
    masks_path, masks = tiny_masks
    out = tmp_path / "run"
    apply_mask(ApplyMaskConfig(str(tiny_checkpoint("llama")), masks_path, out))
    old = tmp_path / "old-run"
    shutil.copytree(out, old)
    (old / MASKS_FILE).rename(old / LEGACY_MASKS_FILE)
    (old / MASKS_FILE).parent.rmdir()
    run = read_run(old)
    assert run.masks_file == (old / LEGACY_MASKS_FILE).resolve() and run.report["command"] == "apply-mask"
    assert all(torch.equal(run.masks.masks[n], m) for n, m in masks.items())
    again = tmp_path / "again"
    apply_mask(ApplyMaskConfig(str(tiny_checkpoint("llama")), old, again))  # the old folder as MASKS
    assert all(torch.equal(load_masks(again / MASKS_FILE).masks[n], m) for n, m in masks.items())
    with pytest.raises(LeapctlError, match="not a run folder"):
        read_run(tiny_checkpoint("llama"))
