"""Where leapctl keeps converted models and downloaded text, and where the shared test assets are."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$LEAPCTL_CACHE`, else `~/.cache/leapctl`; created on first use."""
    root = Path(os.environ.get("LEAPCTL_CACHE", Path.home() / ".cache" / "leapctl")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def assets_dir() -> Path | None:
    """`$LEAPCTL_ASSETS`, else `../shared/assets` beside the repository; None when neither exists."""
    env = os.environ.get("LEAPCTL_ASSETS")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2] / "shared" / "assets")
    for path in candidates:
        if path.is_dir():
            return path
    return None
