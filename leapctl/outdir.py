"""Atomic output folders: work goes into a temporary sibling that is renamed into place at the end,
so a failed or interrupted command never leaves a half-written result behind."""

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from leapctl.errors import LeapctlError


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse an existing non-empty folder (or a file) unless `overwrite` is set."""
    if out.exists() and not out.is_dir():
        raise LeapctlError(f"output path {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise LeapctlError(f"output folder {out} exists and is not empty (use --overwrite to replace it)")


@contextmanager
def atomic_output_dir(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; on success replace `out` with it, on failure remove it."""
    out = Path(out)
    check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f".{out.name}.old-{tmp.name[-8:]}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
