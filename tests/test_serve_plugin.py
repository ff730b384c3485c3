"""The `leap_sparse` linear method inside real vLLM linear layers, in this process: weights go in the way
vLLM's loader sends them (the model's stacked-params mapping tags q/k/v and gate/up shards), and each
tensor-parallel rank must compute exactly its slice of the dense masked weight. Ranks are simulated by
patching the tensor-parallel rank and size that vLLM's linear layers read."""

import pytest
import torch

vllm_linear = pytest.importorskip("vllm.model_executor.layers.linear")
vllm_parameter = pytest.importorskip("vllm.model_executor.parameter")

from serving import leap_sparse  # noqa: E402
from serving.contract import DECODE_DENSE_ENV, SERVABLE_FORMATS, LeapSparseSettings  # noqa: E402
from serving.leap_sparse import LeapSparseConfig  # noqa: E402
from serving.plugin import QUANT_METHOD, register  # noqa: E402
from sparse_formats import get_format  # noqa: E402

HIDDEN, HEAD, HEADS, KV_HEADS, FFN = 64, 16, 4, 2, 90
STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
           ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}


def masked_projection(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen), torch.rand(rows, cols, generator=gen) < 0.5


PROJECTIONS = {  # HF name -> (weight, mask)
    "q_proj": masked_projection(HEADS * HEAD, HIDDEN, 1),
    "k_proj": masked_projection(KV_HEADS * HEAD, HIDDEN, 2),
    "v_proj": masked_projection(KV_HEADS * HEAD, HIDDEN, 3),
    "o_proj": masked_projection(HIDDEN, HEADS * HEAD, 4),
    "gate_proj": masked_projection(FFN, HIDDEN, 5),
    "up_proj": masked_projection(FFN, HIDDEN, 6),
    "down_proj": masked_projection(HIDDEN, FFN, 7),
}


def stored(fmt: str, names: list[str]) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name relative to the layer, tensor) as the export writes them, with the shard tag
    vLLM's stacked-params mapping adds (`q_proj.bitmap` -> `qkv_proj.bitmap`, shard "q")."""
    out = []
    for name in names:
        weight, mask = PROJECTIONS[name]
        for key, tensor in get_format(fmt).encode(weight, mask).items():
            stacked = STACKED.get(f".{name}")
            if stacked is not None:
                tensor.shard_id = stacked[1]
            out.append((key, tensor))
    return out


def build_layer(monkeypatch, kind: str, config: LeapSparseConfig, rank: int, size: int):
    for module in (vllm_linear, vllm_parameter):
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: size)
    common = dict(bias=False, quant_config=config, params_dtype=torch.float32)
    block = "model.layers.0"
    if kind == "qkv":
        return vllm_linear.QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS,
                                             prefix=f"{block}.self_attn.qkv_proj", **common)
    if kind == "gate_up":
        return vllm_linear.MergedColumnParallelLinear(HIDDEN, [FFN, FFN], prefix=f"{block}.mlp.gate_up_proj",
                                                      **common)
    if kind == "down":
        return vllm_linear.RowParallelLinear(FFN, HIDDEN, prefix=f"{block}.mlp.down_proj", **common)
    return vllm_linear.ReplicatedLinear(HEADS * HEAD, HIDDEN, prefix=f"{block}.self_attn.o_proj", **common)


def load(layer, fmt: str, names: list[str]) -> None:
    load_tensors(layer, stored(fmt, names))


def load_tensors(layer, weights: list[tuple[str, torch.Tensor]]) -> None:
    """What vLLM's AutoWeightsLoader does: merged layers get `load_weights`, others each param's loader."""
    if hasattr(layer, "load_weights"):
        list(layer.load_weights(weights))
    else:
        params = dict(layer.named_parameters())
        for key, tensor in weights:
            params[key].weight_loader(params[key], tensor)
    layer.quant_method.process_weights_after_loading(layer)


def expected_slice(kind: str, rank: int, size: int) -> torch.Tensor:
    """This rank's part of the dense masked weight, cut plainly from the full matrices."""
    dense = {name: w * m for name, (w, m) in PROJECTIONS.items()}

    def rows(t, parts, index):
        step = t.shape[0] // parts
        return t[index * step:(index + 1) * step]

    if kind == "qkv":
        kv_parts = min(size, KV_HEADS)
        kv_index = rank // max(1, size // KV_HEADS)
        return torch.cat([rows(dense["q_proj"], size, rank), rows(dense["k_proj"], kv_parts, kv_index),
                          rows(dense["v_proj"], kv_parts, kv_index)])
    if kind == "gate_up":
        return torch.cat([rows(dense["gate_proj"], size, rank), rows(dense["up_proj"], size, rank)])
    if kind == "down":
        step = FFN // size
        return dense["down_proj"][:, rank * step:(rank + 1) * step]
    return dense["o_proj"]


