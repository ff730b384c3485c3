"""Settings declared once. A command's settings are one config dataclass whose fields carry their help
(`setting(...)`); `config_command` turns it into the command's typer options, reads `--config FILE`
(JSON or TOML, keys are the field names) and lets flags given on the command line override the file.
So a default, a help text or a new setting is written in exactly one place."""

import dataclasses
import inspect
import json
import math
import tomllib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from leapctl.errors import LeapctlError

CONFIG_OPTION = "config_file"


def setting(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | tuple[str, ...] | None = None,
            argument: bool = False, metavar: str | None = None, cli: bool = True, required: bool = False,
            default_factory: Any = dataclasses.MISSING, envvar: str | None = None,
            min: int | None = None, max: int | None = None) -> Any:
    """A config field with its command-line help. `flag` overrides the generated spelling
    (`--name`, or `--name/--no-name` for booleans; a tuple adds short forms such as `-v`); `argument`
    makes it positional; `cli=False` keeps it off the command line (Python callers only); `required` makes
    the command line (or --config FILE) give a field that Python callers may leave at its default;
    `envvar` reads an unset option from the environment; `min`/`max` bound an integer option."""
    metadata = {"help": help, "flag": flag, "argument": argument, "metavar": metavar, "cli": cli,
                "required": required, "envvar": envvar, "min": min, "max": max}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def cli_fields(config_cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(config_cls) if f.metadata.get("cli", True)]


def _required(field: dataclasses.Field) -> bool:
    no_default = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    return no_default or field.metadata.get("required", False)


def _flag_names(field: dataclasses.Field, annotation: Any) -> list[str]:
    flag = field.metadata.get("flag")
    if flag:
        return [flag] if isinstance(flag, str) else list(flag)
    name = field.name.replace("_", "-")
    if _base_type(annotation) is bool:
        return [f"--{name}/--no-{name}"]
    return [f"--{name}"]


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; `list[str]` stays as it is."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _parameters(config_cls: type, with_config_file: bool) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(config_cls)
    params = []
    for field in cli_fields(config_cls):
        annotation = hints[field.name]
        help_text = field.metadata.get("help", "")
        if field.metadata.get("argument"):
            default = ... if _required(field) else field.default
            info = typer.Argument(default, help=help_text, metavar=field.metadata.get("metavar"),
                                  show_default=False)
        else:
            if _required(field):
                # Required, but possibly from --config FILE: checked after the file is merged.
                default, annotation = None, annotation | None
                help_text = f"{help_text} (required)"
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:
                default = field.default
            bounds = {key: field.metadata[key] for key in ("min", "max")
                      if field.metadata.get(key) is not None}
            info = typer.Option(default, *_flag_names(field, annotation), help=help_text,
                                metavar=field.metadata.get("metavar"), envvar=field.metadata.get("envvar"),
                                **bounds)
        params.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=info,
                                        annotation=annotation))
    if with_config_file:
        params.append(inspect.Parameter(
            CONFIG_OPTION, inspect.Parameter.KEYWORD_ONLY, annotation=Path | None,
            default=typer.Option(None, "--config", metavar="FILE",
                                 help="Read settings from a JSON or TOML file (keys: the option names "
                                      "with underscores); options given on the command line win.")))
    return params


