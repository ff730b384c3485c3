"""The first-contact GPU check, in one run of at most about 9 minutes: every part in a child process of its
own under its own time limit, every result row appended to `OUT/results.jsonl` (flushed) the moment it is
measured, so a part killed at its limit keeps what it measured; `OUT/results.md` (tables) at the end, also
printed last; each part's output in `OUT/parts.log`.

    python bench/gpu_check.py --out DIR              # on the GPU machine as it comes (no vLLM, no network)
    python bench/gpu_check.py --out DIR --dry-run    # the same parts on the CPU: Triton's interpreter, tiny
                                                     # shapes, the host-sync guard instead of CUDA graphs

Parts (`--parts` picks some):
- env: device, versions, multiprocessors, L2, memory.
- correctness: every GPU op of the serving path against its torch reference (bitmap-q4's tile kernel: both
  grids, every group size of an odd shape and Llama shapes, M on each kernel path; tiled-bitmap; the int8
  lm_head through torch._int_mm; the torch int4 baseline itself), each also run under
  `torch.cuda.set_sync_debug_mode("error")` and captured in a CUDA graph whose replay must give the same
  output (dry run: `serving.kernels.sync_guard.no_host_sync`).
- decode: microseconds per call at M = 1, 4, 16 on Llama-3.1-8B's layer shapes at 50% and 60% sparsity:
  cuBLAS fp16 on the dense weight, tiled-bitmap fp16, bitmap-q4 (both grids, groups of 64, fp16 x), and
  torch's dense int4 matmul (`aten._weight_int4pack_mm`, bf16 x, groups of 128); CUDA graphs over enough
  weight copies that every call reads its weight from HBM (bench/kernels/gpu.py's timing).
- graph: a small Llama's whole decode step through the plugin's ops (bitmap-q4 tiles in every decoder
  linear, the 8-bit lm_head through GpuInt8, transformers' static KV cache) captured in one CUDA graph;
  replay against eager, both against the dense dequantised model; ms per step.
- learn: LEAP steps (`leapctl.learn.leap_masks`) on a random Llama-3.2-1B-shaped model in bf16 against a
  plain bf16 fine-tuning step: tokens/s and peak memory, and `leapctl.learn.plan.memory_plan`'s estimate
  where that module is there.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the GPU machine runs the repository as copied, nothing installed
PART_LIMITS = {"env": 45, "correctness": 150, "decode": 200, "graph": 90, "learn": 160}  # seconds on a GPU
DRY_LIMITS = {"env": 60, "correctness": 300, "decode": 200, "graph": 120, "learn": 200}  # loaded 2-core CPU
TOKENS = (1, 4, 16)
SPARSITIES = (0.5, 0.6)


@dataclass
class Context:
    dry_run: bool
    device: torch.device
    rows: "Rows"

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


class Rows:
    """Appends each row (a dict, tagged with its part) to results.jsonl at once, flushed to disk."""

    def __init__(self, path: Path, part: str) -> None:
        self.path, self.part = path, part

    def add(self, **row) -> None:
        row = {"part": self.part, **row}
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        print(json.dumps(row, default=str), flush=True)


def time_us(ctx: Context, calls: list[Callable[[], object]]) -> float:
    """Median microseconds per call: a CUDA graph of all calls replayed (bench/harness.py), or on the CPU
    one timed pass after a warm-up."""
    def run_all() -> None:
        for call in calls:
            call()

    if ctx.cuda:
        from bench.harness import median_graph_ms

        return median_graph_ms(run_all) * 1000 / len(calls)
    run_all()
    start = time.perf_counter()
    run_all()
    return (time.perf_counter() - start) * 1e6 / len(calls)


def sync_free_and_captured(ctx: Context, fn: Callable[[], torch.Tensor], allow: tuple = ()) -> dict:
    """Whether `fn` runs without a host synchronisation and, on a GPU, how far a CUDA graph of it replays
    from the eager call's output (0.0: the same). `allow`: CPU tensors the op reads by contract."""
    from serving.kernels.sync_guard import no_host_sync

    if not ctx.cuda:
        with no_host_sync(allow):
            fn()
        return {"sync_free": True, "graph": "n/a (cpu)"}
    side = torch.cuda.Stream()  # warm-up (compilation, split-K tickets, cuBLAS workspaces) off the checks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.set_sync_debug_mode("error")
    try:
        expected = fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    graph.replay()
    torch.cuda.synchronize()
    return {"sync_free": True, "graph_rel_diff": relative_error(captured, expected.float())}


