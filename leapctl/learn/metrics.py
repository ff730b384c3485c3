"""The per-step numbers of a learning run: kept in memory, appended to `metrics.jsonl` in the state folder
(rank 0), sent to TensorBoard when it is installed, shown on the progress bar."""

import json
import math
from pathlib import Path

from leapctl.progress import progress_bar

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    """`log(record)` once per step; a no-op on disk for other ranks and in-memory runs (no state folder)."""

    def __init__(self, state_dir: Path | None, master: bool, start_step: int, show_progress: bool,
                 steps: int):
        self.records: list[dict] = []
        self.path = state_dir / METRICS_FILE if master and state_dir is not None else None
        self.writer = None
        if self.path is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
            _truncate(self.path, start_step)
            self.writer = _tensorboard_writer(state_dir)
        self.bar = progress_bar(master and show_progress, eta=True, bar_width=16,
                                fields="lm {task.fields[lm]:.3f} dens {task.fields[density]:.3f} "
                                       "α {task.fields[alpha]:.0f} τ {task.fields[tau]:.2f} "
                                       "{task.fields[tps]:.0f} tok/s")
        self.task = self.bar.add_task("learn", total=steps, completed=start_step, lm=math.nan,
                                      density=math.nan, alpha=0.0, tau=0.0, tps=0.0)

    def __enter__(self):
        self.bar.start()
        return self

    def log(self, record: dict) -> None:
        self.records.append(record)
        if self.path is not None:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                self.writer.add_scalar(f"learn/{key}", value, record["step"])
        self.bar.update(self.task, advance=1, lm=record["lm_loss"], density=record["density"],
                        alpha=record["alpha"], tau=record["tau"], tps=record["tokens_per_s"])

    def __exit__(self, *exc):
        self.bar.stop()
        if self.writer is not None:
            self.writer.close()


def read_metrics(state_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (state_dir / METRICS_FILE).read_text().splitlines() if line]


def _truncate(path: Path, start_step: int) -> None:
    """On resume, forget metric lines of steps after the checkpoint (they will be run again)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] < start_step]
    path.write_text("".join(line + "\n" for line in keep))


def _tensorboard_writer(state_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(state_dir / TENSORBOARD_DIR))
