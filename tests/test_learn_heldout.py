"""The text `learn` reports on at its end: what is held apart from training, and its perplexity."""

import math

import pytest
import torch

from leapctl.data import GENERATED, WIKI_SUMMARIES
from leapctl.eval.perplexity import ids_perplexity, perplexity
from leapctl.learn.heldout import (
    HELD_APART_SHARE,
    held_apart_tokens,
    perplexities,
    report_texts,
    split_stream,
)
from leapctl.models import load_model


@pytest.fixture(scope="module")
def stories(stories260k_dir):
    return load_model(str(stories260k_dir))


def test_tail_of_a_text_source_is_held_apart_and_never_more_than_its_share():
    ids = torch.arange(100_000)
    train, tail = split_stream(ids, "my-corpus.txt", windows=32, seq_len=256)
    # 2% of 100k tokens is 2000 tokens: 7 whole windows of 256, fewer than the 32 asked for.
    assert tail.numel() == 7 * 256 <= HELD_APART_SHARE * ids.numel()
    assert torch.equal(torch.cat([train, tail]), ids)  # a split, nothing lost or repeated
    assert held_apart_tokens(1_000_000, 32, 256) == 32 * 256  # a large source gives all the windows
    assert held_apart_tokens(10_000, 32, 256) == 0  # 2% of it is less than one window: nothing held apart


@pytest.mark.parametrize("source", [WIKI_SUMMARIES, GENERATED])
def test_sources_with_their_own_held_apart_text_train_on_their_whole_stream(source):
    ids = torch.arange(100_000)
    train, tail = split_stream(ids, source, windows=32, seq_len=256)
    assert tail is None and train is ids
    assert split_stream(ids, "file.txt", windows=0, seq_len=256)[1] is None  # reporting off: no hold-out


def test_ids_perplexity_equals_the_text_perplexity_of_the_same_tokens(stories, tinystories_text):
    model, tokenizer = stories
    ids = tokenizer(tinystories_text.replace("<|endoftext|>", ""), return_tensors="pt").input_ids[0]
    text = tokenizer.decode(ids[:1024 + 10], skip_special_tokens=False)
    expected = perplexity(model, tokenizer, text, seq_len=256, progress=False)
    stream = tokenizer(text, return_tensors="pt").input_ids[0]
    assert ids_perplexity(model, stream, 256, progress=False) == pytest.approx(expected, rel=1e-6)


def test_report_texts_of_a_text_source_are_its_tail_and_wikitext(stories, tinystories_text):
    model, tokenizer = stories
    tail = tokenizer(tinystories_text, return_tensors="pt").input_ids[0][:512]
    texts = report_texts("stories.txt", model, tokenizer, windows=4, seq_len=128, seed=0, tail=tail)
    assert torch.equal(texts["held-apart tail of the calibration text"], tail)
    assert texts["WikiText-2 test"].numel() == 4 * 128  # the shared assets hold WikiText-2
    scores = perplexities(model, texts, seq_len=128, progress=False)
    # stories260K knows its own stories (about 3-6) and has never seen Wikipedia (far worse).
    assert scores["held-apart tail of the calibration text"] < 10 < scores["WikiText-2 test"]
    assert all(math.isfinite(v) for v in scores.values())


def test_generated_source_reports_on_fresh_samples_of_the_dense_model(stories):
    model, tokenizer = stories
    texts = report_texts(GENERATED, model, tokenizer, windows=2, seq_len=64, seed=0, tail=None)
    samples = texts["fresh samples of the dense model"]
    assert samples.numel() == 2 * 64
    assert (samples.view(2, 64)[:, 0] == tokenizer.bos_token_id).all()  # each sample starts a sequence


def test_learn_reports_dense_and_sparse_perplexity_on_a_tail_it_did_not_train_on(stories260k_dir,
                                                                                  tinystories_text, tmp_path):
    import json
    import subprocess
    import sys

    from leapctl.data import corpus_ids

    calib = tmp_path / "stories.txt"
    calib.write_text(tinystories_text * 20)  # about 55k tokens: 2% is 34 windows of 32, 4 are held apart
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "leapctl", "learn", str(stories260k_dir), "--out", str(out),
                           "--calib", str(calib), "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                           "--nsamples", "4", "--report-windows", "4", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    heldout = json.loads((out / "report.json").read_text())["heldout"]
    assert (heldout["windows"], heldout["seq_len"]) == (4, 32)
    texts = heldout["texts"]
    assert set(texts) == {"held-apart tail of the calibration text", "WikiText-2 test"}
    # Independent reference: the dense and the written sparse model scored on the stream's last 4 windows.
    dense, tokenizer = load_model(str(stories260k_dir))
    tail = corpus_ids(str(calib), tokenizer, min_tokens=1)[-4 * 32:]
    sparse, _ = load_model(str(out))
    scores = texts["held-apart tail of the calibration text"]
    assert scores["dense"] == pytest.approx(ids_perplexity(dense, tail, 32, progress=False), rel=1e-5)
    assert scores["sparse"] == pytest.approx(ids_perplexity(sparse, tail, 32, progress=False), rel=1e-5)
    assert "perplexity on held-apart tail of the calibration text (4 x 32 tokens): dense" in proc.stdout
