"""Evaluation: perplexity the way the pruning papers measure it, and zero-shot accuracy through lm-eval.

`evaluate_models` is what `leapctl eval` (`leapctl.commands.eval`) runs: several models, one at a time
in memory, on the same perplexity texts and zero-shot tasks, as one JSON-ready dict."""

import gc
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from leapctl.errors import LeapctlError
from leapctl.eval.perplexity import (
    DOCUMENT_SEPARATOR,
    default_seq_len,
    documents_nll,
    perplexity,
    perplexity_documents,
    read_wikitext,
    split_documents,
    windowed_nll,
)
from leapctl.eval.zeroshot import TASKS, check_task_files, parse_tasks, zero_shot

__all__ = ["perplexity", "perplexity_documents", "zero_shot", "evaluate_models", "PplText",
           "load_ppl_text", "load_ppl_texts", "TASKS", "parse_tasks", "read_wikitext", "split_documents"]

WIKITEXT2 = "wikitext2"
WIKITEXT2_FILE = "wikitext-2-raw/wiki.test.lf.raw"


@dataclass
class PplText:
    """A perplexity text: its label in the results and the string handed to the tokenizer."""

    name: str
    text: str

    @property
    def has_documents(self) -> bool:
        return DOCUMENT_SEPARATOR in self.text


def load_ppl_text(spec: str | Path) -> PplText:
    """`wikitext2` (WikiText-2 test from the shared assets), a WikiText file (`wiki.*.raw`, read with the
    papers' "\\n\\n" row join) or any UTF-8 text file (documents may be separated by `<|endoftext|>`)."""
    from leapctl.paths import assets_dir

    if str(spec) == WIKITEXT2:
        assets = assets_dir()
        if assets is None or not (assets / WIKITEXT2_FILE).is_file():
            raise LeapctlError(f"--ppl {WIKITEXT2}: {WIKITEXT2_FILE} not found (set LEAPCTL_ASSETS)")
        return PplText(WIKITEXT2, read_wikitext(assets / WIKITEXT2_FILE))
    path = Path(spec).expanduser()
    if not path.is_file():
        raise LeapctlError(f"--ppl file {path} not found")
    try:
        if path.name.startswith("wiki.") and path.suffix == ".raw":
            text = read_wikitext(path)
        else:
            text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LeapctlError(f"cannot read --ppl file {path}: {exc}") from None
    if not text.strip():
        raise LeapctlError(f"--ppl file {path} is empty")
    return PplText(path.name, text)


def load_ppl_texts(specs: list[str | Path]) -> list[PplText]:
    """`load_ppl_text` of each spec. Scores are keyed by the file's name: a second file of the same name
    and text is dropped (scored once), one of the same name and another text is refused."""
    texts: dict[str, PplText] = {}
    for spec in specs:
        text = load_ppl_text(spec)
        earlier = texts.setdefault(text.name, text)
        if earlier.text != text.text:
            raise LeapctlError(f"two --ppl files are named {text.name} with different texts (scores are "
                               f"keyed by file name): rename one")
    return list(texts.values())


def measured_sparsity(model: torch.nn.Module) -> float:
    """Fraction of exact zeros over the prunable linears (decoder-block `nn.Linear` weights)."""
    from leapctl.models import prunable_linears

    layers = prunable_linears(model).values()
    zeros = sum(int((layer.weight == 0).sum()) for layer in layers)
    return zeros / sum(layer.weight.numel() for layer in layers)


def evaluate_models(models: list[str], ppl_texts: list[PplText], tasks: list[str], seq_len: int | None = None,
                    limit: int | None = None, tasks_dir: str | Path | None = None, device: str = "cpu",
                    dtype: torch.dtype = torch.float32, batch_size: int = 1, progress: bool = True) -> dict:
    """Evaluate each model in turn (one in memory at a time) and return the results side by side."""
    from leapctl.models import load_model, resolve_model

    if seq_len is not None and seq_len < 2:
        raise LeapctlError(f"--seq-len must be at least 2, got {seq_len}")
    if limit is not None and limit < 1:
        raise LeapctlError(f"--limit must be at least 1, got {limit}")
    if batch_size < 1:
        raise LeapctlError(f"--batch-size must be at least 1, got {batch_size}")
    if tasks:
        check_task_files(tasks, tasks_dir)
    for spec in models:  # a missing model fails now, not after the models before it have run
        resolve_model(spec)
    results = []
    for spec in models:
        started = time.perf_counter()
        model, tokenizer = load_model(spec, dtype=dtype, device=device)
        entry: dict = {"model": spec, "sparsity": measured_sparsity(model), "perplexity": {}, "zeroshot": {}}
        window = seq_len or default_seq_len(model)
        for ppl_text in ppl_texts:
            try:
                nll, count = windowed_nll(model, tokenizer, ppl_text.text, window, batch_size=batch_size,
                                          progress=progress)
            except LeapctlError as exc:
                raise LeapctlError(f"--ppl {ppl_text.name}: {exc}") from None
            scores = {"ppl": math.exp(nll / count), "seq_len": window, "tokens": count}
            if ppl_text.has_documents:
                doc_nll, doc_count = documents_nll(model, tokenizer, split_documents(ppl_text.text),
                                                   progress=progress)
                scores.update(ppl_docs=math.exp(doc_nll / doc_count), doc_tokens=doc_count)
            entry["perplexity"][ppl_text.name] = scores
        if tasks:
            entry["zeroshot"] = zero_shot(model, tokenizer, tasks, limit=limit, tasks_dir=tasks_dir)
        entry["seconds"] = round(time.perf_counter() - started, 2)
        results.append(entry)
        del model
        gc.collect()
    return {
        "settings": {"seq_len": seq_len, "tasks": tasks, "limit": limit, "device": device,
                     "dtype": str(dtype).removeprefix("torch."), "ppl": [text.name for text in ppl_texts]},
        "models": results,
    }
