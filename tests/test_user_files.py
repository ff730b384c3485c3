"""Issue 20: no command deletes what the user did not ask to replace.

`--overwrite` replaces only a folder leapctl wrote and never the command's own input; `learn` keeps a user's
`--checkpoint-dir` and an old checkpoint until the new run has its inputs in hand; a command stopped by a
signal (SIGTERM, SIGINT, SIGHUP) or killed (SIGKILL) at any point of its write leaves the old folder or the
complete new one, and a SIGKILL's temporary folder is cleared by the next command that writes there."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from leapctl.errors import LeapctlError
from leapctl.outdir import atomic_output_dir, clear_leftovers

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny model: one thread is fastest on a shared machine

# A child that runs `leapctl ARGS` and sends itself SIGNAL the first time a Python function whose qualified
# name is POINT is called: a real signal at a real point of the real command, nothing replaced.
KILL_AT = """
import os, sys
point, signum = sys.argv[1], int(sys.argv[2])
def hook(frame, event, arg):
    if event == "call" and frame.f_code.co_qualname == point:
        sys.setprofile(None)
        os.kill(os.getpid(), signum)
sys.setprofile(hook)
from leapctl.cli import main
sys.argv = ["leapctl", *sys.argv[3:]]
main()
"""


def leapctl(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leapctl", *map(str, args)], env=ENV, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def leapctl_killed_at(point: str, signum: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KILL_AT, point, str(int(signum)), *map(str, args)], env=ENV,
                          capture_output=True, text=True, timeout=600)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def hidden_leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def calib(tmp_path_factory, tinystories_text) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(tinystories_text)
    return path


def prune_args(model: Path, calib: Path, out: Path, method: str = "wanda") -> list[str]:
    return ["prune", str(model), "--method", method, "--sparsity", "0.5", "--nsamples", "4", "--seq-len",
            "64", "--calib", str(calib), "--out", str(out), "--no-progress"]


@pytest.fixture(scope="module")
def pruned(tmp_path_factory, stories260k_dir, calib) -> Path:
    """A real run folder written by `leapctl prune`."""
    out = tmp_path_factory.mktemp("runs") / "p"
    assert leapctl(*prune_args(stories260k_dir, calib, out)).returncode == 0
    return out


# ------------------------------------------------------------------ --overwrite: only leapctl's folders


def test_overwrite_refuses_a_folder_leapctl_did_not_write(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(LeapctlError, match="not written by leapctl"), atomic_output_dir(out, overwrite=True):
        pass
    assert snapshot(out) == {"thesis.tex": b"years of work"}
    assert hidden_leftovers(tmp_path) == []


def test_an_output_path_that_is_a_link_is_refused(tmp_path):
    target = tmp_path / "real"
    target.mkdir()
    (target / "manifest.json").write_text(json.dumps({"manifest_format": "leapctl.export/1"}))
    (tmp_path / "link").symlink_to(target, target_is_directory=True)
    with pytest.raises(LeapctlError, match="symbolic link"), atomic_output_dir(tmp_path / "link", True):
        pass
    assert (tmp_path / "link").resolve() == target and (target / "manifest.json").is_file()


def test_export_overwrite_refuses_its_own_input_and_a_folder_holding_it(pruned):
    """`export runs/p --out runs --overwrite` deleted runs/ whole on main, the source run with it."""
    runs = pruned.parent
    (runs / "notes.txt").write_text("keep me")
    before = snapshot(runs)
    for out in (runs, pruned):
        line = one_error_line(leapctl("export", pruned, "--format", "bitmap", "--out", out, "--overwrite"))
        assert "is or contains this command's input" in line
    assert snapshot(runs) == before


def test_export_overwrite_replaces_an_earlier_export(pruned, tmp_path):
    out = tmp_path / "e"
    assert leapctl("export", pruned, "--format", "csr", "--out", out).returncode == 0
    assert leapctl("export", pruned, "--format", "bitmap", "--out", out, "--overwrite").returncode == 0
    assert json.loads((out / "manifest.json").read_text())["format"] == "bitmap"
    assert hidden_leftovers(tmp_path) == []


# ------------------------------------------------------------------ learn: --checkpoint-dir, --overwrite


def test_learn_keeps_a_user_folder_given_as_checkpoint_dir(tmp_path, calib):
    """On main the folder was deleted before MODEL was even looked at; `.` would have been the cwd."""
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "photo.jpg").write_bytes(b"\xff\xd8 not a checkpoint")
    for folder, cwd in ((keep, None), (Path("."), keep)):
        proc = leapctl("learn", tmp_path / "no-model", "--sparsity", "0.5", "--out", tmp_path / "o",
                       "--calib", calib, "--checkpoint-dir", folder, cwd=cwd)
        assert "holds files that learn did not write" in one_error_line(proc)
    assert snapshot(keep) == {"photo.jpg": b"\xff\xd8 not a checkpoint"}


def test_learn_accepts_the_state_a_kill_during_its_first_write_left(tmp_path, calib):
    """A run killed while writing its token stream leaves only a temporary file: that is learn's own."""
    state = tmp_path / "state"
    state.mkdir()
    (state / ".tokens.u32.tmp-12345").write_bytes(b"\0" * 8)
    proc = leapctl("learn", tmp_path / "no-model", "--sparsity", "0.5", "--out", tmp_path / "o", "--calib",
                   calib, "--checkpoint-dir", state)
    assert "no-model" in one_error_line(proc)  # past the state folder's check, refused for the model


