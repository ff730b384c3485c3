"""Perplexity the way the pruning papers measure it, and per-document perplexity.

`perplexity` follows the Wanda / SparseGPT evaluation: tokenise the whole text once (so the tokenizer adds
its BOS, if it has one, at the very start only), cut the ids into non-overlapping windows of `seq_len`,
drop the last partial window, and average the next-token NLL over every predicted position (the first
token of each window has no context inside the window and is not scored). With equal windows this is
exactly the papers' `exp(sum(loss_i * seq_len) / (n * seq_len))`.

A text made of documents separated by `<|endoftext|>` (TinyStories) is not tokenised as one string, since
the marker is no token of most tokenizers: each document is tokenised on its own and starts with the
tokenizer's BOS (its EOS when it has no BOS), and the ids are concatenated. That is the stream llama2.c
trains the TinyStories models on.

`perplexity_documents` scores each document on its own from that same start token and weights documents
by their number of predicted tokens.
"""

import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from leapctl.errors import LeapctlError
from leapctl.progress import track

MAX_DEFAULT_SEQ_LEN = 4096
DOCUMENT_SEPARATOR = "<|endoftext|>"


def default_seq_len(model: torch.nn.Module) -> int:
    """The model's context length, capped at 4096 (the papers evaluate LLaMA-2 at its 4096 context)."""
    context = getattr(model.config, "max_position_embeddings", None) or MAX_DEFAULT_SEQ_LEN
    return min(int(context), MAX_DEFAULT_SEQ_LEN)


def read_wikitext(path: str | Path) -> str:
    """WikiText-2 raw as the papers feed it: the lines as Hugging Face `datasets` yields them (a blank
    line becomes "", any other line keeps its "\\n"), joined with "\\n\\n" (`"\\n\\n".join(data["text"])`)."""
    with open(path, encoding="utf-8") as handle:
        rows = [line if line.strip() else "" for line in handle]
    return "\n\n".join(rows)


def split_documents(text: str, separator: str = DOCUMENT_SEPARATOR) -> list[str]:
    """Documents of a text file whose documents are separated by `<|endoftext|>` (as TinyStories is)."""
    return [doc.strip() for doc in text.split(separator) if doc.strip()]


def perplexity(model: torch.nn.Module, tokenizer, text: str, seq_len: int | None = None,
               device: str | torch.device | None = None, batch_size: int = 1, progress: bool = True) -> float:
    """Perplexity over non-overlapping `seq_len` windows of the tokenised `text`; the last partial
    window is dropped, as in the papers. `seq_len` defaults to the model's context capped at 4096."""
    nll, count = windowed_nll(model, tokenizer, text, seq_len, device, batch_size, progress)
    return math.exp(nll / count)


def perplexity_documents(model: torch.nn.Module, tokenizer, docs: list[str],
                         device: str | torch.device | None = None, progress: bool = True) -> float:
    """Perplexity with each document scored on its own from BOS, weighted by predicted tokens.
    A document longer than the model's context (capped at 4096) is scored in consecutive pieces of it."""
    nll, count = documents_nll(model, tokenizer, docs, device, progress)
    return math.exp(nll / count)


def windowed_nll(model: torch.nn.Module, tokenizer, text: str, seq_len: int | None = None,
                 device: str | torch.device | None = None, batch_size: int = 1,
                 progress: bool = True) -> tuple[float, int]:
    """Summed NLL (nats) and number of predicted tokens behind `perplexity`."""
    return ids_nll(model, text_ids(tokenizer, text), seq_len, device, batch_size, progress)


def text_ids(tokenizer, text: str) -> torch.Tensor:
    """The token stream `perplexity` scores: each `<|endoftext|>`-separated document led by its BOS, else
    the whole text as the tokenizer encodes it."""
    if DOCUMENT_SEPARATOR in text:
        return torch.cat([document_ids(tokenizer, doc) for doc in split_documents(text)])
    return tokenizer(text, return_tensors="pt").input_ids[0]


def ids_perplexity(model: torch.nn.Module, ids: torch.Tensor, seq_len: int | None = None,
                   device: str | torch.device | None = None, progress: bool = True) -> float:
    """`perplexity` of a token stream that is already tokenised (1-D ids)."""
    nll, count = ids_nll(model, ids, seq_len, device, progress=progress)
    return math.exp(nll / count)


def ids_nll(model: torch.nn.Module, ids: torch.Tensor, seq_len: int | None = None,
            device: str | torch.device | None = None, batch_size: int = 1,
            progress: bool = True) -> tuple[float, int]:
    """Summed NLL (nats) and number of predicted tokens over the non-overlapping `seq_len` windows of 1-D
    `ids` (the last partial window dropped)."""
    seq_len = seq_len or default_seq_len(model)
    if seq_len < 2:
        raise LeapctlError(f"--seq-len must be at least 2, got {seq_len}")
    n_windows = ids.numel() // seq_len
    if n_windows == 0:
        raise LeapctlError(f"the text has {ids.numel()} tokens, fewer than one window of {seq_len}")
    windows = ids[: n_windows * seq_len].view(n_windows, seq_len)
    total, count = 0.0, 0
    batches = windows.split(max(1, batch_size))
    for batch in _progress(batches, "perplexity", progress):
        batch_nll, batch_count = _sequence_nll(model, batch, device)
        total += batch_nll
        count += batch_count
    return total, count


def documents_nll(model: torch.nn.Module, tokenizer, docs: list[str],
                  device: str | torch.device | None = None, progress: bool = True) -> tuple[float, int]:
    """Summed NLL (nats) and number of predicted tokens behind `perplexity_documents`."""
    if not docs:
        raise LeapctlError("no documents to score")
    context = default_seq_len(model)
    total, count = 0.0, 0
    for doc in _progress(docs, "documents", progress):
        ids = document_ids(tokenizer, doc)
        for piece in ids.split(context):
            if piece.numel() < 2:
                continue
            piece_nll, piece_count = _sequence_nll(model, piece.unsqueeze(0), device)
            total += piece_nll
            count += piece_count
    if count == 0:
        raise LeapctlError("the documents are too short to predict any token")
    return total, count


def document_ids(tokenizer, doc: str) -> torch.Tensor:
    """Token ids of one document, led by the tokenizer's BOS, or its EOS for tokenizers without a BOS
    (GPT-2 and Qwen mark document starts with `<|endoftext|>`)."""
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    ids = tokenizer(doc, add_special_tokens=False).input_ids
    return torch.tensor(([start] if start is not None else []) + ids, dtype=torch.long)


@torch.no_grad()
def _sequence_nll(model: torch.nn.Module, ids: torch.Tensor, device) -> tuple[float, int]:
    """Summed next-token NLL of each row of `ids` [batch, length], computed in float32."""
    device = device or next(model.parameters()).device
    ids = ids.to(device)
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    targets = ids[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
    return nll.item(), targets.numel()


def _progress(items, label: str, enabled: bool) -> Iterator:
    """Iterate with a transient progress bar (on stderr, only when enabled)."""
    return track(items, label, enabled)
