"""Issue 44's hardening: `eval --json` replaces neither an input nor a stranger's file, a SIGKILLed
`leapctl serve` takes its server's process group with it, a failed `learn` leaves no state folder; one error
boundary in the CLI (one line for every bad input, a traceback file for a bug), damaged files refused by the
module that owns their format, `--config FILE` checked as the options are, a signal after the output is in
place changes nothing, files written with the umask's modes. tests/test_fuzz.py runs the commands on a
generated corpus of broken inputs."""

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
from test_export import pruned_run  # noqa: F401  (a fixture)

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
    """On main `--lr nan` passed the `<= 0` check. nan and inf: not finite (every float option's check);
    0: not positive (learn's own)."""
    out = tmp_path / "run"
    status, stderr = run_cli(capsys, monkeypatch, "learn", tmp_path / "no-model", "--sparsity", "0.5",
                             "--out", out, "--lr", lr)
    kind = "positive finite" if lr == "0" else "finite"
    assert one_error_line(status, stderr) == f"error: --lr must be a {kind} number, got {float(lr)}"
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


# ------------------------------------------------------------------ the CLI's one error boundary


PRUNE_ARGS = ["prune", "m", "--method", "wanda", "--out", "o"]


@pytest.mark.parametrize("args", [[*PRUNE_ARGS, "--sparsity", "0.5", "--bogus"], ["no-such-command"],
                                  ["prune"], ["serve", "x", "--port", "70000"],
                                  [*PRUNE_ARGS, "--sparsity", "half"]],
                         ids=["option", "command", "argument", "range", "type"])
def test_a_usage_error_is_one_line(capsys, monkeypatch, args):
    """On main typer drew a 5-6 line box around a usage error."""
    status, stderr = run_cli(capsys, monkeypatch, *args)
    assert "leapctl" in one_error_line(status, stderr)


