"""End-to-end LEAP runs in subprocesses: a run killed with SIGKILL (or stopped with SIGTERM) and resumed
ends bit for bit where an uninterrupted run ends, with one process and with FSDP2 over two; two gloo
processes under torchrun (DDP or FSDP2) learn the same mask as one process with the same global batch."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from leapctl.learn.mask import hard_masks
from leapctl.masks import load_masks
from leapctl.runs import LOGITS_FILE, MASKS_FILE

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny model: one thread each is fastest on a shared machine


def _args(model: Path, calib: Path, out: Path, steps: int = 10) -> list[str]:
    return [
        str(model), "--out", str(out), "--calib", str(calib), "--sparsity", "0.5", "--steps", str(steps),
        "--batch-size", "4", "--micro-batch-size", "1", "--seq-len", "32", "--lr", "0.05", "--nsamples", "4",
        "--init", "wanda-small", "--checkpoint-every", "2", "--save-logits", "--no-progress",
    ]  # fmt: skip


def _learn(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(_learn_command(*args), env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc


def _start_and_stop_after_checkpoint(command: list[str], state: Path,
                                     stop: Callable[[subprocess.Popen], None]) -> subprocess.Popen:
    """Start `command`, wait for its first checkpoint, then `stop` it while it still runs."""
    proc = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (state / "checkpoint.json").exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    stop(proc)
    proc.wait(timeout=300)
    return proc


def _learn_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "leapctl", "learn", *args]


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "leapctl", "learn", *args]  # fmt: skip


def _kill_process_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to a launcher and everything under it (torchrun starts each worker in its own session, so
    killing the process group is not enough)."""
    launcher = psutil.Process(proc.pid)
    for process in [launcher, *launcher.children(recursive=True)]:
        process.kill()


@pytest.fixture(scope="module")
def calib(tmp_path_factory, tinystories_text) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(tinystories_text)
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, stories260k_dir, calib) -> Path:
    out = tmp_path_factory.mktemp("runs") / "whole"
    _learn(*_args(stories260k_dir, calib, out))
    return out


def _assert_same_run(a: Path, b: Path) -> None:
    logits_a, logits_b = load_file(a / LOGITS_FILE), load_file(b / LOGITS_FILE)
    assert logits_a.keys() == logits_b.keys()
    for name in logits_a:
        assert torch.equal(logits_a[name], logits_b[name]), name
    masks_a, masks_b = load_masks(a / MASKS_FILE).masks, load_masks(b / MASKS_FILE).masks
    assert all(torch.equal(masks_a[n], masks_b[n]) for n in masks_a)
    steps_a = (a / "metrics.jsonl").read_text().splitlines()
    steps_b = (b / "metrics.jsonl").read_text().splitlines()
    assert len(steps_a) == len(steps_b) == 10


def test_sigkill_then_resume_matches_an_uninterrupted_run_bit_for_bit(stories260k_dir, calib, uninterrupted,
                                                                        tmp_path):  # fmt: skip
    out = tmp_path / "killed"
    args = _args(stories260k_dir, calib, out)
    state = Path(f"{out}.learn-state")
    proc = _start_and_stop_after_checkpoint(_learn_command(*args), state, subprocess.Popen.kill)
    assert proc.returncode == -signal.SIGKILL
    step = json.loads((state / "checkpoint.json").read_text())["step"]
    assert 2 <= step < 10 and not out.exists()
    _learn(*args, "--resume")
    _assert_same_run(uninterrupted, out)
    assert not state.exists()


# `leapctl learn ARGS` that sends itself SIGKILL on the Nth call of the function named POINT (qualified name).
KILL_ON_CALL = """
import os, signal, sys
point, wanted = sys.argv[1], int(sys.argv[2])
calls = 0
def hook(frame, event, arg):
    global calls
    if event == "call" and frame.f_code.co_qualname == point:
        calls += 1
        if calls == wanted:
            os.kill(os.getpid(), signal.SIGKILL)
sys.setprofile(hook)
from leapctl.cli import main
sys.argv = ["leapctl", "learn", *sys.argv[3:]]
main()
"""


