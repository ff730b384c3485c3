"""`.ci/run` refuses to run without the shared assets (issue 20: on main it ran, about 40% of the tests
skipped, and CI went green), and the tests fail rather than skip when it requires them."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ci_run_without_the_shared_assets_fails_in_one_line(tmp_path):
    """A copy of the CI entry point with no ../shared beside it. MAKEFLAGS=n makes any make a dry run, so
    the test never builds or tests anything even where the check is missing."""
    repo = tmp_path / "clone"
    (repo / ".ci").mkdir(parents=True)
    for name in (".ci/run", "Makefile", "pyproject.toml"):
        shutil.copy2(REPO / name, repo / name)
    env = {k: v for k, v in os.environ.items() if k != "LEAPCTL_ASSETS"} | {"MAKEFLAGS": "n"}
    done = subprocess.run([str(repo / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: the shared test assets are not at ../shared/assets (set LEAPCTL_ASSETS); CI does not run "
        "without them"]


def test_a_missing_asset_fails_its_test_where_assets_are_required(tmp_path):
    (tmp_path / "test_one.py").write_text(
        "from conftest import require_asset\n\n"
        "def test_needs_an_asset():\n"
        "    require_asset('no/such/asset')\n")
    shutil.copy2(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    env = os.environ | {"LEAPCTL_REQUIRE_ASSETS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout
    assert "shared asset no/such/asset not found" in done.stdout
