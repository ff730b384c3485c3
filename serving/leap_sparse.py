"""The `leap_sparse` quantization method: vLLM linear layers that hold unstructured-sparse weights.

What a checkpoint says and stores is the contract in `serving.contract` (the config keys, the servable
formats and the tensors each pruned projection X stores, e.g. `X.shape`, `X.bitmap`, `X.values`,
`X.row_offsets` for bitmap); this module only implements it for vLLM.

The values tensor has a data-dependent length, unknown when vLLM calls `create_weights`, so each layer
registers empty placeholder parameters whose weight loader only stashes what it receives (per q/k/v or
gate/up shard); `process_weights_after_loading` then cuts this rank's slice, stacks the shards and
replaces the placeholders with the runtime tensors. Merged layers arrive through the model's
stacked-params mapping: `q_proj.bitmap` is loaded into `qkv_proj.bitmap` with shard id "q".

`bitmap-q4` layers (4-bit codes of the kept weights and fp16 scales, `serving.q4_linear`) load the same way,
and so does an 8-bit lm_head (`int8-rows`, `serving.int8_linear`; the config's `lm_head_format`).

Compute: on CPU the native kernel (`serving.cpu_kernel`, built ahead by `make` or once when the model
loads) reads the stored layout directly; where it cannot be built, one warning line says so and the layers
decode their weight on every call. On CUDA the Triton kernels, chosen at load: tiled-bitmap for 16-bit values,
bitmap-q4's tile kernel (`Q4Weight.tiles`) for 4-bit codes, and `GpuInt8` (torch._int_mm) for an 8-bit
lm_head, none of which synchronises the host, so vLLM's CUDA graphs capture them; `LEAP_SPARSE_DECODE_DENSE=1`
keeps dense weights instead."""

from typing import Any

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
# The runtime weight of each servable format (the loader's placeholders only stash what they receive).
_WEIGHTS = {"bitmap": BitmapWeight, "csr": BitmapWeight, "bitmap-q4": Q4Weight, "int8-rows": Int8Weight}
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
            self._layers_expected += 1
            return LeapSparseLinearMethod(self, *self.settings.layer_tensors(lm_head=True))
        if not isinstance(layer, LinearBase):
            return None
        if skipped:
            return UnquantizedLinearMethod()
        self._layers_expected += 1
        return LeapSparseLinearMethod(self, *self.settings.layer_tensors(lm_head=False))

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