def read_config_file(path: Path, config_cls: type) -> dict[str, Any]:
    """Field values from a JSON or TOML file; one clear error for an unreadable file or an unknown key."""
    path = Path(path)
    if not path.is_file():
        raise LeapctlError(f"config file {path} does not exist")
    try:
        if path.suffix == ".toml":
            values = tomllib.loads(path.read_text())
        else:
            values = json.loads(path.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LeapctlError(f"config file {path} is not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: "
                           f"{exc}") from None
    if not isinstance(values, dict):
        raise LeapctlError(f"config file {path} must hold one object of settings")
    known = {f.name: f for f in cli_fields(config_cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise LeapctlError(f"config file {path}: unknown setting {unknown[0]!r} "
                           f"(known: {', '.join(sorted(known))})")
    hints = typing.get_type_hints(config_cls)
    return {name: _coerce(value, hints[name], name, path) for name, value in values.items()}


def _coerce(value: Any, annotation: Any, name: str, path: Path) -> Any:
    """JSON/TOML values as the field's type (paths from strings, floats from integers); a value of another
    type is refused, a boolean included where a number is expected (`nsamples = true` is not 1)."""
    base = _base_type(annotation)
    if value is None:
        return None
    expected = typing.get_origin(base) or base
    if base is Path and isinstance(value, str):
        return Path(value)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    wrong = isinstance(value, bool) and expected is not bool
    if base is Path or wrong or (isinstance(expected, type) and not isinstance(value, expected)):
        name_of = "a path" if base is Path else getattr(expected, "__name__", expected)
        raise LeapctlError(f"config file {path}: {name} should be {name_of}, got {value!r}")
    item = typing.get_args(base)[0] if expected is list and typing.get_args(base) else None
    if isinstance(item, type) and not all(isinstance(v, item) for v in value):
        raise LeapctlError(f"config file {path}: {name} should be a list of {item.__name__}, got {value!r}")
    return value


def check_values(config_cls: type, values: dict[str, Any], labels: dict[str, str]) -> None:
    """The checks every setting gets wherever it came from (an option or --config FILE): a float is
    finite, a bounded number is within its `min`/`max`. `labels` names each value's origin for the error."""
    hints = typing.get_type_hints(config_cls)
    for field in cli_fields(config_cls):
        value = values.get(field.name)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        label = labels.get(field.name) or _flag_names(field, hints[field.name])[0].split("/")[0]
        if isinstance(value, float) and not math.isfinite(value):
            raise LeapctlError(f"{label} must be a finite number, got {value}")
        low, high = field.metadata.get("min"), field.metadata.get("max")
        if low is not None and value < low:
            raise LeapctlError(f"{label} must be >= {low}, got {value}")
        if high is not None and value > high:
            raise LeapctlError(f"{label} must be <= {high}, got {value}")


def config_from_cli(config_cls: type, given: dict[str, Any], ctx: typer.Context) -> Any:
    """The config object: the file's values (if `--config`), then every option the user typed."""
    file_path = given.pop(CONFIG_OPTION, None)
    values = read_config_file(file_path, config_cls) if file_path is not None else {}
    labels = {name: f"config file {file_path}: {name}" for name in values}
    for name, value in given.items():
        source = ctx.get_parameter_source(name)
        if name not in values or getattr(source, "name", "") in ("COMMANDLINE", "ENVIRONMENT"):
            values[name] = value
            labels.pop(name, None)
    check_values(config_cls, values, labels)
    for field in cli_fields(config_cls):
        if _required(field) and values.get(field.name) is None:
            flag = _flag_names(field, None)[0]
            raise LeapctlError(f"missing option {flag} (give it on the command line or in --config FILE)")
    return config_cls(**values)


def config_command(app: typer.Typer, config_cls: type, run: Callable[[Any], int | None], *, name: str,
                   help: str, with_config_file: bool = True, extra_args: str | None = None,
                   **command_kwargs) -> Callable:
    """Register command `name` on `app` with one option per field of `config_cls`; the command builds
    the config and calls `run(config)`, whose non-zero return value becomes the exit status.
    `extra_args` names a (`cli=False`) field that receives the arguments after `--`."""

    def command(ctx: typer.Context, **given: Any) -> None:
        config = config_from_cli(config_cls, given, ctx)
        if extra_args is not None:
            setattr(config, extra_args, list(ctx.args))
        status = run(config)
        if status:
            raise typer.Exit(status)

    if extra_args is not None:
        command_kwargs["context_settings"] = {**command_kwargs.get("context_settings", {}),
                                              "allow_extra_args": True}

    context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    command.__signature__ = inspect.Signature([context, *_parameters(config_cls, with_config_file)])
    command.__doc__ = help
    command.__name__ = name.replace("-", "_")
    return app.command(name, help=help, **command_kwargs)(command)
