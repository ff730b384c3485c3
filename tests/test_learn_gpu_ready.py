"""What a GPU run needs from the LEAP loop, checked on the CPU: each test would fail on the code that broke
multi-GPU runs or could not scale (issue 12):
1. collectives on CPU tensors under an NCCL-only process group (every multi-GPU run failed after step 1);
2. AdamW state put back by hand instead of through `Optimizer.load_state_dict`;
3. five host syncs per micro-batch;
4. the corpus pickled to every rank and into every checkpoint; checkpoints unpickled on resume.
Plus the pieces they rest on: the sharded hard mask, the uint32 token file, gradient clipping, the resume
fingerprint."""

import copy
import json
import os
import pickle
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import leapctl.learn.processes as processes
import leapctl.learn.train as train
from leapctl.errors import LeapctlError
from leapctl.learn import LearnConfig, leap_masks
from leapctl.learn.mask import hard_masks
from leapctl.learn.stream import open_token_file, write_token_file

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(stories260k_dir, tinystories_text):
    """The real stories260K model, the TinyStories excerpt as a token stream, and Wanda's mask on it."""
    from leapctl.data import sample_windows, tokenize_documents
    from leapctl.models import load_model
    from leapctl.prune.wanda import wanda_masks

    model, tokenizer = load_model(str(stories260k_dir))
    ids = tokenize_documents([tinystories_text], tokenizer)
    init = wanda_masks(copy.deepcopy(model), sample_windows(ids, 4, 32, 0), 0.5, in_place=False,
                       progress=False)
    return model, tokenizer, ids, init


def _config(**overrides) -> LearnConfig:
    settings = dict(model="stories260k", sparsity=0.5, steps=4, batch_size=4, micro_batch_size=2, seq_len=32,
                    nsamples=4, progress=False, checkpoint_every=0)
    settings.update(overrides)
    return LearnConfig(**settings)


def _learn(setup, corpus=None, **overrides):
    model, tokenizer, ids, init = setup
    corpus = ids if corpus is None else corpus
    return leap_masks(copy.deepcopy(model), tokenizer, corpus, _config(**overrides), init=init)


