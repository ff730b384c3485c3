"""What LEAP adds beyond the paper: distillation from the dense model and the least-squares refit of the
kept weights after the hard mask, each against an independent reference."""

import copy

import pytest
import torch

from leapctl.distill import language_model_and_distillation
from leapctl.learn.mask import MaskState, attach_masks
from leapctl.learn.reconstruct import reconstruct_weights, refit_rows

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- distillation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_losses_and_gradient_match_the_naive_ones(dtype):
    """Against cross-entropy and KL(teacher || student) written out in float64 on the predicted positions
    (all but each sequence's last, labelled by the next id), with the task loss (1 - d) * LM + d * KL."""
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(2, 5, 11, generator=generator).to(dtype).requires_grad_()
    teacher = torch.randn(2, 5, 11, generator=generator).to(dtype)
    ids = torch.randint(0, 11, (2, 5), generator=generator)
    reference = student.detach().double().requires_grad_()
    log_q = torch.log_softmax(reference[:, :-1], -1)
    p = torch.softmax(teacher[:, :-1].double(), -1)
    naive_lm = -log_q.gather(-1, ids[:, 1:, None]).mean()
    naive_kl = (p * (p.log() - log_q)).sum(-1).mean()
    lm, kl = language_model_and_distillation(student, teacher, ids)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lm.double(), naive_lm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl.double(), naive_kl, rtol=1e-5, atol=1e-6)
    d = 0.7
    ((1 - d) * lm + d * kl).backward()
    ((1 - d) * naive_lm + d * naive_kl).backward()
    assert student.grad.dtype == dtype and student.grad[:, -1].abs().max() == 0
    torch.testing.assert_close(student.grad.double(), reference.grad, **tolerance)
    _, same_kl = language_model_and_distillation(teacher, teacher, ids)
    assert float(same_kl) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_the_kl_from_hidden_states_in_chunks_matches_the_kl_of_whole_logits(softcap, monkeypatch):
    """`head_distillation` against KL(teacher || student) of the heads' whole logits written out in float64
    (Gemma's soft cap cap * tanh(logits / cap) applied to both): the value and the gradients w.r.t. the
    student's hidden states and its head's weight and bias (quantize's tuning trains the head's scales), with
    3 positions a chunk: 10 predicted positions make 3 full chunks and a partial one."""
    from leapctl import distill

    generator = torch.Generator().manual_seed(0)
    vocabulary, width = 11, 8
    monkeypatch.setattr(distill, "CPU_CHUNK_BYTES", 3 * 4 * vocabulary)
    head, teacher_head = torch.nn.Linear(width, vocabulary), torch.nn.Linear(width, vocabulary, bias=False)
    teacher_head.requires_grad_(False)
    hidden = torch.randn(2, 6, width, generator=generator).requires_grad_()
    teacher_hidden = torch.randn(2, 6, width, generator=generator)
    reference = [t.detach().double().requires_grad_() for t in (hidden, head.weight, head.bias)]

    def logits(h, weight, bias=None):
        z = torch.nn.functional.linear(h, weight.double(), bias)[:, :-1]
        return softcap * torch.tanh(z / softcap) if softcap else z

    log_p = torch.log_softmax(logits(*reference), -1)
    log_q = torch.log_softmax(logits(teacher_hidden.double(), teacher_head.weight), -1)
    naive = (log_q.exp() * (log_q - log_p)).sum(-1).mean()
    kl = distill.head_distillation(hidden, teacher_hidden, head, teacher_head, softcap)
    torch.testing.assert_close(kl.double(), naive, rtol=1e-5, atol=1e-6)
    (3 * kl).backward()
    (3 * naive).backward()
    assert hidden.grad[:, -1].abs().max() == 0  # each sequence's last position predicts nothing
    for tensor, expected in zip((hidden, head.weight, head.bias), reference, strict=True):
        torch.testing.assert_close(tensor.grad.double(), expected.grad, rtol=1e-5, atol=1e-6)


def test_the_teacher_forward_is_the_dense_model(tiny_checkpoint):
    """With the masks off the masked model computes exactly what the model computed before masking."""
    from leapctl.models import load_model, prunable_linears

    model, _ = load_model(str(tiny_checkpoint("llama")))
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model(input_ids=ids).logits
    linears = prunable_linears(model)
    state = MaskState()
    logits = {f"{name}.weight": torch.full_like(linear.weight, -3.0) for name, linear in linears.items()}
    attach_masks(model, linears, logits, state)
    with torch.no_grad():
        masked = model(input_ids=ids).logits
        state.enabled = False
        teacher = model(input_ids=ids).logits
    assert torch.equal(teacher, dense) and not torch.allclose(masked, dense)


