"""The names clients use for models: any alias, id or path -> the canonical model id.

A name seen for the first time is resolved through the catalogue (shoal.catalog.resolve),
off the event loop: resolving may hash or assemble files. Afterwards the name, and the id
itself, map to the id in any letter case, and the model's task ("generate" / "embed") is
known without resolving again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from shoal.catalog.resolve import ModelNotFound, resolve_model
from shoal.engine.config import ModelSource, ModelTask

Resolver = Callable[[str], ModelSource]
# The id every node of the cluster knows a model by, for a name as a client gave it
# (catalog.resolve.cluster_model_id: a path on another machine goes by its file's stem).
ClusterId = Callable[[str], str]
# A model's files copied from another node: True once here, False when no node holds them;
# ModelNotFound when every holder failed.
PeerFetch = Callable[[str], Awaitable[bool]]


class WrongModelTask(ValueError):
    """A request named a model that does something else: a text request an embedding or
    image model, an embedding or image request a text model, and so on."""


# What a model that does the task asked for: a name for the message.
_DOES = {"generate": "generates text", "embed": "is an embedding model",
         "image": "is an image model"}
# Where a request for each task belongs, for the message.
_ASK_FOR = {"generate": "generate text", "embed": "produce embeddings (use an embedding model "
            "such as all-minilm-l6-v2)", "image": "draw images (POST /v1/images/generations "
            "takes an image model: a diffusers pipeline)"}
_USE_INSTEAD = {"embed": "; use it through the embeddings API",
                "image": "; use it through POST /v1/images/generations", "generate": ""}


class ModelNames:
    """resolve: how a name becomes files (may pull from the outside source); resolve_here:
    the same without any download (default: resolve). A model on no disk here is copied
    from another node (fetch_from_peers, which the cluster sets) before any pull, asked
    for by the id other nodes know it by (cluster_id, which the cluster sets too)."""

    def __init__(self, resolve: Resolver | None = None,
                 resolve_here: Resolver | None = None) -> None:
        self._resolve = resolve or resolve_model
        self._resolve_here = resolve_here or self._resolve
        self.fetch_from_peers: PeerFetch | None = None
        self.cluster_id: ClusterId | None = None  # None: a name is its own id
        # Told each model id newly resolved here (the cluster lists its files soon after).
        self.on_new_model: Callable[[str], None] | None = None
        self._ids: dict[str, str] = {}  # any name a client used (lower case) -> model id
        self._tasks: dict[str, ModelTask] = {}  # model id -> what it does
        self._sources: dict[str, ModelSource] = {}  # model id -> where its weights are

    async def identify(self, name: str, task: ModelTask | None = None, from_peers: bool = True
                       ) -> tuple[str, ModelSource | None]:
        """(canonical model id, its source if resolved just now); WrongModelTask when the
        model does not do task, ModelNotFound when it is unknown. from_peers: a model on
        no disk here may be copied from another node."""
        model_id = self._ids.get(name.lower())
        source = None
        if model_id is None:
            source = await self.resolve(name, from_peers)
            model_id = source.model_id
            self.remember(name, source)
        actual = self._tasks.get(model_id, "generate")
        if task is not None and actual != task:
            raise WrongModelTask(f"model {model_id!r} {_DOES[actual]}; it does not "
                                 f"{_ASK_FOR[task]}{_USE_INSTEAD[actual]}")
        return model_id, source

    def remember(self, name: str, source: ModelSource) -> None:
        """name (and the model's id) mean source from now on: a runner started for an
        instance of it finds its files by the id."""
        model_id = source.model_id
        new = model_id not in self._sources
        self._ids[name.lower()] = model_id
        self._ids[model_id.lower()] = model_id
        self._tasks[model_id] = source.task
        self._sources[model_id] = source
        if new and self.on_new_model is not None:
            self.on_new_model(model_id)

    async def on_disk(self, name: str) -> ModelSource | None:
        """name's files if this machine holds them, without copying or pulling anything."""
        try:
            source = await asyncio.to_thread(self._resolve_here, name)
        except ModelNotFound:
            return None
        self.remember(name, source)
        return source

    async def resolve(self, name: str, from_peers: bool = True) -> ModelSource:
        """Where name's weights are, looked up afresh: on disk here, else copied from a
        node holding them, else pulled when the resolver pulls (ModelNotFound if unknown)."""
        try:
            return await asyncio.to_thread(self._resolve_here, name)
        except ModelNotFound:
            if self.fetch_from_peers is None or not from_peers:
                if self._resolve_here is self._resolve:
                    raise
                return await asyncio.to_thread(self._resolve, name)
        # Peers list the model under its cluster id (a path's stem, say), and the copy
        # lands in the store under that id.
        model_id = await self.peer_id(name)
        try:
            if await self.fetch_from_peers(model_id):
                return await asyncio.to_thread(self._resolve_here, model_id)
        except ModelNotFound as failed:
            try:  # the outside source, when the resolver pulls
                return await asyncio.to_thread(self._resolve, name)
            except ModelNotFound as error:
                raise ModelNotFound(f"{failed}; {error}") from error
        return await asyncio.to_thread(self._resolve, name)

    async def source_of(self, model_id: str) -> ModelSource:
        """Where a model id's weights are: as resolved when a client named it here, else
        resolved from the id (an instance placed by another node)."""
        source = self._sources.get(model_id)
        if source is None:
            source = await self.resolve(model_id)
            self.remember(model_id, source)
        return source

    def sources(self) -> dict[str, ModelSource]:
        """model id -> where its weights are, for every model resolved here so far."""
        return dict(self._sources)

    async def peer_id(self, name: str) -> str:
        """The id other nodes know name's model by: the id it was identified as here, else
        the cluster's id for the name (blocking reads, off the event loop)."""
        known = self._ids.get(name.lower())
        if known is not None or self.cluster_id is None:
            return known or name
        return await asyncio.to_thread(self.cluster_id, name)

    def canonical_id(self, name: str) -> str:
        """The id name was identified as; name itself if it has not been."""
        return self._ids.get(name.lower(), name)

    def task_of(self, name: str) -> ModelTask | None:
        """What an identified model does; None if name has not been identified."""
        model_id = self._ids.get(name.lower())
        return None if model_id is None else self._tasks.get(model_id)
