"""The sha256 of model files, computed once per (path, size, mtime) and kept in the data dir.

A node advertises the hashes of the files it holds (other nodes fetch and verify against
them), and hashing a file of several gigabytes takes seconds: the cache makes that a cost paid
once per file version, across restarts. A file rewritten in place changes its size or mtime
and is hashed again. Blocking: callers run it off any event loop.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shoal.catalog.store import MANIFEST, write_json_atomically
from shoal.engine.config import ModelSource

CACHE_FILE = ".file-hashes.json"  # under <data dir>/models
READ_BYTES = 4 * 1024 * 1024


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file's bytes (blocking: reads the whole file)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while data := file.read(READ_BYTES):
            digest.update(data)
    return digest.hexdigest()


class FileHashes:
    """sha256 per file version; cache_path None keeps them in memory only."""

    def __init__(self, cache_path: Path | None = None) -> None:
        self.cache_path = cache_path
        self._lock = threading.Lock()
        self._known: dict[str, str] = self._load()
        self.computed = 0  # files hashed by this object (not found in the cache)

    @classmethod
    def of_data_dir(cls, data_dir: Path) -> FileHashes:
        return cls(Path(data_dir) / "models" / CACHE_FILE)

    def sha256(self, path: Path) -> str:
        """path's sha256, hashed now only when this version of it was never hashed."""
        key = _version_key(path)
        with self._lock:
            known = self._known.get(key)
        if known is not None:
            return known
        digest = sha256_of(path)
        if _version_key(path) != key:  # rewritten while being read: this hash is of neither
            raise OSError(f"{path} changed while it was being hashed")
        with self._lock:
            self._known[key] = digest
            self.computed += 1
            self._save()
        return digest

    def cached(self, path: Path) -> str | None:
        """path's sha256 if this version of it was hashed before; never reads the file."""
        try:
            key = _version_key(path)
        except OSError:
            return None
        with self._lock:
            return self._known.get(key)

    def _load(self) -> dict[str, str]:
        if self.cache_path is None:
            return {}
        try:
            known = json.loads(self.cache_path.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): str(v) for k, v in known.items()} if isinstance(known, dict) else {}

    def _save(self) -> None:
        if self.cache_path is None:
            return
        try:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomically(self.cache_path, self._known)
        except OSError:
            pass  # a read-only data dir hashes again after a restart; nothing is wrong


def _version_key(path: Path) -> str:
    stat = Path(path).stat()
    return f"{Path(path).resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


@dataclass(frozen=True)
class ModelFile:
    """One file of a model: its path relative to the model's directory, and where it is."""

    relative: str
    path: Path
    size: int


def model_files(source: ModelSource) -> Sequence[ModelFile]:
    """The files a model's weights consist of: a GGUF file alone, or every plain file of a
    checkpoint directory (config, tokenizer, weights; not its subdirectories)."""
    path = Path(source.path)
    if path.is_file():
        return (ModelFile(path.name, path, path.stat().st_size),)
    files = []
    for child in sorted(path.iterdir()):
        # The store's manifest describes this copy; a fetched copy gets its own.
        if child.name.startswith(".") or child.name == MANIFEST or not child.is_file():
            continue
        files.append(ModelFile(child.name, child, child.stat().st_size))
    return tuple(files)