# ---------------------------------------------------------------- reconstruction


def _problem(seed: int, rows: int = 12, cols: int = 40, tokens: int = 500):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=generator, dtype=torch.float64) @ torch.randn(
        cols, cols, generator=generator, dtype=torch.float64)  # correlated inputs
    w = torch.randn(rows, cols, generator=generator, dtype=torch.float64)
    keep = torch.rand(rows, cols, generator=generator) < 0.45
    keep[0] = False  # a row with nothing kept
    keep[1] = True  # and one with everything kept
    return x, w, keep


def test_refit_rows_is_the_least_squares_solution_of_every_row():
    """Reference: per row, `lstsq` of the kept input columns against the dense row's outputs."""
    x, w, keep = _problem(0)
    got = refit_rows(w, keep, x.T @ x / x.shape[0], percdamp=0.0)
    assert torch.equal(got == 0, ~keep | (got == 0)) and (got[~keep] == 0).all()
    for r in range(w.shape[0]):
        kept = keep[r].nonzero().flatten()
        if kept.numel() == 0:
            continue
        best = torch.linalg.lstsq(x[:, kept], (x @ w[r]).unsqueeze(1)).solution.flatten()
        torch.testing.assert_close(got[r, kept], best, rtol=1e-7, atol=1e-9)


def test_refit_against_other_inputs_is_their_least_squares_solution():
    """`cross`: fit X_s v to the dense outputs X_d w, inputs that differ from the layer's own."""
    x, w, keep = _problem(1)
    x_dense = x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = refit_rows(w, keep, x.T @ x / x.shape[0], percdamp=0.0, cross=x.T @ x_dense / x.shape[0])
    for r in range(2, w.shape[0]):
        kept = keep[r].nonzero().flatten()
        best = torch.linalg.lstsq(x[:, kept], (x_dense @ w[r]).unsqueeze(1)).solution.flatten()
        torch.testing.assert_close(got[r, kept], best, rtol=1e-7, atol=1e-9)


def test_dampened_refit_never_does_worse_than_masking_alone():
    """With SparseGPT's dampening the refit is not the plain optimum, but its output error on the
    calibration inputs is still at most that of the masked dense weights (it minimises error plus
    damp * ||v - w||^2, and every masked candidate pays at least the masked weights' damp term)."""
    x, w, keep = _problem(3)
    h = x.T @ x / x.shape[0]
    refit = refit_rows(w, keep, h, percdamp=0.01)

    def error(v):
        return ((x @ (w - v).T) ** 2).sum(0)  # per row

    assert (error(refit) <= error(w * keep) * (1 + 1e-9) + 1e-12).all()


def test_reconstruction_keeps_the_mask_and_repairs_a_wanda_model(stories260k_dir, tinystories_text):
    """Reference: the Wanda-pruned model (same mask, weights only masked). On stories260K at 50% the refit
    model predicts its calibration text much better, and every pruned weight is still exactly 0."""
    from leapctl.data import sample_windows, tokenize_documents
    from leapctl.masks import apply_masks
    from leapctl.models import load_model
    from leapctl.prune.wanda import wanda_masks

    dense, tokenizer = load_model(str(stories260k_dir))
    ids = tokenize_documents([tinystories_text], tokenizer)
    calib = sample_windows(ids, 32, 64, 0)
    masks = wanda_masks(copy.deepcopy(dense), calib, 0.5, in_place=False, progress=False)
    masked = copy.deepcopy(dense)
    apply_masks(masked, masks)
    refit = copy.deepcopy(dense)
    reconstruct_weights(refit, masks, calib, batch_size=8, progress=False)
    params = dict(refit.named_parameters())
    for name, keep in masks.masks.items():
        assert (params[name][~keep] == 0).all()
        assert not torch.equal(params[name], dict(masked.named_parameters())[name])

    def loss(model) -> float:
        with torch.no_grad():
            return float(model(input_ids=calib, labels=calib).loss)

    assert loss(refit) < 0.9 * loss(masked)
