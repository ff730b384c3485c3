"""Issue 44's hardening: `eval --json` replaces neither an input nor a stranger's file, a SIGKILLed
`leapctl serve` takes its server's process group with it, and a failed `learn` leaves no state folder."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import require_asset

from leapctl.errors import LeapctlError

REPO = Path(__file__).resolve().parents[1]


def run_cli(capsys, monkeypatch, *args: str) -> tuple[int, str]:
    """`leapctl ARGS` through the real entry point, in this process: (exit status, stderr)."""
    from leapctl.cli import main

    monkeypatch.setattr(sys, "argv", ["leapctl", *map(str, args)])
    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code, capsys.readouterr().err


def one_error_line(status: int, stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), (status, stderr)
    return lines[0]


# ------------------------------------------------------------------ eval --json


@pytest.fixture
def eval_files(tmp_path, stories260k_dir, tinystories_text):
    """(a copy of stories260K, whose files may be named as --json without risk to the shared one, and a
    perplexity text beside it: the first story, a few windows, quick to evaluate)."""
    model = shutil.copytree(stories260k_dir, tmp_path / "model")
    text = tmp_path / "t.txt"
    text.write_text(tinystories_text.split("<|endoftext|>")[0])
    return model, text


def eval_args(model: Path, text: Path, out: Path, *extra: str) -> list[str]:
    return ["eval", str(model), "--ppl", str(text), "--seq-len", "64", "--no-progress", "--json", str(out),
            *extra]


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_eval_json_never_replaces_an_input(eval_files, capsys, monkeypatch, overwrite):
    """On main `--json t.txt` turned the --ppl text into JSON; a file in the model folder is an input too."""
    model, text = eval_files
    for target in (text, model / "config.json"):
        before = target.read_bytes()
        status, stderr = run_cli(capsys, monkeypatch, *eval_args(model, text, target, *overwrite))
        assert "would replace this command's input" in one_error_line(status, stderr)
        assert target.read_bytes() == before


def test_eval_json_replaces_another_file_only_with_overwrite(eval_files, tmp_path, capsys, monkeypatch,
                                                           one_thread):
    """A stranger's file needs --overwrite; an earlier eval result is replaced as it always was; the write
    leaves no temporary file."""
    model, text = eval_files
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}\n')
    status, stderr = run_cli(capsys, monkeypatch, *eval_args(model, text, notes))
    assert "exists and is not an earlier eval result" in one_error_line(status, stderr)
    assert notes.read_text() == '{"mine": true}\n'
    status, stderr = run_cli(capsys, monkeypatch, *eval_args(model, text, notes, "--overwrite"))
    assert status == 0, stderr
    first = json.loads(notes.read_text())
    assert [entry["model"] for entry in first["models"]] == [str(model)]
    status, stderr = run_cli(capsys, monkeypatch, *eval_args(model, text, notes))  # its own result now
    assert status == 0, stderr
    assert json.loads(notes.read_text())["models"][0]["perplexity"] == first["models"][0]["perplexity"]
    assert not [path.name for path in tmp_path.iterdir() if ".tmp-" in path.name]


def test_eval_json_in_no_writable_folder_fails_before_any_model_loads(eval_files, tmp_path, capsys,
                                                                        monkeypatch):
    """A path under a file cannot be written: said at once, not after the evaluation."""
    import leapctl.models

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before --json was checked")

    monkeypatch.setattr(leapctl.models, "load_model", no_loading)
    model, text = eval_files
    out = text / "results" / "eval.json"
    status, stderr = run_cli(capsys, monkeypatch, *eval_args(model, text, out))
    assert one_error_line(status, stderr) == f"error: --json {out}: {text} is not a folder"


# ------------------------------------------------------------------ serve: a SIGKILLed leapctl

# A stand-in for vLLM's server: answers /health on the port, with a helper process in its group as vLLM's
# engine core is; the helper ignores SIGTERM (as vLLM's resource tracker does), so only SIGKILL ends it.
STAND_IN = """
import http.server, subprocess, sys
helper = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                           "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

# What `leapctl serve` does around vLLM: `running_command` starts the server, waits until it is ready and
# prints the group's id; then it waits (to be SIGKILLed). Its grace period is short (vLLM's default is
# 30 s) so that the helper's SIGKILL comes soon.
GRACE_S = 2
LAUNCHER = f"""
import os, sys, time
from leapctl.commands.serve import running_command
port = int(sys.argv[1])
with running_command([sys.executable, "-c", sys.argv[2], str(port)], port, env=dict(os.environ),
                     ready_timeout_s=120, grace_s={GRACE_S}) as process:
    print(process.pid, flush=True)
    time.sleep(600)
"""


