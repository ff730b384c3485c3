"""LEAP mask learning: the masked linear against plain autograd, exact hard masks, schedules, the
regularisers, the window stream, a whole tiny run, and bad input."""

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leapctl.commands.learn import run as learn_masks
from leapctl.errors import LeapctlError
from leapctl.learn import LearnConfig
from leapctl.learn.loss import regularisers
from leapctl.learn.mask import (
    SATURATION,
    MaskedLinearFunction,
    MaskState,
    attach_masks,
    hard_masks,
    init_logits,
    logistic_noise,
    noise_seed,
    soft_mask,
)
from leapctl.learn.stream import WindowStream
from leapctl.masks import load_masks
from leapctl.runs import LOGITS_FILE, MASKS_FILE
from leapctl.schedule import cosine_with_warmup, linear, magnitude_decay, mask_temperature

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- the masked linear


def _reference(x, weight, bias, logits, alpha, tau, noise):
    """The paper's formula written plainly with autograd, no custom backward."""
    mask = torch.sigmoid((alpha * logits + noise) / tau)
    masked = weight * mask
    return x @ masked.t() + bias, mask.sum(), (masked**2).sum()


@pytest.mark.parametrize("noisy", [True, False])
def test_masked_linear_matches_plain_autograd(noisy):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float32)
    weight, bias = torch.randn(8, 16), torch.randn(8)
    logits = (torch.randn(8, 16) * 0.05).requires_grad_(True)
    alpha, tau, seed = 25.0, 4.0, 1234 if noisy else None
    upstream, c_sum, c_norm = torch.randn(3, 5, 8), 0.3, -0.7

    x1 = x.clone().requires_grad_(True)
    y, s, n = MaskedLinearFunction.apply(x1, weight, bias, logits, alpha, tau, seed, torch.float32, True)
    ((y * upstream).sum() + c_sum * s + c_norm * n).backward()
    grad_logits, logits.grad = logits.grad.clone(), None

    noise = logistic_noise(logits.shape, seed, logits.device) if noisy else torch.zeros(8, 16)
    x2 = x.clone().requires_grad_(True)
    y_ref, s_ref, n_ref = _reference(x2, weight, bias, logits, alpha, tau, noise)
    ((y_ref * upstream).sum() + c_sum * s_ref + c_norm * n_ref).backward()

    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref)
    torch.testing.assert_close(n, n_ref)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_logits, logits.grad, rtol=1e-4, atol=1e-6)


def test_masked_linear_without_norm_tracking_gives_the_lm_gradient_alone():
    """Without the magnitude term the norm output is a constant 0 and the logits get exactly the gradient of
    the plain masked linear (reference: autograd through the naive formula, no norm term)."""
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, 7, 16), torch.randn(8, 16), torch.randn(8)
    logits = (torch.randn(8, 16) * 0.05).requires_grad_(True)
    upstream = torch.randn(2, 7, 8)
    y, s, n = MaskedLinearFunction.apply(x, weight, bias, logits, 25.0, 4.0, 5, torch.float32, False)
    assert n.item() == 0.0 and not n.requires_grad
    ((y * upstream).sum() + 0.3 * s).backward()
    grad_logits, logits.grad = logits.grad.clone(), None

    noise = logistic_noise(logits.shape, 5, logits.device)
    y_ref, s_ref, _ = _reference(x, weight, bias, logits, 25.0, 4.0, noise)
    ((y_ref * upstream).sum() + 0.3 * s_ref).backward()
    torch.testing.assert_close(grad_logits, logits.grad, rtol=1e-4, atol=1e-6)