def relative_error(got, reference) -> float:
    return float((got.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-12))


def part_env(ctx: Context) -> None:
    import platform

    import transformers
    import triton

    row = {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "device": str(ctx.device)}
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        row |= {"name": props.name, "cuda": torch.version.cuda,
                "multiprocessors": props.multi_processor_count,
                "l2_mb": round(props.L2_cache_size / 2**20, 1),
                "memory_gib": round(props.total_memory / 2**30, 1)}
    ctx.rows.add(**row)


def q4_problem(n: int, k: int, group: int, asymmetric: bool, sparsity: float, device: torch.device, seed: int,
               reference: bool = True):
    """Random codes, mask, scales (and zero points) on `device`: (tiles, fp32 dequantised weight or None)."""
    from serving.kernels.bitmap_q4_triton import Q4Tiles, _reference_dense

    generator = torch.Generator(device=device).manual_seed(seed)
    mask = torch.rand(n, k, generator=generator, device=device) >= sparsity
    codes = torch.randint(0, 16, (n, k), generator=generator, device=device, dtype=torch.uint8)
    scales = (torch.rand(n, k // group, generator=generator, device=device) * 2e-3 + 1e-4).half()
    zeros = torch.randint(0, 16, (n, k // group), generator=generator, device=device,
                          dtype=torch.uint8) if asymmetric else None
    tiles = Q4Tiles.from_dense(codes, mask, scales, zeros)
    return tiles, _reference_dense(tiles) if reference else None


def check_op(ctx: Context, label: dict, fn: Callable, reference: torch.Tensor, tolerance: float,
             capture: bool, allow: tuple = ()) -> bool:
    """One correctness row: relative error against `reference`, and the sync / graph checks; whether it
    passed."""
    try:
        got = fn()
        error = relative_error(got, reference)
        row = {**label, "rel_error": round(error, 6), "ok": error <= tolerance}
        if capture:
            row |= sync_free_and_captured(ctx, fn, allow)
    except Exception as exc:  # a failed op is a row, not the end of the part
        row = {**label, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    ctx.rows.add(**row)
    return row["ok"] and row.get("graph_rel_diff", 0.0) <= tolerance


def correctness_q4(ctx: Context) -> int:
    from serving.kernels.bitmap_q4_triton import Q4_KERNEL_MAX_M, q4_tiles_linear

    groups = (32, 96) if ctx.dry_run else (32, 64, 96, 192)  # tests/test_gpu_kernels_q4.py has them all
    cases = [(70, 192, group, asym) for group in groups for asym in (False, True)]
    if ctx.cuda:
        cases += [(n, k, group, asym) for n, k in [(4096, 4096), (1024, 14336)] for group in (64, 128)
                  for asym in (False, True)]
    failed = 0
    for index, (n, k, group, asym) in enumerate(cases):
        tiles, dense = q4_problem(n, k, group, asym, 0.5, ctx.device, seed=index)
        for m in (1, 4, 16, 33):
            dtype = (torch.float16, torch.bfloat16)[(index + m) % 2]
            x = torch.randn(m, k, device=ctx.device).to(dtype)
            weight = dense.to(dtype).float() if m > Q4_KERNEL_MAX_M else dense
            label = {"op": "bitmap_q4", "shape": [n, k], "group": group, "grid": "asym" if asym else "sym",
                     "m": m, "dtype": str(dtype)[6:]}
            failed += not check_op(ctx, label, lambda x=x, tiles=tiles: q4_tiles_linear(x, tiles),
                                   x.float() @ weight.T, 1e-2 if dtype == torch.bfloat16 else 2e-3,
                                   capture=m in (1, 16) and index % 3 == 0)
    return failed


def correctness_others(ctx: Context) -> int:
    """tiled-bitmap, the int8 lm_head, and the int4 baseline that the decode part times."""
    from serving.int8_linear import GpuInt8, Int8Weight, int8_rows_linear
    from serving.kernels.tiled_bitmap_triton import tiled_bitmap_linear
    from sparse_formats import get_format

    n, k = (160, 256) if ctx.dry_run else (4096, 4096)
    failed = 0
    for dtype in (torch.float16, torch.bfloat16):
        weight = (torch.randn(n, k) * 0.02).to(dtype)
        mask = torch.rand(n, k) < 0.5
        tensors = {name: (t if name == "shape" else t.to(ctx.device))
                   for name, t in get_format("tiled-bitmap").encode(weight, mask).items()}
        dense = torch.where(mask, weight, 0).float().to(ctx.device)
        for m in (1, 16, 64, 200):
            x = torch.randn(m, k, device=ctx.device).to(dtype)
            label = {"op": "tiled_bitmap", "shape": [n, k], "m": m, "dtype": str(dtype)[6:]}
            failed += not check_op(ctx, label, lambda x=x, t=tensors: tiled_bitmap_linear(x, t),
                                   x.float() @ dense.T, 1e-2, capture=m <= 16, allow=(tensors["shape"],))
    vocab = 1000 if ctx.dry_run else 128256
    encoded = get_format("int8-rows").encode(torch.randn(vocab, k))
    weight = Int8Weight(encoded["qweight"], encoded["scales"]).to(ctx.device)
    head = GpuInt8(weight)
    for m in (1, 16, 40):
        x = torch.randn(m, k, device=ctx.device).to(torch.bfloat16)
        reference = int8_rows_linear(x.float(), weight.qweight, weight.scales)
        label = {"op": "int8_head_int_mm", "shape": [vocab, k], "m": m, "dtype": "bfloat16"}
        failed += not check_op(ctx, label, lambda x=x: head(x), reference, 1e-2, capture=True)
    mm, dense, _ = int4pack_weight(ctx, n, k, 128)
    for m in (1, 16):
        x = torch.randn(m, k, device=ctx.device).to(torch.bfloat16)
        failed += not check_op(ctx, {"op": "int4pack_baseline", "shape": [n, k], "m": m, "dtype": "bfloat16"},
                               lambda x=x: mm(x), x.float() @ dense.T, 1e-2, capture=False)
    return failed


def int4pack_weight(ctx: Context, n: int, k: int, group: int) -> tuple[Callable, torch.Tensor, int]:
    """torch's dense int4 weight (random codes, scales and zeros, packed as torchao packs them): (its call
    `mm(x)`, the fp32 weight w = (code - 8) * scale + zero, its bytes)."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, device=ctx.device)
    scale = torch.rand(k // group, n, device=ctx.device) * 2e-3 + 1e-4
    zero = torch.randn(k // group, n, device=ctx.device) * 1e-3
    scales_zeros = torch.stack([scale, zero], dim=-1).to(torch.bfloat16).contiguous()
    if ctx.cuda:
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, 8)
        mm = torch.ops.aten._weight_int4pack_mm
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    per_col = scales_zeros.float().repeat_interleave(group, dim=0)  # [k, n, 2]
    dense = (codes.float() - 8) * per_col[..., 0].T + per_col[..., 1].T
    nbytes = packed.numel() * packed.element_size() + scales_zeros.numel() * 2
    return (lambda x: mm(x, packed, group, scales_zeros)), dense, nbytes


def part_correctness(ctx: Context) -> None:
    """Every check writes its row; the part fails at the end if any check did."""
    failed = correctness_q4(ctx) + correctness_others(ctx)
    if failed:
        raise SystemExit(f"{failed} correctness check(s) failed (rows with ok=False or a graph difference)")


def decode_methods(ctx: Context, n: int, k: int,
                   sparsity: float) -> dict[str, tuple[Callable, int, Callable]]:
    """name -> (op(x, weight), bytes of one weight, copies(count) -> that many independent weights) for
    one shape and sparsity."""
    import dataclasses

    from serving.kernels.bitmap_q4_triton import q4_tiles_linear
    from serving.kernels.tiled_bitmap_triton import tiled_bitmap_linear
    from sparse_formats import get_format

    weight = (torch.randn(n, k, device=ctx.device) * 0.02).half()
    mask = torch.rand(n, k, device=ctx.device) >= sparsity
    dense = torch.where(mask, weight, 0)
    tiled = {name: (t if name == "shape" else t.to(ctx.device))
             for name, t in get_format("tiled-bitmap").encode(weight.cpu(), mask.cpu()).items()}
    methods = {
        "cublas_fp16": (lambda x, w: torch.matmul(x, w.T), dense.numel() * 2,
                        lambda count: [dense.clone() for _ in range(count)]),
        "tiled_bitmap_fp16": (tiled_bitmap_linear, sum(t.numel() * t.element_size() for t in tiled.values()),
                              lambda count: [{name: (t if name == "shape" else t.clone())
                                              for name, t in tiled.items()} for _ in range(count)])}
    for asym in (False, True):
        tiles, _ = q4_problem(n, k, 64, asym, sparsity, ctx.device, seed=n + k, reference=False)
        held = [f.name for f in dataclasses.fields(tiles) if isinstance(getattr(tiles, f.name), torch.Tensor)]
        methods[f"q4_{'asym' if asym else 'sym'}_g64_fp16"] = (
            q4_tiles_linear, tiles.nbytes(),
            lambda count, tiles=tiles, held=held: [
                dataclasses.replace(tiles, **{name: getattr(tiles, name).clone() for name in held})
                for _ in range(count)])
    methods["int4pack_g128_bf16"] = (lambda x, mm: mm(x), int4pack_weight(ctx, n, k, 128)[2],
                                     lambda count: [int4pack_weight(ctx, n, k, 128)[0] for _ in range(count)])
    return methods


def part_decode(ctx: Context) -> None:
    from bench.kernels.gpu import copies_for
    from bench.shapes import linear_shapes

    shapes = [(64, 256)] if ctx.dry_run else linear_shapes("Llama-3.1-8B")
    for n, k in shapes:
        for sparsity in SPARSITIES:
            methods = decode_methods(ctx, n, k, sparsity)
            for name, (op, nbytes, make_copies) in methods.items():
                copies = 2 if ctx.dry_run else copies_for(nbytes)
                weights = make_copies(copies)  # together far larger than L2: each call reads from HBM
                for m in TOKENS:
                    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float16
                    x = torch.randn(m, k, device=ctx.device).to(dtype)
                    us = time_us(ctx, [lambda w=w, x=x, op=op: op(x, w) for w in weights])
                    ctx.rows.add(shape=[n, k], sparsity=sparsity, m=m, method=name, us=round(us, 2),
                                 bytes_per_weight=round(nbytes / (n * k), 4), copies=copies,
                                 gb_per_s=round(nbytes / us / 1e3, 1))
                del weights
            del methods
            if ctx.cuda:
                torch.cuda.empty_cache()


class OpModule(torch.nn.Module):
    """A module whose forward is one call (a plugin op on a layer's held weight)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def plugin_linear(linear: torch.nn.Linear, sparsity: float) -> OpModule:
    """A decoder linear, masked at random and put on bitmap-q4's symmetric grid by the format's encoder, as
    a `leap_sparse` layer on a GPU holds it (`Q4Weight.tiles`) and calls it (the tiled op); `linear`'s own
    weight becomes the dequantised one (the dense reference)."""
    from serving.q4_linear import Q4Weight
    from sparse_formats import get_format

    q4 = get_format("bitmap-q4")
    weight = linear.weight.detach().float().cpu()
    stored = q4.encode(weight, torch.rand(weight.shape) >= sparsity)
    linear.weight.data.copy_(q4.decode(stored).to(linear.weight.dtype))
    tiles = Q4Weight.from_tensors("bitmap-q4", stored).to(linear.weight.device).tiles()
    return OpModule(lambda x: torch.ops.leap_sparse.bitmap_q4_tiled_linear(
        x, tiles.tensors(), tiles.n_rows, tiles.n_cols, tiles.group_size))


def small_model(ctx: Context):
    """(plugin model, dense dequantised reference, config): a random Llama, every decoder linear bitmap-q4
    at 50% through the plugin's op, lm_head (untied) through the 8-bit GPU op."""
    import copy

    from transformers import AutoModelForCausalLM, LlamaConfig

    from serving.int8_linear import GpuInt8, Int8Weight
    from sparse_formats import get_format

    size = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512) if ctx.dry_run else dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000)
    config = LlamaConfig(**size, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    reference = AutoModelForCausalLM.from_config(config).to(ctx.device, dtype).eval()
    model = copy.deepcopy(reference)
    for name, module in list(reference.model.layers.named_modules()):
        if isinstance(module, torch.nn.Linear):
            parent, _, attr = f"model.layers.{name}".rpartition(".")
            setattr(model.get_submodule(parent), attr, plugin_linear(module, 0.5))
    encoded = get_format("int8-rows").encode(reference.lm_head.weight.detach().float().cpu())
    head = GpuInt8(Int8Weight(encoded["qweight"], encoded["scales"]).to(ctx.device))
    model.lm_head = OpModule(head)
    reference.lm_head.weight.data.copy_(get_format("int8-rows").decode(encoded).to(dtype))
    return model, reference, config


def part_graph(ctx: Context) -> None:
    from transformers import StaticCache

    model, reference, config = small_model(ctx)
    prompt = torch.randint(0, config.vocab_size, (1, 8), device=ctx.device)
    caches = {}
    with torch.no_grad():
        for name, net in (("plugin", model), ("dense", reference)):
            caches[name] = StaticCache(config=config, max_cache_len=64)  # prefill: eager, allocates the cache
            net(input_ids=prompt, past_key_values=caches[name],
                cache_position=torch.arange(8, device=ctx.device))
        ids = prompt[:, -1:].clone()
        position = torch.tensor([8], device=ctx.device)

        def step(net: torch.nn.Module = model, cache: StaticCache = caches["plugin"]) -> torch.Tensor:
            return net(input_ids=ids, past_key_values=cache, cache_position=position,
                       position_ids=position[None], use_cache=True).logits.float()

        eager = step()
        row = {"model": {k: v for k, v in config.to_dict().items() if k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")},
            "rel_error_vs_dense": round(relative_error(eager, step(reference, caches["dense"])), 5)}
        row |= sync_free_and_captured(ctx, step)
        row["eager_ms"] = round(host_ms(ctx, step), 3)
        if ctx.cuda:
            row["graph_ms"] = round(time_us(ctx, [step]) / 1e3, 3)
    ctx.rows.add(**row)


def host_ms(ctx: Context, step: Callable[[], object]) -> float:
    """Median milliseconds of an eager call by the host clock (launches included)."""
    samples = []
    for _ in range(10 if ctx.cuda else 1):
        start = time.perf_counter()
        step()
        if ctx.cuda:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def learn_setup(ctx: Context, out: Path):
    """(model config folder, model, LearnConfig, tokens per step): Llama-3.2-1B's shape (dry run: tiny),
    bf16, on the device."""
    import dataclasses

    from transformers import AutoModelForCausalLM, LlamaConfig

    from leapctl.learn import LearnConfig

    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256) if ctx.dry_run else dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256)
    model_config = LlamaConfig(**size, max_position_embeddings=8192, tie_word_embeddings=True)
    folder = out / "learn_model"
    model_config.save_pretrained(folder)
    seq_len, steps = (64, 4) if ctx.dry_run else (4096, 6)
    fields = {f.name for f in dataclasses.fields(LearnConfig)}
    extra = {"dtype": "bfloat16"} if "dtype" in fields else {}
    config = LearnConfig(model=str(folder), sparsity=0.5, steps=steps, batch_size=1, seq_len=seq_len,
                         init="random", gradient_checkpointing=True, autocast=ctx.cuda, checkpoint_every=0,
                         progress=False, **extra).checked(1)
    with torch.device(ctx.device):
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.bfloat16)
    return folder, model, config, seq_len


def finetune_seconds(model, seq_len: int, steps: int, vocab: int) -> float:
    """Median seconds of a plain bf16 full fine-tuning step (checkpointing, fused AdamW on CUDA, clipping)."""
    device = next(model.parameters()).device
    params = list(model.parameters())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), fused=device.type == "cuda")
    ids = torch.randint(0, vocab, (1, seq_len), device=device)
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss.float()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[2:])


