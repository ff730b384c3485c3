"""The `leap_sparse` serving contract, in one place and without vLLM imports: what an export writes into
`config.json`, which formats the vLLM plugin loads and with which stored tensors, and the settings the
plugin reads. `leapctl export` writes it, `leapctl serve` checks it before starting anything, and the
plugin parses it; none of them spells these names on its own.

    "quantization_config": {"quant_method": "leap_sparse", "format": "bitmap", "sparsity": 0.5,
                             "ignore": ["lm_head"]}

`ignore` lists the linear layers left dense. Kernel layouts (`tiled-csl`, `tiled-bitmap`) are written with
the same method name for the tools that read them, but the plugin serves only `SERVABLE_FORMATS`."""

import os
from dataclasses import dataclass

QUANT_METHOD = "leap_sparse"
# Per servable format, the tensors each pruned projection X stores as `X.<name>`, in load order.
SERVABLE_FORMATS: dict[str, tuple[str, ...]] = {
    "bitmap": ("shape", "bitmap", "values", "row_offsets"),
    "csr": ("shape", "values", "col_indices", "row_ptr"),
    "bitmap-q4": ("shape", "bitmap", "codes", "scales", "row_offsets"),
}
# Formats lm_head may have apart from the checkpoint's (`lm_head_format` in the config; bitmap-q4 exports
# of `quantize --lm-head-bits 8` runs), with the tensors `lm_head.<name>` it stores.
LM_HEAD_FORMATS: dict[str, tuple[str, ...]] = {"int8-rows": ("shape", "qweight", "scales")}
# Keep dense weights at load (prefill-heavy traffic): "1" in the environment, or `decode_dense: true`.
DECODE_DENSE_ENV = "LEAP_SPARSE_DECODE_DENSE"
# How bitmap-q4 layers multiply x on CPU, decoding steps and prefill alike: "int8" quantizes x per weight
# group (scale max|x| / 127, as llama.cpp's Q8_0 does for its Q4_0 dot products) and multiplies in integers;
# "bf16" multiplies x as it is. The environment wins over the config.
ACTIVATIONS_ENV = "LEAP_SPARSE_ACTIVATIONS"
ACTIVATIONS = ("int8", "bf16")
# bitmap-q4's grids: "asymmetric" layers (`quantize --grid asymmetric`) also store `X.zeros`, their zero
# points.
Q4_GRIDS = ("symmetric", "asymmetric")
Q4_ZERO_POINTS = "zeros"


@dataclass(frozen=True)
class LeapSparseSettings:
    """A checkpoint's `quantization_config` as the plugin uses it."""

    fmt: str
    sparsity: float
    ignore: tuple[str, ...] = ()
    decode_dense: bool = False
    activations: str = ACTIVATIONS[0]
    lm_head_format: str = ""  # a key of LM_HEAD_FORMATS, or "" when lm_head is dense or in `fmt`
    grid: str = Q4_GRIDS[0]  # bitmap-q4's grid

    def layer_tensors(self, lm_head: bool) -> tuple[str, tuple[str, ...]]:
        """(format, stored tensor names) of one layer: lm_head's own format where it has one."""
        fmt = self.lm_head_format if lm_head and self.lm_head_format else self.fmt
        names = {**SERVABLE_FORMATS, **LM_HEAD_FORMATS}[fmt]
        if fmt == "bitmap-q4" and self.grid == "asymmetric":
            names += (Q4_ZERO_POINTS,)
        return fmt, names

    def to_config(self) -> dict:
        """The `quantization_config` entry of config.json."""
        config = {"quant_method": QUANT_METHOD, "format": self.fmt, "sparsity": self.sparsity,
                  "ignore": list(self.ignore)}
        if self.decode_dense:
            config["decode_dense"] = True
        if self.activations != ACTIVATIONS[0]:
            config["activations"] = self.activations
        if self.lm_head_format:
            config["lm_head_format"] = self.lm_head_format
        if self.grid != Q4_GRIDS[0]:
            config["grid"] = self.grid
        return config

    @classmethod
    def from_config(cls, config: dict, environ: dict | None = None) -> "LeapSparseSettings":
        """Parse and check a `quantization_config`; ValueError (one line) when the plugin cannot serve it."""
        problem = serving_problem(config)
        if problem:
            raise ValueError(f"{QUANT_METHOD}: {problem}")
        environ = os.environ if environ is None else environ
        decode_dense = bool(config.get("decode_dense", False)) or environ.get(DECODE_DENSE_ENV, "0") == "1"
        activations = environ.get(ACTIVATIONS_ENV) or config.get("activations", ACTIVATIONS[0])
        if activations not in ACTIVATIONS:
            raise ValueError(f"{QUANT_METHOD}: activations {activations!r}: use {' or '.join(ACTIVATIONS)}")
        return cls(fmt=config["format"], sparsity=float(config.get("sparsity", 0.0)),
                   ignore=tuple(config.get("ignore", ())), decode_dense=decode_dense, activations=activations,
                   lm_head_format=config.get("lm_head_format", ""), grid=config.get("grid", Q4_GRIDS[0]))


def serving_problem(quantization_config: dict | None) -> str | None:
    """Why the plugin cannot serve a checkpoint with this `quantization_config`; None when it can."""
    if quantization_config is not None and not isinstance(quantization_config, dict):
        return f"not a {QUANT_METHOD} serving checkpoint (its quantization_config is not a JSON object)"
    method = (quantization_config or {}).get("quant_method")
    if method != QUANT_METHOD:
        return (f"not a {QUANT_METHOD} serving checkpoint (quant_method {method!r}); export it with "
                f"--format bitmap, bitmap-q4 or csr")
    fmt = quantization_config.get("format")
    if fmt not in SERVABLE_FORMATS:
        return (f"format {fmt!r} is not servable; the plugin serves {', '.join(SERVABLE_FORMATS)} "
                f"(export with --format bitmap)")
    head = quantization_config.get("lm_head_format", "")
    if head and head not in LM_HEAD_FORMATS:
        return f"lm_head format {head!r} is not servable; the plugin serves {', '.join(LM_HEAD_FORMATS)}"
    grid = quantization_config.get("grid", Q4_GRIDS[0])
    if grid not in Q4_GRIDS or (grid != Q4_GRIDS[0] and fmt != "bitmap-q4"):
        return f"grid {grid!r} is not servable with format {fmt!r} (bitmap-q4 serves {', '.join(Q4_GRIDS)})"
    return None
