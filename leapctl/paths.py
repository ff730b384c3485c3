"""Where leapctl keeps converted models and downloaded text, and where the shared test assets are."""

import os
import uuid
from pathlib import Path

from leapctl.errors import LeapctlError


def cache_dir() -> Path:
    """`$LEAPCTL_CACHE`, else `~/.cache/leapctl`; created on first use."""
    root = Path(os.environ.get("LEAPCTL_CACHE", Path.home() / ".cache" / "leapctl")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def write_text_atomically(path: Path, text: str) -> None:
    """Write beside the target under a name of this call's own, flush it to disk, then rename: an interrupted
    write (or a power cut) leaves no half-written file, and processes writing the same file at once (two
    tests, two users of one cache) cannot interleave. The temporary name, `.NAME.tmp-PID-XXXXXXXX`, is the
    one leapctl's leftover checks know (`leapctl.outdir`, `leapctl.learn.state`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(partial, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def check_creatable(path: Path, label: str) -> None:
    """Refuse, before any work, a path that cannot be created: its nearest existing ancestor must be a
    writable folder (not a file, as in `--out notes.txt/run`)."""
    parent = Path(path).absolute().parent
    folder = next(p for p in (parent, *parent.parents) if p.exists())
    if not folder.is_dir():
        raise LeapctlError(f"{label}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LeapctlError(f"{label}: folder {folder} is not writable")


def assets_dir() -> Path | None:
    """`$LEAPCTL_ASSETS`, else `../shared/assets` beside the repository; None when neither exists."""
    env = os.environ.get("LEAPCTL_ASSETS")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2] / "shared" / "assets")
    for path in candidates:
        if path.is_dir():
            return path
    return None
