"""The model store: pulled models under <data dir>/models/store/, one directory each.

A directory is listed only once it holds its manifest (shoal-model.json), and a pull writes
the manifest into its staging directory before renaming that directory into place, so a
model is either wholly here or not listed at all. Removal renames the directory away first
for the same reason. When a model was last used is the mtime of a small sidecar file, so
using a model never rewrites its manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STORE_DIR = "store"  # under <data dir>/models
DOWNLOADS_DIR = ".downloads"  # staging directories of pulls in progress (resumable)
MANIFEST = "shoal-model.json"
_LAST_USED = ".last-used"


@dataclass(frozen=True)
class StoredModel:
    """One pulled model as its manifest describes it."""

    name: str  # the store's name for it: llama3.2:latest, org/repo:Q4_K_M, org/repo
    names: tuple[str, ...]  # every name it was pulled under
    source: str  # "huggingface" or "ollama"
    format: str  # "gguf", "safetensors" or "diffusers"
    directory: Path
    weights: Path  # the .gguf file, or the directory holding config.json + *.safetensors
    size: int  # bytes of all its files
    pulled_at: float
    last_used: float
    files: tuple[dict[str, Any], ...] = ()  # {"path", "size", "sha256"?, "digest"?}
    card: dict[str, Any] = field(default_factory=dict)  # Ollama's template, params, system

    def answers_to(self, name: str) -> bool:
        key = name.strip().lower()
        return key == self.name.lower() or key in (n.lower() for n in self.names)


class ModelStore:
    """The pulled models of one data dir."""

    def __init__(self, models_dir: Path) -> None:
        self.models_dir = Path(models_dir)
        self.root = self.models_dir / STORE_DIR
        self.downloads = self.models_dir / DOWNLOADS_DIR

    @classmethod
    def of_data_dir(cls, data_dir: Path) -> ModelStore:
        return cls(Path(data_dir) / "models")

    def entries(self) -> list[StoredModel]:
        """Every complete model in the store, by name."""
        if not self.root.is_dir():
            return []
        found = []
        for directory in sorted(self.root.iterdir()):
            entry = read_entry(directory)
            if entry is not None:
                found.append(entry)
        return sorted(found, key=lambda entry: entry.name.lower())

    def find(self, name: str) -> StoredModel | None:
        for entry in self.entries():
            if entry.answers_to(name):
                return entry
        return None

    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.entries())

    def directory_for(self, key: str) -> Path:
        return self.root / directory_name(key)

    def staging_for(self, key: str) -> Path:
        """Where a pull of key gathers its files; kept across interruptions (resume)."""
        return self.downloads / directory_name(key)

    def install(self, staging: Path, manifest: dict[str, Any]) -> StoredModel:
        """Write manifest into staging and rename it into the store in one step."""
        write_json_atomically(staging / MANIFEST, manifest)
        target = self.directory_for(manifest["name"])
        self.root.mkdir(parents=True, exist_ok=True)
        if target.exists():
            _remove_tree(target, self.root)
        os.replace(staging, target)
        (target / _LAST_USED).touch()
        entry = read_entry(target)
        if entry is None:
            raise OSError(f"the model store could not read back {target / MANIFEST}")
        return entry

    def add_name(self, entry: StoredModel, name: str) -> StoredModel:
        """entry, answering to name as well from now on."""
        if entry.answers_to(name):
            return entry
        manifest = json.loads((entry.directory / MANIFEST).read_text())
        manifest["names"] = [*manifest.get("names", []), name.strip()]
        write_json_atomically(entry.directory / MANIFEST, manifest)
        return read_entry(entry.directory) or entry

    def touch(self, entry: StoredModel) -> None:
        """Mark entry used now (least recently used models are evicted first)."""
        try:
            (entry.directory / _LAST_USED).touch()
        except OSError:
            pass  # a read-only store still serves; it only loses its LRU order

    def remove(self, entry: StoredModel) -> None:
        """Delete entry: unlisted at once (renamed away), then its files."""
        _remove_tree(entry.directory, self.root)


def directory_name(key: str) -> str:
    """A file-system-safe, collision-free directory name for a store key (names are
    matched in any letter case, so the directory is too)."""
    key = key.lower()
    slug = re.sub(r"[^a-z0-9._-]+", "--", key).strip("-.")[:80] or "model"
    return f"{slug}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def read_entry(directory: Path) -> StoredModel | None:
    """The model in directory, or None when it has no readable manifest (not complete)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        last_used_file = directory / _LAST_USED
        last_used = (last_used_file.stat().st_mtime if last_used_file.exists()
                     else float(manifest["pulled_at"]))
        return StoredModel(
            name=manifest["name"], names=tuple(manifest.get("names", ())),
            source=manifest["source"], format=manifest["format"], directory=directory,
            weights=directory / manifest["weights"], size=int(manifest["size"]),
            pulled_at=float(manifest["pulled_at"]), last_used=last_used,
            files=tuple(manifest.get("files", ())), card=dict(manifest.get("card", {})))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_json_atomically(path: Path, value: Any) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        temporary.write_text(json.dumps(value, indent=2))
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _remove_tree(directory: Path, root: Path) -> None:
    trash = root.parent / f".removing-{uuid.uuid4().hex}"
    os.replace(directory, trash)
    shutil.rmtree(trash, ignore_errors=True)


def choose_victims(entries: Sequence[StoredModel], bytes_needed: int, limit: int,
                   keep: Callable[[StoredModel], bool]) -> list[StoredModel]:
    """The models to evict so that bytes_needed more fit under limit: least recently used
    first, never one that keep() protects (pinned or loaded). ValueError when even evicting
    every other model leaves too little room."""
    held = sum(entry.size for entry in entries)
    excess = held + bytes_needed - limit
    if excess <= 0:
        return []
    victims: list[StoredModel] = []
    for entry in sorted((e for e in entries if not keep(e)), key=lambda e: e.last_used):
        victims.append(entry)
        excess -= entry.size
        if excess <= 0:
            return victims
    raise ValueError(f"the model store is bounded at {limit:,} bytes (--models-disk); "
                     f"{held:,} are held by models in use or pinned and {bytes_needed:,} more "
                     f"are needed")

