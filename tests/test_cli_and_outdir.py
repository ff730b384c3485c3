"""The CLI's error contract (one line, exit 2, no traceback) and atomic output folders."""

import json
import stat
import subprocess
import sys

import pytest

from leapctl import __version__
from leapctl.errors import LeapctlError
from leapctl.exporters.base import MANIFEST_FORMAT
from leapctl.outdir import atomic_output_dir


def run_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "leapctl", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_version_prints_the_package_version():
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"leapctl {__version__}"


def test_usage_errors_exit_2_without_traceback():
    for args in [(), ("prune",), ("no-such-command",)]:
        result = run_cli(*args)
        assert result.returncode == 2, args
        assert "Traceback" not in result.stderr


def test_user_error_is_one_line_and_exit_2(tmp_path):
    result = run_cli("prune", str(tmp_path / "missing"), "--method", "wanda", "--sparsity", "0.5",
                     "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert not (tmp_path / "out").exists()


def test_atomic_dir_appears_only_on_success(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError), atomic_output_dir(out) as tmp:
        (tmp / "half.txt").write_text("x")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []  # neither the result nor the temporary folder is left

    with atomic_output_dir(out) as tmp:
        (tmp / "done.txt").write_text("ok")
    assert (out / "done.txt").read_text() == "ok"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


def test_atomic_dir_refuses_non_empty_without_overwrite_and_replaces_with_it(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    # an export folder as leapctl writes it: the only kind (with run folders) --overwrite replaces
    (out / "manifest.json").write_text(json.dumps({"manifest_format": MANIFEST_FORMAT}))
    with pytest.raises(LeapctlError, match="not empty"), atomic_output_dir(out):
        pass
    assert (out / "manifest.json").exists()
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert [p.name for p in out.iterdir()] == ["new.txt"]
