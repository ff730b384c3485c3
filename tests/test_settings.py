"""Settings declared once (leapctl.settings): options generated from the config dataclasses, `--config FILE`
(JSON or TOML) with the command line winning, and one-line errors for files that cannot be used."""

import dataclasses
import json
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from leapctl.errors import LeapctlError
from leapctl.eval.config import EvalConfig
from leapctl.learn.config import LearnConfig
from leapctl.prune.config import PruneConfig
from leapctl.settings import cli_fields, config_command, read_config_file


def _app_capturing(config_cls):
    """A one-command app that records the config it was called with."""
    app, seen = typer.Typer(), []
    config_command(app, config_cls, seen.append, name="run", help="test command")
    app.command("other")(lambda: None)  # with two commands, typer keeps the command name in argv
    return app, seen


@pytest.mark.parametrize("config_cls", [PruneConfig, EvalConfig, LearnConfig])
def test_every_field_is_an_option_with_its_help(config_cls):
    app, _ = _app_capturing(config_cls)
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    for field in cli_fields(config_cls):
        if not field.metadata.get("argument"):
            flag = field.metadata.get("flag") or "--" + field.name.replace("_", "-")
            assert flag.split("/")[0] in result.output, field.name
        assert field.metadata["help"], f"{config_cls.__name__}.{field.name} has no help"


def test_defaults_come_from_the_dataclass():
    app, seen = _app_capturing(PruneConfig)
    result = CliRunner().invoke(app, ["run", "MODEL", "--method", "wanda", "--sparsity", "0.5", "--out", "o"])
    assert result.exit_code == 0, result.output
    expected = PruneConfig(model="MODEL", method="wanda", sparsity=0.5, out="o")
    got = seen[0]
    for field in dataclasses.fields(PruneConfig):
        assert str(getattr(got, field.name)) == str(getattr(expected, field.name)), field.name


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_config_file_with_command_line_overrides(tmp_path, suffix):
    path = tmp_path / f"prune{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"method": "sparsegpt", "sparsity": 0.6, "nsamples": 32, "out": "runs/x",
                                    "progress": False}))
    else:
        path.write_text('method = "sparsegpt"\nsparsity = 0.6\nnsamples = 32\nout = "runs/x"\n'
                        'progress = false\n')
    app, seen = _app_capturing(PruneConfig)
    argv = ["run", "M", "--config", str(path), "--nsamples", "64", "--seq-len", "128"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    config = seen[0]
    assert (config.method, config.sparsity, str(config.out)) == ("sparsegpt", 0.6, "runs/x")  # from the file
    assert (config.nsamples, config.seq_len) == (64, 128)  # typed on the command line: they win
    assert config.calib == "wiki-summaries" and config.progress is False  # default / file


def test_bad_config_files_are_one_line(tmp_path):
    unknown = tmp_path / "a.json"
    unknown.write_text(json.dumps({"methd": "wanda"}))
    with pytest.raises(LeapctlError, match="unknown setting 'methd'"):
        read_config_file(unknown, PruneConfig)
    wrong_type = tmp_path / "b.json"
    wrong_type.write_text(json.dumps({"nsamples": "many"}))
    with pytest.raises(LeapctlError, match="nsamples should be int"):
        read_config_file(wrong_type, PruneConfig)
    broken = tmp_path / "c.toml"
    broken.write_text("method = \n")
    with pytest.raises(LeapctlError, match="not valid TOML"):
        read_config_file(broken, PruneConfig)


def test_learn_settings_from_a_file_keep_the_preset_open(tmp_path):
    """Options a preset fills stay None unless the file or the command line sets them, so `resolved()`
    can fill them; the three-state flags (--magnitude/--no-magnitude) keep their None."""
    path = tmp_path / "learn.toml"
    path.write_text('preset = "paper"\nsteps = 40\nout = "runs/leap"\ndistill = 0.5\n')
    app, seen = _app_capturing(LearnConfig)
    result = CliRunner().invoke(app, ["run", "M", "--config", str(path), "--steps", "60", "--no-magnitude"])
    assert result.exit_code == 0, result.output
    config = seen[0]
    assert (config.preset, config.steps, config.distill, config.magnitude_term) == ("paper", 60, 0.5, False)
    assert config.lr is None and config.alpha_end is None and config.reconstruct is None
    resolved = config.resolved()
    paper_lr, paper_alpha_end = 1e-2, 350.0
    got = (resolved.lr, resolved.alpha_end, resolved.magnitude_term, resolved.distill)
    assert got == (paper_lr, paper_alpha_end, False, 0.5)


@pytest.mark.parametrize("command", [["prune", "some-model", "--method", "wanda", "--sparsity", "0.5"],
                                     ["learn", "some-model", "--sparsity", "0.5"]])
def test_missing_required_option_through_the_real_cli(tmp_path, command):
    done = subprocess.run([sys.executable, "-m", "leapctl", *command], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    expected = "error: missing option --out (give it on the command line or in --config FILE)"
    assert done.stderr.strip() == expected
