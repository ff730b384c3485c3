"""The one owner of output folders: every command that writes a folder goes through `atomic_output_dir`.

What it promises (the README's "Your files" section says the same):
- the work goes into a hidden sibling `.OUT.tmp-PID-XXXX` that replaces OUT only once it is complete, in
  one atomic exchange where the file system has one (Linux `renameat2`), so OUT is at every moment either
  the old folder or the complete new one;
- an existing non-empty OUT is replaced only with `overwrite`, only when leapctl wrote it (a run folder or
  an export folder, recognised by their layout), and never when it is, or contains, one of the command's
  own inputs;
- SIGTERM, SIGINT and SIGHUP during the write remove the temporary folder; a SIGKILL leaves it, and the
  next command writing beside it removes it (it names it in one line) once its process is gone;
- once OUT is in place the command is done: in the CLI a stop signal after that exits 0;
- files and folders get the modes of the user's umask (0644 and 0755 under 022), weights included."""

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
from leapctl.paths import check_creatable

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
    check_creatable(out, f"output path {out}")
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
    with _StopSignals() as signals:
        try:
            yield tmp
        except BaseException as exc:
            signals.holding = True
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, _Stopped):
                print(f"leapctl: stopped by signal {exc.code - 128}; {out} is as it was before",
                      file=sys.stderr)
            raise
        signals.holding = True
        _set_modes(tmp)
        _commit(tmp, out)
        _IN_PLACE.append(out)


# The output folders this process has put in place (see `exit_zero_once_written`).
_IN_PLACE: list[Path] = []


def exit_zero_once_written() -> None:
    """For the CLI's process, whose command is done once its output folder is in place: from then on a stop
    signal ends it with status 0 and one line (only the printed summary is lost); before that the signal
    does what it always did (SIGINT: KeyboardInterrupt; SIGTERM, SIGHUP: the process ends by the signal)."""
    _IN_PLACE.clear()  # a command's own output only (tests run several commands in one process)
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, _stop_after_output)


def _stop_after_output(signum: int, _frame) -> None:
    if _IN_PLACE:
        print(f"leapctl: signal {signum} arrived after {_IN_PLACE[-1]} was complete; exiting with status 0",
              file=sys.stderr)
        raise SystemExit(0)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)


def _set_modes(folder: Path) -> None:
    """Give every file and folder the mode an ordinary file gets under the user's umask: safetensors writes
    weights 0600 and mkdtemp makes folders 0700, while everything else is written 0644 under umask 022."""
    mask = _umask()
    folder.chmod(0o777 & ~mask)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _umask() -> int:
    """The process's umask, read from /proc where it can be (setting it to read it races with threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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


class _StopSignals:
    """SIGTERM, SIGINT and SIGHUP while an output folder is written: raised as `_Stopped` while the work runs
    (so the temporary folder is removed); once `holding` is set (the cleanup or the final exchange runs, and
    from then on) recorded instead, so that neither is cut in half, and passed on to the handlers the caller
    had when the block ends: the CLI's then exits 0, the output being complete (`exit_zero_once_written`).
    Recorded by a handler, not masked: in a process with other threads, torch's among them, a masked signal
    is delivered to another thread. Only the main thread can install handlers; elsewhere this does nothing."""

    def __init__(self):
        self.holding = False
        self.held: list[int] = []
        self.previous: dict = {}

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        return self

    def _handle(self, signum: int, _frame) -> None:
        if self.holding:
            self.held.append(signum)
            return
        raise _Stopped(128 + signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.held:
            signal.raise_signal(self.held[0])