def test_sigkill_during_a_checkpoint_write_then_resume_matches(stories260k_dir, calib, uninterrupted,
                                                               tmp_path):  # fmt: skip
    """Issue 20: killed while DCP writes the second checkpoint's tensors (the first, of step 2, complete):
    the torn folder is never the current one, and the resumed run ends bit for bit like the whole one."""
    out = tmp_path / "torn"
    args = _args(stories260k_dir, calib, out)
    state = Path(f"{out}.learn-state")
    proc = subprocess.run([sys.executable, "-c", KILL_ON_CALL, "HuggingFaceStorageWriter.write_data", "2",
                           *args], env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert json.loads((state / "checkpoint.json").read_text())["step"] == 2
    assert len(list(state.glob("ckpt-*"))) == 2  # the current one and the torn one
    _learn(*args, "--resume")
    _assert_same_run(uninterrupted, out)
    assert not state.exists()


def test_sigterm_checkpoints_and_resume_matches(stories260k_dir, calib, uninterrupted, tmp_path):
    out = tmp_path / "stopped"
    args = _args(stories260k_dir, calib, out)
    state = Path(f"{out}.learn-state")
    proc = _start_and_stop_after_checkpoint(_learn_command(*args), state, subprocess.Popen.terminate)
    stderr = proc.stderr.read()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    step = json.loads((state / "checkpoint.json").read_text())["step"]
    assert f"interrupted after step {step}" in stderr and step < 10
    _learn(*args, "--resume")
    _assert_same_run(uninterrupted, out)


@pytest.fixture(scope="module")
def fsdp_uninterrupted(tmp_path_factory, stories260k_dir, calib) -> Path:
    out = tmp_path_factory.mktemp("runs") / "fsdp"
    proc = subprocess.run(_torchrun(*_args(stories260k_dir, calib, out), "--fsdp"), env=ENV,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_two_gloo_processes_learn_the_same_mask_as_one(
    stories260k_dir, calib, uninterrupted, fsdp_uninterrupted, tmp_path, sharding
):
    """Same windows and the same noise per global micro-batch; only the order of the gradient sums
    differs (each rank sums its own two micro-batches, the all-reduce then adds the two ranks, where one
    process adds four in a row). So the runs agree up to float32 rounding, which the end of the schedule
    amplifies (d mask / d logit grows with alpha / tau, 7000 at the last step): the logits agree to 1e-5
    almost everywhere and to 1e-2 everywhere. The hard masks are equal except next to the global top-k cut:
    if no logit moves by more than d, the cut moves by at most d too, so a weight can change sides only
    when its logit lies within 2d of the cut (CI's CPU did move a few). FSDP2 shards the logits and
    reduce-scatters their gradients instead of all-reducing them: the same sums in another order."""
    if sharding == "fsdp2":
        out = fsdp_uninterrupted
    else:
        out = tmp_path / "ddp"
        proc = subprocess.run(_torchrun(*_args(stories260k_dir, calib, out)), env=ENV, capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    single = load_file(uninterrupted / LOGITS_FILE)
    ddp = load_file(out / LOGITS_FILE)
    difference = torch.cat([(single[n] - ddp[n]).abs().flatten() for n in single])
    assert difference.max() < 1e-2 and (difference < 1e-5).float().mean() > 0.99
    assert 0 < difference.max()  # two processes really ran with their own reduction order
    lm_single = [
        json.loads(line)["lm_loss"] for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()
    ]
    lm_ddp = [json.loads(line)["lm_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lm_single == pytest.approx(lm_ddp, rel=1e-5)  # the same windows and noise on every step
    masks_single = load_masks(uninterrupted / MASKS_FILE).masks
    masks_ddp = load_masks(out / MASKS_FILE).masks
    all_single = torch.cat([p.flatten() for p in single.values()])
    cut = all_single.kthvalue(all_single.numel() - round(0.5 * all_single.numel()) + 1).values
    for name in masks_single:
        moved = masks_single[name] != masks_ddp[name]
        assert ((single[name][moved] - cut).abs() <= 2 * difference.max()).all(), name
    assert all(torch.equal(hard_masks(ddp, 0.5)[n], masks_ddp[n]) for n in masks_ddp)


def test_fsdp2_sigkill_then_resume_matches_an_uninterrupted_fsdp2_run_bit_for_bit(
    stories260k_dir, calib, fsdp_uninterrupted, tmp_path
):
    """Each rank writes its shard of the logits and optimizer state (DCP, safetensors) and reads it back on
    resume. With the same two ranks the reduction order is the same as the uninterrupted run's, so the
    result is identical, not merely close. SIGKILL goes to the launcher and every worker."""
    out = tmp_path / "killed"
    args = [*_args(stories260k_dir, calib, out), "--fsdp"]
    state = Path(f"{out}.learn-state")
    _start_and_stop_after_checkpoint(_torchrun(*args), state, _kill_process_tree)
    index = json.loads((state / "checkpoint.json").read_text())
    assert 2 <= index["step"] < 10 and not out.exists()
    # sharded: each process wrote its own half of the logits and AdamW moments, nothing else holds them
    shards = sorted((state / index["folder"]).glob("*.safetensors"))
    assert len(shards) == 2 and {p.suffix for p in (state / index["folder"]).iterdir()} == {".safetensors"}
    resumed = subprocess.run(_torchrun(*args, "--resume"), env=ENV, capture_output=True, text=True,
                             timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_run(fsdp_uninterrupted, out)


# ---------------------------------------------------------------- the weights learned with the mask

WEIGHT_LR = "0.01"  # large enough that ten steps move every kept weight well past float32 rounding


@pytest.fixture(scope="module")
def weights_uninterrupted(tmp_path_factory, stories260k_dir, calib) -> Path:
    out = tmp_path_factory.mktemp("runs") / "weights"
    _learn(*_args(stories260k_dir, calib, out), "--weight-lr", WEIGHT_LR)
    return out


def test_weights_learned_with_the_mask_resume_after_sigkill_bit_for_bit(
    stories260k_dir, calib, weights_uninterrupted, tmp_path
):
    """The checkpoint holds the trained weights and their AdamW moments beside the logits: the resumed run
    ends with the same weights, logits and masks as the uninterrupted one."""
    out = tmp_path / "killed"
    args = [*_args(stories260k_dir, calib, out), "--weight-lr", WEIGHT_LR]
    state = Path(f"{out}.learn-state")
    proc = _start_and_stop_after_checkpoint(_learn_command(*args), state, subprocess.Popen.kill)
    assert proc.returncode == -signal.SIGKILL
    assert 2 <= json.loads((state / "checkpoint.json").read_text())["step"] < 10
    _learn(*args, "--resume")
    _assert_same_run(weights_uninterrupted, out)
    whole = load_file(weights_uninterrupted / "model.safetensors")
    resumed = load_file(out / "model.safetensors")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[n], resumed[n]) for n in whole)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_two_processes_write_the_weights_learned_with_the_mask(
    stories260k_dir, calib, weights_uninterrupted, tmp_path, sharding
):
    """DDP all-reduces the weights' gradients with the logits'; under FSDP2 rank 0 prunes a fresh copy of
    the model, so the trained weights, gathered from the shards, must reach it. Two processes sum in
    another order (see above), so the kept weights agree with one process's to far less than the training
    moved them; a fresh copy without them would be as far from one process's weights as the dense model."""
    out = tmp_path / sharding
    sharded = ["--fsdp"] if sharding == "fsdp2" else []
    proc = subprocess.run(_torchrun(*_args(stories260k_dir, calib, out), *sharded, "--weight-lr", WEIGHT_LR),
                          env=ENV, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = load_file(weights_uninterrupted / "model.safetensors")
    fsdp = load_file(out / "model.safetensors")
    dense = load_file(stories260k_dir / "model.safetensors")
    masks_single = load_masks(weights_uninterrupted / MASKS_FILE).masks
    masks_fsdp = load_masks(out / MASKS_FILE).masks
    apart, moved = [], []
    for name, keep in masks_single.items():
        both = keep & masks_fsdp[name]
        apart.append((fsdp[name][both] - single[name][both]).abs())
        moved.append((single[name][both] - dense[name][both]).abs())
        assert torch.equal(fsdp[name][~masks_fsdp[name]], torch.zeros_like(fsdp[name][~masks_fsdp[name]]))
    assert torch.cat(apart).mean() < 0.1 * torch.cat(moved).mean()
