"""Recovery of the kept weights (`leapctl recover`, `leapctl.recover.recover_weights`).

References: the mask file the run came with (pruned weights must stay +0.0 bit for bit, the mask unchanged),
an independent KL computed with `torch.nn.functional` (recovery must lower it), and an uninterrupted run
(a run killed with SIGKILL and resumed must end with the same weights bit for bit)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from leapctl.data import sample_windows, tokenize_documents
from leapctl.masks import load_masks
from leapctl.models import load_model
from leapctl.recover import RecoverySettings, distillation_losses, recover_weights, step_batch
from leapctl.runs import MASKS_FILE, read_run

# One thread: the bit-for-bit resume compares runs whose sums must happen in the same order.
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def leapctl(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leapctl", *args], capture_output=True, text=True,
                          env=env or ONE_THREAD)


@pytest.fixture(scope="module")
def wanda_run(stories260k_dir, tinystories_text, tmp_path_factory):
    """stories260K at 50% (Wanda on the TinyStories excerpt)."""
    folder = tmp_path_factory.mktemp("recover")
    text = folder / "text.txt"
    text.write_text(tinystories_text)
    out = folder / "wanda"
    done = leapctl("prune", str(stories260k_dir), "--method", "wanda", "--sparsity", "0.5", "--calib",
                   str(text), "--nsamples", "8", "--seq-len", "64", "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    return out


def independent_kl(student, teacher, ids: torch.Tensor) -> float:
    """KL(teacher || student) over next-token positions, from torch.nn.functional alone."""
    with torch.no_grad():
        s = student(input_ids=ids).logits[:, :-1].float()
        t = teacher(input_ids=ids).logits[:, :-1].float()
    return float(F.kl_div(F.log_softmax(s, -1).flatten(0, 1), F.log_softmax(t, -1).flatten(0, 1),
                          log_target=True, reduction="batchmean"))


def test_recovery_keeps_the_mask_and_lowers_the_kl(wanda_run, stories260k_dir, tinystories_text):
    run = read_run(wanda_run)
    model, tokenizer = load_model(str(wanda_run))
    teacher, _ = load_model(str(stories260k_dir))
    ids = tokenize_documents([tinystories_text], tokenizer)
    windows = sample_windows(ids, 32, 64, seed=0)
    held = sample_windows(ids, 8, 64, seed=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    kl_before = independent_kl(model, teacher, held)
    # lr 3e-3: stories260K's weights are ~100x fewer than SmolLM2's; 12 steps move it measurably.
    settings = RecoverySettings(steps=12, batch_size=8, lr=3e-3, autocast=False, progress=False)
    result = recover_weights(model, teacher, run.masks, windows, settings)
    assert independent_kl(model, teacher, held) < 0.8 * kl_before
    assert len(result.history) == 12
    for name, param in model.named_parameters():
        if name in run.masks.masks:
            keep = run.masks.masks[name]
            pruned = param.detach()[~keep]
            assert torch.equal(pruned.view(torch.int32), torch.zeros_like(pruned).view(torch.int32)), name
            assert not torch.equal(param.detach()[keep], before[name][keep]), f"{name} did not train"
        else:  # embeddings, norms, lm_head: frozen
            assert torch.equal(param.detach(), before[name]), name
    assert not any(p.requires_grad for p in model.parameters())


def test_the_loss_is_the_kl_plus_the_weighted_hidden_term(stories260k_dir):
    """With hidden_weight w, loss = KL + w * mean over blocks of ||h_s - h_t||^2 / ||h_t||^2 (the means
    over the same elements), each computed here from the models' own outputs (whole logits)."""
    teacher, _ = load_model(str(stories260k_dir))
    student, _ = load_model(str(stories260k_dir))
    with torch.no_grad():
        for p in student.parameters():
            p.mul_(0.9)
        ids = torch.randint(0, teacher.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        s = student(input_ids=ids, output_hidden_states=True)
        t = teacher(input_ids=ids, output_hidden_states=True)
        loss, kl, hidden = distillation_losses(student, teacher, ids, hidden_weight=0.5)
    expected_kl = F.kl_div(F.log_softmax(s.logits[:, :-1], -1).flatten(0, 1),
                           F.log_softmax(t.logits[:, :-1], -1).flatten(0, 1), log_target=True,
                           reduction="batchmean")
    ratios = [((a - b) ** 2).sum() / (b ** 2).sum() for a, b in zip(s.hidden_states[1:], t.hidden_states[1:],
                                                                     strict=True)]
    assert kl.item() == pytest.approx(expected_kl.item(), rel=1e-5)
    assert hidden.item() == pytest.approx(torch.stack(ratios).mean().item(), rel=1e-5)
    assert loss.item() == pytest.approx(kl.item() + 0.5 * hidden.item(), rel=1e-6)


def test_batches_are_a_function_of_seed_and_step():
    windows = torch.arange(100 * 4).view(100, 4)
    assert torch.equal(step_batch(windows, 5, 0, 7), step_batch(windows, 5, 0, 7))
    assert not torch.equal(step_batch(windows, 5, 0, 7), step_batch(windows, 5, 0, 8))


def recover_args(run: Path, out: Path, text: Path, *extra: str) -> list[str]:
    return ["recover", str(run), "--out", str(out), "--calib", str(text), "--steps", "8", "--batch-size", "4",
            "--seq-len", "64", "--checkpoint-every", "1", "--no-progress", *extra]


@pytest.mark.slow
def test_a_run_killed_and_resumed_ends_with_the_same_weights(wanda_run, tmp_path):
    text = wanda_run.parent / "text.txt"
    whole = leapctl(*recover_args(wanda_run, tmp_path / "whole", text))
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "resumed"
    args = [sys.executable, "-m", "leapctl", *recover_args(wanda_run, out, text)]
    child = subprocess.Popen(args, env=ONE_THREAD, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    index = tmp_path / "resumed.recover-state" / "checkpoint.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and child.poll() is None:
        if index.is_file() and json.loads(index.read_text())["step"] >= 3:
            break
        time.sleep(0.05)
    assert child.poll() is None, "the run ended before it could be killed mid-way"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert not out.exists()
    resumed = leapctl(*recover_args(wanda_run, out, text, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads((out / "report.json").read_text())["recovery"]
    assert report["resumed_at_step"] >= 3 and len(report["history"]) == 8
    a, b = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not (tmp_path / "resumed.recover-state").exists()


def test_the_run_folder_keeps_the_masks_and_reports_the_recovery(wanda_run, tmp_path):
    out = tmp_path / "rec"
    done = leapctl(*recover_args(wanda_run, out, wanda_run.parent / "text.txt"))
    assert done.returncode == 0, done.stderr
    assert "recovered" in done.stdout
    source, result = load_masks(wanda_run / MASKS_FILE), load_masks(out / MASKS_FILE)
    assert source.masks.keys() == result.masks.keys()
    assert all(torch.equal(source.masks[name], result.masks[name]) for name in source.masks)
    report = json.loads((out / "report.json").read_text())
    assert report["command"] == "recover" and report["recovery"]["steps"] == 8
    assert report["achieved_sparsity"]["global"] == pytest.approx(0.5, abs=1e-3)
    assert (out / "recover_kl.png").stat().st_size > 0


def test_a_budget_larger_than_the_text_says_how_often_it_read_the_text(wanda_run, stories260k_dir, tmp_path):
    from transformers import AutoTokenizer

    text = tmp_path / "short.txt"
    text.write_text((wanda_run.parent / "text.txt").read_text()[:1500])
    tokenizer = AutoTokenizer.from_pretrained(stories260k_dir)
    ids = tokenizer(text.read_text(), add_special_tokens=False)["input_ids"]
    whole = len(ids) // 64 * 64  # the text cut into whole 64-token windows
    read = 8 * 4 * 64  # recover_args: 8 steps of 4 x 64
    done = leapctl(*recover_args(wanda_run, tmp_path / "rec", text))
    assert done.returncode == 0, done.stderr
    recovery = json.loads((tmp_path / "rec" / "report.json").read_text())["recovery"]
    assert read / whole >= 2
    assert (recovery["text_tokens"], recovery["passes"]) == (whole, round(read / whole, 2))
    assert f"({read:,} tokens, {read / whole:.1f} times the text's {whole:,}," in done.stdout


@pytest.mark.parametrize("extra, message", [
    (("--steps", "0"), "--steps"),
    (("--lr", "nan"), "--lr"),
    (("--hidden-weight", "-1"), "--hidden-weight"),
    (("--resume", "--overwrite"), "contradict"),
])
def test_bad_settings_fail_in_one_line_and_write_nothing(wanda_run, tmp_path, extra, message):
    out = tmp_path / "rec"
    done = leapctl(*recover_args(wanda_run, out, wanda_run.parent / "text.txt", *extra))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and message in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def quantized_run(stories260k_dir, tinystories_text, tmp_path_factory):
    """stories260K at 50% (Wanda, down_proj left dense: no group of 32 divides its 172 columns), its kept
    weights on the asymmetric 4-bit grid by round to nearest."""
    folder = tmp_path_factory.mktemp("recover-q4")
    text = folder / "text.txt"
    text.write_text(tinystories_text)
    pruned, out = folder / "wanda", folder / "q4"
    done = leapctl("prune", str(stories260k_dir), "--method", "wanda", "--sparsity", "0.5", "--calib",
                   str(text), "--nsamples", "8", "--seq-len", "64", "--exclude", "down_proj", "--out",
                   str(pruned), "--no-progress")
    assert done.returncode == 0, done.stderr
    done = leapctl("quantize", str(pruned), "--method", "rtn", "--group-size", "32", "--grid", "asymmetric",
                   "--lm-head-bits", "16", "--tune-steps", "0", "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    return out


def test_a_quantized_run_is_recovered_on_its_grid(quantized_run, stories260k_dir, tinystories_text):
    """Every kept weight ends exactly on its group's grid (scales and zero points unchanged), every pruned
    one +0.0, codes moved, and the KL lower than the quantized start's."""
    from leapctl.grid import round_to_grid

    run = read_run(quantized_run)
    model, tokenizer = load_model(str(quantized_run))
    teacher, _ = load_model(str(stories260k_dir))
    ids = tokenize_documents([tinystories_text], tokenizer)
    windows, held = sample_windows(ids, 32, 64, seed=0), sample_windows(ids, 8, 64, seed=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    kl_before = independent_kl(model, teacher, held)
    settings = RecoverySettings(steps=12, batch_size=8, lr=3e-3, autocast=False, progress=False)
    recover_weights(model, teacher, run.masks, windows, settings, grid=(run.scales, run.zeros))
    assert independent_kl(model, teacher, held) < 0.8 * kl_before
    params = dict(model.named_parameters())
    assert params.keys() == before.keys()  # the parametrizations are gone
    for name, keep in run.masks.masks.items():
        weight = params[name].detach()
        on_grid = round_to_grid(weight, run.scales[name], run.zeros[name])
        assert torch.equal(weight[keep], on_grid[keep]), f"{name} is off its grid"
        pruned = weight[~keep]
        assert torch.equal(pruned.view(torch.int32), torch.zeros_like(pruned).view(torch.int32)), name
        assert not torch.equal(weight, before[name]), f"{name} did not train"


def test_a_recovered_quantized_run_exports_and_validates(quantized_run, tmp_path):
    out = tmp_path / "rec"
    done = leapctl(*recover_args(quantized_run, out, quantized_run.parent / "text.txt"))
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["recovery"]["on_grid"] and report["quantization"]["grid"] == "asymmetric"
    source = read_run(quantized_run)
    result = read_run(out)
    assert all(torch.equal(source.scales[name], result.scales[name]) for name in source.scales)
    export = tmp_path / "export"
    done = leapctl("export", str(out), "--format", "bitmap-q4", "--out", str(export))
    assert done.returncode == 0, done.stderr
    done = leapctl("validate", str(export), "--max-new-tokens", "4")
    assert done.returncode == 0, done.stderr
