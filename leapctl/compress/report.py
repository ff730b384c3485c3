"""What `compress` reports at its end: dense against compressed perplexity per text, and the bytes a decoded
token reads per weight (every decoder matrix plus the output projection, as llama.cpp's files are compared),
counted from the export's own tensors."""

from pathlib import Path

from safetensors import safe_open

EMBEDDING_MARKERS = ("embed_tokens",)  # the input table: a decoded token reads one row of it, not all
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def evaluation_rows(eval_result: dict) -> list[dict]:
    """One row per text from `leapctl eval --json` of (dense, compressed): both perplexities and their
    ratio."""
    dense, compressed = eval_result["models"][0]["perplexity"], eval_result["models"][-1]["perplexity"]
    return [{"text": name, "tokens": dense[name]["tokens"], "seq_len": dense[name]["seq_len"],
             "dense": round(dense[name]["ppl"], 4), "compressed": round(compressed[name]["ppl"], 4),
             "ratio": round(compressed[name]["ppl"] / dense[name]["ppl"], 4)} for name in dense]


def bytes_per_weight(export_dir: Path, run_dir: Path) -> dict:
    """Bytes of every tensor of the export a decode step reads (all but the input embedding table) over the
    weights of the matrices of the run it came from (every 2-D weight but the input table, plus a tied
    lm_head): what the memory-bound decode pays per weight."""
    read_bytes = sum(count * _DTYPE_BYTES[dtype] for name, count, dtype in _tensors(export_dir)
                     if not _embedding(name))
    matrices = [(name, count) for name, count, _ in _tensors(run_dir, two_d=True)]
    weights = sum(count for name, count in matrices if not _embedding(name))
    if not any("lm_head" in name for name, _ in matrices):  # tied: the output projection is the table
        weights += sum(count for name, count in matrices if _embedding(name))
    return {"read_bytes": read_bytes, "weights": weights, "per_weight": round(read_bytes / weights, 4)}


def _embedding(name: str) -> bool:
    return any(marker in name for marker in EMBEDDING_MARKERS)


def _tensors(folder: Path, two_d: bool = False) -> list[tuple[str, int, str]]:
    """(name, elements, safetensors dtype) of every tensor in the folder's top-level safetensors files."""
    found = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                tensor = handle.get_slice(name)
                shape = tensor.get_shape()
                if two_d and len(shape) != 2:
                    continue
                count = 1
                for size in shape:
                    count *= size
                found.append((name, count, tensor.get_dtype()))
    return found
