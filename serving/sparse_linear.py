"""The sparse linear op that the `leap_sparse` layers compute with, and the compressed weight they hold.

Weights stay in the `bitmap` layout in memory (one bit per weight plus the kept values, about 0.53x of
fp32 or 0.56x of 16-bit dense at 50% sparsity). `bitmap_linear` is a `torch.library.custom_op`, so
vLLM's torch.compile sees one opaque call instead of tracing the bit unpacking.

On CPU the layers call the native kernel `torch.ops.leap_sparse_cpu.bitmap_linear` (`serving.cpu_kernel`),
which reads this layout as it is. On CUDA, when the GPU kernel package is importable, layers convert their
weight to the tiled-bitmap layout at load and call `tiled_bitmap_linear`. `bitmap_linear` below is the
portable path, used where neither kernel is available and as the reference: it decodes the weight per call
(unpack the bits, scatter the values) and runs one dense matmul, so the result equals the dense masked
matmul up to the matmul's own rounding."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparse_formats import get_format, pack_rows, unpack_rows


def _decode(bitmap: torch.Tensor, values: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Dense [rows, n_cols] weight: bitmap order is row-major, the order `values` were kept in."""
    mask = unpack_rows(bitmap, n_cols)
    return values.new_zeros(mask.shape).masked_scatter_(mask, values)


@torch.library.custom_op("leap_sparse::bitmap_linear", mutates_args=())
def bitmap_linear(x: torch.Tensor, bitmap: torch.Tensor, values: torch.Tensor, row_offsets: torch.Tensor,
                  n_cols: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b for W stored as a row-packed bitmap, its kept values (row-major) and row offsets.

    `row_offsets` belongs to the stored layout (each row's first value, for kernels that work per row);
    this decode-per-call path reads the values in order and does not need it."""
    weight = _decode(bitmap, values, n_cols).to(x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


@bitmap_linear.register_fake
def _bitmap_linear_fake(x, bitmap, values, row_offsets, n_cols, bias=None):
    return x.new_empty((*x.shape[:-1], bitmap.shape[0]))


def tiled_kernel():
    """The GPU kernel `tiled_bitmap_linear(x, tensors, bias)` when its package imports, else None."""
    try:
        from serving.kernels.tiled_bitmap_triton import tiled_bitmap_linear
    except ImportError:
        return None
    return tiled_bitmap_linear


@torch.library.custom_op("leap_sparse::tiled_bitmap_linear", mutates_args=())
def tiled_bitmap_linear(x: torch.Tensor, tensors: list[torch.Tensor], names: str, n_rows: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GPU kernel behind an opaque op: `names` (comma-separated) labels `tensors`, the tiled-bitmap
    encoding as `sparse_formats.get_format("tiled-bitmap").encode` returns it; `n_rows` (output features)
    lets the fake implementation size its result without reading the `shape` tensor."""
    kernel = tiled_kernel()
    if kernel is None:
        raise RuntimeError("serving.kernels.tiled_bitmap_triton is not importable")
    return kernel(x, dict(zip(names.split(","), tensors, strict=True)), bias=bias)


@tiled_bitmap_linear.register_fake
def _tiled_bitmap_linear_fake(x, tensors, names, n_rows, bias=None):
    return x.new_empty((*x.shape[:-1], n_rows))


@dataclass
class BitmapWeight:
    """A [rows, n_cols] sparse weight in the serving layout, with the slicing that tensor parallelism
    needs: row ranges for column-parallel layers, column ranges (re-packed) for row-parallel ones."""

    bitmap: torch.Tensor
    values: torch.Tensor
    row_offsets: torch.Tensor
    n_cols: int

    @property
    def rows(self) -> int:
        return self.bitmap.shape[0]

    @classmethod
    def from_tensors(cls, fmt: str, tensors: dict[str, torch.Tensor]) -> "BitmapWeight":
        """From one projection's stored tensors (`bitmap` or `csr` format); checks them first, so a
        corrupt checkpoint fails at load with the format's message instead of computing garbage."""
        get_format(fmt).check(tensors)
        rows, n_cols = (int(v) for v in tensors["shape"].tolist())
        if fmt == "bitmap":
            return cls(tensors["bitmap"], tensors["values"], tensors["row_offsets"], n_cols)
        if fmt == "csr":
            row_ptr = tensors["row_ptr"]
            row_ids = torch.repeat_interleave(torch.arange(rows), row_ptr[1:] - row_ptr[:-1])
            mask = torch.zeros((rows, n_cols), dtype=torch.bool)
            mask[row_ids, tensors["col_indices"].long()] = True
            # CSR columns increase within a row (checked), so its values are already in bitmap order.
            return cls(pack_rows(mask), tensors["values"], row_ptr[:-1].clone(), n_cols)
        raise ValueError(f"leap_sparse serves the bitmap and csr formats, not {fmt!r}")

    def check(self) -> None:
        """The layout the native op trusts with `checked=True`: bitmap shape, each row's offset where the
        rows before it end (so never decreasing and inside `values`); raises the format's error."""
        get_format("bitmap").check({"shape": torch.tensor([self.rows, self.n_cols]),
                                    "bitmap": self.bitmap.cpu(), "values": self.values.cpu(),
                                    "row_offsets": self.row_offsets.cpu()})

    def _row_end(self, row: int) -> int:
        return int(self.row_offsets[row]) if row < self.rows else self.values.numel()

    def slice_rows(self, start: int, stop: int) -> "BitmapWeight":
        first = self._row_end(start)
        return BitmapWeight(self.bitmap[start:stop], self.values[first:self._row_end(stop)],
                            self.row_offsets[start:stop] - first, self.n_cols)

    def slice_cols(self, start: int, stop: int) -> "BitmapWeight":
        mask = unpack_rows(self.bitmap, self.n_cols)
        in_slice = torch.zeros_like(mask)
        in_slice[:, start:stop] = True
        part = mask[:, start:stop]
        counts = part.sum(dim=1)
        return BitmapWeight(pack_rows(part), self.values[in_slice[mask]], counts.cumsum(0) - counts,
                            stop - start)

    @classmethod
    def cat_rows(cls, parts: list["BitmapWeight"]) -> "BitmapWeight":
        """Stack weights with equal column counts (q/k/v into qkv, gate/up into gate_up)."""
        if len({p.n_cols for p in parts}) != 1:
            raise ValueError(f"cannot stack weights with {sorted({p.n_cols for p in parts})} columns")
        starts = torch.tensor([0] + [p.values.numel() for p in parts[:-1]]).cumsum(0).tolist()
        offsets = [p.row_offsets + s for p, s in zip(parts, starts, strict=True)]
        return cls(torch.cat([p.bitmap for p in parts]), torch.cat([p.values for p in parts]),
                   torch.cat(offsets), parts[0].n_cols)

    def to(self, device: torch.device, dtype: torch.dtype) -> "BitmapWeight":
        """On `device` with values in `dtype`, each tensor contiguous and owning its memory."""
        return BitmapWeight(self.bitmap.to(device).contiguous().clone(),
                            self.values.to(device=device, dtype=dtype).contiguous().clone(),
                            self.row_offsets.to(device).contiguous().clone(), self.n_cols)

    def dense(self) -> torch.Tensor:
        return _decode(self.bitmap, self.values, self.n_cols)

    def mask(self) -> torch.Tensor:
        return unpack_rows(self.bitmap, self.n_cols)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.bitmap, self.values, self.row_offsets))