LAYERS = {"qkv": ["q_proj", "k_proj", "v_proj"], "gate_up": ["gate_proj", "up_proj"], "down": ["down_proj"],
          "replicated": ["o_proj"]}


# Four ranks over two KV heads replicate each KV head on two ranks (q/k/v only: FFN=90 splits in two).
RANKS = [(kind, rank, size) for kind in LAYERS for rank, size in [(0, 1), (0, 2), (1, 2), (3, 4)]
         if size != 4 or kind in ("qkv", "replicated")]


@pytest.mark.parametrize("fmt", ["bitmap", "csr"])
@pytest.mark.parametrize("kind,rank,size", RANKS)
def test_each_rank_computes_its_slice_of_the_dense_masked_weight(monkeypatch, fmt, kind, rank, size):
    config = LeapSparseConfig(LeapSparseSettings(fmt, 0.5, ("lm_head",)))
    layer = build_layer(monkeypatch, kind, config, rank, size)
    load(layer, fmt, LAYERS[kind])
    weight = expected_slice(kind, rank, size)
    held_tensors = {"shape": torch.tensor(list(weight.shape)), "bitmap": layer.bitmap, "values": layer.values,
                    "row_offsets": layer.row_offsets}
    get_format("bitmap").check(held_tensors)
    assert torch.equal(get_format("bitmap").decode(held_tensors), weight)
    x = torch.randn(5, weight.shape[1])
    torch.testing.assert_close(layer.quant_method.apply(layer, x), x @ weight.T)
    held = sum(t.numel() * t.element_size() for t in (layer.bitmap, layer.values, layer.row_offsets))
    assert held <= 0.6 * weight.numel() * 4
    assert not hasattr(layer, "shape") and not hasattr(layer, "leap_parts")  # placeholders are gone


def test_decode_dense_flag_keeps_a_dense_weight(monkeypatch):
    monkeypatch.setenv(DECODE_DENSE_ENV, "1")
    config = LeapSparseConfig.from_config({"quant_method": QUANT_METHOD, "format": "bitmap", "sparsity": 0.5,
                                           "ignore": []})
    layer = build_layer(monkeypatch, "gate_up", config, 1, 2)
    load(layer, "bitmap", LAYERS["gate_up"])
    weight = expected_slice("gate_up", 1, 2)
    assert torch.equal(layer.weight, weight) and not hasattr(layer, "bitmap")
    x = torch.randn(3, HIDDEN)
    torch.testing.assert_close(layer.quant_method.apply(layer, x), x @ weight.T)


def test_a_missing_tensor_names_the_layer(monkeypatch):
    config = LeapSparseConfig(LeapSparseSettings("bitmap", 0.5))
    layer = build_layer(monkeypatch, "qkv", config, 0, 1)
    list(layer.load_weights([(k, t) for k, t in stored("bitmap", LAYERS["qkv"])
                             if not (k == "values" and t.shard_id == "v")]))
    with pytest.raises(ValueError, match=r"qkv_proj \(shard 2\) has no values"):
        layer.quant_method.process_weights_after_loading(layer)


def test_ignored_layers_stay_dense_and_fused_layers_must_agree(monkeypatch):
    config = LeapSparseConfig(LeapSparseSettings("bitmap", 0.5, ("model.layers.0.mlp.down_proj",)))
    config.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    dense = build_layer(monkeypatch, "down", config, 0, 1)
    assert isinstance(dense.quant_method, vllm_linear.UnquantizedLinearMethod)
    sparse = build_layer(monkeypatch, "qkv", config, 0, 1)
    assert type(sparse.quant_method) is leap_sparse.BitmapLinearMethod


def test_plugin_registration_is_idempotent():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    register()
    register()
    assert QUANTIZATION_METHODS.count(QUANT_METHOD) == 1
    assert get_quantization_config(QUANT_METHOD) is LeapSparseConfig


def test_cpu_layers_compute_with_the_native_kernel(monkeypatch):
    from serving import cpu_kernel

    if not cpu_kernel.load():
        pytest.skip(f"native kernel unavailable: {cpu_kernel.unavailable_reason()}")
    config = LeapSparseConfig(LeapSparseSettings("bitmap", 0.5))
    layer = build_layer(monkeypatch, "gate_up", config, 0, 1)
    load(layer, "bitmap", LAYERS["gate_up"])
    assert layer.leap_kernel is leap_sparse.bitmap_native_kernel
    x = torch.randn(4, HIDDEN)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = layer.quant_method.apply(layer, x)
    assert "leap_sparse_cpu::bitmap_linear" in {event.name for event in prof.events()}
    torch.testing.assert_close(got, x @ expected_slice("gate_up", 0, 1).T)