def part_learn(ctx: Context, out: Path) -> None:
    from leapctl.learn import leap_masks

    folder, model, config, seq_len = learn_setup(ctx, out)
    vocab = model.config.vocab_size
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    seconds = finetune_seconds(model, seq_len, config.steps, vocab)
    row = {"finetune_tokens_per_s": round(seq_len / seconds), "finetune_s_per_step": round(seconds, 4)}
    if ctx.cuda:
        row["finetune_peak_gb"] = round(torch.cuda.max_memory_allocated(ctx.device) / 1e9, 2)
    del model
    ctx.rows.add(variant="finetune", **row)
    folder, model, config, seq_len = learn_setup(ctx, out)
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    corpus = torch.randint(0, vocab, (config.steps * seq_len + 1,))
    learned = leap_masks(model, None, corpus, config)
    step_s = statistics.median(m["step_s"] for m in learned.stats["metrics"][2:])
    row = {"learn_tokens_per_s": round(seq_len / step_s), "learn_s_per_step": round(step_s, 4),
           "dtype": getattr(config, "dtype", "float32"), "seq_len": seq_len, "distill": config.distill,
           "learn_over_finetune_time": round(step_s / seconds, 3)}
    if ctx.cuda:
        row["learn_peak_gb"] = round(torch.cuda.max_memory_allocated(ctx.device) / 1e9, 2)
    ctx.rows.add(variant="learn", **row | planned_peak(config, ctx))


