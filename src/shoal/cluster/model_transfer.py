"""Model files between nodes, over the data plane: a node that lacks a model another node
holds copies it from that node instead of from the outside source.

The asking node sends {"model_file_ask": {fetch, from, model, path, offset, length}} to a
holder's data key; the holder reads that range of a file it advertises (held_models.py;
nothing else is ever read) and answers {"model_file_part": {fetch, offset, data, sha256}},
or {..., "error"}. The asker keeps `window` chunks asked ahead, checks each chunk's hash,
writes them in order to <file>.partial in the store's staging directory, and paces itself
to `rate_bytes_per_s` so that serving on both nodes goes on. A finished file is checked
against the size and sha256 its holder advertised, then renamed into place; the model is
installed into the store in one rename (the pull package's staging, verification and
landing). A partial file is resumed from where it stopped, by this holder or another.

Every wait is bounded: a holder silent for `chunk_wait_s` (killed, or gone from the
cluster) is dropped and the next holder of the same files resumes the file; when none is
left the fetch fails with every holder's reason, and the caller may fall back to the
outside source.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from shoal.catalog.pull.download import PARTIAL_SUFFIX, RemoteFile, verify_file
from shoal.catalog.pull.errors import NotEnoughDisk, PullError
from shoal.catalog.pull.progress import Progress, PullEvent
from shoal.catalog.pull.puller import STAGED_PLAN, forget_stale_files
from shoal.catalog.resolve import ModelNotFound
from shoal.catalog.store import ModelStore, directory_name, write_json_atomically
from shoal.cluster.data_plane import FILE_ASK_FIELD, FILE_PART_FIELD, SEND_ROOM_WAIT_S
from shoal.cluster.held_models import HeldFile, HeldModel, HeldModels
from shoal.cluster.rank_files import copy_rank_share
from shoal.cluster.telemetry import NodeReading
from shoal.cluster.transport.base import Subscription, Transport, TransportError
from shoal.ids import NodeId

log = logging.getLogger("shoal.cluster.transfer")

SOURCE = "peer"  # the label of these bytes in progress events and /metrics
MAX_ASK_BYTES = 16 * 1024 * 1024  # the most one ask may read (whatever the asker's chunk)
RANKS_DIR = "ranks"  # under <data dir>/models: pipeline ranks' own copies
_RANGES_RECORD = ".ranges.json"  # the byte ranges a rank's copy already holds


@dataclass(frozen=True)
class TransferConfig:
    chunk_bytes: int = 1024 * 1024
    window: int = 4  # chunks asked ahead of the one being written
    chunk_wait_s: float = 10.0  # a holder silent this long is given up
    # --peer-fetch-rate: at most this many bytes a second per fetch; None: unbounded.
    rate_bytes_per_s: float | None = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.window < 1 or self.chunk_wait_s <= 0:
            raise ValueError("peer fetch chunk_bytes, window and chunk_wait_s must be positive")
        if self.rate_bytes_per_s is not None and self.rate_bytes_per_s <= 0:
            raise ValueError("--peer-fetch-rate must be positive")

    @property
    def chunk_size(self) -> int:
        """Bytes per chunk: chunk_bytes, or a quarter second at the rate when that is less
        (pacing then stays smooth; never under 4 KiB)."""
        if self.rate_bytes_per_s is None:
            return self.chunk_bytes
        return max(4096, min(self.chunk_bytes, int(self.rate_bytes_per_s // 4)))


class _HolderFailed(Exception):
    """This holder cannot finish the file (silent, gone, refused, or sent bad bytes);
    reached: the offset up to which its bytes were written."""

    reached = 0


Readings = Callable[[], Sequence[NodeReading]]


class ModelTransfer:
    """Serves this node's advertised files to peers, and fetches missing models from them.

    readings(): the live telemetry readings of the other nodes (what each holds)."""

    def __init__(self, transport: Transport, held: HeldModels, store: ModelStore,
                 readings: Readings, config: TransferConfig | None = None) -> None:
        self._transport = transport
        self.held = held
        self.store = store
        self._readings = readings
        self.config = config or TransferConfig()
        self.observers: list[Progress] = []  # every fetch's progress (the node's metrics)
        # (model bytes, bytes missing, label): evicts for --models-disk and checks the free
        # disk (the node's puller sets it); NotEnoughDisk when there is no room.
        self.make_room: Callable[[int, int, str], None] = self._check_disk
        self._parts: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._fetching: dict[str, asyncio.Task[bool]] = {}
        self._ranks: dict[str, asyncio.Task[Path]] = {}
        self._serving: set[asyncio.Task] = set()
        self._subscription: Subscription | None = None
        self.fetched_bytes = 0  # bytes received from peers
        self.served_bytes = 0  # bytes sent to peers

    def start(self) -> None:
        self._subscription = self._transport.subscribe_data(self._on_data)

    async def stop(self) -> None:
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
        for task in [*self._serving, *self._fetching.values(), *self._ranks.values()]:
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

    async def fetch_rank(self, name: str, start: int, end: int, n_layers: int) -> Path | None:
        """A pipeline rank's own copy of a one-file GGUF model other nodes hold: only the
        bytes layers [start, end) need (rank_files.py), in a sparse file of the original's
        layout under <models>/ranks/. None when no peer holds the model or it is not one
        GGUF file (the caller copies it whole); ModelNotFound when every holder failed."""
        found = self.holders(name)
        if found is None or found[0].format != "gguf" or len(found[0].files) != 1:
            return None
        model, nodes = found
        key = f"{model.model}@{model.files[0].sha256[:16]}:layers-{start}-{end}"
        task = self._ranks.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(
                self._fetch_rank(model, nodes, key, (start, end, n_layers)))
            self._ranks[key] = task
            task.add_done_callback(lambda _t: self._ranks.pop(key, None))
        return await asyncio.shield(task)

    async def _fetch_rank(self, model: HeldModel, nodes: list[NodeId], key: str,
                          layers: tuple[int, int, int]) -> Path:
        [file] = model.files
        start, end, n_layers = layers
        directory = self.store.models_dir / RANKS_DIR / directory_name(key)
        target = directory / file.path
        if target.is_file():
            return target  # renamed into place once complete
        label = (f"fetch layers [{start}, {end}) of model {model.model!r} from peer "
                 f"{', '.join(nodes)}")
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
                await self._copy_with_failover(model, file, out, begin, begin + length,
                                               nodes, failures, label)
                done.append((begin, length))
                await asyncio.to_thread(write_json_atomically, record, done)

            try:
                await copy_rank_share(partial, file.size, copy, start, end, n_layers)
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
        self._report(PullEvent("success", source=SOURCE))
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
        with partial.open("r+b" if have else "wb") as out:
            # Resumed where an interrupted copy stopped (bytes are written in order).
            await self._copy_with_failover(model, file, out, have, file.size, nodes,
                                           failures, label)
        try:
            await asyncio.to_thread(verify_file, remote, partial, label)
        except PullError as error:
            raise ModelNotFound(str(error)) from error
        os.replace(partial, target)

    async def _copy_with_failover(self, model: HeldModel, file: HeldFile, out: BinaryIO,
                                  begin: int, end: int, nodes: list[NodeId],
                                  failures: dict[NodeId, str], label: str) -> None:
        """file's bytes [begin, end) into out at the same offsets, from the first holder
        that can; a holder that fails is left out and the next resumes where it stopped."""
        for node in nodes:
            if node in failures:
                continue
            try:
                await self._copy_range(node, model, file, out, begin, end)
                break
            except _HolderFailed as error:
                failures[node] = str(error)
                begin = error.reached
                log.warning("%s: %s of %s from %s: %s; trying another holder", label,
                            file.path, model.model, node, error)
        else:
            reasons = "; ".join(f"{node}: {why}" for node, why in failures.items())
            raise ModelNotFound(f"{label}: no holder could finish {file.path} ({reasons}); "
                                f"fetch again to resume it")
        await asyncio.to_thread(_sync, out)

    async def _copy_range(self, node: NodeId, model: HeldModel, file: HeldFile,
                          out: BinaryIO, begin: int, end: int) -> None:
        """file's bytes [begin, end) from node into out, chunk by chunk in order;
        _HolderFailed (with how far it got) when node cannot finish them."""
        config, chunk = self.config, self.config.chunk_size
        fetch_id = uuid.uuid4().hex
        parts = self._parts[fetch_id] = asyncio.Queue()
        have, asked, early = begin, begin, {}
        started, copied = time.monotonic(), 0
        try:
            while have < end:
                while asked < end and asked - have < config.window * chunk:
                    length = min(chunk, end - asked)
                    self._ask(node, fetch_id, model, file, asked, length)
                    asked += length
                part = await self._next_part(node, parts)
                early[int(part["offset"])] = part
                while (part := early.pop(have, None)) is not None:
                    # Hashing and writing off the event loop (sha256 lets go of the GIL).
                    data = await asyncio.to_thread(_check_and_write, part, have, file, out)
                    have += len(data)
                    copied += len(data)
                    self.fetched_bytes += len(data)
                    self._report(PullEvent(f"pulling {file.sha256[:12]}",
                                           f"sha256:{file.sha256}", file.size, have,
                                           new_bytes=len(data), source=SOURCE))
                await self._pace(started, copied)
        except _HolderFailed as error:
            error.reached = have
            raise
        finally:
            self._parts.pop(fetch_id, None)

    def _ask(self, node: NodeId, fetch_id: str, model: HeldModel, file: HeldFile,
             offset: int, length: int) -> None:
        try:
            self._transport.send_data(node, {FILE_ASK_FIELD: {
                "fetch": fetch_id, "from": self._transport.node_id, "model": model.model,
                "path": file.path, "offset": offset, "length": length}})
        except TransportError as error:
            raise _HolderFailed(f"cannot reach it ({error})") from error

    async def _next_part(self, node: NodeId, parts: asyncio.Queue[dict[str, Any]]
                         ) -> dict[str, Any]:
        try:
            async with asyncio.timeout(self.config.chunk_wait_s):
                part = await parts.get()
        except TimeoutError:
            gone = "" if node in self._transport.peers else " and left the cluster"
            raise _HolderFailed(f"sent nothing for {self.config.chunk_wait_s:g} s{gone}") \
                from None
        if "error" in part:
            raise _HolderFailed(str(part["error"]))
        return part

    async def _pace(self, started: float, copied: int) -> None:
        """Sleep while this fetch is ahead of --peer-fetch-rate."""
        rate = self.config.rate_bytes_per_s
        if rate is not None:
            ahead = copied / rate - (time.monotonic() - started)
            if ahead > 0:
                await asyncio.sleep(ahead)

    def _check_disk(self, _model_size: int, missing: int, label: str) -> None:
        place = self.store.models_dir
        while not place.exists() and place != place.parent:
            place = place.parent
        free = shutil.disk_usage(place).free
        if missing > free:
            raise NotEnoughDisk(f"{label}: not enough free disk: {missing:,} bytes are needed "
                                f"in {self.store.models_dir} and {free:,} are free")

    def _report(self, event: PullEvent) -> None:
        for observer in list(self.observers):
            try:
                observer(event)
            except Exception:  # noqa: BLE001 - a metrics hiccup must not stop a fetch
                log.exception("a fetch progress observer failed")

    # --- serving -------------------------------------------------------------------------

    def _on_data(self, message: Any) -> None:
        if not isinstance(message, dict):
            return
        if FILE_PART_FIELD in message:
            part = message[FILE_PART_FIELD]
            queue = self._parts.get(str(part.get("fetch"))) if isinstance(part, dict) else None
            if queue is not None:
                queue.put_nowait(part)
        elif FILE_ASK_FIELD in message and isinstance(message[FILE_ASK_FIELD], dict):
            task = asyncio.get_running_loop().create_task(self._serve(message[FILE_ASK_FIELD]))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, ask: dict[str, Any]) -> None:
        try:
            asker, fetch_id = NodeId(str(ask["from"])), str(ask["fetch"])
            offset, length = int(ask["offset"]), int(ask["length"])
            path = self.held.path_of(str(ask["model"]), str(ask["path"]))
        except (KeyError, TypeError, ValueError):
            log.warning("malformed model file ask dropped")
            return
        answer: dict[str, Any] = {"fetch": fetch_id, "offset": offset}
        if path is None or offset < 0 or not 0 < length <= MAX_ASK_BYTES:
            answer["error"] = f"node {self._transport.node_id} does not hold {ask['path']}"
        else:
            try:
                data, digest = await asyncio.to_thread(_read_and_hash, path, offset, length)
                answer.update(data=data, sha256=digest)
                self.served_bytes += len(data)
            except OSError as error:
                answer["error"] = f"cannot read {ask['path']}: {error}"
        try:
            await self._transport.room(SEND_ROOM_WAIT_S)  # parts are large: back-pressure
            self._transport.send_data(asker, {FILE_PART_FIELD: answer})
        except TransportError as error:
            log.warning("cannot send a model file part to %s: %s", asker, error)


def _version(model: HeldModel) -> frozenset[tuple[str, int, str]]:
    return frozenset((f.path, f.size, f.sha256) for f in model.files)


def _describe(version: frozenset[tuple[str, int, str]]) -> str:
    return ", ".join(f"{path} sha256 {sha256[:12]}" for path, _, sha256 in sorted(version))


def _checked(part: dict[str, Any], offset: int, file: HeldFile) -> bytes:
    """A chunk's bytes once they match the hash they came with and fit the file."""
    data = part.get("data")
    if not isinstance(data, bytes) or not data or offset + len(data) > file.size:
        raise _HolderFailed(f"sent a malformed chunk at offset {offset}")
    if hashlib.sha256(data).hexdigest() != part.get("sha256"):
        raise _HolderFailed(f"the chunk at offset {offset} does not match its sha256")
    return data


def _write_at(out: BinaryIO, offset: int, data: bytes) -> None:
    out.seek(offset)
    out.write(data)


def _check_and_write(part: dict[str, Any], offset: int, file: HeldFile, out: BinaryIO) -> bytes:
    data = _checked(part, offset, file)
    _write_at(out, offset, data)
    return data


def _read_and_hash(path: Path, offset: int, length: int) -> tuple[bytes, str]:
    data = _read_range(path, offset, length)
    return data, hashlib.sha256(data).hexdigest()


def _sync(out: BinaryIO) -> None:
    out.flush()
    os.fsync(out.fileno())


def _read_range(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(length)


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
