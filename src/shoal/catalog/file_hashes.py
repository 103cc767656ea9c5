"""The sha256 of model files, computed once per (path, size, mtime) and kept in the data dir.

A node advertises the hashes of the files it holds (other nodes fetch and verify against
them), and hashing a file of several gigabytes takes seconds: the cache makes that a cost paid
once per file version, across restarts. A file rewritten in place changes its size or mtime
and is hashed again. Blocking: callers run it off any event loop.

The same read also hashes each CHUNK_BYTES span of the file on its own (its chunk digests),
kept beside the cache under the file's sha256: a node serving the file to a peer sends each
span with its digest without hashing it again (cluster/file_stream.py).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from shoal.catalog.store import MANIFEST, write_json_atomically
from shoal.engine.config import ModelSource

CACHE_FILE = ".file-hashes.json"  # under <data dir>/models
CHUNKS_DIR = ".chunk-digests"  # under <data dir>/models: <sha256>.4m, 32 bytes a chunk
CHUNK_BYTES = 4 * 1024 * 1024  # the span of one chunk digest, and of one read
READ_BYTES = CHUNK_BYTES
DIGEST_BYTES = 32


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file's bytes (blocking: reads the whole file)."""
    return digests_of(path)[0]


def digests_of(path: Path) -> tuple[str, bytes]:
    """A file's hex sha256 and its chunk digests (the raw sha256 of each CHUNK_BYTES span in
    order, the last span possibly short, concatenated), from one read of the file."""
    whole, chunks = hashlib.sha256(), []
    # Both hashes of a span at once, on two threads (hashlib lets go of the GIL).
    with ThreadPoolExecutor(1) as pool, open(path, "rb") as file:
        while data := file.read(CHUNK_BYTES):
            chunk = pool.submit(lambda d: hashlib.sha256(d).digest(), data)
            whole.update(data)
            chunks.append(chunk.result())
    return whole.hexdigest(), b"".join(chunks)


class FileHashes:
    """sha256 per file version; cache_path None keeps them in memory only."""

    def __init__(self, cache_path: Path | None = None) -> None:
        self.cache_path = cache_path
        self._lock = threading.Lock()
        self._known: dict[str, str] = self._load()
        self._chunks: dict[str, bytes] = {}  # sha256 -> chunk digests
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
        digest, chunks = digests_of(path)
        if _version_key(path) != key:  # rewritten while being read: this hash is of neither
            raise OSError(f"{path} changed while it was being hashed")
        with self._lock:
            self._known[key] = digest
            self._chunks[digest] = chunks
            self.computed += 1
            self._save()
            self._save_chunks(digest, chunks)
        return digest

    def chunk_digests(self, sha256: str) -> bytes | None:
        """The chunk digests of the file whose sha256 this is, if it was hashed here (by
        this version of shoal); never reads the file itself."""
        with self._lock:
            known = self._chunks.get(sha256)
        if known is not None or self.cache_path is None:
            return known
        try:
            known = (self.cache_path.parent / CHUNKS_DIR / f"{sha256}.4m").read_bytes()
        except (OSError, ValueError):
            return None
        if len(known) % DIGEST_BYTES:
            return None
        with self._lock:
            self._chunks[sha256] = known
        return known

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

    def _save_chunks(self, sha256: str, chunks: bytes) -> None:
        if self.cache_path is None or not all(c in "0123456789abcdef" for c in sha256):
            return
        directory = self.cache_path.parent / CHUNKS_DIR
        try:
            directory.mkdir(parents=True, exist_ok=True)
            staged = directory / f".{sha256}.partial"
            staged.write_bytes(chunks)
            staged.replace(directory / f"{sha256}.4m")
        except OSError:
            pass  # as _save: served spans are then hashed as they are sent


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
