"""Mask files: bit order against numpy's packbits, exact round trip and density, corrupt files;
`leapctl apply-mask` as a library call and through the CLI."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from leapctl.errors import LeapctlError
from leapctl.masks import MASK_FORMAT, MaskSet, apply_masks, load_masks, save_masks, write_masked_checkpoint
from leapctl.models import load_model, prunable_linears
from sparse_formats import pack_rows, unpack_rows


def random_mask(rows: int, cols: int, density: float, seed: int) -> torch.Tensor:
    return torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed)) < density


def numpy_packed(mask: torch.Tensor) -> np.ndarray:
    """Independent reference: numpy packs each row with bit j of byte b = column 8b+j."""
    return np.stack([np.packbits(row, bitorder="little") for row in mask.numpy().astype(np.uint8)])


@pytest.mark.parametrize("cols", [1, 8, 13, 64, 100])
def test_pack_rows_matches_numpy_little_endian(cols):
    mask = random_mask(7, cols, 0.5, seed=cols)
    packed = pack_rows(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (7, (cols + 7) // 8)
    np.testing.assert_array_equal(packed.numpy(), numpy_packed(mask))
    assert torch.equal(unpack_rows(packed, cols), mask)


@pytest.mark.parametrize("rows, cols", [(0, 13), (0, 0), (3, 0)])
def test_empty_masks_pack_and_unpack(rows, cols):
    """Shape is kept exactly when there is nothing to pack (numpy gives the same empty array)."""
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    packed = pack_rows(mask)
    assert packed.shape == (rows, (cols + 7) // 8)
    assert torch.equal(unpack_rows(packed, cols), mask)


def test_single_bits_land_where_the_layout_says():
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[0, 0] = mask[0, 9] = mask[1, 15] = True
    assert pack_rows(mask).tolist() == [[1, 2], [0, 128]]


def test_mask_file_round_trip(tmp_path):
    masks = {"model.layers.0.mlp.up_proj.weight": random_mask(24, 40, 0.5, 1),
             "model.layers.0.self_attn.q_proj.weight": random_mask(16, 19, 0.3, 2)}
    save_masks(tmp_path / "m.safetensors", MaskSet(masks, model="tiny", extra={"method": "wanda"}))
    loaded = load_masks(tmp_path / "m.safetensors")
    assert loaded.model == "tiny" and loaded.extra == {"method": "wanda"}
    assert loaded.masks.keys() == masks.keys()
    for name, mask in masks.items():
        assert loaded.masks[name].dtype == torch.bool and torch.equal(loaded.masks[name], mask)
    raw = load_file(str(tmp_path / "m.safetensors"))
    for name, mask in masks.items():
        np.testing.assert_array_equal(raw[name].numpy(), numpy_packed(mask))
    zeros = {name: int((~m).sum()) for name, m in masks.items()}
    sparsity = loaded.sparsity()
    for name, mask in masks.items():
        assert sparsity[name] == pytest.approx(zeros[name] / mask.numel(), abs=1e-12)
    assert sparsity["global"] == pytest.approx(sum(zeros.values()) / sum(m.numel() for m in masks.values()))


def test_exact_density_of_a_constructed_mask(tmp_path):
    mask = torch.zeros(10, 20, dtype=torch.bool)
    mask.view(-1)[torch.randperm(200, generator=torch.Generator().manual_seed(0))[:80]] = True
    save_masks(tmp_path / "m.safetensors", MaskSet({"w": mask}))
    assert load_masks(tmp_path / "m.safetensors").sparsity() == {"w": 0.6, "global": 0.6}


def _mask_error(path) -> str:
    with pytest.raises(LeapctlError) as info:
        load_masks(path)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_corrupt_mask_files(tmp_path):
    assert "does not exist" in _mask_error(tmp_path / "missing.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes(b"this is not safetensors")
    assert "not a readable safetensors file" in _mask_error(tmp_path / "garbage.safetensors")
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "weights.safetensors"))
    assert "not a leapctl mask file" in _mask_error(tmp_path / "weights.safetensors")
    save_file({"w": torch.zeros(2, 3, dtype=torch.uint8)}, str(tmp_path / "shape.safetensors"),
              metadata={"format": MASK_FORMAT, "shapes": json.dumps({"w": [2, 16]})})
    assert "expected (2, 2)" in _mask_error(tmp_path / "shape.safetensors")


def test_apply_masks_zeroes_exactly_the_pruned_weights():
    layer = torch.nn.Linear(12, 5)
    dense = layer.weight.detach().clone()
    mask = random_mask(5, 12, 0.5, 0)
    apply_masks(layer, MaskSet({"weight": mask}))
    assert torch.equal(layer.weight, torch.where(mask, dense, torch.zeros(())))
    with pytest.raises(LeapctlError, match="does not have"):
        apply_masks(layer, MaskSet({"other.weight": mask}))
    with pytest.raises(LeapctlError, match="has shape"):
        apply_masks(layer, MaskSet({"weight": mask.T.contiguous()}))


@pytest.fixture(scope="module")
def tiny_masks(tiny_checkpoint, tmp_path_factory):
    """A 50% random mask on every prunable weight of the tiny Llama."""
    model, _ = load_model(str(tiny_checkpoint("llama")))
    masks = {f"{name}.weight": random_mask(*layer.weight.shape, 0.5, seed=i)
             for i, (name, layer) in enumerate(prunable_linears(model).items())}
    path = tmp_path_factory.mktemp("masks") / "masks.safetensors"
    save_masks(path, MaskSet(masks, model="tiny-llama", extra={"method": "random"}))
    return path, masks


def test_write_masked_checkpoint(tiny_checkpoint, tiny_masks, tmp_path):
    masks_path, masks = tiny_masks
    source = str(tiny_checkpoint("llama"))
    out = tmp_path / "pruned"
    report = write_masked_checkpoint(source, masks_path, out)
    dense, _ = load_model(source)
    pruned, tokenizer = load_model(str(out))
    dense_params, pruned_params = dict(dense.named_parameters()), dict(pruned.named_parameters())
    for name, value in dense_params.items():
        expected = torch.where(masks[name], value, torch.zeros(())) if name in masks else value
        assert torch.equal(pruned_params[name], expected), name
    assert tokenizer.eos_token_id == 2
    assert all(torch.equal(load_masks(out / "masks.safetensors").masks[n], m) for n, m in masks.items())
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk == report and report["command"] == "apply-mask" and report["masks_model"] == "tiny-llama"
    zeros = sum(int((~m).sum()) for m in masks.values())
    total = sum(m.numel() for m in masks.values())
    assert report["achieved_sparsity"]["global"] == pytest.approx(zeros / total)
    with pytest.raises(LeapctlError, match="not empty"):
        write_masked_checkpoint(source, masks_path, out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_write_masked_checkpoint_keeps_the_checkpoint_dtype(tiny_checkpoint, tiny_masks, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = tiny_checkpoint("llama")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path / "bf16")
    write_masked_checkpoint(str(tmp_path / "bf16"), tiny_masks[0], tmp_path / "out")
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    name = next(iter(tiny_masks[1]))
    assert not weights[name][~tiny_masks[1][name]].any()  # pruned positions are zero


def test_mask_for_another_model_leaves_nothing_behind(tiny_checkpoint, tmp_path):
    masks_path = tmp_path / "other.safetensors"
    save_masks(masks_path, MaskSet({"model.layers.9.mlp.up_proj.weight": random_mask(128, 64, 0.5, 0)}))
    with pytest.raises(LeapctlError, match="which the model does not have"):
        write_masked_checkpoint(str(tiny_checkpoint("llama")), masks_path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.safetensors"]


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leapctl", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_cli_apply_mask(tiny_checkpoint, tiny_masks, tmp_path):
    out = tmp_path / "cli-out"
    done = run_cli("apply-mask", str(tiny_checkpoint("llama")), str(tiny_masks[0]), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "global sparsity" in done.stdout
    assert (out / "model.safetensors").is_file() and (out / "masks.safetensors").is_file()


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
