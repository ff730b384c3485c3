"""The competitors' model files for the serving benchmark, made from one Hugging Face Llama folder.

- `write_gptq_checkpoint`: a dense 4-bit GPTQ checkpoint (round to nearest, symmetric, groups of input
  columns) that stock vLLM serves through its own GPTQ path (on CPU: `CPUWNA16LinearKernel`);
  `write_gptq_reference` writes the same weights dequantized, fp32, to check that path against.
- `write_gguf`: llama.cpp's F16 GGUF (its own converter) or Q4_0 (its own quantizer on that F16).
- `start_llama_cpp_server`: the command that serves a GGUF with llama-cpp-python's OpenAI-compatible
  server; `llama_cpp_completion` the request body that makes it generate exactly max_tokens tokens.
- `make_llama_1b_shape`: a random Llama with Llama-3.2-1B's decoder shapes, to time a model the size of
  a real deployment without downloading one.

Every writer is idempotent: it returns at once when its output exists, and builds into a temporary
sibling that is renamed at the end, so that an interrupted run leaves nothing that looks finished.
"""

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
MAIN_VENV = REPO / ".venv"
BENCH_VENV = REPO / ".venv-bench"  # `make bench-setup`: llama-cpp-python and llama.cpp's converter
# Tokenizer and generation files copied next to a rewritten checkpoint (whichever the source has).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")


def _say(message: str) -> None:
    print(f"[competitors] {message}", flush=True)


