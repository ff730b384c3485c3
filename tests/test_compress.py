"""`leapctl compress`: the whole pipeline on stories260K, its resume after a kill, its plan and its refusals.

References: the stage commands' own run folders (the output is the quantize stage's run folder, which
export and validate accept), the inode of a finished stage's files (a rerun must not rewrite them), and
the plan's arithmetic (tokens / tokens a step)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from leapctl.compress.config import CompressConfig, parse_budget, parse_stages
from leapctl.compress.plan import BATCH_SIZE, MIN_TUNE_STEPS, SEQ_LEN, make_plan
from leapctl.errors import LeapctlError

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
BUDGET = "50ktok"  # 48 steps of 1,024 tokens: 20 of scale tuning, 28 of recovery, about a minute in all


def leapctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leapctl", *args], capture_output=True, text=True, env=ENV)


def compress_args(model, out, *extra: str) -> list[str]:
    return ["compress", str(model), "--sparsity", "0.5", "--calib", "generated", "--budget", BUDGET,
            "--out", str(out), "--no-progress", *extra]


@pytest.fixture(scope="module")
def compressed(stories260k_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compress") / "model"
    done = leapctl(*compress_args(stories260k_dir, out))
    assert done.returncode == 0, done.stderr
    return out, done


@pytest.mark.slow
def test_compress_runs_every_stage_and_its_folder_exports_and_validates(compressed, tmp_path):
    out, done = compressed
    summary = json.loads((out / "compress.json").read_text())
    assert summary["stages"] == ["prune", "recover", "quantize"]
    assert summary["plan"]["recover_steps"] == 48 - MIN_TUNE_STEPS
    report = json.loads((out / "report.json").read_text())
    assert report["command"] == "quantize" and report["source"]["command"] == "recover"
    assert report["tuning"]["teacher"] == str(out.with_name("model.compress-state") / "recover")  # not dense
    assert report["quantization"]["lm_head_bits"] == CompressConfig.lm_head_bits == 4  # GPTQ'd, untied
    assert not json.loads((out / "config.json").read_text())["tie_word_embeddings"]
    assert summary["bytes_per_weight"]["per_weight"] > 0
    assert "leapctl export" in done.stdout and "x dense" in done.stdout
    assert not out.with_name("model.compress-state").exists()
    export = tmp_path / "export"
    exported = leapctl("export", str(out), "--format", "bitmap-q4", "--out", str(export))
    assert exported.returncode == 0, exported.stderr
    validated = leapctl("validate", str(export))
    assert validated.returncode == 0, validated.stdout + validated.stderr


@pytest.mark.slow
def test_a_rerun_after_a_kill_does_not_redo_finished_stages(stories260k_dir, tmp_path):
    out = tmp_path / "model"
    state = tmp_path / "model.compress-state"
    args = [sys.executable, "-m", "leapctl", *compress_args(stories260k_dir, out, "--keep-stages")]
    child = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (state / "prune" / "report.json").is_file():
        time.sleep(0.05)
    time.sleep(1.0)  # the recover stage is starting: loading its two models takes longer than this
    os.killpg(child.pid, signal.SIGKILL)  # compress and the stage it runs
    child.wait()
    assert (state / "prune" / "report.json").is_file() and not out.exists()
    inode = (state / "prune" / "model.safetensors").stat().st_ino
    done = leapctl(*compress_args(stories260k_dir, out, "--keep-stages"))
    assert done.returncode == 0, done.stderr
    assert "prune finished earlier" in done.stderr
    assert (state / "prune" / "model.safetensors").stat().st_ino == inode


@pytest.mark.parametrize("extra, message", [
    (("--sparsity", "0"), "--sparsity"),
    (("--sparsity", "1.5"), "--sparsity"),
    (("--budget", "0"), "--budget"),
    (("--budget", "ten minutes"), "--budget"),
    (("--stages", "prune,distil"), "unknown stage"),
    (("--stages", "recover,learn"), "learn comes right after prune"),
    (("--stages", "recover,quantize,recover"), "named twice"),
    (("--lm-head-bits", "16"), "--lm-head-bits 16"),
    (("--lm-head-bits", "6"), "--lm-head-bits 6"),
])
def test_bad_options_fail_in_one_line_and_write_nothing(stories260k_dir, tmp_path, extra, message):
    done = leapctl(*compress_args(stories260k_dir, tmp_path / "model"), *extra)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and message in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_budgets_read_as_minutes_or_tokens():
    assert parse_budget("45").minutes == 45 and parse_budget("1.5h").minutes == 90
    assert parse_budget("300ktok").tokens == 300_000 and parse_budget("2Mtok").tokens == 2_000_000
    assert parse_stages("recover, quantize") == ("prune", "recover", "quantize")
    assert parse_stages("quantize,recover") == ("prune", "quantize", "recover")  # recovery on the grid
    assert parse_stages("prune,learn,recover") == ("prune", "learn", "recover")


def test_the_plan_spends_the_budget_on_the_stages_named():
    config = CompressConfig(model="m", sparsity=0.5, out="o", stages="prune,learn,recover,quantize")
    config.validate()
    plan = make_plan(config, parse_budget("200ktok"), None, None, checkpointing=False)
    steps = 200_000 // (BATCH_SIZE * SEQ_LEN)
    assert plan.tune_steps == round(0.2 * steps)
    assert plan.learn_steps > 0 and plan.recover_steps > 0
    with pytest.raises(LeapctlError, match="fewer than 10 steps"):
        make_plan(config, parse_budget("20ktok"), None, None, checkpointing=False)


def test_recovery_after_quantize_takes_the_tuning_steps():
    """Quantize is not the last stage: its scales are not tuned, recovery on the grid gets every step."""
    config = CompressConfig(model="m", sparsity=0.5, out="o", stages="quantize,recover")
    config.validate()
    plan = make_plan(config, parse_budget("200ktok"), None, None, checkpointing=False)
    assert plan.tune_steps == 0 and plan.recover_steps == 200_000 // (BATCH_SIZE * SEQ_LEN)


@pytest.mark.parametrize("names, message", [
    (["wikitext2-60k.txt"], "compress names its own texts wiki-summaries-heldout.txt and wikitext2-60k.txt"),
    (["a/t.txt", "b/t.txt"], "another --eval-text is also named t.txt"),
])
def test_eval_texts_of_one_name_are_refused(stories260k_dir, tmp_path, names, message):
    """Scores are keyed by file name: a user's file named like compress's own text, or like another of the
    user's, would share its score's key."""
    texts = []
    for name in names:
        texts += ["--eval-text", str(tmp_path / "texts" / name)]
        (tmp_path / "texts" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "texts" / name).write_text(f"The text of {name}.\n")
    done = leapctl(*compress_args(stories260k_dir, tmp_path / "model"), *texts)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and message in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts"]
