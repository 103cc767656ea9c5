"""Model files between nodes: a node that lacks a model another node holds copies it from
that node instead of from the outside source; a rank copies only its share of a GGUF, and
a node guessing for a model it does not serve only the model's tokenizer.

Each range of a file is copied over a direct stream from the holder, else over the data
plane itself (range_copy.py; model_serving.py is the holder's side). The copy lands in
<file>.partial in the store's staging directory, paced to `rate_bytes_per_s` so that
serving on both nodes goes on. A finished file is checked against the size and sha256 its
holder advertised (a file whose every byte came over streams in this fetch was checked
piece by piece against the holder's digests of that very version, so it is not read again),
then renamed into place; the model is installed into the store in one rename (the pull
package's staging, verification and landing). A partial file is resumed from where it
stopped, by this holder or another.

Every wait is bounded: a holder silent for `chunk_wait_s` (killed, or gone from the
cluster) is dropped and the next holder of the same files resumes the file; when none is
left the fetch fails with every holder's reason, and the caller may fall back to the
outside source.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from shoal.catalog.pull.download import PARTIAL_SUFFIX, RemoteFile, verify_file
from shoal.catalog.pull.errors import NotEnoughDisk, PullError
from shoal.catalog.pull.progress import Progress, PullEvent
from shoal.catalog.pull.puller import STAGED_PLAN, forget_stale_files
from shoal.catalog.resolve import ModelNotFound
from shoal.catalog.store import ModelStore, directory_name, write_json_atomically
from shoal.cluster.file_stream import server_context
from shoal.cluster.held_models import HeldFile, HeldModel, HeldModels
from shoal.cluster.model_serving import ModelFileServer
from shoal.cluster.range_copy import SOURCE, RangeCopier, TransferConfig
from shoal.cluster.rank_files import CopyRange, Experts, copy_header, copy_rank_share
from shoal.cluster.telemetry import NodeReading
from shoal.cluster.transport.base import Subscription, Transport
from shoal.engine.config import ModelSource
from shoal.ids import NodeId

__all__ = ["ModelTransfer", "TransferConfig"]

log = logging.getLogger("shoal.cluster.transfer")

RANKS_DIR = "ranks"  # under <data dir>/models: ranks' own copies, and tokenizers alone
# A checkpoint directory's files a tokenizer is read from (with the model's config).
TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                             "special_tokens_map.json", "vocab.json", "merges.txt",
                             "config.json", "generation_config.json", "added_tokens.json"})
_RANGES_RECORD = ".ranges.json"  # the byte ranges a rank's copy already holds


Readings = Callable[[], Sequence[NodeReading]]


class ModelTransfer:
    """Serves this node's advertised files to peers, and fetches missing models from them.

    readings(): the live telemetry readings of the other nodes (what each holds); host():
    the address other nodes reach this one at (where it offers streams)."""

    def __init__(self, transport: Transport, held: HeldModels, store: ModelStore,
                 readings: Readings, config: TransferConfig | None = None,
                 host: Callable[[], str] = lambda: "127.0.0.1") -> None:
        self._transport = transport
        self.held = held
        self.store = store
        self._readings = readings
        self.config = config or TransferConfig()
        tls = self.config.tls
        self.server = ModelFileServer(transport, held, host, self.config.chunk_wait_s,
                                      server_context(tls) if tls is not None else None)
        self.copier = RangeCopier(transport, self.config)
        # (model bytes, bytes missing, label): evicts for --models-disk and checks the free
        # disk (the node's puller sets it); NotEnoughDisk when there is no room.
        self.make_room: Callable[[int, int, str], None] = self._check_disk
        self._fetching: dict[str, asyncio.Task[bool]] = {}
        self._ranks: dict[str, asyncio.Task[Path]] = {}
        self._subscription: Subscription | None = None

    @property
    def observers(self) -> list[Progress]:
        """Every fetch's progress (the node's metrics)."""
        return self.copier.observers

    @property
    def fetched_bytes(self) -> int:
        """Bytes received from peers."""
        return self.copier.fetched_bytes

    @property
    def served_bytes(self) -> int:
        """Bytes sent to peers."""
        return self.server.served_bytes

    def start(self) -> None:
        self._subscription = self._transport.subscribe_data(self._on_data)

    async def stop(self) -> None:
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
        self.server.stop()
        for task in [*self._fetching.values(), *self._ranks.values()]:
            task.cancel()

    def holders(self, name: str) -> tuple[HeldModel, list[NodeId]] | None:
        """The files other nodes hold under name, and the nodes holding them; None when no
        other node holds it. ModelNotFound when nodes hold different files under one name
        (two files of the same name on two machines, say): copying either would be a guess."""
        found = [(reading.node_id, model) for reading in self._readings()
                 if reading.node_id != self._transport.node_id
                 and (model := reading.held(name)) is not None]
        if not found:
            return None
        versions: dict[frozenset[tuple[str, int, str]], list[NodeId]] = {}
        for node, model in found:
            versions.setdefault(_version(model), []).append(node)
        if len(versions) > 1:
            held = "; ".join(f"{', '.join(sorted(nodes))}: {_describe(version)}"
                             for version, nodes in versions.items())
            raise ModelNotFound(f"nodes hold different files under the name {name!r} ({held}); "
                                f"name the model by a path or pull it here")
        [nodes] = versions.values()
        return found[0][1], sorted(nodes)

    async def fetch(self, name: str) -> bool:
        """Copy name's files from a peer into this node's store: True once installed, False
        when no peer holds it; ModelNotFound (saying why) when every holder failed or
        holders disagree on its files.
        Concurrent fetches of one model are one fetch."""
        found = self.holders(name)
        if found is None:
            return False
        key = found[0].model.lower()  # any of its names: one fetch
        task = self._fetching.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._fetch(*found))
            self._fetching[key] = task
            task.add_done_callback(lambda _t: self._fetching.pop(key, None))
        return await asyncio.shield(task)

    async def fetch_rank(self, name: str, start: int, end: int, n_layers: int,
                         experts: Experts | None = None) -> Path | None:
        """A pipeline or expert rank's own copy of a one-file GGUF model other nodes hold:
        only the bytes layers [start, end) need, of their expert tensors only the experts
        [first, last) of n_experts when `experts` says so (rank_files.py), in a sparse file
        of the original's layout under <models>/ranks/. None when no peer holds the model or
        it is not one GGUF file (the caller copies it whole); ModelNotFound when every
        holder failed."""
        found = self.holders(name)
        if found is None or found[0].format != "gguf" or len(found[0].files) != 1:
            return None
        model, nodes = found
        key = f"{model.model}@{model.files[0].sha256[:16]}:layers-{start}-{end}"
        if experts is not None:
            key += f":experts-{experts[0]}-{experts[1]}-of-{experts[2]}"
        share = "" if experts is None else f" (experts [{experts[0]}, {experts[1]}))"
        return await self._share(model, nodes, key, f"layers [{start}, {end}){share}",
                                 lambda partial, size, copy: copy_rank_share(
                                     partial, size, copy, start, end, n_layers, experts))

    async def fetch_tokenizer(self, name: str) -> ModelSource | None:
        """What a node guessing tokens for a model it does not serve needs of it: its
        tokenizer. A GGUF keeps its tokenizer in its header, so only the header is copied,
        into a sparse file of the original's layout that reads as the model for its
        metadata; a checkpoint directory, only its tokenizer and config files. None when no
        peer holds the model; ModelNotFound when every holder failed."""
        found = self.holders(name)
        if found is None:
            return None
        model, nodes = found
        key = f"{model.model}@{_version_key(model)}:tokenizer"
        if model.format == "gguf" and len(model.files) == 1:
            path = await self._share(model, nodes, key, "the tokenizer (GGUF header)",
                                     lambda partial, size, copy: copy_header(partial, size,
                                                                             copy))
            return ModelSource(model_id=model.model, format="gguf", path=path)
        wanted = [f for f in model.files if f.path in TOKENIZER_FILES]
        if model.format != "safetensors" or not any(f.path.startswith("tokenizer")
                                                    for f in wanted):
            return None
        directory = self.store.models_dir / RANKS_DIR / directory_name(key)
        label = f"fetch the tokenizer of model {model.model!r} from peer {', '.join(nodes)}"
        failures: dict[NodeId, str] = {}
        for file in wanted:
            await self._fetch_file(model, file, directory, nodes, failures, label)
        return ModelSource(model_id=model.model, format="safetensors", path=directory)

    async def _share(self, model: HeldModel, nodes: list[NodeId], key: str, what: str,
                     fill: Callable[[Path, int, CopyRange], Awaitable[Any]]) -> Path:
        """One copy (concurrent asks share it) of part of a one-file model: fill(partial,
        size, copy) says which ranges, in a sparse file under <models>/ranks/."""
        task = self._ranks.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._fetch_share(model, nodes, key, what, fill))
            self._ranks[key] = task
            task.add_done_callback(lambda _t: self._ranks.pop(key, None))
        return await asyncio.shield(task)

    async def _fetch_share(self, model: HeldModel, nodes: list[NodeId], key: str, what: str,
                           fill: Callable[[Path, int, CopyRange], Awaitable[Any]]) -> Path:
        [file] = model.files
        directory = self.store.models_dir / RANKS_DIR / directory_name(key)
        target = directory / file.path
        if target.is_file():
            return target  # renamed into place once complete
        label = f"fetch {what} of model {model.model!r} from peer {', '.join(nodes)}"
        directory.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + PARTIAL_SUFFIX)
        record = directory / _RANGES_RECORD
        done = _read_ranges(record)
        failures: dict[NodeId, str] = {}
        with partial.open("r+b" if partial.exists() else "wb") as out:
            out.truncate(file.size)  # sparse: what this rank never reads stays a hole

            async def copy(begin: int, length: int) -> None:
                if any(b <= begin and begin + length <= b + n for b, n in done):
                    return  # copied by an earlier, interrupted fetch
                await self.copier.copy_with_failover(model, file, out, begin, begin + length,
                                               nodes, failures, label, set())
                done.append((begin, length))
                await asyncio.to_thread(write_json_atomically, record, done)

            try:
                await fill(partial, file.size, copy)
            except ValueError as error:
                raise ModelNotFound(f"{label}: {error}") from error
        os.replace(partial, target)
        record.unlink(missing_ok=True)
        log.info("%s: %d of %d bytes, in %s", label, sum(n for _, n in done), file.size,
                 target)
        return target

    # --- fetching ------------------------------------------------------------------------

    async def _fetch(self, model: HeldModel, nodes: list[NodeId]) -> bool:
        label = f"fetch model {model.model!r} from peer {', '.join(nodes)}"
        log.info("%s: %d file(s), %d bytes", label, len(model.files), model.size)
        staging = self.store.staging_for(model.model)
        # What an earlier fetch or pull of this name left of other file versions goes.
        await asyncio.to_thread(forget_stale_files, staging,
                                {f.path: f"sha256:{f.sha256}" for f in model.files})
        try:
            await asyncio.to_thread(self.make_room, model.size,
                                    _missing_bytes(staging, model), label)
        except PullError as error:
            raise ModelNotFound(str(error)) from error
        failures: dict[NodeId, str] = {}
        for file in model.files:
            await self._fetch_file(model, file, staging, nodes, failures, label)
        manifest = {"name": model.model, "names": [model.model, *model.names],
                    "source": SOURCE, "format": model.format,
                    "weights": model.files[0].path if model.format == "gguf" else ".",
                    "size": model.size, "pulled_at": time.time(),
                    "origin": {"peers": list(nodes)},
                    "files": [{"path": f.path, "size": f.size, "digest": f"sha256:{f.sha256}",
                               "sha256": f.sha256} for f in model.files]}
        (staging / STAGED_PLAN).unlink(missing_ok=True)  # all fetched: it is the model now
        await asyncio.to_thread(self.store.install, staging, manifest)
        self.copier.report(PullEvent("success", source=SOURCE))
        log.info("%s: installed in %s", label, self.store.root)
        return True

    async def _fetch_file(self, model: HeldModel, file: HeldFile, staging: Path,
                          nodes: list[NodeId], failures: dict[NodeId, str], label: str) -> None:
        target = staging / file.path
        remote = RemoteFile(url=f"shoal-peer://{nodes[0]}/{file.path}", path=file.path,
                            size=file.size, digest=f"sha256:{file.sha256}", sha256=file.sha256)
        if target.is_file() and target.stat().st_size == file.size:
            return  # verified before it was renamed, by an earlier fetch
        partial = target.with_name(target.name + PARTIAL_SUFFIX)
        target.parent.mkdir(parents=True, exist_ok=True)
        have = partial.stat().st_size if partial.exists() else 0
        if have > file.size:  # not this file's bytes: start over
            have = 0
        ways: set[str] = set()  # "stream", "relay": how this fetch's bytes came
        with partial.open("r+b" if have else "wb") as out:
            # Resumed where an interrupted copy stopped (bytes are written in order).
            await self.copier.copy_with_failover(model, file, out, have, file.size, nodes,
                                           failures, label, ways)
        if not have and ways == {"stream"}:
            # Every byte was checked against the holder's digests of the version whose
            # sha256 was asked for (file_stream.py): only the size is left to check.
            remote = dataclasses.replace(remote, sha256=None)
        try:
            await asyncio.to_thread(verify_file, remote, partial, label)
        except PullError as error:
            raise ModelNotFound(str(error)) from error
        os.replace(partial, target)

    def _check_disk(self, _model_size: int, missing: int, label: str) -> None:
        place = self.store.models_dir
        while not place.exists() and place != place.parent:
            place = place.parent
        free = shutil.disk_usage(place).free
        if missing > free:
            raise NotEnoughDisk(f"{label}: not enough free disk: {missing:,} bytes are needed "
                                f"in {self.store.models_dir} and {free:,} are free")

    # --- the data key ---------------------------------------------------------------------

    def _on_data(self, message: Any) -> None:
        if isinstance(message, dict) and not self.server.handle(message):
            self.copier.take(message)


def _version(model: HeldModel) -> frozenset[tuple[str, int, str]]:
    return frozenset((f.path, f.size, f.sha256) for f in model.files)


def _version_key(model: HeldModel) -> str:
    """A short name for a model's file version (its files' hashes)."""
    return hashlib.sha256("".join(sorted(f.sha256 for f in model.files)).encode()
                          ).hexdigest()[:16]


def _describe(version: frozenset[tuple[str, int, str]]) -> str:
    return ", ".join(f"{path} sha256 {sha256[:12]}" for path, _, sha256 in sorted(version))


def _read_ranges(record: Path) -> list[tuple[int, int]]:
    try:
        return [(int(b), int(n)) for b, n in json.loads(record.read_text())]
    except (OSError, ValueError, TypeError):
        return []


def _missing_bytes(staging: Path, model: HeldModel) -> int:
    """Bytes of model's files not in staging yet (finished or partial)."""
    needed = 0
    for file in model.files:
        target = staging / file.path
        partial = target.with_name(target.name + PARTIAL_SUFFIX)
        have = target.stat().st_size if target.exists() else (
            partial.stat().st_size if partial.exists() else 0)
        needed += max(0, file.size - have)
    return needed
