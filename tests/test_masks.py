"""Mask files: bit order against numpy's packbits, exact round trip and density, corrupt files; zeroing
pruned weights (always +0.0)."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from leapctl.errors import LeapctlError
from leapctl.masks import MASK_FORMAT, MaskSet, apply_masks, load_masks, masked_weight, save_masks
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


def test_pruned_weights_become_positive_zero_whatever_their_sign():
    """-0.0 and +0.0 compare equal but are different bits; every writer must give the same file."""
    weight = torch.tensor([[-1.5, 2.0, -0.25, 3.0]])
    keep = torch.tensor([[False, True, False, True]])
    zeroed = masked_weight(weight, keep)
    positive = torch.tensor([[0.0, 2.0, 0.0, 3.0]])
    assert torch.equal(zeroed.view(torch.int32), positive.view(torch.int32))
    layer = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    apply_masks(layer, MaskSet({"weight": keep}))
    assert torch.equal(layer.weight.detach().view(torch.int32), zeroed.view(torch.int32))
