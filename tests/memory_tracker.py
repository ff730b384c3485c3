"""Counting tensor memory on the CPU, where torch keeps no allocator statistics: every storage alive when
counting starts (`track`) or made by an op while it runs, with FSDP2's storage resizes, and the peak."""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemory(TorchDispatchMode):
    """Live bytes of tensor storages and their peak, updated after every op and every
    `UntypedStorage.resize_` (which FSDP2 uses to free and re-allocate unsharded parameters, and which no
    dispatch mode sees). A storage's Python object can outlive its memory (it then reports itself invalid;
    FSDP2's sharding leaves such objects behind), so every new peak is first checked against the storages
    that really still hold their bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.refs: dict[int, weakref.ref] = {}
        self.live = self.peak = 0
        self._resize = torch.UntypedStorage.resize_

    def track(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            self._add(_local(tensor).untyped_storage())

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self.sizes:
            return
        self.sizes[key] = storage.nbytes()
        self.refs[key] = weakref.ref(storage)
        self.live += self.sizes[key]
        weakref.finalize(storage, self._drop, key)
        self._new_peak()

    def _drop(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)
        self.refs.pop(key, None)

    def _new_peak(self) -> None:
        if self.live <= self.peak:
            return
        for key, ref in list(self.refs.items()):
            storage = ref()
            try:
                size = storage.nbytes() if storage is not None and storage.data_ptr() is not None else 0
            except RuntimeError:  # "invalid python storage": its memory is gone
                size = 0
            if key not in self.sizes:  # dropped meanwhile, by a finalizer
                continue
            self.live += size - self.sizes[key]
            self.sizes[key] = size
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                self._add(_local(tensor).untyped_storage())
        return out

    def __enter__(self):
        tracker, original = self, self._resize

        def resize_(storage, size):
            before = storage.nbytes()
            result = original(storage, size)
            if id(storage) in tracker.sizes:
                tracker.sizes[id(storage)] = storage.nbytes()
                tracker.live += storage.nbytes() - before
                tracker._new_peak()
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (its ops run below this mode, so the shard is all that shows)."""
    return getattr(tensor, "_local_tensor", tensor)
