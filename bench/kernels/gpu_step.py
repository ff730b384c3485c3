"""Decode tokens/s of Llama-shaped models with tiled-bitmap sparse layers against the same model dense (GPU).

    python -m bench.kernels --format tiled-bitmap --phase step [--models Llama-3.2-1B Llama-3.1-8B]
        [--batches 1 8] [--sparsities 0.5 0.6]

vLLM cannot be put on the GPU machine, so this is one compact decode loop in torch: Llama-3.2-1B- and
Llama-3.1-8B-shaped decoders (GQA attention with RoPE over a static KV cache, SwiGLU MLP, RMSNorm, dense
embedding and lm_head), one decode step captured as a CUDA graph and replayed, greedy tokens fed back on
the GPU. Every decoder linear is either `torch.matmul` on the dense masked weight or
`tiled_bitmap_linear` on the same weight in the tiled-bitmap format (q/k/v and gate/up merged, as serving
engines merge them, in both variants). The weights are random: one random masked weight per projection
shape, copied into every layer's own memory (what the kernel's speed depends on is the density, not
the values; encoding on the CPU once per shape keeps the run short). Before timing, the sparse and the
dense model must produce the same logits for the same step.

Writes bench/results/kernels/decode_e2e_<device>_<date>.json (rows: device, model, batch, sparsity, context,
dense_tok_s, sparse_tok_s, speedup, ms per step each) and a bar chart next to it.
"""

import argparse
import datetime
import json
import re
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import RESULTS, fail, median_graph_ms, require_cuda_and_triton
from bench.shapes import MODEL_SHAPES, ModelShape, merged_shapes

Config = ModelShape
CONFIGS = {model: MODEL_SHAPES[model] for model in ("Llama-3.2-1B", "Llama-3.1-8B")}
CONTEXT = 1024  # static KV cache length; decoding starts at position CONTEXT // 2 of random "prompt" K/V


projection_shapes = merged_shapes


def random_projections(cfg: Config, sparsity: float, dtype: torch.dtype):
    """One random masked weight per projection shape: dense (masked) and tiled-bitmap encoded."""
    from sparse_formats import get_format

    dense, encoded = {}, {}
    for name, (n, k) in projection_shapes(cfg).items():
        weight = (torch.randn(n, k, device="cuda") * 0.02).to(dtype)
        mask = torch.rand(n, k, device="cuda") >= sparsity
        dense[name] = torch.where(mask, weight, torch.zeros((), dtype=dtype, device="cuda"))
        tensors = get_format("tiled-bitmap").encode(weight.cpu(), mask.cpu())
        encoded[name] = {key: (t if key == "shape" else t.cuda()) for key, t in tensors.items()}
        del weight, mask
    return dense, encoded


class Decoder:
    """A Llama decoder for one token per sequence per step, with its own static KV cache."""

    def __init__(self, cfg: Config, batch: int, linears: list[dict], dtype: torch.dtype):
        self.cfg, self.batch, self.linears = cfg, batch, linears
        self.embed = torch.randn(cfg.vocab, cfg.hidden, device="cuda").to(dtype)
        self.lm_head = (torch.randn(cfg.vocab, cfg.hidden, device="cuda") * 0.02).to(dtype)
        self.norms = torch.ones(2 * cfg.layers + 1, cfg.hidden, device="cuda", dtype=dtype)
        cache_shape = (cfg.layers, batch, cfg.kv_heads, CONTEXT, cfg.head_dim)
        self.k_cache = torch.randn(cache_shape, device="cuda").to(dtype)
        self.v_cache = torch.randn(cache_shape, device="cuda").to(dtype)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device="cuda") / cfg.head_dim)
        angles = torch.outer(torch.arange(CONTEXT, device="cuda").float(), inv_freq)
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self.positions = torch.arange(CONTEXT, device="cuda")
        self.tokens = torch.zeros(batch, dtype=torch.long, device="cuda")
        self.position = torch.full((1,), CONTEXT // 2, dtype=torch.long, device="cuda")

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    def logits(self) -> torch.Tensor:
        cfg, batch = self.cfg, self.batch
        q_size, kv_size = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        cos, sin = self.cos[self.position], self.sin[self.position]  # [1, head_dim / 2]
        visible = (self.positions <= self.position).view(1, 1, 1, CONTEXT)
        x = self.embed[self.tokens]
        for index, layer in enumerate(self.linears):
            h = F.rms_norm(x, (cfg.hidden,), self.norms[2 * index], eps=1e-5)
            q, k, v = layer["qkv"](h).split([q_size, kv_size, kv_size], dim=-1)
            q = self._rope(q.view(batch, cfg.heads, cfg.head_dim), cos, sin)
            k = self._rope(k.view(batch, cfg.kv_heads, cfg.head_dim), cos, sin)
            self.k_cache[index].index_copy_(2, self.position, k.unsqueeze(2))
            self.v_cache[index].index_copy_(2, self.position, v.view(batch, cfg.kv_heads, 1, cfg.head_dim))
            keys, values = self.k_cache[index], self.v_cache[index]
            attention = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=visible,
                                                       enable_gqa=True)
            x = x + layer["o"](attention.reshape(batch, q_size))
            h = F.rms_norm(x, (cfg.hidden,), self.norms[2 * index + 1], eps=1e-5)
            gate, up = layer["gate_up"](h).chunk(2, dim=-1)
            x = x + layer["down"](F.silu(gate) * up)
        return torch.matmul(F.rms_norm(x, (cfg.hidden,), self.norms[-1], eps=1e-5), self.lm_head.T)

    def step(self) -> None:
        """One greedy decode step, fed back in place (what the CUDA graph captures)."""
        self.tokens.copy_(self.logits().argmax(dim=-1))
        self.position.add_(1)


