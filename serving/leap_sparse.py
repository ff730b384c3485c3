"""The `leap_sparse` quantization method: vLLM linear layers that hold unstructured-sparse weights.

What a checkpoint says and stores is the contract in `serving.contract` (the config keys, the servable
formats and the tensors each pruned projection X stores, e.g. `X.shape`, `X.bitmap`, `X.values`,
`X.row_offsets` for bitmap); this module only implements it for vLLM.

As vLLM writes one linear method per scheme, each format has its own (`LINEAR_METHODS`):
`BitmapLinearMethod` (bitmap and csr, 16-bit values), `BitmapQ4LinearMethod` (4-bit codes of the kept weights
and fp16 scales, `serving.q4_linear`) and `Int8RowsLinearMethod` (an 8-bit lm_head, `serving.int8_linear`;
the config's `lm_head_format`). Their base, `LeapSparseLinearMethod`, loads them all the same way: the
values tensor has a data-dependent length, unknown when vLLM calls `create_weights`, so each layer
registers empty placeholder parameters whose weight loader only stashes what it receives (per q/k/v or
gate/up shard); `process_weights_after_loading` then cuts this rank's slice, stacks the shards and
replaces the placeholders with the runtime tensors. Merged layers arrive through the model's
stacked-params mapping: `q_proj.bitmap` is loaded into `qkv_proj.bitmap` with shard id "q".

Compute: each method picks its layer's kernel once, at load (`layer.leap_kernel`; `apply` only calls it).
On CPU the native kernel (`serving.cpu_kernel`, built ahead by `make` or once when the model loads) reads
the stored layout directly; where it cannot be built, one warning line says so and the layers decode their
weight on every call. On CUDA the Triton kernels: tiled-bitmap for 16-bit values, bitmap-q4's tile kernel
(`Q4Weight.tiles`) for 4-bit codes, and `GpuInt8` (torch._int_mm) for an 8-bit lm_head, none of which
synchronises the host, so vLLM's CUDA graphs capture them; `LEAP_SPARSE_DECODE_DENSE=1` keeps dense
weights instead."""

from abc import abstractmethod
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethodBase,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.utils import set_weight_attrs

from serving import cpu_kernel
from serving.contract import Q4_ZERO_POINTS, QUANT_METHOD, LeapSparseSettings
from serving.huge_pages import enabled as huge_pages_enabled
from serving.huge_pages import huge_page_bytes, huge_page_copy
from serving.int8_linear import (
    GpuInt8,
    Int8Weight,
    NativeInt8,
    OneDNNInt8,
    int8_rows_linear,
    native_int8_available,
    onednn_int8_available,
)
from serving.q4_linear import Q4Weight, bitmap_q4_linear, bitmap_q4_tiled_linear, q4_gpu_kernel
from serving.sparse_linear import BitmapWeight, bitmap_linear, tiled_bitmap_linear, tiled_kernel
from sparse_formats import get_format

logger = init_logger(f"vllm.plugins.{__name__}")  # under "vllm" so that vLLM's log handlers show it

_INDEX_DTYPES = {"shape": torch.int64, "bitmap": torch.uint8, "row_offsets": torch.int64,
                 "col_indices": torch.int32, "row_ptr": torch.int64, "codes": torch.uint8,
                 "scales": torch.float16, "qweight": torch.int8, Q4_ZERO_POINTS: torch.uint8}
# A layer's runtime weight: what the loader's placeholders stashed, this rank's part, stacked and checked.
Weight = BitmapWeight | Q4Weight | Int8Weight
_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


