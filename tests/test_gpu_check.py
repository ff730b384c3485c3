"""bench/gpu_check.py, the first-contact GPU check, kept from rotting on a CPU: `--dry-run` runs every part
(Triton's interpreter, tiny shapes, the host-sync guard in place of CUDA graphs) and writes each row to
results.jsonl and the tables to results.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.py"


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_dry_run_runs_every_part_on_the_cpu(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=1200)
    log = (tmp_path / "parts.log").read_text() if (tmp_path / "parts.log").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}\n{log[-4000:]}"
    rows = _rows(tmp_path)
    statuses = {r["name"]: r["status"] for r in rows if r["part"] == "status"}
    assert statuses == dict.fromkeys(("env", "correctness", "decode", "graph", "learn"), "ok")
    checks = [r for r in rows if r["part"] == "correctness"]
    assert {r["op"] for r in checks} == {"bitmap_q4", "tiled_bitmap", "int8_head_int_mm", "int4pack_baseline"}
    assert all(r["ok"] for r in checks) and any(r.get("sync_free") for r in checks)
    decode = [r for r in rows if r["part"] == "decode"]
    assert {(r["method"], r["m"]) for r in decode} == {
        (method, m) for method in ("cublas_fp16", "tiled_bitmap_fp16", "q4_sym_g64_fp16", "q4_asym_g64_fp16",
                                   "int4pack_g128_bf16") for m in (1, 4, 16)}
    graph = next(r for r in rows if r["part"] == "graph")
    assert graph["sync_free"] and graph["rel_error_vs_dense"] < 0.05
    learn = {r["variant"]: r for r in rows if r["part"] == "learn"}
    assert learn["learn"]["learn_tokens_per_s"] > 0 and learn["finetune"]["finetune_tokens_per_s"] > 0
    assert "## decode: microseconds per call" in (tmp_path / "results.md").read_text()


def test_a_failing_part_is_reported_and_the_rest_still_run(tmp_path):
    """A part that fails (here: no GPU without --dry-run) gets its status row and a non-zero exit; the
    Markdown is still written."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this check needs a machine without a GPU")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--parts", "env"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert [r["status"] for r in _rows(tmp_path) if r["part"] == "status"] == ["failed (exit 1)"]
    assert "no CUDA GPU here" in (tmp_path / "parts.log").read_text()
    assert "## status" in (tmp_path / "results.md").read_text()
