"""SIGTERM / SIGINT / SIGHUP (a closed terminal) during training: they only raise a flag; the loop checkpoints
at the end of the current step and stops (`--resume` continues)."""

import signal
import threading


class StopFlag:
    """`stop.signal` is the signal number that arrived, 0 while none has. Installed only where there is a
    checkpoint to write and only from the main thread."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signal = 0
        self._previous = {}

    def __enter__(self):
        if self.enabled:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                self._previous[sig] = signal.signal(sig, self._raise)
        return self

    def _raise(self, signum, frame):
        self.signal = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