def tokens_per_second(model: Decoder, steps: int, reps: int = 5) -> tuple[float, float]:
    """(tokens/s, ms per step): median over `reps` samples of `steps` graph-captured decode steps."""

    def rewind() -> None:
        model.position.fill_(CONTEXT // 2)

    ms = median_graph_ms(model.step, warmup=3, replays=steps, reps=reps, reset=rewind)
    return model.batch * 1000.0 / ms, ms


def build(cfg: Config, batch: int, projections: dict, sparse: bool, dtype: torch.dtype, seed: int) -> Decoder:
    from serving.kernels.tiled_bitmap_triton import tiled_bitmap_linear

    layers = []
    for _ in range(cfg.layers):
        if sparse:
            layers.append({name: partial(tiled_bitmap_linear, tensors={
                key: (t if key == "shape" else t.clone()) for key, t in tensors.items()})
                for name, tensors in projections.items()})
        else:
            layers.append({name: partial(lambda x, w: torch.matmul(x, w.T), w=weight.clone())
                           for name, weight in projections.items()})
    torch.manual_seed(seed)  # the same embedding, lm_head and cache for the dense and the sparse model
    return Decoder(cfg, batch, layers, dtype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--sparsities", nargs="+", type=float, default=[0.5, 0.6])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels")
    args = parser.parse_args(argv)
    require_cuda_and_triton("bench.kernels --format tiled-bitmap --phase step")
    dtype = torch.float16
    device = torch.cuda.get_device_name()
    rows = []
    for model_name in args.models:
        cfg = CONFIGS[model_name]
        dense_speed: dict[int, tuple[float, float]] = {}
        for sparsity in args.sparsities:
            torch.manual_seed(1)
            dense_weights, encoded = random_projections(cfg, sparsity, dtype)
            for batch in args.batches:
                dense = build(cfg, batch, dense_weights, False, dtype, seed=2)
                sparse = build(cfg, batch, encoded, True, dtype, seed=2)
                check_same_logits(dense, sparse, f"{model_name} batch {batch} {int(sparsity * 100)}%")
                if batch not in dense_speed:  # dense speed does not depend on how many zeros it holds
                    dense_speed[batch] = tokens_per_second(dense, args.steps)
                del dense
                torch.cuda.empty_cache()
                sparse_tok_s, sparse_ms = tokens_per_second(sparse, args.steps)
                del sparse
                torch.cuda.empty_cache()
                dense_tok_s, dense_ms = dense_speed[batch]
                rows.append({"device": device, "model": model_name, "batch": batch, "sparsity": sparsity,
                             "context": CONTEXT, "dtype": "fp16", "dense_tok_s": round(dense_tok_s, 1),
                             "sparse_tok_s": round(sparse_tok_s, 1),
                             "speedup": round(sparse_tok_s / dense_tok_s, 3),
                             "dense_ms_per_step": round(dense_ms, 3),
                             "sparse_ms_per_step": round(sparse_ms, 3)})
                print(f"{model_name} batch {batch} {int(sparsity * 100)}%: dense {dense_tok_s:.1f} tok/s, "
                      f"sparse {sparse_tok_s:.1f} tok/s, {rows[-1]['speedup']:.2f}x", flush=True)
            del dense_weights, encoded
            torch.cuda.empty_cache()
    write_results(rows, device, args.out)


def check_same_logits(dense: Decoder, sparse: Decoder, label: str) -> None:
    """Same weights, same inputs: one step's logits must agree up to fp16 rounding through the layers."""
    with torch.no_grad():
        expected, got = dense.logits().float(), sparse.logits().float()
    similarity = F.cosine_similarity(expected, got, dim=-1).min().item()
    if not similarity > 0.999:
        fail(f"{label}: sparse and dense logits differ (cosine similarity {similarity:.4f})")


def write_results(rows: list[dict], device: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    device_slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-")
    stem = f"decode_e2e_{device_slug}_{datetime.date.today().isoformat()}"
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    print("| model | batch | sparsity | dense tok/s | sparse tok/s | speed-up |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['batch']} | {int(r['sparsity'] * 100)}% | {r['dense_tok_s']} | "
              f"{r['sparse_tok_s']} | {r['speedup']:.2f}x |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 2, 3.5))
    labels = [f"{r['model'].split('-', 1)[1]}\nbatch {r['batch']}\n{int(r['sparsity'] * 100)}%" for r in rows]
    ax.bar(labels, [r["speedup"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("decode tokens/s, sparse / dense")
    ax.set_title(f"tiled-bitmap decode end to end, {device}")
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    print(f"wrote {out / stem}.json and .png")


if __name__ == "__main__":
    main()
