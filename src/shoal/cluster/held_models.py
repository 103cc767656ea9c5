"""The model files a node holds, as its telemetry advertises them to the cluster.

Each node lists the models it can serve from its own disk (pulled into its store, or
resolved here for a request: a catalogue model, a local path, the Hugging Face cache) with
every file's size and sha256. Placement prefers nodes that hold a model; a node that lacks
one fetches it from a holder (model_transfer.py) and checks each file against the hash
listed here. Hashes come from FileHashes (once per file version), off the event loop, and a
model is listed only once all its files are hashed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from shoal.catalog.file_hashes import FileHashes, model_files
from shoal.cluster.instances import Frozen
from shoal.engine.config import ModelSource

log = logging.getLogger("shoal.cluster.models")


class HeldFile(Frozen):
    path: str  # relative to the model's directory (a GGUF: its file name)
    size: int
    sha256: str


class HeldModel(Frozen):
    """model: the id the cluster knows it by; names: other names it answers to."""

    model: str
    format: str  # "gguf", "safetensors" or "diffusers"
    files: tuple[HeldFile, ...]
    names: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return sum(file.size for file in self.files)

    def answers_to(self, name: str) -> bool:
        key = name.strip().lower()
        return key == self.model.lower() or key in (n.lower() for n in self.names)


# The models this node can serve from disk now: (source, other names it answers to).
HeldSources = Callable[[], Iterable[tuple[ModelSource, Sequence[str]]]]


class HeldModels:
    """This node's held models: scan() (blocking: may hash) refreshes what current() (cheap)
    returns; path_of() maps an advertised file back to its path, and nothing else."""

    def __init__(self, sources: HeldSources, hashes: FileHashes) -> None:
        self._sources = sources
        self.hashes = hashes
        self._lock = threading.Lock()
        self._held: tuple[HeldModel, ...] = ()
        self._paths: dict[tuple[str, str], Path] = {}

    def current(self) -> tuple[HeldModel, ...]:
        with self._lock:
            return self._held

    def find(self, name: str) -> HeldModel | None:
        return next((m for m in self.current() if m.answers_to(name)), None)

    def path_of(self, model: str, relative: str) -> Path | None:
        """The file of an advertised model, or None for anything not advertised (a peer
        never reads a path of its own choosing)."""
        with self._lock:
            return self._paths.get((model.lower(), relative))

    def scan(self) -> tuple[HeldModel, ...]:
        """List every model's files with their hashes (hashing new file versions)."""
        held: dict[str, HeldModel] = {}
        paths: dict[tuple[str, str], Path] = {}
        for source, names in self._sources():
            key = source.model_id.lower()
            if key in held:
                continue
            try:
                files = model_files(source)
                listed = tuple(HeldFile(path=f.relative, size=f.size,
                                        sha256=self.hashes.sha256(f.path)) for f in files)
            except OSError as error:
                log.warning("cannot list the files of model %s: %s", source.model_id, error)
                continue
            if not listed:
                continue
            held[key] = HeldModel(model=source.model_id, format=source.format, files=listed,
                                  names=tuple(n for n in names if n != source.model_id))
            paths.update({(key, f.relative): f.path for f in files})
        models = tuple(sorted(held.values(), key=lambda m: m.model.lower()))
        with self._lock:
            self._held, self._paths = models, paths
        return models
