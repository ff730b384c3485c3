"""One process or N under torchrun: the process group, the training device, the model wrapped for DDP or
FSDP2, gradient accumulation without syncs, and whole tensors from FSDP2 shards."""

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from leapctl.compute import resolve_device


@dataclass(frozen=True)
class Processes:
    """Where this process stands: `world` processes, this one `rank` (0 writes the files)."""

    world: int = 1
    rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world > 1 or (dist.is_available() and dist.is_initialized())

    @property
    def master(self) -> bool:
        return self.rank == 0

    @classmethod
    def current(cls) -> "Processes":
        """The initialised process group, or one process."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_world_size(), dist.get_rank())
        return cls()


def bind_device(device: str, world: int) -> torch.device:
    """The training device, bound before any process group exists (NCCL then builds its communicator on
    the right GPU): under torchrun each process takes its local rank's GPU whatever --device names."""
    named = resolve_device(device)  # the one resolver: cpu, or cuda:N checked to exist
    if named.type != "cuda":
        return named
    index = int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else named.index
    bound = torch.device("cuda", index)
    torch.cuda.set_device(bound)
    return bound


def start_group(device: torch.device, world: int, timeout_s: float) -> None:
    """Under torchrun, the process group: one backend per device type (gloo for CPU tensors, NCCL for CUDA
    ones), so a collective works wherever its tensor lives; `timeout_s` bounds every collective and the
    wait for the processes that join late (rank 0 joins after its set-up). The GPU is bound already."""
    if world <= 1 or dist.is_initialized():
        return
    cuda = device.type == "cuda"
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s), device_id=device if cuda else None)


def world_from_environment() -> tuple[int, int]:
    """(world size, rank) that torchrun gives this process, before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def shutdown(distributed: bool) -> None:
    if distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shard_block(block: torch.nn.Module) -> None:
    """FSDP2 on one decoder block: its parameters become this process's row shards (the whole ones are
    freed when nothing else holds them)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(block)


def wrap_model(model: torch.nn.Module, distributed: bool, fsdp: bool,
               device: torch.device) -> torch.nn.Module:
    """The module the loop calls: under FSDP2 the whole model sharded in place (its blocks are already,
    `shard_block`) and returned; DDP wraps it; one process uses it as it is."""
    if distributed and fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        return model
    if distributed:
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    return model


def no_gradient_sync(train_model, model, skip_sync: bool, fsdp: bool):
    """Gradient accumulation: no all-reduce until the last micro-batch of the step."""
    if not skip_sync:
        return contextlib.nullcontext()
    if fsdp:
        return _fsdp_no_sync(model)
    return train_model.no_sync()


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_cpu(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole of a layer-sized tensor on the CPU: `tensor` is this process's shard when `like` (the
    parameter) is an FSDP2 DTensor (every process must call this then), else the whole tensor already."""
    if hasattr(like, "device_mesh"):
        from torch.distributed.tensor import DTensor

        if not isinstance(tensor, DTensor):
            tensor = DTensor.from_local(tensor, like.device_mesh, like.placements, shape=like.shape,
                                        stride=like.stride())
        tensor = tensor.full_tensor()
    return tensor.detach().cpu()