def test_an_unexpected_error_is_one_line_naming_the_command_and_its_traceback_file(tmp_path, capsys,
                                                                                   monkeypatch):
    """A bug (not a LeapctlError) prints one line, exit 1; the traceback is in the file the line names."""
    import leapctl.commands.validate

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug\nwith a second line")

    monkeypatch.setenv("LEAPCTL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(leapctl.commands.validate, "validate", broken)
    status, stderr = run_cli(capsys, monkeypatch, "validate", tmp_path)
    lines = stderr.strip().splitlines()
    assert status == 1 and len(lines) == 1, stderr
    assert lines[0].startswith("error: leapctl validate failed unexpectedly (ZeroDivisionError: a bug); "
                               "the traceback is in "), lines[0]
    written = Path(lines[0].rsplit(" ", 1)[1])
    assert written.parent == tmp_path / "cache" / "tracebacks"
    assert "Traceback" in written.read_text() and "ZeroDivisionError: a bug" in written.read_text()


# ------------------------------------------------------------------ damaged inputs: one line from their owner


def broken_masks(run: Path, folder: Path, **metadata: str | None) -> Path:
    """The run's mask file with metadata entries replaced (None removes one)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from leapctl.runs import MASKS_FILE

    source = run / MASKS_FILE
    with safe_open(str(source), framework="pt") as handle:
        meta = handle.metadata()
    meta = {k: v for k, v in {**meta, **metadata}.items() if v is not None}
    path = folder / "masks.safetensors"
    save_file(load_file(str(source)), str(path), metadata=meta)
    return path


def first_shape(run: Path, shape) -> str:
    from safetensors import safe_open

    from leapctl.runs import MASKS_FILE

    with safe_open(str(run / MASKS_FILE), framework="pt") as handle:
        shapes = json.loads(handle.metadata()["shapes"])
    return json.dumps({**shapes, next(iter(shapes)): shape})


MASK_DAMAGE = {"no shapes": dict(shapes=None), "garbage shapes": dict(shapes="garbage"),
               "shapes a list": dict(shapes="[1, 2]"), "garbage extra": dict(extra="{")}


@pytest.mark.parametrize("damage", [*MASK_DAMAGE, "3-D shape", "string shape"])
def test_a_mask_file_with_damaged_metadata_is_one_line(pruned_run, tmp_path, damage):  # noqa: F811
    """On main: KeyError, JSONDecodeError, 'too many values to unpack', TypeError."""
    from leapctl.masks import load_masks

    edits = MASK_DAMAGE.get(damage) or dict(shapes=first_shape(pruned_run, [1, 2, 3] if damage == "3-D shape"
                                                               else ["a", "b"]))
    with pytest.raises(LeapctlError, match="mask file .*masks.safetensors"):
        load_masks(broken_masks(pruned_run, tmp_path, **edits))


@pytest.mark.parametrize("report", ["{not json", "[1, 2]"])
def test_a_run_report_that_is_not_a_json_object_is_one_line(pruned_run, tmp_path, report):  # noqa: F811
    from leapctl.runs import read_run

    run = shutil.copytree(pruned_run, tmp_path / "run")
    (run / "report.json").write_text(report)
    with pytest.raises(LeapctlError, match="report.json is not"):
        read_run(run)


def test_export_of_a_truncated_checkpoint_is_one_line(pruned_run, tmp_path, capsys, monkeypatch):  # noqa: F811
    run = shutil.copytree(pruned_run, tmp_path / "run")
    weights = run / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    status, stderr = run_cli(capsys, monkeypatch, "export", run, "--format", "bitmap", "--out",
                             tmp_path / "e")
    assert "cannot read" in one_error_line(status, stderr)
    assert not (tmp_path / "e").exists()


@pytest.fixture(scope="module")
def bitmap_export(pruned_run, tmp_path_factory) -> Path:  # noqa: F811
    from leapctl.commands.export import export

    out = tmp_path_factory.mktemp("export") / "bitmap"
    export(str(pruned_run), "bitmap", out)
    return out


def restamped(export_dir: Path, tmp_path: Path, edit_manifest=None, config=None) -> Path:
    """A copy of the export with its manifest edited, or config.json replaced and re-hashed into it."""
    from leapctl.exporters.base import sha256_file

    copy = shutil.copytree(export_dir, tmp_path / "export")
    manifest = json.loads((copy / "manifest.json").read_text())
    if config is not None:
        (copy / "config.json").write_text(config)
        manifest["files"]["config.json"] = {"sha256": sha256_file(copy / "config.json"),
                                            "bytes": (copy / "config.json").stat().st_size}
    if edit_manifest is not None:
        edit_manifest(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


MANIFEST_DAMAGE = {
    "no layers": lambda m: m.pop("layers"),
    "no source": lambda m: m.pop("source"),
    "no dense_tensors": lambda m: m.pop("dense_tensors"),
    "a files entry is a number": lambda m: m["files"].__setitem__("config.json", 5),
    "a files entry lacks bytes": lambda m: m["files"]["config.json"].pop("bytes"),
    "layers a list": lambda m: m.__setitem__("layers", [1]),
}


@pytest.mark.parametrize("damage", MANIFEST_DAMAGE)
def test_a_manifest_lacking_what_validate_and_serve_read_is_one_line(bitmap_export, tmp_path, damage):
    """On main validate (and serve, for the files entries) failed with KeyError, TypeError, AttributeError."""
    from leapctl.commands.serve import check_export
    from leapctl.commands.validate import validate

    damaged = restamped(bitmap_export, tmp_path, MANIFEST_DAMAGE[damage])
    for check in (lambda: validate(damaged, end_to_end=False), lambda: check_export(damaged)):
        with pytest.raises(LeapctlError, match="manifest.json is damaged"):
            check()


def drop_heads(text: str) -> str:
    return json.dumps({k: v for k, v in json.loads(text).items() if k != "num_attention_heads"})


@pytest.mark.parametrize("config", ["garbage", "[1]", "no heads", "quantization_config 5"])
def test_a_rehashed_export_config_that_builds_no_model_fails_in_one_line(bitmap_export, tmp_path, config):
    """validate reports a failed check (exit 1), serve refuses (exit 2); on main both raised tracebacks."""
    from leapctl.commands.serve import check_export
    from leapctl.commands.validate import validate

    original = (bitmap_export / "config.json").read_text()
    text = {"no heads": drop_heads(original),
            "quantization_config 5": json.dumps({**json.loads(original), "quantization_config": 5})
            }.get(config, config)
    damaged = restamped(bitmap_export, tmp_path, config=text)
    report = validate(damaged, max_new_tokens=2)
    assert [c.kind for c in report.failures] == ["logits"], report.failures
    assert "config.json" in report.failures[0].detail
    with pytest.raises(LeapctlError, match="config.json|quantization_config"):
        check_export(damaged)


@pytest.mark.parametrize("command", ["prune", "export", "apply-mask"])
def test_an_out_under_a_file_fails_before_the_work(pruned_run, stories260k_dir, tmp_path, capsys,  # noqa: F811
                                                   monkeypatch, command):
    """On main prune and apply-mask loaded, pruned and then failed with FileExistsError; export too."""
    import leapctl.models

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before --out was checked")

    monkeypatch.setattr(leapctl.models, "load_model", no_loading)
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    out = afile / "run"
    args = {"prune": ["prune", stories260k_dir, "--method", "magnitude", "--sparsity", "0.5"],
            "export": ["export", pruned_run, "--format", "bitmap"],
            "apply-mask": ["apply-mask", stories260k_dir, pruned_run]}[command]
    status, stderr = run_cli(capsys, monkeypatch, *args, "--out", out)
    assert one_error_line(status, stderr) == f"error: output path {out}: {afile} is not a folder"


def test_validate_refuses_a_negative_token_count(bitmap_export, capsys, monkeypatch):
    status, stderr = run_cli(capsys, monkeypatch, "validate", bitmap_export, "--max-new-tokens", "-5")
    assert "--max-new-tokens" in one_error_line(status, stderr)


# ------------------------------------------------------------------ --config FILE: the options' checks


@pytest.mark.parametrize("command, text, expected", [
    (["prune", "m", "--method", "wanda", "--sparsity", "0.5", "--out", "o"], "nsamples = true",
     "nsamples should be int, got True"),
    (["serve", "x"], "port = 70000", "port must be <= 65535, got 70000"),
    (["learn", "m", "--sparsity", "0.5", "--out", "o"], "lr = nan", "lr must be a finite number, got nan"),
    (["export", "r", "--format", "bitmap"], "out = 5", "out should be a path, got 5"),
    (["eval", "m"], 'ppl = ["a", 3]', "ppl should be a list of str, got ['a', 3]"),
], ids=["bool for int", "port range", "nan", "number for path", "list items"])
def test_a_config_file_gets_the_checks_the_options_get(tmp_path, capsys, monkeypatch, command, text,
                                                       expected):
    """On main `nsamples = true` ran with one sample and `port = 70000` reached vLLM."""
    config = tmp_path / "settings.toml"
    config.write_text(text + "\n")
    status, stderr = run_cli(capsys, monkeypatch, *command, "--config", config)
    assert one_error_line(status, stderr) == f"error: config file {config}: {expected}"


def test_an_option_out_of_range_or_not_finite_is_refused_by_the_same_check(capsys, monkeypatch):
    status, stderr = run_cli(capsys, monkeypatch, "recover", "r", "--out", "o", "--lr", "inf")
    assert one_error_line(status, stderr) == "error: --lr must be a finite number, got inf"


# ------------------------------------------------------------------ a signal after the exchange: exit 0

SIGNAL_AT = """
import os, signal, sys
point = sys.argv[1]
def hook(frame, event, arg):
    if event == "call" and frame.f_code.co_qualname == point:
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGTERM)
sys.setprofile(hook)
from leapctl.cli import main
sys.argv = ["leapctl", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize("point", ["_commit", "echo"], ids=["during the exchange", "after it"])
def test_a_signal_after_the_output_is_complete_exits_0(stories260k_dir, pruned_run, tmp_path,  # noqa: F811
                                                       point):
    """On main SIGTERM in the final exchange ended the command with 143 and no word, the folder complete."""
    from leapctl.runs import read_run

    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", SIGNAL_AT, point, "apply-mask", str(stories260k_dir),
                           str(pruned_run), "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"after {out} was complete" in done.stderr
    assert read_run(out).masks.masks.keys() == read_run(pruned_run).masks.masks.keys()


def test_without_an_output_a_signal_still_ends_the_command(tmp_path):
    """The CLI's handler changes nothing before the output is in place: SIGTERM ends the process by it."""
    done = subprocess.run([sys.executable, "-c", SIGNAL_AT, "read_config_file", "prune", "m", "--method",
                           "wanda", "--sparsity", "0.5", "--out", str(tmp_path / "o"), "--config",
                           str(tmp_path / "none.json")], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGTERM, done.stderr


# ------------------------------------------------------------------ smaller


def test_max_shard_size_0_is_refused(pruned_run, tmp_path, capsys, monkeypatch):  # noqa: F811
    """On main it wrote one shard per module."""
    status, stderr = run_cli(capsys, monkeypatch, "export", pruned_run, "--format", "bitmap", "--out",
                             tmp_path / "e", "--max-shard-size", "0")
    assert "less than one byte" in one_error_line(status, stderr)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_written_file_gets_the_umask_mode_weights_included(tmp_path, umask):
    """On main safetensors' weights were 0600 beside 0644 text files."""
    import stat

    import torch
    from safetensors.torch import save_file

    from leapctl.outdir import atomic_output_dir

    before = os.umask(umask)
    try:
        with atomic_output_dir(tmp_path / "out") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
            (tmp / "sub").mkdir()
            (tmp / "sub" / "notes.txt").write_text("x")
    finally:
        os.umask(before)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode)
             for p in [tmp_path / "out", *(tmp_path / "out").rglob("*")]}
    assert modes == {"out": 0o777 & ~umask, "out/sub": 0o777 & ~umask,
                     "out/model.safetensors": 0o666 & ~umask, "out/sub/notes.txt": 0o666 & ~umask}


def test_apply_mask_refuses_masks_that_prune_a_whole_layer(pruned_run, stories260k_dir, tmp_path,  # noqa: F811
                                                            capsys, monkeypatch):
    from leapctl.masks import load_masks, save_masks
    from leapctl.runs import MASKS_FILE

    masks = load_masks(pruned_run / MASKS_FILE)
    first = next(iter(masks.masks))
    masks.masks[first] = masks.masks[first] & False
    path = tmp_path / "masks.safetensors"
    save_masks(path, masks)
    status, stderr = run_cli(capsys, monkeypatch, "apply-mask", stories260k_dir, path, "--out",
                             tmp_path / "o")
    assert f"prune every weight of {first}" in one_error_line(status, stderr)
    assert not (tmp_path / "o").exists()