def test_without_the_native_kernel_layers_decode_per_call_after_one_warning(monkeypatch):
    monkeypatch.setattr(leap_sparse.cpu_kernel, "load", lambda: False)
    monkeypatch.setattr(leap_sparse.cpu_kernel, "unavailable_reason", lambda: "no compiler (test)")
    warnings = []
    monkeypatch.setattr(leap_sparse.logger, "warning", lambda *args: warnings.append(args[0] % args[1:]))
    config = LeapSparseConfig(LeapSparseSettings("bitmap", 0.5))
    layers = {kind: build_layer(monkeypatch, kind, config, 0, 1) for kind in ("gate_up", "down")}
    for kind, layer in layers.items():
        load(layer, "bitmap", LAYERS[kind])
        assert layer.leap_kernel is leap_sparse.bitmap_torch_kernel
        x = torch.randn(3, layer.leap_n_cols)
        torch.testing.assert_close(layer.quant_method.apply(layer, x), x @ expected_slice(kind, 0, 1).T)
    assert warnings == ["leap_sparse: the native CPU kernel is unavailable: no compiler (test); "
                        "decoding each weight on every call instead (slow)"]


def test_the_plugin_reads_the_contract_that_exports_write():
    """What an export writes into config.json is what the plugin parses back; a kernel layout or another
    method is refused with the contract's one-line reason."""
    written = LeapSparseSettings("csr", 0.6, ("lm_head",)).to_config()
    config = LeapSparseConfig.from_config(written)
    assert (config.fmt, config.ignore, config.decode_dense) == ("csr", ["lm_head"], False)
    with pytest.raises(ValueError, match="format 'tiled-csl' is not servable"):
        LeapSparseConfig.from_config({**written, "format": "tiled-csl"})
    with pytest.raises(ValueError, match="not a leap_sparse serving checkpoint"):
        LeapSparseConfig.from_config({**written, "quant_method": "compressed-tensors"})
    head8 = LeapSparseSettings("bitmap-q4", 0.5, lm_head_format="int8-rows").to_config()
    assert head8["lm_head_format"] == "int8-rows"
    settings = LeapSparseConfig.from_config(head8).settings
    assert settings.layer_tensors(lm_head=True) == ("int8-rows", ("shape", "qweight", "scales"))
    assert settings.layer_tensors(lm_head=False) == ("bitmap-q4", SERVABLE_FORMATS["bitmap-q4"])
    with pytest.raises(ValueError, match="lm_head format 'int4' is not servable"):
        LeapSparseConfig.from_config({**head8, "lm_head_format": "int4"})


def test_every_servable_format_has_a_linear_method():
    from serving.contract import LM_HEAD_FORMATS

    assert set(leap_sparse.LINEAR_METHODS) == set(SERVABLE_FORMATS) | set(LM_HEAD_FORMATS)


