"""The one table of model shapes the benchmarks use (the real models' configs; the weights are random or
measured elsewhere). `merged_shapes` gives each decoder linear as vLLM merges them (qkv, gate_up),
`linear_shapes` the four distinct [out, in] shapes of the unmerged linears."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float = 10000.0


MODEL_SHAPES = {
    "SmolLM2-135M": ModelShape(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64,
                               vocab=49152, rope_theta=100000.0),
    "Qwen2.5-0.5B": ModelShape(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, head_dim=64,
                               vocab=151936, rope_theta=1000000.0),
    "Llama-3.2-1B": ModelShape(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, head_dim=64,
                               vocab=128256, rope_theta=500000.0),
    "Llama-3-8B": ModelShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
                             vocab=128256, rope_theta=500000.0),
}
MODEL_SHAPES["Llama-3.1-8B"] = MODEL_SHAPES["Llama-3-8B"]  # the same decoder shapes


def merged_shapes(model: str | ModelShape) -> dict[str, tuple[int, int]]:
    """[n, k] = [out_features, in_features] of each decoder linear as vLLM merges them."""
    s = MODEL_SHAPES[model] if isinstance(model, str) else model
    return {"qkv": ((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden), "o": (s.hidden, s.heads * s.head_dim),
            "gate_up": (2 * s.intermediate, s.hidden), "down": (s.hidden, s.intermediate)}


def linear_shapes(model: str) -> list[tuple[int, int]]:
    """[n, k] of q (and o), k (and v), gate (and up), down."""
    s = MODEL_SHAPES[model]
    return [(s.heads * s.head_dim, s.hidden), (s.kv_heads * s.head_dim, s.hidden), (s.intermediate, s.hidden),
            (s.hidden, s.intermediate)]
