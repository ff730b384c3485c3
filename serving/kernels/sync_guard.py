"""A guard that refuses, on any device, what would make a CUDA host wait for the GPU inside a decode step.

CUDA-graph capture (vLLM's decode path) fails on a host synchronisation, but CI has no GPU. Under
`no_host_sync()` every torch op is seen through a dispatch mode, and those that need the host to read device
data raise `HostSyncError` even on CPU tensors: a scalar read (`.item()`, `bool(t)`, `int(t)`), an output
whose size depends on the data (`nonzero`, `masked_select`, boolean indexing, `repeat_interleave` without
its output size, `unique`), a comparison returning a Python bool (`equal`), a copy from a device to the host,
and, patched on `torch.Tensor`, `.tolist()` and `.numpy()` (which reach no dispatch mode). `allow` names
tensors that are host metadata by contract (tiled-bitmap's CPU `shape`). On a GPU,
`torch.cuda.set_sync_debug_mode("error")` and graph capture check the same for real (bench/gpu_check.py)."""

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose"}
_DATA_SHAPED = {"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                "unique_dim_consecutive", "masked_scatter", "masked_scatter_"}


class HostSyncError(RuntimeError):
    """An op that would wait for the GPU ran inside `no_host_sync()`."""


def _tensors(values) -> list[torch.Tensor]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(_tensors(value))
    return found


def _bool_index(args) -> bool:
    return any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1:2]))


def sync_reason(func, args, kwargs, result) -> str | None:
    """Why calling `func` would synchronise a CUDA host, or None."""
    name = func.overloadpacket.__name__
    if name in _SCALAR_READS:
        return "reads a tensor's value on the host"
    if name in _DATA_SHAPED:
        return "has an output whose size depends on the data"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and _bool_index(args):
        return "indexes with a boolean mask"
    repeats = args[1] if len(args) > 1 else args[0] if args else None
    if name == "repeat_interleave" and isinstance(repeats, torch.Tensor) \
            and kwargs.get("output_size") is None:
        return "repeats by counts without output_size"
    devices = {t.device.type for t in _tensors(list(args) + list(kwargs.values()))}
    if name in ("_to_copy", "copy_", "to") and devices - {"cpu", "meta"} and any(
            t.device.type == "cpu" for t in _tensors([result])):
        return "copies device data to the host"
    return None


class _Guard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        reason = sync_reason(func, args, kwargs, result)
        if reason:
            raise HostSyncError(f"{func} {reason}: a CUDA host would wait for the GPU here")
        return result


@contextmanager
def no_host_sync(allow: Iterable[torch.Tensor] = ()) -> Iterator[None]:
    """Raise `HostSyncError` on any host synchronisation inside the block (module docstring)."""
    allowed = {id(t) for t in allow}
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def refusing(name: str):
        def method(self, *args, **kwargs):
            if id(self) not in allowed:
                raise HostSyncError(f"Tensor.{name}() reads device data on the host")
            return originals[name](self, *args, **kwargs)
        return method

    for name in originals:
        setattr(torch.Tensor, name, refusing(name))
    try:
        with _Guard():
            yield
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


__all__ = ["HostSyncError", "no_host_sync", "sync_reason"]