def test_masked_linear_trains_the_weight_with_the_task_gradient_of_plain_autograd():
    """Weights learned with the mask: W gets autograd's gradient of the task term through W * M, and none
    of the magnitude term (a mask regulariser that would only grow W); the logits' gradient is unchanged."""
    torch.manual_seed(0)
    x, bias = torch.randn(2, 7, 16), torch.randn(8)
    weight = torch.randn(8, 16).requires_grad_(True)
    logits = (torch.randn(8, 16) * 0.05).requires_grad_(True)
    upstream, c_sum, c_norm = torch.randn(2, 7, 8), 0.3, -0.7
    y, s, n = MaskedLinearFunction.apply(x, weight, bias, logits, 25.0, 4.0, 11, torch.float32, True)
    ((y * upstream).sum() + c_sum * s + c_norm * n).backward()
    grad_weight, grad_logits = weight.grad.clone(), logits.grad.clone()

    noise = logistic_noise(logits.shape, 11, logits.device)
    reference_weight = weight.detach().clone().requires_grad_(True)
    y_ref, _, _ = _reference(x, reference_weight, bias, logits.detach(), 25.0, 4.0, noise)
    (y_ref * upstream).sum().backward()
    torch.testing.assert_close(grad_weight, reference_weight.grad, rtol=1e-5, atol=1e-6)

    frozen_logits = logits.detach().clone().requires_grad_(True)  # the same call with W frozen
    y2, s2, n2 = MaskedLinearFunction.apply(x, weight.detach(), bias, frozen_logits, 25.0, 4.0, 11,
                                            torch.float32, True)
    ((y2 * upstream).sum() + c_sum * s2 + c_norm * n2).backward()
    torch.testing.assert_close(grad_logits, frozen_logits.grad, rtol=0, atol=0)