class LeapSparseConfig(QuantizationConfig):
    """The checkpoint's `quantization_config`; also totals the bytes the loaded sparse layers hold."""

    def __init__(self, settings: LeapSparseSettings) -> None:
        super().__init__()
        self.fmt = settings.fmt
        self.ignore = list(settings.ignore)
        self.decode_dense = settings.decode_dense
        self.activations = settings.activations
        self.settings = settings
        self._layers_expected = 0
        self._layers_loaded = 0
        self._bytes_held = 0
        self._dense_bytes = 0
        self._compute = "decoded to dense at load" if self.decode_dense else "compressed"
        self._compute_int8 = ""
        self.head_note = ""  # how an 8-bit lm_head multiplies, for the load summary
        self.layout_note = ""  # where bitmap-q4 layers read their pruned weights as codes
        self._native = False  # whether a layer multiplies through the native CPU kernel

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LeapSparseConfig":
        return cls(LeapSparseSettings.from_config(config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> LinearMethodBase | None:
        """Sparse linears, and lm_head when the checkpoint stores it quantized (bitmap-q4 exports of
        `quantize --lm-head-bits 4|8`: its 4-bit codes, every weight kept, or int8-rows); what `ignore` names
        stays dense."""
        skipped = is_layer_skipped(prefix, self.ignore, self.packed_modules_mapping, match_mode="suffix")
        if isinstance(layer, ParallelLMHead) and not skipped:
            return self._method(lm_head=True)
        if not isinstance(layer, LinearBase):
            return None
        if skipped:
            return UnquantizedLinearMethod()
        return self._method(lm_head=False)

    def _method(self, lm_head: bool) -> "LeapSparseLinearMethod":
        """A new linear method (one per layer) of the layer's format, from `LINEAR_METHODS`."""
        self._layers_expected += 1
        fmt, names = self.settings.layer_tensors(lm_head=lm_head)
        return LINEAR_METHODS[fmt](self, fmt, names)

    def native_cpu_kernel(self) -> bool:
        """Whether CPU layers can use the native kernel; the first layer to ask builds or loads it, and
        if that fails this logs the one warning line."""
        if not cpu_kernel.load():
            if self._compute == "compressed":
                logger.warning("leap_sparse: the native CPU kernel is unavailable: %s; decoding each weight "
                               "on every call instead (slow)", cpu_kernel.unavailable_reason())
                self._compute = "compressed, decoded per call"
            return False
        self._compute = f"compressed, native CPU kernel ({cpu_kernel.current_isa()})"
        self._native = True
        return True

    def gpu_kernel(self, device: torch.device, available: bool) -> bool:
        """Whether a layer on `device` computes through a GPU kernel (CUDA and the kernel's package
        importable); says so in the load summary."""
        if device.type != "cuda" or not available:
            return False
        self._compute = "compressed, Triton GPU kernels"
        return True

    def int8_activations(self, weight: Q4Weight, dtype: torch.dtype) -> bool:
        """Whether a native CPU bitmap-q4 layer multiplies int8 x (prefill and decoding steps): asked for
        (`activations`), groups of whole 64-column pairs, a bf16 or fp32 model, and a CPU with the int8
        kernel's instructions (else the layer multiplies x as it is, and the load summary says so)."""
        if self.activations != "int8":
            return False
        if weight.group_size % 64 or dtype not in (torch.bfloat16, torch.float32):
            self._compute_int8 = "x as it is (int8 x needs groups of a multiple of 64 columns, bf16 or fp32)"
            return False
        if not cpu_kernel.int8_kernel_available():
            self._compute_int8 = "x as it is (int8 x needs AVX-512 VNNI and VBMI2, and GFNI)"
            return False
        return True

    def record_loaded_layer(self, bytes_held: int, dense_bytes: int) -> None:
        """Add one loaded layer; after the last one, log what all of them hold against dense weights."""
        self._layers_loaded += 1
        self._bytes_held += bytes_held
        self._dense_bytes += dense_bytes
        if self._layers_loaded == self._layers_expected:
            logger.info("leap_sparse: %d sparse linear layers hold %d bytes, %.4fx of %d dense bytes "
                        "(format %s, %s)%s", self._layers_loaded, self._bytes_held,
                        self._bytes_held / max(self._dense_bytes, 1), self._dense_bytes, self.fmt,
                        self._compute + self._activations_note() + self.layout_note + self.head_note,
                        self._pages_note())

    def _pages_note(self) -> str:
        """How much of the process the kernel put on huge pages, where the layers asked for them."""
        held = huge_page_bytes() if self._native and huge_pages_enabled() else None
        return "" if held is None else f"; {held / 2**20:.0f} MiB of the process on huge pages"

    def _activations_note(self) -> str:
        if self.fmt != "bitmap-q4" or self.decode_dense or not self._native:
            return ""
        return f", prefill and decoding steps with {self._compute_int8 or self.activations + ' x'}"


# Kernels: one per layer, chosen once at load by its method's `hold` and stored as `layer.leap_kernel`;
# `apply` calls it as kernel(layer, x, bias). Each reads what the layer holds (its registered tensors, or the
# layout made at load) and, where an op takes only some dtypes of x, compares x's dtype, nothing else.
Kernel = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor]
# x dtypes the native bitmap-q4 op multiplies; other x goes through the torch op.
_NATIVE_Q4_DTYPES = (torch.bfloat16, torch.float32)


def dense_kernel(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`LEAP_SPARSE_DECODE_DENSE=1`: the weight decoded once at load."""
    return F.linear(x, layer.weight, bias)


def bitmap_torch_kernel(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """16-bit values decoded per call (no native kernel, or x not in the values' dtype)."""
    return bitmap_linear(x, layer.bitmap, layer.values, layer.row_offsets, layer.leap_n_cols, bias)


def bitmap_native_kernel(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The native CPU op, which multiplies x in the values' dtype only."""
    if x.dtype != layer.values.dtype:
        return bitmap_torch_kernel(layer, x, bias)
    return torch.ops.leap_sparse_cpu.bitmap_linear(x, layer.bitmap, layer.values, layer.row_offsets,
                                                   layer.leap_n_cols, bias, checked=True)


def bitmap_tiled_kernel(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The tiled-bitmap Triton kernel on the layout made at load."""
    tensors, names, n_rows = layer.leap_tiled
    return tiled_bitmap_linear(x, tensors, names, n_rows, bias)


def q4_tiles_kernel(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bitmap-q4's Triton tile kernel on the tile-major layout made at load."""
    return bitmap_q4_tiled_linear(x, *layer.leap_q4_tiles, bias)


def q4_torch_kernel(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                    asymmetric: bool) -> torch.Tensor:
    """4-bit codes decoded per call; `asymmetric`: the layer holds the grid's zero points."""
    return bitmap_q4_linear(x, layer.bitmap, layer.codes, layer.scales, layer.row_offsets, layer.leap_n_cols,
                            bias, layer.zeros if asymmetric else None)


def q4_native_kernel(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                     asymmetric: bool) -> torch.Tensor:
    """The native CPU op on the stored layout, which multiplies bf16 or fp32 x only."""
    if x.dtype not in _NATIVE_Q4_DTYPES:
        return q4_torch_kernel(layer, x, bias, asymmetric)
    return torch.ops.leap_sparse_cpu.bitmap_q4_linear(x, layer.bitmap, layer.codes, layer.scales,
                                                      layer.row_offsets, layer.leap_n_cols, bias,
                                                      layer.zeros if asymmetric else None, checked=True)


def q4_pairs_kernel(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                    asymmetric: bool) -> torch.Tensor:
    """The native int8-x op on the pair layout made at load (`Q4Pairs`)."""
    return torch.ops.leap_sparse_cpu.bitmap_q4_i8_linear(
        x, layer.masks, layer.codes, layer.block_offsets, layer.scales, layer.leap_n_rows, layer.leap_n_cols,
        bias, layer.zeros if asymmetric else None, checked=True)


def int8_head_kernel(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """An 8-bit lm_head through the object chosen at load (`GpuInt8`, `NativeInt8` or `OneDNNInt8`)."""
    return layer.leap_int8(x, bias)


def int8_torch_kernel(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """An 8-bit lm_head decoded per call (the portable op)."""
    return int8_rows_linear(x, layer.qweight, layer.scales, bias)


class LeapSparseLinearMethod(LinearMethodBase):
    """What every format shares: placeholders whose loader stashes each shard, this rank's shards assembled
    and checked at load, `decode_dense`, the load summary, and `apply` calling the kernel chosen at load.
    One subclass per format (`LINEAR_METHODS`) holds the runtime tensors and picks the kernel."""

    weight_class: ClassVar[type[Weight]]

    def __init__(self, config: "LeapSparseConfig", fmt: str, names: tuple[str, ...]) -> None:
        self.config = config
        self.fmt = fmt  # this layer's format (an lm_head may have its own) and its stored tensors
        self.names = names

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        layer.leap_parts = {}  # shard index -> stored tensor name -> tensor, filled by the loader below
        layer.leap_output_partition_sizes = list(output_partition_sizes)
        layer.leap_input_size = input_size
        layer.leap_params_dtype = params_dtype
        for name in self.names:
            dtype = _INDEX_DTYPES.get(name, params_dtype)
            placeholder = Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
            set_weight_attrs(placeholder, {"weight_loader": _stash_loader(layer, name)})
            layer.register_parameter(name, placeholder)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight, device = self._assemble(layer)
        dense_bytes = weight.rows * weight.n_cols * layer.leap_params_dtype.itemsize
        if self.config.decode_dense:
            layer.weight = Parameter(weight.dense().to(layer.leap_params_dtype), requires_grad=False)
            layer.leap_kernel = dense_kernel
            self.config.record_loaded_layer(dense_bytes, dense_bytes)
            return
        layer.leap_kernel, bytes_held = self.hold(layer, weight, device)
        self.config.record_loaded_layer(bytes_held, dense_bytes)

    @abstractmethod
    def hold(self, layer: torch.nn.Module, weight: Weight, device: torch.device) -> tuple[Kernel, int]:
        """Register the runtime tensors of `weight` (this rank's, checked) on `layer`; return the kernel
        that multiplies them here and the bytes they hold."""
        raise NotImplementedError

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return layer.leap_kernel(layer, x, bias)

    def _assemble(self, layer: torch.nn.Module) -> tuple[Weight, torch.device]:
        """This rank's weight from the stashed shards, stacked, on the placeholders' device and checked;
        the placeholders and the stash are gone afterwards."""
        device = getattr(layer, self.names[1]).device
        shards = []
        for index, size in enumerate(layer.leap_output_partition_sizes):
            parts = layer.leap_parts.get(index, {})
            missing = [n for n in self.names if n not in parts]
            if missing:
                raise ValueError(f"leap_sparse: {layer.prefix} (shard {index}) has no {', '.join(missing)} "
                                 f"in the checkpoint")
            full = self.weight_class.from_tensors(self.fmt, parts)
            shards.append(_this_rank(layer, index, size, full))
        weight = self.weight_class.cat_rows(shards).to(device, layer.leap_params_dtype)
        weight.check()  # once, at load: the native op is then told the layout is checked
        for name in self.names:
            delattr(layer, name)
        del layer.leap_parts
        return weight, device


def _register(layer: torch.nn.Module, tensors: dict[str, torch.Tensor], huge_pages: bool = True) -> None:
    """Register `tensors` as the layer's parameters; on CPU (with `huge_pages`) on huge pages
    (`serving.huge_pages`: fewer TLB misses while a decode step streams them)."""
    for name, tensor in tensors.items():
        held = huge_page_copy(tensor) if huge_pages else tensor
        layer.register_parameter(name, Parameter(held, requires_grad=False))


class BitmapLinearMethod(LeapSparseLinearMethod):
    """bitmap and csr projections (16-bit values, held as bitmap): tiled-bitmap Triton on CUDA, the native
    op on CPU, else the torch op."""

    weight_class = BitmapWeight

    def hold(self, layer: torch.nn.Module, weight: BitmapWeight, device: torch.device) -> tuple[Kernel, int]:
        layer.leap_n_cols = weight.n_cols
        if self.config.gpu_kernel(device, tiled_kernel() is not None):
            tiled = get_format("tiled-bitmap").encode(weight.dense(), weight.mask())
            layer.leap_tiled = (list(tiled.values()), ",".join(tiled), weight.rows)
            return bitmap_tiled_kernel, sum(t.numel() * t.element_size() for t in tiled.values())
        _register(layer, {"bitmap": weight.bitmap, "values": weight.values})
        _register(layer, {"row_offsets": weight.row_offsets}, huge_pages=False)
        native = device.type == "cpu" and self.config.native_cpu_kernel()
        return (bitmap_native_kernel if native else bitmap_torch_kernel), weight.nbytes()


class BitmapQ4LinearMethod(LeapSparseLinearMethod):
    """bitmap-q4 projections (and a 4-bit lm_head): on CUDA the Triton kernel's tile-major layout, made
    once here (the stored tensors freed); on CPU with int8 activations the native int8-x op on the pair
    layout made here; else as stored, through the native bf16/fp32 op or the torch op."""

    weight_class = Q4Weight

    def hold(self, layer: torch.nn.Module, weight: Q4Weight, device: torch.device) -> tuple[Kernel, int]:
        layer.leap_n_cols = weight.n_cols
        if self.config.gpu_kernel(device, q4_gpu_kernel() is not None):
            tiles = weight.tiles()
            layer.leap_q4_tiles = (tiles.tensors(), tiles.n_rows, tiles.n_cols, tiles.group_size)
            return q4_tiles_kernel, tiles.nbytes()
        native = device.type == "cpu" and self.config.native_cpu_kernel()
        if native and self.config.int8_activations(weight, layer.leap_params_dtype):
            pairs = weight.pairs(checked=True)  # process_weights_after_loading checked the weight
            if pairs.pruned_at_zero:
                self.config.layout_note = "; pruned weights read as zero-point codes (AVX2: no byte expand)"
            layer.leap_n_rows = pairs.n_rows
            tensors = pairs.tensors()
            _register(layer, tensors)
            return partial(q4_pairs_kernel, asymmetric=Q4_ZERO_POINTS in tensors), pairs.nbytes()
        tensors = {name: t for name, t in weight.tensors().items() if name != "shape"}
        _register(layer, tensors)
        kernel = q4_native_kernel if native else q4_torch_kernel
        return partial(kernel, asymmetric=Q4_ZERO_POINTS in tensors), weight.nbytes()


class Int8RowsLinearMethod(LeapSparseLinearMethod):
    """An 8-bit lm_head (int8-rows): on a GPU an int8 GEMM of the codes as stored (GpuInt8); on CPU the
    native op for decoding steps (NativeInt8), else packed once for vLLM's oneDNN int8 GEMM (which then owns
    the codes); elsewhere kept as stored and decoded per call."""

    weight_class = Int8Weight

    def hold(self, layer: torch.nn.Module, weight: Int8Weight, device: torch.device) -> tuple[Kernel, int]:
        head = self._head(layer, weight, device)
        if head is None:
            _register(layer, {n: t for n, t in weight.tensors().items() if n != "shape"}, huge_pages=False)
            return int8_torch_kernel, weight.nbytes()
        layer.leap_int8 = head
        return int8_head_kernel, weight.nbytes()

    def _head(self, layer: torch.nn.Module, weight: Int8Weight,
              device: torch.device) -> GpuInt8 | NativeInt8 | OneDNNInt8 | None:
        """The head object that multiplies here (noted in the load summary), or None for the torch op."""
        if self.config.gpu_kernel(device, True):
            self.config.head_note = "; 8-bit lm_head: int8 GEMM (torch._int_mm)"
            return GpuInt8(weight)
        if device.type == "cpu" and self.config.native_cpu_kernel() and native_int8_available(weight.n_cols):
            self.config.head_note = "; 8-bit lm_head: native int8 op in decoding steps"
            return NativeInt8(weight, layer.leap_params_dtype)
        if device.type == "cpu" and onednn_int8_available():
            self.config.head_note = "; 8-bit lm_head: oneDNN int8 GEMM"
            return OneDNNInt8(weight, layer.leap_params_dtype)
        return None


# The linear method of each servable format (`serving.contract`: SERVABLE_FORMATS and LM_HEAD_FORMATS).
LINEAR_METHODS: dict[str, type[LeapSparseLinearMethod]] = {
    "bitmap": BitmapLinearMethod, "csr": BitmapLinearMethod, "bitmap-q4": BitmapQ4LinearMethod,
    "int8-rows": Int8RowsLinearMethod}


def _stash_loader(layer: torch.nn.Module, name: str):
    """A weight loader that keeps the tensor for `process_weights_after_loading`, keyed by shard."""

    def load(param: Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if shard_id is None:
            shard_id = getattr(loaded, "shard_id", None)
        if isinstance(layer, QKVParallelLinear) and shard_id is None:
            raise ValueError(f"leap_sparse: {layer.prefix} needs q/k/v stored separately, not fused")
        index = _QKV_SHARDS[shard_id] if isinstance(shard_id, str) else int(shard_id or 0)
        layer.leap_parts.setdefault(index, {})[name] = loaded

    return load


def _this_rank(layer: torch.nn.Module, index: int, size: int, full: Weight) -> Weight:
    """This tensor-parallel rank's part of one projection: a row range of column-parallel layers (k/v
    heads may be replicated over ranks), a column range of row-parallel ones, all of a replicated one."""
    name = f"leap_sparse: {layer.prefix} (shard {index})"
    if isinstance(layer, ParallelLMHead):  # split by vocabulary rows
        if full.rows != size * layer.tp_size or full.n_cols != layer.leap_input_size:
            raise ValueError(f"{name} is {full.rows}x{full.n_cols}, the model expects "
                             f"{size * layer.tp_size}x{layer.leap_input_size} (a vocabulary padded to the "
                             f"ranks is not supported)")
        return full.slice_rows(layer.tp_rank * size, (layer.tp_rank + 1) * size)
    if isinstance(layer, RowParallelLinear):
        cols = layer.input_size_per_partition
        if full.rows != size or full.n_cols != layer.leap_input_size:
            raise ValueError(f"{name} is {full.rows}x{full.n_cols}, the model expects "
                             f"{size}x{layer.leap_input_size}")
        start = layer.tp_rank * cols
        return full.slice_cols(start, start + cols)
    if isinstance(layer, ColumnParallelLinear):
        replicas = layer.num_kv_head_replicas if isinstance(layer, QKVParallelLinear) and index > 0 else 1
        blocks = layer.tp_size // replicas
        if full.rows != size * blocks or full.n_cols != layer.leap_input_size:
            raise ValueError(f"{name} is {full.rows}x{full.n_cols}, the model expects "
                             f"{size * blocks}x{layer.leap_input_size}")
        start = (layer.tp_rank // replicas) * size
        return full.slice_rows(start, start + size)
    if full.rows != size or full.n_cols != layer.leap_input_size:
        raise ValueError(f"{name} is {full.rows}x{full.n_cols}, the model expects "
                         f"{size}x{layer.leap_input_size}")
    return full
