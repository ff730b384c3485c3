"""`leapctl eval` end to end through a subprocess: a dense and a pruned stories260K side by side."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import require_asset


def _leapctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leapctl", "eval", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def half_pruned(tmp_path_factory, stories260k_dir):
    """stories260K with the smaller-magnitude half of each decoder linear's weights zeroed, written the way
    a prune run folder holds its checkpoint (safetensors, config, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("half-pruned")
    model = AutoModelForCausalLM.from_pretrained(stories260k_dir)
    with torch.no_grad():
        for block in model.model.layers:
            for layer in block.modules():
                if isinstance(layer, torch.nn.Linear):
                    weight = layer.weight
                    order = weight.abs().flatten().argsort()
                    weight.view(-1)[order[: weight.numel() // 2]] = 0
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(stories260k_dir).save_pretrained(out)
    return out


def test_dense_and_pruned_side_by_side(tmp_path, stories260k_dir, half_pruned):
    excerpt = require_asset("tinystories/valid_excerpt.txt")
    out = tmp_path / "results" / "eval.json"
    done = _leapctl(str(stories260k_dir), str(half_pruned), "--ppl", str(excerpt), "--seq-len", "256",
                    "--json", str(out))
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    dense, pruned = results["models"]
    assert dense["model"] == str(stories260k_dir) and pruned["model"] == str(half_pruned)
    # Stories260K's decoder linears have even sizes, so exactly half of them is zero.
    assert dense["sparsity"] == 0.0 and pruned["sparsity"] == 0.5
    dense_ppl = dense["perplexity"]["valid_excerpt.txt"]
    assert dense_ppl["ppl"] == pytest.approx(3.4, abs=0.05)  # the figures
    assert dense_ppl["ppl_docs"] == pytest.approx(3.1, abs=0.05)
    assert dense_ppl["seq_len"] == 256 and dense_ppl["tokens"] == 10 * 255  # 2674 tokens: 10 full windows
    assert pruned["perplexity"]["valid_excerpt.txt"]["ppl"] > dense_ppl["ppl"]
    assert dense["zeroshot"] == pruned["zeroshot"] == {}
    assert "stories260K/hf" in done.stdout and f"{half_pruned.parent.name}/{half_pruned.name}" in done.stdout


@pytest.mark.slow
def test_zero_shot_side_by_side(tmp_path, stories260k_dir, half_pruned):
    """All three tasks through the CLI; the numbers are those of the library call on the same model."""
    from leapctl.eval import zero_shot
    from leapctl.models import load_model

    out = tmp_path / "eval.json"
    done = _leapctl(str(stories260k_dir), str(half_pruned), "--tasks", "piqa,winogrande,hellaswag",
                    "--limit", "4", "--json", str(out))
    assert done.returncode == 0, done.stderr
    dense, pruned = json.loads(out.read_text())["models"]
    assert dense["perplexity"] == {}  # --tasks alone: no default perplexity text
    model, tokenizer = load_model(str(half_pruned))
    assert pruned["zeroshot"] == zero_shot(model, tokenizer, ["piqa", "winogrande", "hellaswag"], limit=4)
    assert dense["zeroshot"]["hellaswag"]["n"] == 4
    assert "hellaswag acc_norm (n=4)" in done.stdout and "winogrande acc_norm" not in done.stdout


@pytest.mark.parametrize("args, message", [
    (["{model}", "/no/such/model"], "error: model '/no/such/model' is neither a local folder"),
    (["{model}", "--ppl", "/no/such/file.txt"], "error: --ppl file /no/such/file.txt not found"),
    (["{model}", "--tasks", "piqa,arc"], "error: unknown task 'arc' (known: piqa, winogrande, hellaswag)"),
    (["{model}", "--tasks", "piqa", "--tasks-dir", "{tmp}"], "error: piqa: task file {tmp}/piqa/valid.jsonl"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, stories260k_dir, args, message):
    out = tmp_path / "eval.json"
    fill = {"model": str(stories260k_dir), "tmp": str(tmp_path)}
    done = _leapctl(*[arg.format(**fill) for arg in args], "--json", str(out))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith(message.format(**fill))
    assert not out.exists()


def test_ppl_files_of_one_name_are_scored_once_or_refused(tmp_path, stories260k_dir):
    """Scores are keyed by the file's name: the same text under two paths is scored once; another text under
    the same name would overwrite the first's score, so it is refused in one line before any model loads."""
    from leapctl.eval import load_ppl_texts

    paths = {}
    for folder, text in (("a", "One text.\n"), ("b", "One text.\n"), ("c", "Another text.\n")):
        paths[folder] = tmp_path / folder / "t.txt"
        paths[folder].parent.mkdir()
        paths[folder].write_text(text)
    once = load_ppl_texts([paths["a"], paths["b"]])
    assert [(text.name, text.text) for text in once] == [("t.txt", "One text.\n")]
    out = tmp_path / "eval.json"
    done = _leapctl(str(stories260k_dir), "--ppl", str(paths["a"]), "--ppl", str(paths["c"]),
                    "--json", str(out))
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: two --ppl files are named t.txt with different texts (scores are "
                                   "keyed by file name): rename one")
    assert not out.exists()