def test_trained_masked_linear_keeps_the_dense_weight_for_the_teacher():
    """With the weights learned, the teacher's forward (masks off) still computes the dense layer as it
    came, not the trained weight."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 8)
    dense = linear.weight.detach().clone()
    state = MaskState(train_weights=True, dense_teacher=True)
    layer = attach_masks(torch.nn.Sequential(linear), {"0": linear},
                         {"0.weight": torch.zeros(8, 16)}, state)["0"]
    assert layer.weight.requires_grad and not layer.dense_weight.requires_grad
    with torch.no_grad():
        layer.weight.add_(1.0)
    x = torch.randn(3, 16)
    state.enabled = False
    torch.testing.assert_close(layer(x), x @ dense.t() + linear.bias, rtol=0, atol=0)


def test_masked_linear_keeps_no_full_size_copy_for_backward():
    """Only x, W and P are saved for the backward: any weight-sized saved tensor must be W or P itself."""
    weight, logits = torch.randn(32, 48), torch.zeros(32, 48, requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _, _ = MaskedLinearFunction.apply(
            torch.randn(4, 48), weight, None, logits, 25.0, 4.0, 7, torch.float32, True
        )
    big = [t for t in saved if t.numel() >= weight.numel()]
    assert big and all(t.data_ptr() in (weight.data_ptr(), logits.data_ptr()) for t in big)


def test_logistic_noise_is_reproducible_and_logistic():
    a = logistic_noise(torch.Size([200_000]), 99, torch.device("cpu"))
    assert torch.equal(a, logistic_noise(torch.Size([200_000]), 99, torch.device("cpu")))
    assert not torch.equal(a, logistic_noise(torch.Size([200_000]), 100, torch.device("cpu")))
    # standard logistic: mean 0, variance pi^2 / 3; CDF at 1 is sigmoid(1)
    assert abs(a.mean().item()) < 0.02
    assert abs(a.var().item() - math.pi**2 / 3) < 0.05
    assert abs((a < 1).float().mean().item() - 1 / (1 + math.exp(-1))) < 0.005
    seeds = {noise_seed(0, s, m, layer) for s in range(3) for m in range(3) for layer in range(3)}
    assert len(seeds) == 27


def test_soft_mask_without_noise_is_the_plain_sigmoid():
    logits = torch.linspace(-1, 1, 11)
    torch.testing.assert_close(soft_mask(logits, 25.0, 4.0, None), torch.sigmoid(25.0 * logits / 4.0))


def test_saturated_soft_mask_stays_normal_for_fast_cpu_matmuls():
    """End of schedule (alpha 350, tau 0.05): the plain sigmoid gives subnormal M for pruned weights, which
    slows CPU matmuls ~100x. The capped mask keeps M and W * M normal and differs from the plain sigmoid by
    at most sigmoid(-SATURATION)."""
    logits = torch.linspace(-0.02, 0.02, 4001)
    plain = torch.sigmoid(350.0 * logits / 0.05)
    smallest_normal = torch.finfo(torch.float32).tiny
    assert ((plain > 0) & (plain < smallest_normal)).any()  # the hazard is real for the plain sigmoid
    capped = soft_mask(logits, 350.0, 0.05, seed=11)
    weight = torch.full_like(logits, 1e-6)  # a small frozen weight
    assert (capped >= smallest_normal).all()
    assert ((weight * capped) >= smallest_normal).all()
    largest_change = torch.sigmoid(torch.tensor(-SATURATION))
    assert (soft_mask(logits, 350.0, 0.05, None) - plain).abs().max() <= largest_change


def test_checkpointed_block_gives_the_same_gradients(tiny_checkpoint):
    """Gradient checkpointing recomputes the forward in the backward: the noise must come back identical."""
    from leapctl.models import load_model, prunable_linears

    grads = []
    for checkpointing in (False, True):
        model, _ = load_model(str(tiny_checkpoint("llama")))
        model.requires_grad_(False)
        linears = prunable_linears(model)
        generator = torch.Generator().manual_seed(0)
        logits = {
            f"{n}.weight": torch.randn(lin.weight.shape, generator=generator) * 0.05
            for n, lin in linears.items()
        }
        state = MaskState(run_seed=3)
        masked = attach_masks(model, linears, logits, state)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
        state.start_micro_batch(step=0, micro_batch=0)
        loss = (
            model(input_ids=ids, labels=ids, use_cache=False).loss + torch.stack(state.mask_sums).sum() * 1e-4
        )
        state.recording = False
        loss.backward()
        assert len(state.mask_sums) == len(linears)  # recomputation did not record twice
        grads.append(torch.cat([layer.mask_logits.grad.flatten() for layer in masked.values()]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-8)


def test_initial_logits_follow_the_wanda_mask():
    keep = {"w": torch.rand(64, 32, generator=torch.Generator().manual_seed(0)) < 0.5}
    paper = init_logits(keep, "wanda", 3.0, torch.Generator().manual_seed(0))["w"]
    assert torch.equal(paper, torch.where(keep["w"], 3.0, -3.0))
    small = init_logits(keep, "wanda-small", 3.0, torch.Generator().manual_seed(1))["w"]
    # authors' code: N(0, 0.014) around +-3 * 0.014, so the sign follows the mask but for a 3-sigma tail
    assert (small > 0).ne(keep["w"]).float().mean() < 0.01
    assert abs(small[keep["w"]].mean().item() - 0.042) < 0.003 and abs(small.std().item() - 0.044) < 0.004


# ---------------------------------------------------------------- hard masks


def _naive_global(logits: dict, density: float) -> dict:
    """Stable sort of every logit (ties: earlier layer, lower index first), keep the first k."""
    flat = torch.cat([p.flatten() for p in logits.values()])
    k = round(density * flat.numel())
    order = torch.sort(-flat, stable=True).indices[:k]
    keep = torch.zeros(flat.numel(), dtype=torch.bool)
    keep[order] = True
    out, start = {}, 0
    for name, p in logits.items():
        out[name] = keep[start : start + p.numel()].view_as(p)
        start += p.numel()
    return out


@pytest.mark.parametrize("density", [0.5, 0.4, 0.123])
def test_global_hard_mask_is_exact_top_k(density):
    generator = torch.Generator().manual_seed(0)
    logits = {
        "a": torch.randn(16, 24, generator=generator),
        "b": torch.randn(8, 40, generator=generator) * 3,
        # many exact ties, and both signs of zero
        "c": torch.tensor([[3.0, -3.0, 0.0, -0.0] * 10] * 6),
    }
    got = hard_masks(logits, density, "global")
    want = _naive_global(logits, density)
    total = sum(p.numel() for p in logits.values())
    assert sum(int(m.sum()) for m in got.values()) == round(density * total)
    for name in logits:
        assert torch.equal(got[name], want[name]), name


def test_per_layer_and_positive_hard_masks():
    generator = torch.Generator().manual_seed(1)
    logits = {"a": torch.randn(10, 30, generator=generator), "b": torch.randn(7, 11, generator=generator)}
    per_layer = hard_masks(logits, 0.6, "per-layer")
    for name, p in logits.items():
        assert int(per_layer[name].sum()) == round(0.6 * p.numel())
        kept_min = p[per_layer[name]].min()
        assert kept_min >= p[~per_layer[name]].max()
    positive = hard_masks(logits, 0.6, "positive")
    assert all(torch.equal(positive[n], logits[n] > 0) for n in logits)


# ---------------------------------------------------------------- schedules and regularisers


def test_schedules():
    assert linear(25, 350, 0, 100) == 25 and linear(25, 350, 99, 100) == 350
    assert mask_temperature(0, 10, (25, 350), (4, 0.05)) == (25, 4)
    alpha, tau = mask_temperature(9, 10, (25, 350), (4, 0.05))
    assert alpha == 350 and math.isclose(tau, 0.05)
    assert mask_temperature(9, 10, (25, 350), (4, 0.05), fixed_alpha=True, fixed_tau=True) == (25, 4)
    assert magnitude_decay(0, 10) == 1.0 and magnitude_decay(5, 10) == 0.5
    factor = cosine_with_warmup(5, 105)
    assert [factor(s) for s in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert math.isclose(factor(55), 0.5) and math.isclose(factor(105), 0.0, abs_tol=1e-12)


def test_regularisers_match_the_formula():
    generator = torch.Generator().manual_seed(0)
    masks = [torch.rand(4, 6, generator=generator), torch.rand(3, 5, generator=generator)]
    weights = [torch.randn(4, 6, generator=generator), torch.randn(3, 5, generator=generator)]
    terms = regularisers(
        [m.sum() for m in masks],
        [((m * w) ** 2).sum() for m, w in zip(masks, weights, strict=True)],
        total_weights=39,
        dense_norm_sum=sum(float(w.norm()) for w in weights),
        rho=0.5,
        lambda1=7.0,
        lambda2=10.0,
        magnitude_decay=0.25,
    )
    density = (masks[0].sum() + masks[1].sum()) / 39
    ratio = sum((m * w).norm() for m, w in zip(masks, weights, strict=True)) / sum(w.norm() for w in weights)
    torch.testing.assert_close(terms.density, density)
    torch.testing.assert_close(terms.density_penalty, 7.0 * (density - 0.5).abs())
    torch.testing.assert_close(terms.magnitude_penalty, -10.0 * 0.25 * ratio)


# ---------------------------------------------------------------- the window stream


def test_stream_gives_fresh_windows_then_wraps_and_resumes_from_its_position():
    ids = torch.arange(100)
    stream = WindowStream(ids, seq_len=10, batch_size=3, seed=0)
    seen = []
    for _ in range(3):
        seen += [int(row[0]) // 10 for row in stream.peek(0, 3)]
        stream.advance(3)
    assert len(set(seen)) == 9  # nine distinct windows of the ten before any repeat
    later = stream.peek(0, 6)  # crosses into the second epoch
    assert len({int(r[0]) for r in later[1:]}) == 5
    again = WindowStream(ids, seq_len=10, batch_size=3, seed=0, position=9)
    assert torch.equal(again.peek(0, 6), later)
    with pytest.raises(LeapctlError, match="too small"):
        WindowStream(torch.arange(25), seq_len=10, batch_size=3, seed=0)


# ---------------------------------------------------------------- whole runs


def _config(model_dir: Path, calib: Path, out: Path, **overrides) -> LearnConfig:
    settings = dict(
        model=str(model_dir),
        out=out,
        sparsity=0.5,
        calib=str(calib),
        nsamples=4,
        steps=4,
        batch_size=4,
        micro_batch_size=2,
        seq_len=32,
        lr=0.05,
        init="wanda-small",
        progress=False,
        checkpoint_every=2,
    )
    settings.update(overrides)
    return LearnConfig(**settings)


@pytest.fixture
def calib_file(tmp_path, tinystories_text) -> Path:
    path = tmp_path / "calib.txt"
    path.write_text(tinystories_text)
    return path


def test_learn_writes_a_prune_style_run_with_exact_density(stories260k_dir, calib_file, tmp_path):
    out = tmp_path / "run"
    result = learn_masks(_config(stories260k_dir, calib_file, out, sparsity=0.6, save_logits=True))
    assert result.out == out and result.interrupted_by == 0
    masks = load_masks(out / MASKS_FILE)
    total = sum(m.numel() for m in masks.masks.values())
    kept = sum(int(m.sum()) for m in masks.masks.values())
    assert kept == round(0.4 * total)
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "leap" and report["achieved_sparsity"]["global"] == pytest.approx(
        1 - kept / total
    )
    assert report["peak_memory"]["process_max_rss_bytes"] > 0 and len(report["density_per_block"]) == 5
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]
    for png in ("density_per_block.png", "loss.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # the checkpoint's weights are the dense weights times the mask
    from safetensors.torch import load_file

    saved = load_file(out / "model.safetensors")
    dense = load_file(stories260k_dir / "model.safetensors")
    for name, keep in masks.masks.items():
        torch.testing.assert_close(saved[name], dense[name] * keep)
    # the hard mask is the global top-k of the saved logits
    logits = load_file(out / LOGITS_FILE)
    assert all(torch.equal(hard_masks(logits, 0.4)[n], masks.masks[n]) for n in masks.masks)
    assert not result.state_dir.exists()


def test_learn_with_weight_lr_trains_the_kept_weights_and_prunes_exactly(stories260k_dir, calib_file,
                                                                          tmp_path):  # fmt: skip
    """--weight-lr: the mask and the weights learned in one loop. The density is exact, every pruned weight
    is +0.0, the kept ones moved away from the dense model's, nothing outside the masked linears changed,
    and the first step's KL is the frozen run's (same windows and noise, teacher = the dense model)."""
    from safetensors.torch import load_file

    frozen, joint = tmp_path / "frozen", tmp_path / "joint"
    learn_masks(_config(stories260k_dir, calib_file, frozen))
    learn_masks(_config(stories260k_dir, calib_file, joint, weight_lr=0.01))
    masks = load_masks(joint / MASKS_FILE).masks
    total = sum(m.numel() for m in masks.values())
    assert sum(int(m.sum()) for m in masks.values()) == round(0.5 * total)
    saved, dense = load_file(joint / "model.safetensors"), load_file(stories260k_dir / "model.safetensors")
    for name, keep in masks.items():
        pruned = saved[name][~keep]
        assert torch.equal(pruned, torch.zeros_like(pruned)) and not torch.signbit(pruned).any(), name
        assert not torch.equal(saved[name][keep], dense[name][keep]), name
    assert all(torch.equal(saved[name], dense[name]) for name in saved if name not in masks)
    first = [json.loads((run / "metrics.jsonl").read_text().splitlines()[0]) for run in (frozen, joint)]
    assert first[0]["kl"] == first[1]["kl"] and first[0]["lm_loss"] == first[1]["lm_loss"]
    assert json.loads((joint / "report.json").read_text())["settings"]["weight_lr"] == 0.01


def test_learn_with_bits_learns_against_weights_on_the_4_bit_grid(stories260k_dir, calib_file, tmp_path):
    """--bits 4: the frozen weights rounded to the grid (groups of 64; down_proj's 172 columns fit none and
    are left out) before the masks are learned, so that the run's kept weights sit exactly on the grid its
    scales define."""
    from safetensors.torch import load_file

    from leapctl.runs import read_run
    from sparse_formats import get_format

    out = tmp_path / "run"
    learn_masks(_config(stories260k_dir, calib_file, out, bits=4, exclude="down_proj", reconstruct=False))
    run = read_run(str(out))
    assert run.quantization["bits"] == 4 and run.quantization["group_size"] == 64
    saved = load_file(out / "model.safetensors")
    q4 = get_format("bitmap-q4")
    for name, keep in run.masks.masks.items():
        assert run.scales[name].shape[1] == keep.shape[1] // 64
        assert torch.equal(q4.decode(q4.encode(saved[name], keep, scales=run.scales[name])), saved[name])


def test_defaults_learn_from_step_one_and_the_paper_start_does_not(stories260k_dir, tinystories_text):
    """Issue 12: at the paper's +-3 start the sigmoid is saturated (dM/dP ~ 4.5e-8) and a short run ends on
    its Wanda start exactly. At the defaults (+-0.5, lr 0.4 / sqrt(steps)) the same 30 steps move the
    logits, change the mask, lower the training loss, and the pruned model predicts its training text
    better than with Wanda's mask (noiseless, hard mask, every window of the text)."""
    from leapctl.data import sample_windows, tokenize_documents
    from leapctl.learn import leap_masks
    from leapctl.masks import apply_masks
    from leapctl.models import load_model
    from leapctl.prune.wanda import wanda_masks

    dense, tokenizer = load_model(str(stories260k_dir))
    ids = tokenize_documents([tinystories_text], tokenizer)
    wanda = wanda_masks(copy.deepcopy(dense), sample_windows(ids, 4, 32, 0), 0.5, in_place=False,
                        progress=False)
    windows = ids[: ids.numel() // 32 * 32].view(-1, 32)

    def loss(masks) -> float:
        model = copy.deepcopy(dense)
        apply_masks(model, masks)
        with torch.no_grad():
            return float(model(input_ids=windows, labels=windows).loss)

    def learn(preset: str):
        config = LearnConfig(model="stories260k", sparsity=0.5, steps=30, batch_size=4, seq_len=32,
                             preset=preset, progress=False, save_logits=True)
        return leap_masks(copy.deepcopy(dense), tokenizer, ids, config, init=wanda)

    paper = learn("paper")
    assert all(torch.equal(paper.masks[n], wanda.masks[n]) for n in wanda.masks)
    auto = learn("auto")
    assert auto.extra["lr"] == pytest.approx(0.4 / math.sqrt(30)) and auto.extra["init_scale"] == 0.5
    start = torch.cat([torch.where(wanda.masks[n], 0.5, -0.5).flatten() for n in wanda.masks])
    end = torch.cat([auto.stats["logits"][n].flatten() for n in wanda.masks])
    assert (end - start).abs().mean() > 0.05
    changed = sum(int((auto.masks[n] != wanda.masks[n]).sum()) for n in wanda.masks)
    assert changed > 0.002 * end.numel()
    lm = [m["lm_loss"] for m in auto.stats["metrics"]]
    assert sum(lm[-5:]) < sum(lm[:5])
    assert loss(auto) < 0.9 * loss(wanda)


def test_init_masks_file_gives_the_run_that_computing_wanda_gives(stories260k_dir, calib_file, tmp_path):
    """Starting from a saved Wanda mask is the same run as computing that mask inside learn."""
    from leapctl.data import calibration_batch
    from leapctl.masks import MaskSet, save_masks
    from leapctl.models import load_model
    from leapctl.prune.wanda import wanda_masks

    computed = _config(stories260k_dir, calib_file, tmp_path / "computed", steps=2)
    learn_masks(computed)
    model, tokenizer = load_model(str(stories260k_dir))
    calib = calibration_batch(str(calib_file), tokenizer, computed.nsamples, computed.seq_len, computed.seed)
    wanda = wanda_masks(model, calib, 0.5, in_place=False, progress=False)
    save_masks(tmp_path / "wanda.safetensors", wanda)
    learn_masks(_config(stories260k_dir, calib_file, tmp_path / "from-file", steps=2,
                        init_masks=tmp_path / "wanda.safetensors"))
    a = load_masks(tmp_path / "computed" / MASKS_FILE).masks
    b = load_masks(tmp_path / "from-file" / MASKS_FILE).masks
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

    other_target = MaskSet({n: torch.ones_like(m) for n, m in wanda.masks.items()})
    save_masks(tmp_path / "dense.safetensors", other_target)
    with pytest.raises(LeapctlError, match="has sparsity 0.0000, the target is 0.5"):
        learn_masks(_config(stories260k_dir, calib_file, tmp_path / "o",
                            init_masks=tmp_path / "dense.safetensors"))
    assert not (tmp_path / "o").exists()


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "leapctl", "learn", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--sparsity", "1.5"], "error: --sparsity must be in (0, 1), got 1.5"),
        (["--preset", "fast"], "error: --preset must be one of auto, paper, got 'fast'"),
        (["--distill", "2"], "error: --distill must be in [0, 1], got 2.0"),
        (["--max-grad-norm", "-1"], "error: --max-grad-norm must be >= 0 (0: no clipping), got -1.0"),
        (["--calib", "no-such-source"], "error: calibration source 'no-such-source' is neither a built-in"),
        (["--seq-len", "4096", "--batch-size", "8"], "has 2784 tokens, fewer than the 32768 needed"),
    ],
)
def test_learn_cli_bad_input_is_one_line_exit_2_and_writes_nothing(stories260k_dir, calib_file, tmp_path,
                                                                     args, expected):
    out = tmp_path / "run"
    options = {"--calib": str(calib_file), "--steps": "2", "--seq-len": "32", "--batch-size": "2"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        options[flag] = value
    proc = _cli(str(stories260k_dir), "--out", str(out), "--no-progress",
                *[item for pair in options.items() for item in pair], cwd=tmp_path)
    assert expected in _one_error_line(proc)
    assert not out.exists() and not Path(f"{out}.learn-state").exists()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"sparsity": 1.0}, "--sparsity must be in (0, 1)"),
        ({"sparsity": -0.1}, "--sparsity must be in (0, 1)"),
        ({"steps": 0}, "--steps must be at least 1"),
        ({"batch_size": 6, "micro_batch_size": 4}, "--micro-batch-size 4 must divide"),
        ({"init": "zeros"}, "--init must be one of"),
        ({"weight_lr": -1e-3}, "--weight-lr must be a finite number >= 0"),
        ({"weight_lr": 1e-3, "dtype": "bfloat16"}, "they need --dtype float32"),
        ({"weight_lr": 1e-3, "bits": 4}, "--weight-lr would move the weights off the --bits grid"),
        ({"weight_lr": 1e-3, "reconstruct": True}, "--reconstruct would refit them"),
    ],
)
def test_bad_settings_are_refused_before_any_work(tmp_path, overrides, expected):
    config = _config(tmp_path / "no-model", tmp_path / "no-calib", tmp_path / "o", **overrides)
    with pytest.raises(LeapctlError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        learn_masks(config)
    assert not (tmp_path / "o").exists() and not config.state_dir().exists()


def test_calibration_too_small_for_one_batch(stories260k_dir, tmp_path):
    (tmp_path / "small.txt").write_text("Once upon a time there was a cat.")
    config = _config(stories260k_dir, tmp_path / "small.txt", tmp_path / "o", batch_size=8, seq_len=64)
    with pytest.raises(LeapctlError, match="fewer than"):
        learn_masks(config)
    assert not (tmp_path / "o").exists()


def test_resume_refuses_other_settings_and_leaves_the_checkpoint(stories260k_dir, calib_file, tmp_path):
    from leapctl.learn.checkpoint import save_checkpoint

    out = tmp_path / "run"
    config = _config(stories260k_dir, calib_file, out)
    state = config.state_dir()
    save_checkpoint(state, {"x": torch.zeros(1)}, {"fingerprint": config.fingerprint(False), "step": 2,
                                                   "generation": 0}, distributed=False)
    before = {path.name: path.read_bytes() for path in state.rglob("*") if path.is_file()}
    with pytest.raises(LeapctlError, match="pass --resume"):
        learn_masks(config)
    with pytest.raises(LeapctlError, match="other settings.*model"):
        learn_masks(_config(calib_file.parent, calib_file, out, resume=True))
    with pytest.raises(LeapctlError, match="no checkpoint"):
        learn_masks(_config(stories260k_dir, calib_file, out, resume=True, checkpoint_dir=tmp_path / "none"))
    # through the CLI: exit status 2 and one line
    proc = subprocess.run(
        [sys.executable, "-m", "leapctl", "learn", str(stories260k_dir), "--out", str(out), "--calib",
         str(calib_file), "--steps", "4", "--batch-size", "4", "--micro-batch-size", "2", "--seq-len", "32",
         "--lr", "0.05", "--nsamples", "4", "--init", "wanda-small", "--sparsity", "0.6", "--resume"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: --resume: the checkpoint at {state / 'checkpoint.json'} was made with other settings "
        "(sparsity 0.5 -> 0.6); rerun with the same settings or use --overwrite"
    ]
    assert {path.name: path.read_bytes() for path in state.rglob("*") if path.is_file()} == before