def planned_peak(config, ctx: Context) -> dict:
    """`leapctl.learn.plan.memory_plan`'s expected peak for this run, where that module is there."""
    try:
        from leapctl.learn.plan import memory_plan
    except ImportError as exc:
        return {"plan": f"skipped ({exc})"}
    try:
        plan = memory_plan(config, 1, ctx.device.type)
    except Exception as exc:  # the plan is another module's, still changing: report, do not fail
        return {"plan": f"failed: {type(exc).__name__}: {exc}"[:300]}
    return {"plan_tensors_peak_gb": round(plan.tensors_peak / 1e9, 2),
            "plan_peak_gb": round(plan.peak / 1e9, 2)}


PARTS = {"env": part_env, "correctness": part_correctness, "decode": part_decode, "graph": part_graph,
         "learn": part_learn}


def run_part(name: str, out: Path, dry_run: bool) -> None:
    """One part in this (child) process."""
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here (torch.cuda.is_available() is False); use --dry-run on a CPU")
    torch.manual_seed(0)
    ctx = Context(dry_run, torch.device("cpu" if dry_run else "cuda"), Rows(out / "results.jsonl", name))
    if name == "learn":
        part_learn(ctx, out)
    else:
        PARTS[name](ctx)


def orchestrate(out: Path, parts: list[str], dry_run: bool, budget: float) -> int:
    """Each part in a child process under min(its limit, the time left); a status row per part."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").write_text("")
    end = time.monotonic() + budget
    failed = 0
    with (out / "parts.log").open("w") as log:
        for name in parts:
            limit = min((DRY_LIMITS if dry_run else PART_LIMITS)[name], end - time.monotonic())
            status, start = "ok", time.monotonic()
            if limit < 5:
                status = "skipped (no time left)"
            else:
                command = [sys.executable, __file__, "--part", name, "--out", str(out)]
                command += ["--dry-run"] * dry_run
                log.write(f"=== {name} (limit {limit:.0f} s)\n")
                log.flush()
                try:
                    proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=limit,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
                    status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
                except subprocess.TimeoutExpired:
                    status = f"timeout after {limit:.0f} s"
            failed += status != "ok"
            Rows(out / "results.jsonl", "status").add(name=name, status=status,
                                                      seconds=round(time.monotonic() - start, 1))
    markdown = write_markdown(out)
    print(markdown)
    return 1 if failed else 0


def write_markdown(out: Path) -> str:
    """results.md: one table per part (its rows' keys as columns), decode also pivoted by method."""
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    lines = ["# bench/gpu_check.py results", ""]
    for part in dict.fromkeys(r["part"] for r in rows):
        mine = [{k: v for k, v in r.items() if k != "part"} for r in rows if r["part"] == part]
        keys = list(dict.fromkeys(k for r in mine for k in r))
        lines += [f"## {part}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in mine]
        lines.append("")
    lines += decode_pivot([r for r in rows if r["part"] == "decode"])
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    return text


def decode_pivot(rows: list[dict]) -> list[str]:
    """Microseconds per method side by side, and bitmap-q4 (asymmetric) over torch's int4 matmul."""
    if not rows:
        return []
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((tuple(r["shape"]), r["sparsity"], r["m"]), {})[r["method"]] = r["us"]
    lines = ["## decode: microseconds per call", "",
             "| shape | sparsity | M | " + " | ".join(methods) + " | int4 / q4 asym |",
             "|" + "---|" * (len(methods) + 4)]
    for (shape, sparsity, m), by in cells.items():
        ratio = by.get("int4pack_g128_bf16", 0) / by["q4_asym_g64_fp16"] if by.get("q4_asym_g64_fp16") else ""
        lines.append(f"| {shape[0]}x{shape[1]} | {sparsity} | {m} | "
                     + " | ".join(str(by.get(name, "")) for name in methods)
                     + f" | {round(ratio, 2) if ratio else ''} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="folder for results.jsonl, results.md and parts.log")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same parts on the CPU (Triton's interpreter, tiny shapes)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for all parts together")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one part in this process
    args = parser.parse_args()
    if args.part:
        try:
            run_part(args.part, args.out, args.dry_run)
        except Exception:
            traceback.print_exc()
            raise SystemExit(1) from None
        return
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    raise SystemExit(orchestrate(args.out, parts, args.dry_run, args.budget))


if __name__ == "__main__":
    main()