class LeapSparseLinearMethod(LinearMethodBase):
    """Loads bitmap, csr or bitmap-q4 projections (and an int8-rows lm_head) into a vLLM linear layer and
    multiplies through the matching op."""

    def __init__(self, config: LeapSparseConfig, fmt: str, names: tuple[str, ...]) -> None:
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
        names = self.names
        device = getattr(layer, names[1]).device
        weight_class = _WEIGHTS[self.fmt]
        shards = []
        for index, size in enumerate(layer.leap_output_partition_sizes):
            parts = layer.leap_parts.get(index, {})
            missing = [n for n in names if n not in parts]
            if missing:
                raise ValueError(f"leap_sparse: {layer.prefix} (shard {index}) has no {', '.join(missing)} "
                                 f"in the checkpoint")
            full = weight_class.from_tensors(self.fmt, parts)
            shards.append(_this_rank(layer, index, size, full))
        weight = weight_class.cat_rows(shards).to(device, layer.leap_params_dtype)
        weight.check()  # once, at load: the native op is then told the layout is checked
        for name in names:
            delattr(layer, name)
        del layer.leap_parts

        dense_bytes = weight.rows * weight.n_cols * layer.leap_params_dtype.itemsize
        if self.config.decode_dense:
            layer.weight = Parameter(weight.dense().to(layer.leap_params_dtype), requires_grad=False)
            self.config.record_loaded_layer(dense_bytes, dense_bytes)
            return
        if isinstance(weight, Q4Weight):
            self._hold_q4(layer, weight, device, dense_bytes)
            return
        if isinstance(weight, Int8Weight):
            self._hold_int8(layer, weight, device, dense_bytes)
            return
        # On CPU the weights go onto huge pages (serving.huge_pages: fewer TLB misses while a decode step
        # streams them); elsewhere huge_page_copy returns them as they are.
        layer.bitmap = Parameter(huge_page_copy(weight.bitmap), requires_grad=False)
        layer.values = Parameter(huge_page_copy(weight.values), requires_grad=False)
        layer.row_offsets = Parameter(weight.row_offsets, requires_grad=False)
        layer.leap_n_cols = weight.n_cols
        bytes_held = weight.nbytes()
        layer.leap_tiled = None
        layer.leap_native = device.type == "cpu" and self.config.native_cpu_kernel()
        if self.config.gpu_kernel(device, tiled_kernel() is not None):
            tiled = get_format("tiled-bitmap").encode(weight.dense(), weight.mask())
            layer.leap_tiled = (list(tiled.values()), ",".join(tiled), weight.rows)
            bytes_held = sum(t.numel() * t.element_size() for t in tiled.values())
            for name in ("bitmap", "values", "row_offsets"):
                delattr(layer, name)
        self.config.record_loaded_layer(bytes_held, dense_bytes)

    def _hold_q4(self, layer: torch.nn.Module, weight: Q4Weight, device: torch.device,
                 dense_bytes: int) -> None:
        """bitmap-q4 on a GPU: the Triton kernel's tile-major layout, made here once (the stored tensors
        freed). On CPU it stays as stored: the native CPU op reads it, elsewhere it is decoded per call; with
        int8 activations the native op reads the pair layout made from it here (the stored tensors freed).
        On CPU either goes onto huge pages, as in process_weights_after_loading."""
        layer.leap_n_cols = weight.n_cols
        layer.leap_q4 = True
        layer.leap_q4_tiles = None
        if self.config.gpu_kernel(device, q4_gpu_kernel() is not None):
            tiles = weight.tiles()
            layer.leap_q4_tiles = (tiles.tensors(), tiles.n_rows, tiles.n_cols, tiles.group_size)
            self.config.record_loaded_layer(tiles.nbytes(), dense_bytes)
            return
        layer.leap_native = device.type == "cpu" and self.config.native_cpu_kernel()
        layer.leap_pairs = layer.leap_native and self.config.int8_activations(weight, layer.leap_params_dtype)
        if layer.leap_pairs:
            pairs = weight.pairs(checked=True)  # process_weights_after_loading checked the weight
            if pairs.pruned_at_zero:
                self.config.layout_note = "; pruned weights read as zero-point codes (AVX2: no byte expand)"
            layer.leap_n_rows = pairs.n_rows
            for name, tensor in pairs.tensors().items():
                layer.register_parameter(name, Parameter(huge_page_copy(tensor), requires_grad=False))
            self.config.record_loaded_layer(pairs.nbytes(), dense_bytes)
            return
        for name, tensor in weight.tensors().items():
            if name != "shape":
                layer.register_parameter(name, Parameter(huge_page_copy(tensor), requires_grad=False))
        self.config.record_loaded_layer(weight.nbytes(), dense_bytes)

    def _hold_int8(self, layer: torch.nn.Module, weight: Int8Weight, device: torch.device,
                   dense_bytes: int) -> None:
        """An 8-bit lm_head: on a GPU an int8 GEMM of the codes as stored (GpuInt8); on CPU the native op for
        decoding steps (NativeInt8), else packed once for vLLM's oneDNN int8 GEMM (which then owns the codes);
        elsewhere kept as stored and decoded per call."""
        layer.leap_int8 = None
        if self.config.gpu_kernel(device, True):
            layer.leap_int8 = GpuInt8(weight)
            self.config.head_note = "; 8-bit lm_head: int8 GEMM (torch._int_mm)"
        elif device.type == "cpu" and self.config.native_cpu_kernel() \
                and native_int8_available(weight.n_cols):
            layer.leap_int8 = NativeInt8(weight, layer.leap_params_dtype)
            self.config.head_note = "; 8-bit lm_head: native int8 op in decoding steps"
        elif device.type == "cpu" and onednn_int8_available():
            layer.leap_int8 = OneDNNInt8(weight, layer.leap_params_dtype)
            self.config.head_note = "; 8-bit lm_head: oneDNN int8 GEMM"
        else:
            for name, tensor in weight.tensors().items():
                if name != "shape":
                    layer.register_parameter(name, Parameter(tensor, requires_grad=False))
        self.config.record_loaded_layer(weight.nbytes(), dense_bytes)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.config.decode_dense:
            return F.linear(x, layer.weight, bias)
        if hasattr(layer, "leap_int8"):
            if layer.leap_int8 is not None:
                return layer.leap_int8(x, bias)
            return int8_rows_linear(x, layer.qweight, layer.scales, bias)
        if getattr(layer, "leap_q4", False):
            if layer.leap_q4_tiles is not None:
                return bitmap_q4_tiled_linear(x, *layer.leap_q4_tiles, bias)
            zeros = getattr(layer, Q4_ZERO_POINTS, None)  # the asymmetric grid's
            if layer.leap_pairs:
                return torch.ops.leap_sparse_cpu.bitmap_q4_i8_linear(
                    x, layer.masks, layer.codes, layer.block_offsets, layer.scales, layer.leap_n_rows,
                    layer.leap_n_cols, bias, zeros, checked=True)
            if layer.leap_native and x.dtype in (torch.bfloat16, torch.float32):
                return torch.ops.leap_sparse_cpu.bitmap_q4_linear(x, layer.bitmap, layer.codes, layer.scales,
                                                                  layer.row_offsets, layer.leap_n_cols, bias,
                                                                  zeros, checked=True)
            return bitmap_q4_linear(x, layer.bitmap, layer.codes, layer.scales, layer.row_offsets,
                                    layer.leap_n_cols, bias, zeros)
        if layer.leap_tiled is not None:
            tensors, names, n_rows = layer.leap_tiled
            return tiled_bitmap_linear(x, tensors, names, n_rows, bias)
        if layer.leap_native and x.dtype == layer.values.dtype:
            return torch.ops.leap_sparse_cpu.bitmap_linear(x, layer.bitmap, layer.values, layer.row_offsets,
                                                           layer.leap_n_cols, bias, checked=True)
        return bitmap_linear(x, layer.bitmap, layer.values, layer.row_offsets, layer.leap_n_cols, bias)


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


def _this_rank(layer: torch.nn.Module, index: int, size: int, full: BitmapWeight | Q4Weight):
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
