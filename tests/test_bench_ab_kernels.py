"""bench/kernels/ab.py's plumbing (`python -m bench.kernels --format bitmap-q4 --phase decode --base REV`): a
tree against itself gives one row per layer with both builds' figures and the same outputs bit for bit (a
build that disagreed would say "no"), and a base that is neither a tree nor a revision ends with one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving import cpu_kernel

REPO = Path(__file__).resolve().parent.parent
COMMAND = ["-m", "bench.kernels", "--format", "bitmap-q4", "--phase", "decode"]
LAYOUTS = ("dense", "sparse")


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # The weights' cache in tmp_path; the kernel's build where this session built it (no second compile).
    env = {**os.environ, "LEAPCTL_CACHE": str(tmp_path / "cache"),
           "TORCH_EXTENSIONS_DIR": str(cpu_kernel.build_dir().parent), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *COMMAND, *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)


@pytest.mark.slow
def test_a_tree_against_itself_reports_every_layer_and_the_same_outputs(tmp_path):
    if not cpu_kernel.int8_kernel_available():
        pytest.skip("no int8 kernel on this CPU")
    out = tmp_path / "ab"
    done = run(tmp_path, "--base", str(REPO), "--models", "SmolLM2-135M", "--layers", "k/v", "q/o",
               "--layouts", *LAYOUTS, "--tokens", "1", "3", "--rounds", "2", "--calls", "2",
               "--rotate-mib", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.with_suffix(".json").read_text())
    keys = {(r["layer"], r["layout"], r["m"]) for r in results["rows"]}
    assert keys == {(layer, layout, m) for layer in ("k/v", "q/o") for layout in LAYOUTS for m in (1, 3)}
    assert all(r["same"] and r["base_us"] > 0 and r["head_us"] > 0 for r in results["rows"])
    assert [(r["round"], r["build"]) for r in results["rounds"]] == [(0, "base"), (0, "head"), (1, "head"),
                                                                     (1, "base")]  # alternated
    assert "| SmolLM2-135M | k/v |" in out.with_suffix(".md").read_text()


def test_a_base_that_is_neither_a_tree_nor_a_revision_ends_with_one_line(tmp_path):
    done = run(tmp_path, "--base", "no-such-revision-anywhere")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "ab_kernels: 'no-such-revision-anywhere' is neither a leapctl tree nor a git revision"]
