"""The state folder of an unfinished `leapctl learn` (`OUT.learn-state`, or `--checkpoint-dir`): the token
stream, the metrics, the initial mask and the checkpoints. Only what learn writes is ever removed from it
(--checkpoint-dir may name a user's folder)."""

import shutil
from pathlib import Path

from leapctl.errors import LeapctlError
from leapctl.learn.checkpoint import CHECKPOINT_INDEX, FOLDER_PREFIX
from leapctl.learn.heldout import HELD_APART_FILE
from leapctl.learn.metrics import METRICS_FILE, TENSORBOARD_DIR
from leapctl.learn.stream import TOKENS_FILE, TOKENS_INFO

INIT_MASKS_FILE = "init_masks.safetensors"  # the initial keep-masks, computed once and read by every process
STATE_ENTRIES = (TOKENS_FILE, TOKENS_INFO, METRICS_FILE, INIT_MASKS_FILE, CHECKPOINT_INDEX, TENSORBOARD_DIR,
                 HELD_APART_FILE)


def check_state_dir(state_dir: Path, out: Path, inputs: tuple[Path | str | None, ...]) -> None:
    """The state folder must be missing, empty or hold only what `learn` writes (a token stream, checkpoints,
    a killed run's temporary files), apart from the output folder and the inputs: it is cleared on
    --overwrite and after success."""
    if state_dir.exists() and not state_dir.is_dir():
        raise LeapctlError(f"checkpoint folder {state_dir} exists and is not a folder")
    where, target = state_dir.resolve(), out.resolve()
    if where == target or where in target.parents or target in where.parents:
        raise LeapctlError(f"checkpoint folder {state_dir} overlaps the output folder {out}")
    for given in inputs:
        if given is not None and Path(given).exists() and (where == Path(given).resolve()
                                                           or where in Path(given).resolve().parents):
            raise LeapctlError(f"checkpoint folder {state_dir} is or contains this command's input {given}")
    if state_dir.is_dir() and not all(_written_by_learn(entry) for entry in state_dir.iterdir()):
        raise LeapctlError(f"checkpoint folder {state_dir} holds files that learn did not write; it must be "
                           f"empty, missing or an earlier learn's checkpoint")


def refuse_bad_start(state_dir: Path, out: Path, inputs: tuple, overwrite: bool, resume: bool,
                     fingerprint: dict, command: str) -> None:
    """Before any work of a resumable command (`learn`, `recover`): the output folder and the state folder
    usable, a `resume`'s checkpoint made with the same settings, and an unfinished run's checkpoint never
    given up without `overwrite`."""
    from leapctl.learn.checkpoint import has_checkpoint, read_checkpoint
    from leapctl.outdir import check_output_dir

    check_output_dir(out, overwrite, inputs)
    check_state_dir(state_dir, out, inputs)
    if resume:
        read_checkpoint(state_dir, fingerprint)
    elif has_checkpoint(state_dir) and not overwrite:
        raise LeapctlError(f"an unfinished {command}'s checkpoint exists in {state_dir}: pass --resume to "
                           f"continue it or --overwrite to start over")


def _written_by_learn(entry: Path) -> bool:
    """A state folder entry learn writes: its files, checkpoint folders and the temporary files of both."""
    return (entry.name in STATE_ENTRIES or entry.name.startswith(FOLDER_PREFIX)
            or (entry.name.startswith(".") and ".tmp-" in entry.name))


def clear_state(state_dir: Path) -> None:
    """Remove what learn writes into a state folder (and its checkpoint folders); nothing else."""
    if not state_dir.is_dir():
        return
    for entry in state_dir.iterdir():
        if not _written_by_learn(entry):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
