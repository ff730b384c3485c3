"""Magnitude, Wanda and SparseGPT against plain reference implementations written out here, and the
exact achieved sparsity of each method's rounding rule."""

import math

import pytest
import torch
from conftest import make_tiny_model

from leapctl.prune import prune_model
from leapctl.prune.magnitude import magnitude_keep_mask
from leapctl.prune.sparsegpt import SparseGPTPruner, sparsegpt_prune_weight
from leapctl.prune.wanda import WandaPruner


def _layer_and_inputs(rows: int, cols: int, tokens: int, seed: int, dead: tuple[int, ...] = ()):
    """A linear layer and inputs whose channels differ in scale (so activations matter) and some are dead."""
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(cols, rows, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(rows, cols, generator=gen))
    scale = torch.exp(torch.randn(cols, generator=gen))
    x = torch.randn(tokens, cols, generator=gen) * scale
    mixed = torch.randn(cols, cols, generator=gen) * 0.3  # correlated channels, so OBS updates matter
    x = x + x @ mixed
    x[:, list(dead)] = 0
    return linear, x


def naive_wanda_mask(weight: torch.Tensor, x: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Wanda as the paper states it, with loops: per row, drop the int(cols*s) lowest |W_ij|*||X_j||_2."""
    rows, cols = weight.shape
    norms = [math.sqrt(sum(float(v) ** 2 for v in x[:, j])) for j in range(cols)]
    keep = torch.ones(rows, cols, dtype=torch.bool)
    for i in range(rows):
        scores = [(abs(float(weight[i, j])) * norms[j], j) for j in range(cols)]
        for _, j in sorted(scores)[:int(cols * sparsity)]:
            keep[i, j] = False
    return keep


def naive_sparsegpt(weight: torch.Tensor, x: torch.Tensor, sparsity: float, blocksize: int,
                    percdamp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain OBS, one column at a time, no Cholesky and no lazy batching (float64).

    Eliminating columns 0..j-1 leaves the inverse Hessian of the remaining columns, inv(H[j:, j:]).
    At the start of each block the mask takes the lowest w^2 / inv(H[c:, c:])[0, 0] over the whole block;
    then for each column j every pruned weight w_rj is removed with the OBS update
    W[r, j:] -= w_rj / Hinv[0, 0] * Hinv[0, :], Hinv = inv(H[j:, j:])."""
    W = weight.double().clone()
    H = 2.0 / x.shape[0] * x.double().T @ x.double()
    rows, cols = W.shape
    for j in range(cols):
        if H[j, j] == 0:
            H[j, j] = 1.0
            W[:, j] = 0.0
    H = H + percdamp * torch.diag(H).mean() * torch.eye(cols, dtype=torch.float64)
    keep = torch.ones(rows, cols, dtype=torch.bool)
    for j in range(cols):
        if j % blocksize == 0:
            end = min(j + blocksize, cols)
            scores = []
            for c in range(j, end):
                saliency_denominator = torch.linalg.inv(H[c:, c:])[0, 0]
                scores += [(float(W[r, c] ** 2 / saliency_denominator), c, r) for r in range(rows)]
            for _, c, r in sorted(scores)[:int(rows * (end - j) * sparsity)]:
                keep[r, c] = False
        h_inv = torch.linalg.inv(H[j:, j:])
        for r in range(rows):
            if not keep[r, j]:
                W[r, j:] -= W[r, j] / h_inv[0, 0] * h_inv[0, :]
    return W, keep


@pytest.mark.parametrize("sparsity", [0.5, 0.6])
def test_wanda_matches_the_paper_formula(sparsity):
    linear, x = _layer_and_inputs(rows=12, cols=40, tokens=300, seed=1)
    dense = linear.weight.detach().clone()
    pruner = WandaPruner(linear)
    for chunk in x.reshape(5, 60, 40):  # statistics accumulate over batches, as the hooks feed them
        pruner.add_batch(chunk)
    keep = pruner.prune(sparsity)
    assert torch.equal(keep, naive_wanda_mask(dense, x, sparsity))
    assert torch.equal(linear.weight.detach(), dense * keep)


@pytest.mark.parametrize("sparsity,blocksize", [(0.5, 32), (0.6, 32), (0.5, 128)])
def test_sparsegpt_matches_plain_obs_in_float64(sparsity, blocksize):
    linear, x = _layer_and_inputs(rows=10, cols=80, tokens=400, seed=2, dead=(7, 50))
    hessian = 2.0 / x.shape[0] * x.double().T @ x.double()
    weight, keep = sparsegpt_prune_weight(linear.weight, hessian, sparsity, blocksize=blocksize)
    ref_weight, ref_keep = naive_sparsegpt(linear.weight.detach(), x, sparsity, blocksize)
    assert torch.equal(keep, ref_keep)
    assert torch.allclose(weight, ref_weight, rtol=1e-9, atol=1e-9)
    assert torch.all(weight[~keep] == 0)


def test_sparsegpt_pruner_accumulates_the_hessian_in_float32():
    linear, x = _layer_and_inputs(rows=16, cols=96, tokens=512, seed=3, dead=(5,))
    dense = linear.weight.detach().clone()
    pruner = SparseGPTPruner(linear, blocksize=64)
    for chunk in x.reshape(4, 128, 96):
        pruner.add_batch(chunk)
    keep = pruner.prune(0.5)
    ref_weight, ref_keep = naive_sparsegpt(dense, x, 0.5, blocksize=64)
    assert torch.equal(keep, ref_keep)
    assert torch.allclose(linear.weight.detach().double(), ref_weight, rtol=1e-3, atol=1e-4)


def test_sparsegpt_reconstruction_beats_plain_masking():
    """The OBS updates exist to shrink the layer's output error for the chosen mask."""
    linear, x = _layer_and_inputs(rows=16, cols=96, tokens=512, seed=4)
    dense = linear.weight.detach().double()
    hessian = 2.0 / x.shape[0] * x.double().T @ x.double()
    weight, keep = sparsegpt_prune_weight(dense, hessian, 0.6, blocksize=32)
    xd = x.double()
    updated_error = (xd @ (dense - weight).T).norm()
    masked_error = (xd @ (dense - dense * keep).T).norm()
    assert updated_error < 0.8 * masked_error


def test_magnitude_drops_the_smallest_weights_of_the_whole_layer():
    weight = torch.randn(24, 40, generator=torch.Generator().manual_seed(5))
    keep = magnitude_keep_mask(weight, 0.6)
    assert int((~keep).sum()) == int(weight.numel() * 0.6)
    assert weight[~keep].abs().max() < weight[keep].abs().min()


def _expected_pruned(method: str, rows: int, cols: int, sparsity: float) -> int:
    """Each method's rounding rule: floor per layer, per row, or per 128-column block."""
    if method == "magnitude":
        return math.floor(rows * cols * sparsity)
    if method == "wanda":
        return rows * math.floor(cols * sparsity)
    widths = [min(128, cols - start) for start in range(0, cols, 128)]
    return sum(math.floor(rows * width * sparsity) for width in widths)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_exact_achieved_sparsity(arch, method):
    model = make_tiny_model(arch)
    calib = torch.randint(0, 512, (4, 48), generator=torch.Generator().manual_seed(0))
    sparsity = 0.6
    masks = prune_model(model, method, sparsity, calib, batch_size=2, progress=False)
    params = dict(model.named_parameters())
    linears = [name for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and ".layers." in name]
    assert sorted(masks.masks) == sorted(f"{name}.weight" for name in linears)
    total = pruned_expected = 0
    for name, keep in masks.masks.items():
        rows, cols = keep.shape
        expected = _expected_pruned(method, rows, cols, sparsity)
        assert int((~keep).sum()) == expected, name
        assert torch.all(params[name][~keep] == 0), name
        total += keep.numel()
        pruned_expected += expected
    assert masks.sparsity()["global"] == pytest.approx(pruned_expected / total, abs=1e-12)
    with torch.no_grad():
        assert torch.isfinite(model(calib).logits).all()