def _shards(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: those its index names, else model.safetensors (never a stray
    *.safetensors such as a run folder's masks.safetensors)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = set(json.loads(index.read_text())["weight_map"].values())
        return [model_dir / name for name in sorted(names)]
    return [model_dir / "model.safetensors"]


def _tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for shard in _shards(model_dir):
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def _is_block_linear(name: str, tensor: torch.Tensor) -> bool:
    """Every 2-D weight inside a Llama decoder block is one of its seven linears (norms are 1-D)."""
    return name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2


def _copy_tokenizer(model_dir: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)


def _fresh(out: Path) -> Path:
    """An empty temporary sibling of `out` to build into."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def rtn_quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [out, in] in 0..15, scales fp16 [out, in/G]) such that weight ~ (codes - 8) * scale.

    AutoGPTQ's symmetric quantizer without the GPTQ error feedback: scale = 2 max|w| / 15 per row and
    group, zero point 8. Scales are rounded to bf16 before they are stored as fp16, so that vLLM, which
    casts them to the activation dtype (bf16 on CPU), multiplies by exactly the stored values and the
    dequantized reference is exact."""
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"{cols} input columns are not a multiple of group size {group_size}")
    groups = weight.float().reshape(rows, cols // group_size, group_size)
    amax = groups.abs().amax(dim=2, keepdim=True)
    scale = torch.where(amax > 0, 2 * amax / 15, torch.ones_like(amax)).bfloat16().half().float()
    codes = (groups / scale).round().add(8).clamp(0, 15).to(torch.uint8)
    return codes.reshape(rows, cols), scale.squeeze(2).half()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, cols = codes.shape
    groups = codes.float().reshape(rows, cols // group_size, group_size) - 8
    return (groups * scales.float().unsqueeze(2)).reshape(rows, cols)


def pack_gptq(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AutoGPTQ v1 tensors of one linear (suffix -> tensor), as vLLM's `AutoGPTQLinearMethod` reads
    them: qweight int32 [in/8, out] with input rows 8k..8k+7 in word k, lowest nibble first; qzeros
    int32 [in/G, out/8] packed along the output dim, storing zero - 1 (7: v1's off-by-one); scales
    [in/G, out]; g_idx [in] (vLLM drops it; kept for other readers)."""
    rows, cols = codes.shape
    if cols % 8 or rows % 8:
        raise ValueError(f"a {rows}x{cols} weight does not pack into int32 words of 8 codes")
    by_input = codes.t().to(torch.int64).reshape(cols // 8, 8, rows)
    shifts = (4 * torch.arange(8, dtype=torch.int64)).view(1, 8, 1)
    qweight = (by_input << shifts).sum(dim=1)
    zeros = torch.full((cols // group_size, rows // 8), int("77777777", 16), dtype=torch.int64)
    return {
        "qweight": _as_int32(qweight),
        "qzeros": _as_int32(zeros),
        "scales": scales.t().contiguous(),
        "g_idx": torch.arange(cols, dtype=torch.int32) // group_size,
    }


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> the same bits as int32."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def write_gptq_checkpoint(model_dir: Path, out: Path, group_size: int = 64) -> Path:
    """A dense 4-bit GPTQ checkpoint of `model_dir`'s weights (every linear of the decoder blocks;
    embeddings, norms and lm_head as they are) in one model.safetensors, with the tokenizer."""
    if (out / "model.safetensors").is_file():
        _say(f"gptq checkpoint {out} exists")
        return out
    _say(f"quantizing {model_dir} to 4-bit gptq (rtn, sym, group {group_size}) into {out}")
    tmp, tensors = _fresh(out), {}
    for name, tensor in _tensors(model_dir):
        if _is_block_linear(name, tensor):
            prefix = name.removesuffix(".weight")
            packed = pack_gptq(*rtn_quantize(tensor, group_size), group_size)
            tensors.update({f"{prefix}.{suffix}": value for suffix, value in packed.items()})
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                     "desc_act": False, "sym": True, "checkpoint_format": "gptq"}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(model_dir, tmp)
    tmp.rename(out)
    return out


def write_gptq_reference(model_dir: Path, out: Path, group_size: int = 64) -> Path:
    """The weights `write_gptq_checkpoint` stores, dequantized, as a plain fp32 checkpoint: what a
    correct GPTQ kernel computes with, for transformers to generate from."""
    if (out / "model.safetensors").is_file():
        _say(f"dequantized gptq reference {out} exists")
        return out
    _say(f"writing the dequantized gptq (group {group_size}) weights of {model_dir} into {out}")
    tmp, tensors = _fresh(out), {}
    for name, tensor in _tensors(model_dir):
        if _is_block_linear(name, tensor):
            tensor = dequantize(*rtn_quantize(tensor, group_size), group_size)
        tensors[name] = tensor.float().contiguous()
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    shutil.copy2(model_dir / "config.json", tmp / "config.json")
    _copy_tokenizer(model_dir, tmp)
    tmp.rename(out)
    return out


def make_llama_1b_shape(out: Path, tokenizer_dir: Path) -> Path:
    """A Llama with Llama-3.2-1B's decoder (hidden 2048, MLP 8192, 16 layers, 32 heads, 8 KV heads,
    head_dim 64, rope theta 500000, tied embeddings) and `tokenizer_dir`'s tokenizer and vocabulary
    (SmolLM2's 49152 rather than 128256), random weights (seed 0, std 0.02), bf16. Only speed is
    measured on it, so random weights do; the smaller vocabulary keeps lm_head from dominating less than
    in the real model, which the report must say."""
    if (out / "model.safetensors").is_file():
        _say(f"1B-shaped llama {out} exists")
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    source = json.loads((tokenizer_dir / "config.json").read_text())
    from bench.shapes import MODEL_SHAPES

    shape = MODEL_SHAPES["Llama-3.2-1B"]
    config = LlamaConfig(vocab_size=source["vocab_size"], hidden_size=shape.hidden,
                         intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                         head_dim=shape.head_dim, rope_theta=shape.rope_theta, max_position_embeddings=8192,
                         rms_norm_eps=1e-5,
                         tie_word_embeddings=True, initializer_range=0.02,
                         bos_token_id=source.get("bos_token_id"), eos_token_id=source.get("eos_token_id"))
    _say(f"making a random 1B-shaped llama (vocab {config.vocab_size}) into {out}")
    tmp = _fresh(out)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


# llama.cpp's quantizer through llama-cpp-python's ctypes binding; argv: F16 input, output, ftype.
_QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.allow_requantize = True
params.nthread = 1
if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)):
    sys.exit("llama_model_quantize failed")
"""
# llama.cpp's llama_ftype values (llama.h) of the types the benchmarks make
GGUF_FTYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q2_k": 10, "q3_k_m": 12, "q4_k_m": 15,
               "iq4_nl": 25}


def _run(command: list[str], **env: str) -> None:
    """Run a chatty tool quietly; on failure raise with the end of what it said."""
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode:
        said = (done.stdout + done.stderr)[-2000:]
        raise RuntimeError(f"{command[1]} exited with {done.returncode}: {said}")


def write_gguf(model_dir: Path, out: Path, kind: str, main_venv: Path = MAIN_VENV,
               bench_venv: Path = BENCH_VENV, base: str = "f16") -> Path:
    """`out` as a GGUF of kind "f16" or "f32" (llama.cpp's convert_hf_to_gguf.py, run by the main venv's
    Python, which has the torch and transformers it imports) or a quantized type of GGUF_FTYPES (llama.cpp's
    quantizer on the `base` GGUF of the same name with its last suffix replaced, MODEL.q4_0.gguf ->
    MODEL.f16.gguf, written first unless there)."""
    if out.is_file():
        _say(f"{kind} gguf {out} exists")
        return out
    tmp = out.with_name(out.name + ".tmp")
    if kind in ("f16", "f32"):
        _say(f"converting {model_dir} to an {kind} gguf {out}")
        converter = bench_venv / "llama.cpp"
        _run([str(main_venv / "bin/python"), str(converter / "convert_hf_to_gguf.py"), str(model_dir),
              "--outtype", kind, "--outfile", str(tmp)], PYTHONPATH=str(converter / "gguf-py"))
    elif kind in GGUF_FTYPES:
        source = out.with_suffix("").with_suffix(f".{base}.gguf")
        write_gguf(model_dir, source, base, main_venv, bench_venv)
        _say(f"quantizing {source} to a {kind} gguf {out}")
        _run([str(bench_venv / "bin/python"), "-c", _QUANTIZE, str(source), str(tmp),
              str(GGUF_FTYPES[kind])])
    else:
        raise ValueError(f"unknown gguf kind {kind!r}; known: f16, {', '.join(GGUF_FTYPES)}")
    tmp.rename(out)
    return out


def start_llama_cpp_server(gguf: Path, port: int, threads: int, log: Path,
                           bench_venv: Path = BENCH_VENV) -> list[str]:
    """The command line of llama-cpp-python's OpenAI-compatible server on `gguf` (the caller runs it,
    with its output in `log`); `threads` for both decode and prompt processing."""
    _say(f"llama.cpp server on {gguf.name}, {threads} threads, port {port}, log {log}")
    return [str(bench_venv / "bin/python"), "-m", "llama_cpp.server", "--model", str(gguf),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--port", str(port),
            "--host", "127.0.0.1", "--n_ctx", "1024"]


def llama_cpp_completion(prompt: str, max_tokens: int) -> dict:
    """A streamed greedy /v1/completions body for that server that yields exactly `max_tokens` tokens.

    Its schema takes only text (a token-id prompt is refused, HTTP 500); SmolLM2's text decoded from n
    token ids came back as n prompt tokens (no BOS added). It accepts `ignore_eos` and ignores it:
    `min_tokens` masks EOS until max_tokens. The stream is one chunk per token, then one with empty text
    and finish_reason "length"; no chunk carries usage, even with stream_options.include_usage."""
    return {"prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0,
            "stream": True}
