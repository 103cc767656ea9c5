"""Where shoal keeps its files: the data dir's default. Ground floor: imports nothing of shoal."""

from __future__ import annotations

import os
from pathlib import Path


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "shoal"
