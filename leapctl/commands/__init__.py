"""One module per command, each with the same parts: `NAME` and `HELP`; `Config`, its settings dataclass
(the CLI options and `--config FILE` are generated from it by `leapctl.settings`); `run(config)`, what
Python users call; and `main(config)`, `run` plus the printed summary, returning the exit status. A
command module imports no other command module and nothing registers itself on import: `leapctl.cli`
lists them in `COMMANDS`."""