def port_free(port: int) -> bool:
    from leapctl.commands.serve import check_port_free

    try:
        check_port_free("127.0.0.1", port)
    except LeapctlError:
        return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="vLLM serves on Linux; /proc is read")
def test_a_sigkilled_server_launcher_takes_the_server_group_with_it():
    """On main vLLM's group lived on after `kill -9` of leapctl serve, re-parented, holding the port."""
    from test_serve_cli import free_port, group_alive

    port = free_port()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(port), STAND_IN], cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
    pgid = 0
    try:
        pgid = int(launcher.stdout.readline())  # once the stand-in answers /health
        assert group_alive(pgid) and not port_free(port)
        launcher.kill()
        launcher.wait()
        # The watchdog notices within its 0.2 s poll, the stand-in stops at once on SIGTERM, the helper is
        # SIGKILLed after GRACE_S; 10 s more leave room for a loaded machine.
        deadline = time.monotonic() + GRACE_S + 10
        while (group_alive(pgid) or not port_free(port)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(pgid), "the server's process group outlived the SIGKILLed launcher"
        assert port_free(port)
    finally:
        launcher.kill()
        launcher.wait()
        if pgid:
            kill_group(pgid)


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.skipif(os.name != "posix", reason="the watchdog runs on POSIX only")
def test_the_watchdog_passes_the_server_exit_status_on():
    """Callers read the server's status through the watchdog: an exit code, or the signal that ended it."""
    import psutil

    from leapctl.commands.serve import _start

    exited = _start([sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ))
    assert exited.wait(timeout=60) == 3  # 3: any status but 0 and 1, which a broken watchdog could give
    sleeping = _start([sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ))
    try:
        deadline = time.monotonic() + 30  # a bare interpreter starts in well under a second
        while not psutil.Process(sleeping.pid).children():  # until the watchdog has started the server
            assert time.monotonic() < deadline, "no watchdog started the server"
            time.sleep(0.05)
        os.killpg(sleeping.pid, signal.SIGTERM)
        assert sleeping.wait(timeout=60) == -signal.SIGTERM
    finally:
        kill_group(sleeping.pid)
        sleeping.wait()


# ------------------------------------------------------------------ learn: bad --lr, no state left


@pytest.mark.parametrize("lr", ["nan", "inf", "0"])
def test_learn_refuses_a_learning_rate_that_cannot_train(tmp_path, capsys, monkeypatch, lr):
    """On main `--lr nan` passed the `<= 0` check. nan and inf: not finite; 0: not positive."""
    out = tmp_path / "run"
    status, stderr = run_cli(capsys, monkeypatch, "learn", tmp_path / "no-model", "--sparsity", "0.5",
                             "--out", out, "--lr", lr)
    assert one_error_line(status, stderr) == (f"error: --lr must be a positive finite number, got "
                                              f"{float(lr)}")
    assert not out.exists() and not Path(f"{out}.learn-state").exists()


def test_a_learn_run_that_fails_before_training_leaves_no_state_folder(stories260k_dir, tmp_path, one_thread):
    """On main the token stream of a run refused for its --init-masks stayed in OUT.learn-state."""
    from leapctl.commands.learn import run
    from leapctl.learn.config import LearnConfig

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_text("not a safetensors file")
    out = tmp_path / "run"
    config = LearnConfig(model=str(stories260k_dir), sparsity=0.5, out=out, progress=False,
                         calib=str(require_asset("tinystories/valid_excerpt.txt")), init_masks=garbage,
                         steps=2, seq_len=32, batch_size=2, nsamples=2)  # the smallest run learn accepts
    with pytest.raises(LeapctlError, match="not a readable safetensors file"):
        run(config)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["garbage.safetensors"]


@pytest.mark.parametrize("case", ["created", "there before", "checkpointed"])
def test_only_a_state_folder_this_run_created_goes_on_failure(tmp_path, case):
    """A folder the run made goes with its token stream; one there before (an earlier run's state, a named
    --checkpoint-dir) stays, as does one that holds a checkpoint."""
    from leapctl.commands.learn import _new_state_removed_on_failure
    from leapctl.learn.checkpoint import CHECKPOINT_INDEX
    from leapctl.learn.stream import TOKENS_FILE

    state = tmp_path / "run.learn-state"
    if case == "there before":
        state.mkdir()
    with pytest.raises(RuntimeError), _new_state_removed_on_failure(state, master=True):
        state.mkdir(exist_ok=True)
        (state / TOKENS_FILE).write_bytes(b"\0" * 8)
        if case == "checkpointed":
            (state / CHECKPOINT_INDEX).write_text("{}")
        raise RuntimeError("the run fails")
    assert state.is_dir() == (case != "created")