def test_learn_overwrite_keeps_the_old_checkpoint_when_the_new_run_cannot_start(stories260k_dir, calib,
                                                                                 tmp_path):
    """On main `--overwrite` deleted the old checkpoint before reading --calib: a typo lost it."""
    out = tmp_path / "run"
    common = ["--sparsity", "0.5", "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--nsamples", "2",
              "--checkpoint-every", "1", "--no-progress"]
    first = subprocess.Popen([sys.executable, "-m", "leapctl", "learn", stories260k_dir, "--out", out,
                              "--calib", calib, *common], env=ENV, stderr=subprocess.PIPE, text=True)
    state = Path(f"{out}.learn-state")
    _wait_for(lambda: (state / "checkpoint.json").exists(), first)
    first.send_signal(signal.SIGTERM)  # learn checkpoints and stops
    assert first.wait(timeout=300) == 128 + signal.SIGTERM
    before = snapshot(state)
    proc = leapctl("learn", stories260k_dir, "--out", out, "--calib", tmp_path / "typo.txt", "--overwrite",
                   *common)
    assert "typo.txt" in one_error_line(proc)
    assert snapshot(state) == before
    assert not out.exists()


def _wait_for(condition, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else proc.returncode
        assert time.monotonic() < deadline
        time.sleep(0.02)


# ------------------------------------------------------------------ interruptions at each point of a write


def test_sigkill_leftover_is_cleared_by_the_next_writer_in_one_line(tmp_path, capsys):
    """A temporary folder whose process is gone (a SIGKILL) is removed by the next command writing there."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a process id that has exited
    leftover = tmp_path / f".out.tmp-{dead}-abcd1234"
    (leftover / "sub").mkdir(parents=True)
    (tmp_path / ".out.tmp-notapid").mkdir()  # not ours: kept
    with atomic_output_dir(tmp_path / "out") as tmp:
        (tmp / "done.txt").write_text("ok")
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"leapctl: removed {leftover}, left by an interrupted command (process {dead})"]
    assert hidden_leftovers(tmp_path) == [".out.tmp-notapid"]


def test_a_live_processs_temporary_folder_is_left_alone(tmp_path):
    alive = tmp_path / f".out.tmp-{os.getppid()}-abcd1234"
    alive.mkdir()
    assert clear_leftovers(tmp_path / "out") == [] and alive.is_dir()


def test_an_interrupted_text_write_keeps_the_old_file_and_a_temporary_name_learn_knows(tmp_path, monkeypatch):
    """write_text_atomically (learn's checkpoint index and token count, eval's JSON, caches): a failure before
    the rename keeps the old text and removes its temporary file, whose name learn's state folder accepts as
    its own leftover (a SIGKILL at that point must not make the folder look foreign to the next run)."""
    from leapctl.learn.state import _written_by_learn
    from leapctl.paths import write_text_atomically

    target = tmp_path / "checkpoint.json"
    write_text_atomically(target, "old")
    seen = []

    def failing_replace(src, dst):
        seen.append(Path(src))
        assert Path(src).read_text() == "new"  # complete before the rename
        raise OSError("disk gone")

    monkeypatch.setattr("leapctl.paths.os.replace", failing_replace)
    with pytest.raises(OSError, match="disk gone"):
        write_text_atomically(target, "new")
    assert target.read_text() == "old" and hidden_leftovers(tmp_path) == []
    assert seen[0].parent == tmp_path and _written_by_learn(seen[0])


def _assert_old_or_complete_new(out: Path, old: dict[str, bytes], check_new) -> None:
    now = snapshot(out)
    if now != old:
        check_new(out)


def _interrupted_writes(command: list, out: Path, cases: list[tuple[str, int]], check_new) -> None:
    """Run `command` once per (point, signal) case; after each, OUT is the old or the complete new folder,
    a stop signal left nothing hidden, and a SIGKILL's leftover goes when the next writer clears it."""
    old = snapshot(out)
    for point, signum in cases:
        proc = leapctl_killed_at(point, signum, *command)
        # a stop signal in the final exchange is held until OUT is in place, and then the command is done
        done = point in ("_commit", "rmtree") and signum != signal.SIGKILL
        expected = (0,) if done else (-signum, 128 + signum)
        assert proc.returncode in expected, (point, signum, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, proc.stderr
        if signum != signal.SIGKILL:
            assert hidden_leftovers(out.parent) == [], (point, signum)
        _assert_old_or_complete_new(out, old, check_new)
        clear_leftovers(out)  # what the next command writing there does first
        assert hidden_leftovers(out.parent) == [], (point, signum)
        old = snapshot(out)


def _cases(points: list[str]) -> list[tuple[str, int]]:
    """SIGKILL (nothing of ours runs) at every point; SIGTERM, whose handler cleans up, at the first point
    and at the commit; SIGINT and SIGHUP (handled as SIGTERM is) at the first. Each case is a whole command
    (~20 s on a Zen 3 core): SIGTERM at every point as well cost four more minutes of the suite."""
    terms = [(point, signal.SIGTERM) for point in points if point in (points[0], "_commit")]
    return ([(points[0], signal.SIGINT), (points[0], signal.SIGHUP)] + terms
            + [(point, signal.SIGKILL) for point in points])


@pytest.mark.slow
def test_prune_interrupted_anywhere_leaves_old_or_complete_new(stories260k_dir, calib, tmp_path):
    out = tmp_path / "run"
    assert leapctl(*prune_args(stories260k_dir, calib, out, "magnitude")).returncode == 0

    def check_new(folder: Path) -> None:
        report = json.loads((folder / "report.json").read_text())
        assert report["method"] == "wanda"
        assert {"model.safetensors", "leapctl/masks.safetensors", "config.json"} <= snapshot(folder).keys()

    _interrupted_writes([*prune_args(stories260k_dir, calib, out), "--overwrite"], out,
                        _cases(["PreTrainedModel.save_pretrained", "save_masks", "_commit", "rmtree"]),
                        check_new)


@pytest.mark.slow
def test_export_interrupted_anywhere_leaves_old_or_complete_new(pruned, tmp_path):
    from leapctl.exporters.base import Report
    from leapctl.exporters.manifest import check_files, read_manifest

    out = tmp_path / "export"
    assert leapctl("export", pruned, "--format", "csr", "--out", out).returncode == 0

    def check_new(folder: Path) -> None:
        manifest = read_manifest(folder)
        assert manifest["format"] == "bitmap"
        report = Report(folder, "bitmap")
        check_files(folder, manifest, report)
        assert report.failures == []

    points = ["ShardWriter.flush", "_copy_side_files", "build_manifest", "_commit", "rmtree"]
    _interrupted_writes(["export", pruned, "--format", "bitmap", "--out", out, "--overwrite"], out,
                        _cases(points), check_new)


@pytest.mark.slow
def test_learn_interrupted_in_its_final_write_leaves_old_or_complete_new(stories260k_dir, calib, tmp_path):
    out = tmp_path / "run"
    assert leapctl(*prune_args(stories260k_dir, calib, out, "magnitude")).returncode == 0
    learn = ["learn", stories260k_dir, "--out", out, "--calib", calib, "--sparsity", "0.5", "--steps", "2",
             "--batch-size", "2", "--seq-len", "32", "--nsamples", "2", "--checkpoint-every", "0",
             "--no-progress", "--overwrite"]

    def check_new(folder: Path) -> None:
        assert json.loads((folder / "report.json").read_text())["method"] == "leap"
        assert {"model.safetensors", "leapctl/masks.safetensors", "metrics.jsonl", "loss.png"} <= snapshot(
            folder).keys()

    _interrupted_writes(learn, out, [("save_run", signal.SIGTERM), ("plot_losses", signal.SIGKILL),
                                     ("_commit", signal.SIGKILL)], check_new)
