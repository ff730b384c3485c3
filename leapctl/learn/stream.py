"""A deterministic, resumable stream of training windows over a token corpus.

The corpus (1-D ids, documents joined with EOS) is cut into non-overlapping windows of `seq_len`.
Window number i of the stream is window `perm_e[i mod n]` of epoch e = i // n, with a fresh seeded
permutation per epoch: every step sees windows it has not seen before until the corpus runs out, and
then it wraps around in a new order. The whole state is one integer, `position`, which goes into the
checkpoint."""

import torch

from leapctl.errors import LeapctlError


class WindowStream:
    def __init__(self, ids: torch.Tensor, seq_len: int, batch_size: int, seed: int, position: int = 0):
        self.windows_per_epoch = ids.numel() // seq_len
        if self.windows_per_epoch < batch_size:
            raise LeapctlError(
                f"calibration corpus too small: {ids.numel()} tokens make "
                f"{self.windows_per_epoch} windows of {seq_len}, fewer than one batch of "
                f"{batch_size} (use more text, a shorter --seq-len or a smaller --batch-size)"
            )
        self.windows = ids[: self.windows_per_epoch * seq_len].view(self.windows_per_epoch, seq_len)
        self.seed = seed
        self.position = position
        self._epoch, self._perm = -1, None

    def _window_index(self, i: int) -> int:
        epoch, offset = divmod(i, self.windows_per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.windows_per_epoch, generator=generator)
            self._epoch = epoch
        return int(self._perm[offset])

    def peek(self, start: int, count: int) -> torch.Tensor:
        """Windows [position + start, position + start + count) as a [count, seq_len] batch."""
        rows = [self._window_index(self.position + start + j) for j in range(count)]
        return self.windows[rows]

    def advance(self, count: int) -> None:
        self.position += count