@pytest.fixture
def one_process_group():
    """A real gloo process group of one process, so the loop takes its distributed path (DDP, all-reduces)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ---------------------------------------------------------------- 1. collectives on the training device


def test_every_collective_tensor_lives_on_the_training_device(setup, one_process_group, monkeypatch):
    """On a GPU the default device (CPU) is not the training device; here the default device is `meta`
    while the model trains on the CPU, so any tensor the loop makes without naming its device lands on
    `meta`: a collective on it fails, and the spy below names it. (The old loop all-reduced
    `torch.zeros(5)`, which NCCL, registered for CUDA only, refused.)"""
    seen = []
    for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter_tensor", "all_gather_into_tensor"):
        original = getattr(dist, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            tensors = [a for a in args if torch.is_tensor(a)]
            tensors += [t for a in args if isinstance(a, list) for t in a if torch.is_tensor(t)]
            seen.extend((_name, t.device) for t in tensors)
            return _original(*args, **kwargs)

        monkeypatch.setattr(dist, name, spy)
    torch.set_default_device("meta")
    try:
        learned = _learn(setup, steps=3)
    finally:
        torch.set_default_device(None)
    assert {name for name, _ in seen} >= {"all_reduce"}  # the loss terms and the stop flag, every step
    assert all(device == torch.device("cpu") for _, device in seen), seen
    assert learned.sparsity()["global"] == 0.5


def test_the_device_is_bound_before_the_group_which_has_a_backend_per_device_type_and_a_timeout(monkeypatch):
    """Under torchrun on GPUs: the local rank's GPU is bound before the group starts; the group gets gloo for
    CPU tensors and NCCL for CUDA ones, the bound device and the configured timeout."""
    import datetime

    calls = []

    def init_process_group(backend, timeout, device_id):
        calls.append(("group", backend, timeout, device_id))

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("bind", device)))
    monkeypatch.setenv("LOCAL_RANK", "1")
    device = processes.bind_device("cuda", world=2)
    processes.start_group(device, 2, 600)
    assert device == torch.device("cuda", 1)
    ten_minutes = datetime.timedelta(seconds=600)
    assert calls == [("bind", device), ("group", "cpu:gloo,cuda:nccl", ten_minutes, device)]
    calls.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = processes.bind_device(_config().device, world=2)
    processes.start_group(cpu, 2, 30)
    assert cpu == torch.device("cpu") and calls == [("group", "gloo", datetime.timedelta(seconds=30), None)]


# ---------------------------------------------------------------- 2. optimizer state through load_state_dict


def test_resume_restores_adamw_through_load_state_dict_and_ends_bit_for_bit(setup, tmp_path, monkeypatch):
    from safetensors import safe_open

    whole = _learn(setup, out=tmp_path / "whole", save_logits=True)
    interrupted = tmp_path / "resumed"
    _learn(setup, out=interrupted, steps=4, checkpoint_every=2, save_logits=True)  # leaves the step-2 one
    state = interrupted.with_name("resumed.learn-state")
    index = json.loads((state / "checkpoint.json").read_text())
    assert index["step"] == 2
    saved = {}
    for file in (state / index["folder"]).glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            saved.update({key: handle.get_tensor(key) for key in handle.keys()})

    loaded = []
    original = torch.optim.Optimizer.load_state_dict

    def spy(optimizer, state_dict):
        original(optimizer, state_dict)
        loaded.append({id(p): {k: v.clone() for k, v in optimizer.state[p].items()}
                       for group in optimizer.param_groups for p in group["params"]})

    monkeypatch.setattr(torch.optim.Optimizer, "load_state_dict", spy)
    resumed = _learn(setup, out=interrupted, steps=4, checkpoint_every=2, save_logits=True, resume=True)
    assert len(loaded) == 1
    states = list(loaded[0].values())
    names = list(resumed.masks)
    assert len(states) == len(names)
    for name, slot in zip(names, states, strict=True):
        assert set(slot) == {"step", "exp_avg", "exp_avg_sq"}
        assert slot["step"].dtype == torch.float32 and float(slot["step"]) == 2.0
        assert torch.equal(slot["exp_avg"], saved[f"exp_avg.{name}"])
        assert torch.equal(slot["exp_avg_sq"], saved[f"exp_avg_sq.{name}"])
    for name in names:
        assert torch.equal(resumed.stats["logits"][name], whole.stats["logits"][name]), name
    assert resumed.stats["resumed_at_step"] == 2


def test_resume_refuses_another_micro_batch_size(setup, tmp_path):
    """The micro-batch split changes the noise (one sample per micro-batch), so it is part of the run."""
    _learn(setup, out=tmp_path / "run", steps=4, checkpoint_every=2)
    with pytest.raises(LeapctlError, match="micro_batch_size 2 -> 1"):
        _learn(setup, out=tmp_path / "run", steps=4, checkpoint_every=2, micro_batch_size=1, resume=True)


# ---------------------------------------------------------------- 3. one host sync per step

SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


def test_one_host_sync_per_optimizer_step(setup, monkeypatch):
    """Every read of a tensor's value on the host (item, tolist, bool(), float(), int(), numpy()) is a device
    sync on a GPU. Counted between the starts of consecutive steps (two micro-batches each, distillation on,
    so the teacher's forward counts too): exactly one, the per-step read of the summed loss terms. The
    first step also reads the epoch's data order, a CPU tensor, which is not counted."""
    calls = []
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            calls.append(1)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    starts = []
    temperature = train.mask_temperature
    def at_step_start(*args, **kwargs):
        starts.append(len(calls))
        return temperature(*args, **kwargs)

    monkeypatch.setattr(train, "mask_temperature", at_step_start)
    _learn(setup, steps=5, distill=0.5)
    per_step = np.diff(starts).tolist()
    assert len(starts) == 5 and per_step[1:] == [1, 1, 1], per_step


# ---------------------------------------------------------------- 4. the corpus, checkpoints without pickle


def test_token_file_is_uint32_memory_mapped_and_checked(tmp_path):
    ids = torch.tensor([0, 1, 49151, 2**31 + 5, 7])
    write_token_file(tmp_path, ids)
    mapped = open_token_file(tmp_path)
    assert isinstance(mapped, np.memmap) and mapped.dtype == np.dtype("<u4") and not mapped.flags.writeable
    assert mapped.tolist() == ids.tolist()
    assert (tmp_path / "tokens.u32").stat().st_size == 4 * len(ids)
    (tmp_path / "tokens.u32").write_bytes(b"\0" * 8)
    with pytest.raises(LeapctlError, match="holds 2 tokens"):
        open_token_file(tmp_path)
    with pytest.raises(LeapctlError, match="do not fit in uint32"):
        write_token_file(tmp_path, torch.tensor([2**32]))


def _checkpoint_bytes(state: Path) -> int:
    index = json.loads((state / "checkpoint.json").read_text())
    return sum(f.stat().st_size for f in (state / index["folder"]).iterdir())


def test_checkpoints_hold_positions_not_tokens_and_resume_without_pickle(setup, tmp_path, monkeypatch):
    """A corpus 1024x larger (2.9M tokens, four times the bytes of the checkpoint even as uint32) gives the
    same checkpoint (logits, AdamW moments; the data position is a number in the JSON index); resuming
    reads safetensors and JSON only (pickle and torch.load are made to fail)."""
    ids = setup[2]
    big = ids.repeat(1024)
    _learn(setup, corpus=ids, out=tmp_path / "small", steps=4, checkpoint_every=2)
    _learn(setup, corpus=big, out=tmp_path / "big", steps=4, checkpoint_every=2)
    small_state, big_state = tmp_path / "small.learn-state", tmp_path / "big.learn-state"
    assert _checkpoint_bytes(small_state) == _checkpoint_bytes(big_state) < 4 * big.numel() / 4  # of uint32
    files = {f.suffix for f in big_state.rglob("*") if f.is_file()}
    assert files <= {".safetensors", ".json", ".jsonl"}, files

    def refuse(*args, **kwargs):
        raise AssertionError("resume must not unpickle")

    for module, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    resumed = _learn(setup, corpus=big, out=tmp_path / "big", steps=4, checkpoint_every=2, resume=True)
    assert resumed.stats["resumed_at_step"] == 2
    with pytest.raises(LeapctlError, match="trained on .* tokens, the token stream holds"):
        _learn(setup, corpus=ids, out=tmp_path / "big", steps=4, checkpoint_every=2, resume=True)


# ---------------------------------------------------------------- the pieces they rest on


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sharded_hard_masks(rank: int, world: int, port: int, logits: dict, density: float, mode: str,
                        out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        shards = {name: p.chunk(world, dim=0)[rank] for name, p in logits.items()}  # FSDP2's dim-0 shards
        keep = hard_masks(shards, density, mode, group=dist.group.WORLD)
        # numpy arrays travel by value; a tensor would travel as a shared-memory handle that its sender must
        # still hold when the receiver opens it, and this process may have exited by then (a loaded machine)
        out.put((rank, {name: k.numpy() for name, k in keep.items()}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["global", "per-layer"])
def test_hard_masks_over_row_shards_equal_the_one_process_masks(mode):
    """Two gloo processes each hold half the rows of every layer: counts are summed over the group and
    ties at the threshold are split in layer, then row order, so the shards put together are exactly
    the one-process masks (many exact ties included, some across the shard boundary)."""
    generator = torch.Generator().manual_seed(0)
    logits = {
        "a": torch.randn(16, 24, generator=generator),
        "b": torch.tensor([[3.0, -3.0, 0.0, 0.5] * 5] * 6),
        "c": torch.randn(10, 12, generator=generator).round(),
    }
    expected = hard_masks(logits, 0.45, mode)
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = _free_port()
    processes = [context.Process(target=_sharded_hard_masks, args=(r, 2, port, logits, 0.45, mode, queue))
                 for r in range(2)]
    for process in processes:
        process.start()
    results = dict(queue.get() for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    for name in logits:
        shards = [torch.from_numpy(results[rank][name]) for rank in (0, 1)]
        assert torch.equal(torch.cat(shards), expected[name]), name


def test_gradients_are_clipped_to_max_grad_norm_and_the_norm_is_reported():
    generator = torch.Generator().manual_seed(0)
    params = [torch.zeros(3, 4, requires_grad=True), torch.zeros(5, requires_grad=True)]
    grads = [torch.randn(3, 4, generator=generator) * 10, torch.randn(5, generator=generator) * 10]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = torch.cat([g.flatten() for g in grads]).norm()  # the naive total norm
    torch.testing.assert_close(train._clip_gradients(params, 1.0), norm)
    clipped = torch.cat([p.grad.flatten() for p in params])
    torch.testing.assert_close(clipped.norm(), torch.tensor(1.0), rtol=1e-4, atol=0)
    torch.testing.assert_close(clipped, torch.cat([g.flatten() for g in grads]) / norm, rtol=1e-4, atol=1e-7)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    torch.testing.assert_close(train._clip_gradients(params, 0.0), norm)  # 0: reported, not clipped
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
