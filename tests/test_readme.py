"""The README's Python examples run as written: each ```python block is executed from a folder that sits
beside ../shared like the repository does (a fresh one, so the example's outputs land there)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from leapctl.paths import assets_dir

REPO = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    assets = assets_dir()
    if assets is None:
        pytest.skip("the examples read ../shared/assets")
    (tmp_path / "shared").symlink_to(assets.parent, target_is_directory=True)
    workdir = tmp_path / "checkout"
    workdir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", BLOCKS[index]], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
