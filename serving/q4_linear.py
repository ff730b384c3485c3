"""The 4-bit sparse weight (`bitmap-q4`: bitmap, 4-bit codes of the kept weights, an fp16 scale per row and
group, and on the asymmetric grid a zero point per row and group) that `leap_sparse` layers hold, and its
portable op.

On CPU the layers call the native kernel `torch.ops.leap_sparse_cpu.bitmap_q4_linear` (`serving.cpu_kernel`),
which reads this layout as stored, or, with int8 activations (the default where the CPU has AVX-512 VNNI),
`bitmap_q4_i8_linear` on the pair layout (`Q4Pairs`) made at load. `bitmap_q4_linear` below is the portable
path (any device, the GPU included) and the reference: it decodes the weight per call and runs one dense
matmul; `int8_activations` is the reference of how the int8 op rounds x. On a GPU the layers hold the weight
in the Triton kernel's tile-major layout (`Q4Weight.tiles`, made once at load) and call
`bitmap_q4_tiled_linear`, which never synchronises the host (CUDA graphs capture it); the portable op's
boolean indexing would."""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from serving import cpu_kernel
from sparse_formats import get_format

Q4 = get_format("bitmap-q4")
# Rows of x (tokens of a step) up to which the int8 op runs its decoding kernel (kPairMaxM in
# bitmap_q4/kernels.h); above, its prefill kernel (an int8 GEMM). Both round x as `int8_activations` does.
INT8_MAX_ROWS = 8


