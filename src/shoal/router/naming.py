"""What the model name of a request names, worked out once per request: a fallback ladder
(`task:NAME`), a model resolved here, or the model of an instance that only another node
could resolve (a path on another machine, say).

Resolved names are cached by the pool's ModelNames (pool/names.py), which the worker side
also reads to start runners for instances placed by other nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shoal.catalog.resolve import ModelNotFound
from shoal.engine.config import ModelSource, ModelTask
from shoal.pool.names import ModelNames
from shoal.router.chooser import InstanceChooser
from shoal.router.ladders import Ladder, UnknownTask, task_name


@dataclass(frozen=True)
class Named:
    """A model a request named."""

    model_id: str
    source: ModelSource | None  # resolved just now; None when known before (or elsewhere)
    # Set when only another node's instance knows the name (it cannot be resolved here).
    not_found: ModelNotFound | None = None


class Naming:
    def __init__(self, names: ModelNames, chooser: InstanceChooser,
                 ladders: Mapping[str, Ladder]) -> None:
        self.names = names
        self.chooser = chooser
        self.ladders = dict(ladders)

    async def name(self, name: str, task: ModelTask | None) -> Named | Ladder:
        """The ladder or model name names (UnknownTask, ModelNotFound, WrongModelTask)."""
        ladder = self.ladder(name)
        if ladder is not None:
            return ladder
        return await self.identify(name, task)

    def ladder(self, name: str) -> Ladder | None:
        """The ladder name asks for (task:NAME); UnknownTask if there is none by that name."""
        task = task_name(name)
        if task is None:
            return None
        ladder = self.ladders.get(task)
        if ladder is None:
            known = ", ".join(sorted(self.ladders)) or "none are configured (--tasks)"
            raise UnknownTask(f"task {task!r} not found; known tasks: {known}")
        return ladder

    async def identify(self, name: str, task: ModelTask | None) -> Named:
        """The model name means: resolved here (its files copied from a node holding them
        when no instance of it runs anywhere), else the model of an instance of that name
        elsewhere in the cluster; ModelNotFound if neither, WrongModelTask if the model
        does not do task."""
        # An instance elsewhere serves it as it is: no copy of its files is fetched here.
        # (A name that means nothing here may be another node's path for the model: its
        # instances go by the id that node gives it.)
        elsewhere = self.chooser.model_named(name)
        if elsewhere is None and self.names.task_of(name) is None:
            elsewhere = self.chooser.model_named(await self.names.peer_id(name))
        try:
            model_id, source = await self.names.identify(name, task,
                                                         from_peers=elsewhere is None)
        except ModelNotFound as error:
            if elsewhere is None:
                raise
            return Named(elsewhere, None, not_found=error)
        return Named(model_id, source)

    def canonical_id(self, name: str) -> str:
        """The model id name was identified as (here or as an instance elsewhere); name
        itself if neither."""
        canonical = self.names.canonical_id(name)
        if canonical == name:
            return self.chooser.model_named(name) or name
        return canonical

    def task_of(self, name: str) -> ModelTask | None:
        """What the named model does; None if name has not been identified."""
        if self.ladder(name) is not None:
            return "generate"
        return self.names.task_of(name)
