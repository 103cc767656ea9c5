"""What a model held once loaded, measured by its runner and kept in the data dir.

Before a model's first load placement counts an estimate from its file headers
(cluster/placement.py); once a runner has loaded the whole model and reported what it holds
(its resident memory plus its first KV grant), that figure replaces the estimate, here and
after a restart. A size is kept per backend and version of the weight files (path, size,
mtime), so a rewritten file is estimated afresh and llama-server's figure for a file is never
taken for shoal's engine's; every load measures again, so a changed setting (say
--kv-cache-dtype) corrects the figure at the next load.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from shoal.backend_names import DEFAULT_BACKEND
from shoal.catalog.store import write_json_atomically
from shoal.engine.config import ModelSource

SIZES_FILE = ".measured-sizes.json"  # under <data dir>/models


class MeasuredSizes:
    """Model version -> bytes held after loading; path None keeps them in memory only."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = self._load()

    @classmethod
    def of_data_dir(cls, data_dir: Path | None) -> MeasuredSizes:
        return cls(None if data_dir is None else Path(data_dir) / "models" / SIZES_FILE)

    def get(self, source: ModelSource, backend: str = DEFAULT_BACKEND) -> int | None:
        """What the model held under backend when it was last measured; None: never (this
        version)."""
        key = _key(source, backend)
        if key is None:
            return None
        with self._lock:
            return self._sizes.get(key)

    def record(self, source: ModelSource, held_bytes: int,
               backend: str = DEFAULT_BACKEND) -> None:
        """Keep what a runner of backend serving the model whole holds after loading."""
        key = _key(source, backend)
        if key is None or held_bytes <= 0:
            return
        with self._lock:
            if self._sizes.get(key) == held_bytes:
                return
            self._sizes[key] = held_bytes
            self._save()

    def _load(self) -> dict[str, int]:
        if self.path is None:
            return {}
        try:
            known = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(known, dict):
            return {}
        return {str(k): v for k, v in known.items() if isinstance(v, int) and v > 0}

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomically(self.path, self._sizes)
        except OSError:
            pass  # a read-only data dir estimates again after a restart; nothing is wrong


def _key(source: ModelSource, backend: str) -> str | None:
    """The backend and the weights' version; None when the files cannot be read."""
    path = Path(source.path)
    try:
        stat = path.stat()
        resolved = path.resolve()
    except OSError:
        return None
    version = f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}"
    return version if backend == DEFAULT_BACKEND else f"{backend}|{version}"
