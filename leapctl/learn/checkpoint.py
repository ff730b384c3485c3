"""Resumable training state, with no pickle anywhere: tensors through `torch.distributed.checkpoint` into
safetensors files, everything else as JSON.

A checkpoint is a folder `ckpt-<step>-<id>/` of safetensors shards written by DCP's Hugging Face storage
writer, each process writing only its own shards (FSDP2 logits and AdamW moments stay sharded; replicated
tensors are written once), plus the index `checkpoint.json`: the settings fingerprint, the step, the data
position, the scheduler and optimizer hyperparameters, the RNG states and the name of the current folder.
The index is replaced atomically (temporary file + `os.replace`) after the folder is complete, and older
folders are removed only then, so a kill at any moment leaves either the previous checkpoint or the new
one, never a torn one. The token stream is not in it (it lives once in the state folder, `stream.py`), and
the mask noise needs no state (a pure function of seed, step, micro-batch and layer, `mask.noise_seed`)."""

import base64
import json
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from leapctl.errors import LeapctlError
from leapctl.paths import write_text_atomically

CHECKPOINT_INDEX = "checkpoint.json"
FOLDER_PREFIX = "ckpt-"


def _bytes(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_states() -> dict:
    """The global RNG states as JSON (the loop draws nothing from them, but model code may)."""
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": _bytes(torch.get_rng_state()),
        "cuda": [_bytes(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "python": [version, list(state), gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
    }


def restore_rng_states(states: dict) -> None:
    torch.set_rng_state(_tensor(states["torch"]))
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_tensor(s) for s in states["cuda"]])
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def save_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], meta: dict, distributed: bool) -> Path:
    """Write `tensors` (plain tensors or DTensor shards; every process calls this) and the JSON-able `meta`
    as the new current checkpoint of `directory`; returns the index file. `meta` holds `step` and
    `generation` (how many times the run was started): together they name the folder, the same on every
    process and never the name of the folder the index points to now."""
    master = not distributed or dist.get_rank() == 0
    name = f"{FOLDER_PREFIX}{meta['step']:08d}-{meta['generation']}"
    folder = directory / name
    from torch.distributed.checkpoint import HuggingFaceStorageWriter, save

    if master:
        shutil.rmtree(folder, ignore_errors=True)  # a torn folder of a killed earlier attempt
        folder.mkdir(parents=True)
    _barrier(distributed)
    with warnings.catch_warnings():  # DCP warns that one process without a process group means no_dist
        warnings.simplefilter("ignore", UserWarning)
        save(tensors, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True),
             no_dist=not distributed)
    _barrier(distributed)
    index = directory / CHECKPOINT_INDEX
    if master:
        write_text_atomically(index, json.dumps({**meta, "folder": name}))
        for old in directory.glob(f"{FOLDER_PREFIX}*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    _barrier(distributed)
    return index


def has_checkpoint(directory: Path | None) -> bool:
    return directory is not None and (directory / CHECKPOINT_INDEX).is_file()


def read_checkpoint(directory: Path, fingerprint: dict) -> dict:
    """The checkpoint's JSON state, after checking that it belongs to a run with the same settings; reads
    no tensor and changes nothing."""
    path = directory / CHECKPOINT_INDEX
    if not path.is_file():
        raise LeapctlError(f"--resume: no checkpoint at {path}")
    try:
        meta = json.loads(path.read_text())
        folder = directory / meta["folder"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise LeapctlError(f"--resume: {path} is not a readable checkpoint index") from None
    if not folder.is_dir():
        raise LeapctlError(f"--resume: {path} names {folder.name}, which is missing")
    saved = meta.get("fingerprint", {})
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
    return meta


def load_tensors(directory: Path, meta: dict, templates: dict[str, torch.Tensor], distributed: bool) -> None:
    """Fill `templates` (plain tensors or DTensor shards of the right shapes; every process calls this) in
    place from the checkpoint `meta` names. Reads safetensors only."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        load(templates, storage_reader=HuggingFaceStorageReader(str(directory / meta["folder"])),
             no_dist=not distributed)
