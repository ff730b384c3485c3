"""Zero-shot accuracy through lm-eval on local task files, checked item by item against a plain
implementation: the log-likelihood of each choice computed directly with the model, argmax for acc,
argmax of log-likelihood per character of the choice for acc_norm."""

import bz2
import json

import numpy as np
import pytest
import torch
from conftest import require_asset

from leapctl.errors import LeapctlError
from leapctl.eval.zeroshot import load_docs, parse_tasks, zero_shot
from leapctl.models import load_model

LIMIT = 8


@pytest.fixture(scope="module")
def stories(stories260k_dir):
    return load_model(str(stories260k_dir))


@pytest.fixture(scope="module")
def hellaswag_docs():
    require_asset("hellaswag/hellaswag_val_full.txt.bz2")
    return load_docs("hellaswag")


@pytest.fixture(scope="module")
def harness(stories):
    require_asset("piqa/valid.jsonl")
    model, tokenizer = stories
    return zero_shot(model, tokenizer, ["piqa", "winogrande", "hellaswag"], limit=LIMIT, per_item=True)


def _loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context); trailing spaces of the context belong to the continuation and the
    continuation's tokens are those of the whole string after the context's tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = tokenizer(context).input_ids
    whole = tokenizer(context + continuation).input_ids
    with torch.no_grad():
        logprobs = model(input_ids=torch.tensor([whole])).logits[0].double().log_softmax(-1)
    positions = range(len(context_ids), len(whole))
    return sum(logprobs[position - 1, whole[position]].item() for position in positions)


def _check_items(measured: dict, expected: list[tuple[list[float], int, list[str]]], with_norm: bool) -> None:
    assert measured["n"] == len(expected) == len(measured["items"]) == LIMIT
    accs, norms = [], []
    for item, (lls, gold, choices) in zip(measured["items"], expected, strict=True):
        assert item["loglikelihoods"] == pytest.approx(lls, rel=1e-4, abs=1e-3)
        acc = float(np.argmax(lls) == gold)
        assert item["acc"] == acc
        accs.append(acc)
        if with_norm:
            norm = float(np.argmax(np.array(lls) / [len(choice) for choice in choices]) == gold)
            assert item["acc_norm"] == norm
            norms.append(norm)
    assert measured["acc"] == pytest.approx(np.mean(accs))
    if with_norm:
        assert measured["acc_norm"] == pytest.approx(np.mean(norms))
    else:
        assert "acc_norm" not in measured


def test_piqa_matches_plain_implementation(stories, harness):
    model, tokenizer = stories
    lines = require_asset("piqa/valid.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines[:LIMIT]]
    labels = [int(x) for x in require_asset("piqa/valid-labels.lst").read_text().split()][:LIMIT]
    expected = []
    for row, gold in zip(rows, labels, strict=True):
        context = f"Question: {row['goal']}\nAnswer:"
        choices = [row["sol1"], row["sol2"]]
        lls = [_loglikelihood(model, tokenizer, context, " " + choice) for choice in choices]
        expected.append((lls, gold, choices))
    _check_items(harness["piqa"], expected, with_norm=True)


def test_winogrande_partial_scoring_matches_plain_implementation(stories, harness):
    model, tokenizer = stories
    lines = require_asset("winogrande/dev.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines[:LIMIT]]
    labels = require_asset("winogrande/dev-labels.lst").read_text().split()[:LIMIT]
    expected = []
    for row, answer in zip(rows, labels, strict=True):
        before, after = row["sentence"].split("_", 1)
        lls = [_loglikelihood(model, tokenizer, before + option, " " + after.strip())
               for option in (row["option1"], row["option2"])]
        expected.append((lls, int(answer) - 1, []))
    _check_items(harness["winogrande"], expected, with_norm=False)


def test_hellaswag_matches_plain_implementation(stories, harness, hellaswag_docs):
    model, tokenizer = stories
    expected = []
    for doc in hellaswag_docs[:LIMIT]:
        lls = [_loglikelihood(model, tokenizer, doc["query"], " " + ending) for ending in doc["choices"]]
        expected.append((lls, int(doc["label"]), doc["choices"]))
    _check_items(harness["hellaswag"], expected, with_norm=True)


def test_hellaswag_docs_follow_lm_eval_preprocessing(hellaswag_docs):
    path = require_asset("hellaswag/hellaswag_val_full.txt.bz2")
    docs = hellaswag_docs
    assert len(docs) == 10042  # the validation split
    lines = bz2.decompress(path.read_bytes()).decode().splitlines()
    assert lines[0] == "Roof shingle removal: A man is sitting on a roof. he"
    # lm-eval's query for this item: ctx_a + " " + ctx_b.capitalize() after the activity label.
    assert docs[0]["query"] == "Roof shingle removal: A man is sitting on a roof. He"
    assert docs[0]["choices"][3] == "starts pulling up roofing on a roof." and docs[0]["label"] == "3"
    # lm-eval's preprocess drops WikiHow's bracketed artefacts.
    assert not any("[" in doc["query"] for doc in docs)


def test_task_errors_are_one_line():
    with pytest.raises(LeapctlError, match="unknown task 'arc'"):
        parse_tasks("piqa,arc")
    assert parse_tasks("piqa, hellaswag") == ["piqa", "hellaswag"]


def test_missing_task_files_are_one_line(tmp_path):
    with pytest.raises(LeapctlError, match="piqa: task file .*valid.jsonl not found"):
        load_docs("piqa", tmp_path)
    with pytest.raises(LeapctlError, match="does not exist"):
        load_docs("piqa", tmp_path / "nowhere")
