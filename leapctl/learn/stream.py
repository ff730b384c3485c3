"""The training token stream: tokenised once into a memory-mapped uint32 file, read as a deterministic,
resumable stream of windows.

The corpus (1-D ids, documents joined with EOS) is written once to `tokens.u32` in the run's state folder
(4 bytes a token; 8 GB at the paper's 2B tokens, against ~17 GB as an int64 Python list), and every process
maps the same file: nothing of corpus size is pickled, broadcast or copied into a checkpoint.

It is cut into non-overlapping windows of `seq_len`. Window number i of the stream is window
`perm_e[i mod n]` of epoch e = i // n, with a fresh seeded permutation per epoch: every step sees windows it
has not seen before until the corpus runs out, and then it wraps around in a new order. The whole state is
one integer, `position`, which goes into the checkpoint."""

import json
import os
from pathlib import Path

import numpy as np
import torch

from leapctl.errors import LeapctlError
from leapctl.paths import write_text_atomically

TOKENS_FILE = "tokens.u32"
TOKENS_INFO = "tokens.json"


def write_token_file(directory: Path, ids: torch.Tensor | np.ndarray) -> Path:
    """Write 1-D token ids as little-endian uint32 to `directory/tokens.u32` (atomically) with its length
    beside it in `tokens.json`; returns the file's path."""
    array = np.asarray(ids.cpu() if torch.is_tensor(ids) else ids).reshape(-1)
    if array.size and (array.min() < 0 or array.max() >= 2**32):
        raise LeapctlError("token ids do not fit in uint32")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / TOKENS_FILE
    tmp = directory / f".{TOKENS_FILE}.tmp-{os.getpid()}"
    with open(tmp, "wb") as handle:
        for start in range(0, array.size, 1 << 24):  # 64 MiB at a time, never a second full copy
            handle.write(array[start : start + (1 << 24)].astype("<u4").tobytes())
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    info = json.dumps({"tokens": int(array.size), "dtype": "uint32"}) + "\n"
    write_text_atomically(directory / TOKENS_INFO, info)
    return path


def open_token_file(directory: Path) -> np.ndarray:
    """The token stream of `directory` as a read-only memory map (uint32); one clear error if it is missing
    or does not have the length recorded beside it."""
    path, info = directory / TOKENS_FILE, directory / TOKENS_INFO
    if not path.is_file() or not info.is_file():
        raise LeapctlError(f"no token stream in {directory} ({TOKENS_FILE} and {TOKENS_INFO})")
    expected = json.loads(info.read_text())["tokens"]
    if path.stat().st_size != 4 * expected:
        raise LeapctlError(f"{path} holds {path.stat().st_size // 4} tokens, {info.name} says {expected}")
    return np.memmap(path, dtype="<u4", mode="r", shape=(expected,))


class WindowStream:
    def __init__(self, ids: torch.Tensor | np.ndarray, seq_len: int, batch_size: int, seed: int,
                 position: int = 0):
        array = ids.numpy() if torch.is_tensor(ids) else ids
        self.windows_per_epoch = array.shape[0] // seq_len
        if self.windows_per_epoch < batch_size:
            raise LeapctlError(
                f"calibration corpus too small: {array.shape[0]} tokens make "
                f"{self.windows_per_epoch} windows of {seq_len}, fewer than one batch of "
                f"{batch_size} (use more text, a shorter --seq-len or a smaller --batch-size)"
            )
        self.windows = array[: self.windows_per_epoch * seq_len].reshape(self.windows_per_epoch, seq_len)
        self.seed = seed
        self.position = position
        self._epoch, self._perm = -1, None

    def _window_index(self, i: int) -> int:
        epoch, offset = divmod(i, self.windows_per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.windows_per_epoch, generator=generator, device="cpu").tolist()
            self._epoch = epoch
        return self._perm[offset]

    def peek(self, start: int, count: int) -> torch.Tensor:
        """Windows [position + start, position + start + count) as an int64 [count, seq_len] batch."""
        rows = [self._window_index(self.position + start + j) for j in range(count)]
        return torch.from_numpy(self.windows[rows].astype(np.int64))

    def advance(self, count: int) -> None:
        self.position += count