def int8_activations(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x in fp32 as the int8 op multiplies it: per row and group of `group_size` columns, q = round(x * (127
    / max|x|)) (ties to even; 0 for an all-zero group) and x = q * (max|x| / 127), as llama.cpp's Q8_0."""
    groups = x.float().reshape(*x.shape[:-1], -1, group_size)
    top = groups.abs().amax(-1, keepdim=True)
    # Tensor by tensor: torch computes `127.0 / top` and `top / 127.0` through a reciprocal, which rounds
    # differently from the op's one division.
    limit = torch.full_like(top, 127.0)
    inverse = torch.where(top > 0, limit / top, torch.zeros_like(top))
    return (torch.round(groups * inverse) * (top / limit)).reshape(x.shape)


def decode(bitmap: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, row_offsets: torch.Tensor,
           n_cols: int, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """The dense fp32 weight [rows, n_cols] on the tensors' device (`zeros`: the stored zero points)."""
    shape = torch.tensor([bitmap.shape[0], n_cols], dtype=torch.int64)
    tensors = {"shape": shape, "bitmap": bitmap, "codes": codes, "scales": scales, "row_offsets": row_offsets}
    if zeros is not None:
        tensors["zeros"] = zeros
    return Q4.decode(tensors)


@torch.library.custom_op("leap_sparse::bitmap_q4_linear", mutates_args=())
def bitmap_q4_linear(x: torch.Tensor, bitmap: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     row_offsets: torch.Tensor, n_cols: int, bias: torch.Tensor | None = None,
                     zeros: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b for W in the bitmap-q4 layout, decoded per call (the weight in x's dtype)."""
    weight = decode(bitmap, codes, scales, row_offsets, n_cols, zeros).to(x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


@bitmap_q4_linear.register_fake
def _bitmap_q4_linear_fake(x, bitmap, codes, scales, row_offsets, n_cols, bias=None, zeros=None):
    return x.new_empty((*x.shape[:-1], bitmap.shape[0]))


def q4_gpu_kernel():
    """The Triton bitmap-q4 kernel module (`serving.kernels.bitmap_q4_triton`) when Triton imports, else
    None."""
    try:
        from serving.kernels import bitmap_q4_triton
    except ImportError:
        return None
    return bitmap_q4_triton


@torch.library.custom_op("leap_sparse::bitmap_q4_tiled_linear", mutates_args=())
def bitmap_q4_tiled_linear(x: torch.Tensor, tensors: list[torch.Tensor], n_rows: int, n_cols: int,
                           group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GPU kernel behind an opaque op (vLLM's torch.compile sees one call): `tensors` are
    `Q4Tiles.tensors()` of a [n_rows, n_cols] weight with groups of `group_size` columns."""
    kernel = q4_gpu_kernel()
    if kernel is None:
        raise RuntimeError("serving.kernels.bitmap_q4_triton is not importable (no triton)")
    return kernel.q4_tiles_linear(x, kernel.Q4Tiles.from_tensors(tensors, n_rows, n_cols, group_size), bias)


@bitmap_q4_tiled_linear.register_fake
def _bitmap_q4_tiled_linear_fake(x, tensors, n_rows, n_cols, group_size, bias=None):
    return x.new_empty((*x.shape[:-1], n_rows))


def pruned_at_zero_by_default(asymmetric: bool) -> bool:
    """Whether the int8-x op's pair layout holds every column, each pruned one at its group's zero point: on
    the asymmetric grid where the op runs its AVX2 kernels, which have no byte expand and read those codes in
    a third of the instructions that placing the kept ones takes (bitmap_q4_i8/avx2.cpp; 1.72x as fast on
    the Llama-3.2-1B shape from DRAM, bench/results/cpu_kernels_q4_llama1b_zen3.md)."""
    return asymmetric and cpu_kernel.current_isa() == "avx2"


@dataclass
class Q4Weight:
    """A [rows, n_cols] bitmap-q4 weight with the slicing tensor parallelism needs: row ranges for
    column-parallel layers, column ranges (whole groups, re-packed) for row-parallel ones. `zeros` (the
    stored zero points) is None on the symmetric grid."""

    bitmap: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    row_offsets: torch.Tensor
    n_cols: int
    zeros: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.bitmap.shape[0]

    @property
    def group_size(self) -> int:
        return self.n_cols // self.scales.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        tensors = {"shape": torch.tensor([self.rows, self.n_cols], dtype=torch.int64), "bitmap": self.bitmap,
                   "codes": self.codes, "scales": self.scales, "row_offsets": self.row_offsets}
        if self.zeros is not None:
            tensors["zeros"] = self.zeros
        return tensors

    @classmethod
    def from_tensors(cls, fmt: str, tensors: dict[str, torch.Tensor]) -> "Q4Weight":
        """From one projection's stored tensors; checks them first, so a corrupt checkpoint fails at load
        with the format's message instead of computing garbage."""
        Q4.check(tensors)
        return cls(tensors["bitmap"], tensors["codes"], tensors["scales"], tensors["row_offsets"],
                   int(tensors["shape"][1]), tensors.get("zeros"))

    def check(self) -> None:
        """The whole layout (offsets, counts, padding, scales), as the format checks it; raises its error.
        Layers run it once at load, after slicing and stacking."""
        Q4.check({name: t.cpu() for name, t in self.tensors().items()})

    def _row_end(self, row: int) -> int:
        return int(self.row_offsets[row]) if row < self.rows else self.codes.numel()

    def slice_rows(self, start: int, stop: int) -> "Q4Weight":
        first = self._row_end(start)
        return Q4Weight(self.bitmap[start:stop], self.codes[first:self._row_end(stop)],
                        self.scales[start:stop], self.row_offsets[start:stop] - first, self.n_cols,
                        None if self.zeros is None else self.zeros[start:stop])

    def slice_cols(self, start: int, stop: int) -> "Q4Weight":
        group = self.group_size
        if start % group or stop % group:
            raise ValueError(f"a column slice {start}:{stop} must cut whole groups of {group} columns")
        codes, scales, mask = Q4.unpack(self.tensors())
        zeros = Q4.zero_points(self.tensors())
        groups = slice(start // group, stop // group)
        packed = Q4.pack(codes[:, start:stop].contiguous(), scales[:, groups],
                         mask[:, start:stop].contiguous(), None if zeros is None else zeros[:, groups])
        return Q4Weight(packed["bitmap"], packed["codes"], packed["scales"], packed["row_offsets"],
                        stop - start, packed.get("zeros"))

    @classmethod
    def cat_rows(cls, parts: list["Q4Weight"]) -> "Q4Weight":
        """Stack weights with equal columns and groups (q/k/v into qkv, gate/up into gate_up)."""
        kinds = {(p.n_cols, p.group_size, p.zeros is not None) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot stack weights with {sorted(kinds)} (columns, group size, zero points)")
        starts = torch.tensor([0] + [p.codes.numel() for p in parts[:-1]]).cumsum(0).tolist()
        offsets = [p.row_offsets + s for p, s in zip(parts, starts, strict=True)]
        zeros = None if parts[0].zeros is None else torch.cat([p.zeros for p in parts])
        return cls(torch.cat([p.bitmap for p in parts]), torch.cat([p.codes for p in parts]),
                   torch.cat([p.scales for p in parts]), torch.cat(offsets).to(torch.int32), parts[0].n_cols,
                   zeros)

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> "Q4Weight":
        """On `device`, each tensor contiguous and owning its memory (`dtype`: unused, codes stay codes)."""
        def moved(t: torch.Tensor) -> torch.Tensor:
            return t.to(device).contiguous().clone()

        return Q4Weight(*(moved(t) for t in (self.bitmap, self.codes, self.scales, self.row_offsets)),
                        self.n_cols, None if self.zeros is None else moved(self.zeros))

    def dense(self) -> torch.Tensor:
        return decode(self.bitmap, self.codes, self.scales, self.row_offsets, self.n_cols, self.zeros)

    def tiles(self):
        """The GPU kernel's tile-major layout (`serving.kernels.bitmap_q4_triton.Q4Tiles`), made on this
        weight's device."""
        return q4_gpu_kernel().Q4Tiles.from_stored(self.tensors())

    def pairs(self, pruned_at_zero: bool | None = None, checked: bool = False) -> "Q4Pairs":
        """The layout the native int8-x kernel reads (needs the native op loaded and 64-column groups).
        `pruned_at_zero` (the asymmetric grid only): every column a code, a pruned one its group's zero
        point (the value 0). None: `pruned_at_zero_by_default`. `checked`: this weight's layout was checked
        (`check()`, as a layer does at load), so the op skips its own check of the row offsets."""
        if pruned_at_zero is None:
            pruned_at_zero = pruned_at_zero_by_default(self.zeros is not None)
        masks, codes, block_offsets, scales, zeros = torch.ops.leap_sparse_cpu.bitmap_q4_pack_pairs(
            self.bitmap, self.codes, self.scales, self.row_offsets, self.n_cols, self.zeros, pruned_at_zero,
            checked=checked)
        return Q4Pairs(masks, codes, block_offsets, scales, self.rows, self.n_cols, zeros, pruned_at_zero)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for name, t in self.tensors().items() if name != "shape")


@dataclass
class Q4Pairs:
    """A bitmap-q4 weight in the native int8-x kernel's pair layout (serving/csrc/bitmap_q4/kernels.h):
    rows in blocks of 4, each block's 64-bit masks, 4-bit codes and fp16 scales in the order the kernel reads
    them. Made at load by `Q4Weight.pairs`; multiplied by
    `torch.ops.leap_sparse_cpu.bitmap_q4_i8_linear(x, masks, codes, block_offsets, scales, n_rows, n_cols,
    bias, zeros=zeros, checked=True)` (`checked=True`: a layout that `pairs` made from a checked weight, so
    the op skips its check of the block offsets). `zeros`: the asymmetric grid's zero points (one byte per
    row and group, in the scales' order), empty for the symmetric grid. `pruned_at_zero`: the dense layout
    made from a sparse weight, each pruned column its group's zero point."""

    masks: torch.Tensor
    codes: torch.Tensor
    block_offsets: torch.Tensor
    scales: torch.Tensor
    n_rows: int
    n_cols: int
    zeros: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    pruned_at_zero: bool = False

    def tensors(self) -> dict[str, torch.Tensor]:
        """The layout's tensors; `zeros` only for the asymmetric grid."""
        named = {"masks": self.masks, "codes": self.codes, "block_offsets": self.block_offsets,
                 "scales": self.scales}
        if self.zeros.numel():
            named["zeros"] = self.zeros
        return named

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())
