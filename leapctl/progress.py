"""The one progress bar: rich, on stderr, off when disabled (tests, non-zero ranks, `--no-progress`).

`progress_bar(enabled, ...)` is a `rich.progress.Progress` with leapctl's columns: a description, the bar,
done/total, then time remaining (`eta=True`) or time elapsed, and optionally one line of live numbers
(`fields`, a format string over the task's fields). `track(items, label, enabled)` iterates with a
transient bar."""

from collections.abc import Iterable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def progress_bar(enabled: bool = True, *, eta: bool = False, transient: bool = False,
                 fields: str | None = None, bar_width: int = 40) -> Progress:
    columns = [TextColumn("{task.description}"), BarColumn(bar_width=bar_width), MofNCompleteColumn(),
               TimeRemainingColumn() if eta else TimeElapsedColumn()]
    if fields is not None:
        columns.append(TextColumn(fields))
    return Progress(*columns, console=Console(stderr=True), transient=transient, disable=not enabled)


def track(items: Iterable, label: str, enabled: bool) -> Iterator:
    """Iterate over `items` with a transient bar."""
    items = list(items)
    with progress_bar(enabled, eta=True, transient=True) as bar:
        yield from bar.track(items, total=len(items), description=f"[bold]{label}")
