"""The one owner of output folders: every command that writes a folder goes through `atomic_output_dir`.

What it promises (the README's "Your files" section says the same):
- the work goes into a hidden sibling `.OUT.tmp-PID-XXXX` that replaces OUT only once it is complete, in
  one atomic exchange where the file system has one (Linux `renameat2`), so OUT is at every moment either
  the old folder or the complete new one;
- an existing non-empty OUT is replaced only with `overwrite`, only when leapctl wrote it (a run folder or
  an export folder, recognised by their layout), and never when it is, or contains, one of the command's
  own inputs;
- SIGTERM, SIGINT and SIGHUP during the write remove the temporary folder; a SIGKILL leaves it, and the
  next command writing beside it removes it (it names it in one line) once its process is gone."""

import ctypes
import errno
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from leapctl.errors import LeapctlError

# The signals that stop a command and must not leave a temporary folder behind.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _leftover_pattern(name: str) -> re.Pattern:
    """Temporary (`.tmp-`) and displaced (`.old-`) folders of OUT named `name`, with their process id."""
    return re.compile(rf"\.{re.escape(name)}\.(tmp|old)-(\d+)-.+")


def written_by_leapctl(folder: Path) -> bool:
    """Whether `folder` has a layout leapctl writes: a run folder (report + masks) or an export folder (a
    leapctl manifest). Only such a folder may be replaced by `--overwrite`."""
    from leapctl.exporters.base import MANIFEST_FILE, MANIFEST_FORMAT
    from leapctl.runs import REPORT_FILE, masks_file

    if (folder / REPORT_FILE).is_file() and masks_file(folder) is not None:
        return True
    try:
        return json.loads((folder / MANIFEST_FILE).read_text()).get("manifest_format") == MANIFEST_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _inside(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_output_dir(out: Path, overwrite: bool, inputs: Iterable[Path | str | None] = ()) -> None:
    """Refuse an output path that is a file or a link, is or contains one of the command's `inputs` (those
    that exist), or is a non-empty folder unless `overwrite` is set and leapctl wrote it."""
    out = Path(out)
    if out.is_symlink():  # replacing it would replace the link, and leave or remove the wrong folder
        raise LeapctlError(f"output path {out} is a symbolic link; name the folder it points to")
    if out.exists() and not out.is_dir():
        raise LeapctlError(f"output path {out} exists and is not a folder")
    target = out.resolve()
    for given in inputs:
        if given is not None and Path(given).exists() and _inside(Path(given).resolve(), target):
            raise LeapctlError(f"output folder {out} is or contains this command's input {given}; "
                               f"choose another --out")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise LeapctlError(f"output folder {out} exists and is not empty (use --overwrite to replace it)")
    if not written_by_leapctl(out):
        raise LeapctlError(f"output folder {out} was not written by leapctl (no run report and masks, no "
                           f"export manifest); --overwrite replaces only leapctl's folders")


def clear_leftovers(out: Path) -> list[Path]:
    """Remove the temporary folders that interrupted commands (their process gone) left beside `out`, naming
    each in one line on stderr; a displaced old folder comes back when `out` itself is missing."""
    out = Path(out)
    pattern = _leftover_pattern(out.name)
    removed = []
    if not out.parent.is_dir():
        return removed
    found = [(path, pattern.fullmatch(path.name)) for path in out.parent.iterdir()]
    found = sorted(((p, m) for p, m in found if m is not None and p.is_dir() and not _alive(int(m.group(2)))),
                   key=lambda item: item[1].group(1) != "old")  # a displaced old folder first
    for path, match in found:
        if match.group(1) == "old" and not out.exists():
            path.rename(out)
            print(f"leapctl: restored {out} from {path.name}, left by an interrupted command",
                  file=sys.stderr)
            continue
        shutil.rmtree(path, ignore_errors=True)
        print(f"leapctl: removed {path}, left by an interrupted command (process {match.group(2)})",
              file=sys.stderr)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    return True


@contextmanager
def atomic_output_dir(out: Path, overwrite: bool = False,
                      inputs: Iterable[Path | str | None] = ()) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; when the block completes it replaces `out`, when it fails or a
    stop signal arrives it is removed (see the module docstring)."""
    out = Path(out)
    clear_leftovers(out)
    check_output_dir(out, overwrite, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
    with _stop_signals_raise():
        try:
            yield tmp
        except BaseException as exc:
            with _signals_blocked():
                shutil.rmtree(tmp, ignore_errors=True)
                if isinstance(exc, _Stopped):
                    print(f"leapctl: stopped by signal {exc.code - 128}; {out} is as it was before",
                          file=sys.stderr)
            raise
        with _signals_blocked():
            _commit(tmp, out)


def _commit(tmp: Path, out: Path) -> None:
    """Put the complete `tmp` in place of `out`: one atomic exchange when possible, else two renames."""
    if not out.exists():
        tmp.rename(out)
        return
    if _exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)  # now the old folder
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}-{tmp.name.rsplit('-', 1)[-1]}")
    out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where that is not available."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(b))


class _Stopped(SystemExit):
    """A stop signal arrived while an output folder was being written; exits with 128 + the signal."""


def _raise_stopped(signum: int, _frame) -> None:
    raise _Stopped(128 + signum)


@contextmanager
def _stop_signals_raise() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP become an exception (so the temporary folder is removed) while the block
    runs; the previous handlers come back afterwards. Only the main thread can install handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def _signals_blocked() -> Iterator[None]:
    """Hold the stop signals while a cleanup or the final exchange runs, so neither is cut in half; a signal
    that arrived meanwhile is raised again afterwards. (Recorded by a handler, not masked: in a process with
    other threads, torch's among them, a masked signal is delivered to another thread.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])
