"""Resumable training state, written atomically (temporary file + `os.replace`), so a kill at any
moment leaves either the previous checkpoint or the new one, never a torn file.

Holds the logits, optimizer and scheduler state, the step, the data position, the RNG states
(torch, Python, NumPy) and the settings fingerprint that `--resume` must match. The mask noise needs
no state of its own: it is a pure function of (seed, step, micro-batch, layer), see `mask.noise_seed`."""

import os
import random
from pathlib import Path

import numpy as np
import torch

from leapctl.errors import LeapctlError

CHECKPOINT_FILE = "checkpoint.pt"


def rng_states() -> dict:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if states.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(directory: Path, state: dict) -> Path:
    """Write `state` to `directory/checkpoint.pt` atomically; returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_FILE
    tmp = directory / f".{CHECKPOINT_FILE}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def load_checkpoint(directory: Path, fingerprint: dict) -> dict:
    """Read the checkpoint and check it belongs to a run with the same settings; the file is untouched."""
    path = directory / CHECKPOINT_FILE
    if not path.is_file():
        raise LeapctlError(f"--resume: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch.load raises many types for truncated or foreign files
        raise LeapctlError(f"--resume: {path} is not a readable checkpoint ({type(exc).__name__})") from None
    saved = state.get("fingerprint", {})
    differing = [
        f"{key} {saved.get(key)!r} -> {value!r}"
        for key, value in fingerprint.items()
        if saved.get(key) != value
    ]
    if differing:
        raise LeapctlError(
            f"--resume: the checkpoint at {path} was made with other settings ("
            + "; ".join(differing[:4])
            + "); rerun with the same settings or use --overwrite"
        )
    return state