def q4_stored(names: list[str], asymmetric: bool) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    """(bitmap-q4 tensors as the loader sends them, groups of 64, the dense weight they decode to) for the
    projections `names` (stacked in that order), on the asymmetric grid or not."""
    q4 = get_format("bitmap-q4")
    out, dense = [], []
    for index, name in enumerate(names):
        weight, mask = PROJECTIONS[name]
        gen = torch.Generator().manual_seed(index)
        groups = (*weight.shape[:1], weight.shape[1] // 64)
        codes = torch.randint(0, 16, weight.shape, generator=gen, dtype=torch.uint8)
        scales = (torch.rand(groups, generator=gen) * 0.05 + 0.005).half()
        zeros = torch.randint(0, 16, groups, generator=gen, dtype=torch.uint8) if asymmetric else None
        tensors = q4.pack(codes, scales, mask, zeros)
        dense.append(q4.decode(tensors))
        for key, tensor in tensors.items():
            tensor.shard_id = STACKED[f".{name}"][1]
            out.append((key, tensor))
    return out, torch.cat(dense)


# (format, what the layer multiplies by: the native kernel or not, and for bitmap-q4 its x and grid)
METHOD_CASES = [(fmt, native, "") for fmt in ("bitmap", "csr", "int8-rows") for native in (True, False)] + [
    ("bitmap-q4", native, f"{activations},{grid}") for native in (True, False)
    for activations in ("int8", "bf16") for grid in ("symmetric", "asymmetric")]


def method_layer(monkeypatch, fmt: str, variant: str):
    """(a loaded layer of `fmt`'s linear method: gate_up, or lm_head for int8-rows; its dense weight)."""
    if fmt == "int8-rows":
        vocab = pytest.importorskip("vllm.model_executor.layers.vocab_parallel_embedding")
        monkeypatch.setattr(vocab, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(vocab, "get_tensor_model_parallel_world_size", lambda: 1)
        config = LeapSparseConfig(LeapSparseSettings("bitmap-q4", 0.5, lm_head_format="int8-rows"))
        layer = vocab.ParallelLMHead(128, HIDDEN, params_dtype=torch.float32, quant_config=config,
                                     prefix="lm_head")
        head = torch.randn(128, HIDDEN, generator=torch.Generator().manual_seed(8))
        encoded = get_format("int8-rows").encode(head)
        load_tensors(layer, list(encoded.items()))
        return layer, get_format("int8-rows").decode(encoded)
    activations, grid = variant.split(",") if variant else ("int8", "symmetric")
    config = LeapSparseConfig(LeapSparseSettings(fmt, 0.5, activations=activations, grid=grid))
    layer = build_layer(monkeypatch, "gate_up", config, 0, 1)
    if fmt != "bitmap-q4":
        load(layer, fmt, LAYERS["gate_up"])
        return layer, expected_slice("gate_up", 0, 1)
    weights, dense = q4_stored(LAYERS["gate_up"], grid == "asymmetric")
    load_tensors(layer, weights)
    return layer, dense


def expected_kernel(fmt: str, native: bool, variant: str) -> tuple[leap_sparse.Kernel, str]:
    """(the kernel a layer should hold here, the native op it calls on fp32 x, or "")."""
    from serving import cpu_kernel
    from serving.int8_linear import native_int8_available, onednn_int8_available

    if fmt == "int8-rows":
        if native and native_int8_available(HIDDEN):
            return leap_sparse.int8_head_kernel, "leap_sparse_cpu::int8_rows_linear"
        if onednn_int8_available():  # vLLM's oneDNN GEMM (VNNI)
            return leap_sparse.int8_head_kernel, ""
        return leap_sparse.int8_torch_kernel, ""
    if fmt in ("bitmap", "csr"):
        if native:
            return leap_sparse.bitmap_native_kernel, "leap_sparse_cpu::bitmap_linear"
        return leap_sparse.bitmap_torch_kernel, ""
    if not native:
        return leap_sparse.q4_torch_kernel, ""
    if variant.startswith("int8") and cpu_kernel.int8_kernel_available():
        return leap_sparse.q4_pairs_kernel, "leap_sparse_cpu::bitmap_q4_i8_linear"
    return leap_sparse.q4_native_kernel, "leap_sparse_cpu::bitmap_q4_linear"


@pytest.mark.parametrize(("fmt", "native", "variant"), METHOD_CASES)
def test_each_format_method_picks_its_kernel_at_load_and_matches_the_dense_weight(monkeypatch, fmt, native,
                                                                                   variant):
    """Each registry entry on a small CPU layer: the kernel chosen at load is the one this machine allows;
    fp32 x goes through its native op and gives x W^T (x rounded to int8 as the int8 ops define, where they
    run), fp16 x (which the native 16-bit and 4-bit ops do not take) through the torch op."""
    from serving import cpu_kernel
    from serving.int8_linear import int8_rows_activations
    from serving.q4_linear import int8_activations

    if native and not cpu_kernel.load():
        pytest.skip(f"native kernel unavailable: {cpu_kernel.unavailable_reason()}")
    if not native:
        monkeypatch.setattr(leap_sparse.cpu_kernel, "load", lambda: False)
    layer, dense = method_layer(monkeypatch, fmt, variant)
    assert type(layer.quant_method) is leap_sparse.LINEAR_METHODS[fmt]
    kernel, op = expected_kernel(fmt, native, variant)
    assert getattr(layer.leap_kernel, "func", layer.leap_kernel) is kernel
    x = torch.randn(3, HIDDEN)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = layer.quant_method.apply(layer, x)
    assert not op or op in {event.name for event in prof.events()}
    rounded = {"leap_sparse_cpu::bitmap_q4_i8_linear": int8_activations(x, 64)}.get(op, x)
    if fmt == "int8-rows":
        rounded = int8_rows_activations(x)
    torch.testing.assert_close(got, rounded @ dense.T, rtol=1e-4, atol=1e-4)
    if fmt == "int8-rows" or kernel is leap_sparse.q4_pairs_kernel:
        return  # these multiply x in the model's dtype: no fallback to check
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = layer.quant_method.apply(layer, x.half())
    assert not {event.name for event in prof.events()} & {"leap_sparse_cpu::bitmap_linear",
                                                          "leap_sparse_cpu::bitmap_q4_linear"}
    torch.testing.assert_close(got.float(), x @ dense.T, rtol=1e-2, atol=1e-2)
