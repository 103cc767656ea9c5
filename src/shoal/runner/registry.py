"""Every runner process of one node, keyed by (instance id, rank).

The registry alone starts, supervises (through each RunnerSupervisor) and stops runners:
single-rank instances, and ranks of instances split across nodes alike. The cluster's worker
decides what runs; the pool decides how long it stays; both go through here.

A runner is shoal's engine in a subprocess (RunnerSupervisor) or a served backend's process
(llama-server: runner/llama_server/), chosen by the backend its instance was placed for;
both answer the same calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from shoal.backend_names import DEFAULT_BACKEND, BackendName
from shoal.engine.config import ModelSource
from shoal.engine.parallel.config import ParallelConfig
from shoal.runner.proposals import ProposalHook
from shoal.runner.supervisor import RunnerSupervisor, RunnerUnavailable

log = logging.getLogger("shoal.runner.registry")

RunnerKey = tuple[str, int]  # (instance id, rank)
# (where the weights are, the rank's place in its group or None alone) -> a supervisor
SupervisorFactory = Callable[[ModelSource, ParallelConfig | None], RunnerSupervisor]
# where the weights are -> the supervisor of a served backend's process (whole models only)
BackendFactory = Callable[[ModelSource], Any]

# How long stop() gives a runner to shut down before close() stops waiting for it.
_CLOSE_WAIT_S = 15.0
# How often wait_ready asks whether a runner not yet registered is still wanted.
_RECHECK_S = 0.25


class RunnerRegistry:
    def __init__(self, make_supervisor: SupervisorFactory,
                 backends: Mapping[str, BackendFactory] | None = None) -> None:
        self._make_supervisor = make_supervisor
        # The backends besides shoal's engine this node runs, by name (llama-server).
        self._backends = dict(backends or {})
        self._runners: dict[RunnerKey, RunnerSupervisor] = {}
        self._starts: dict[RunnerKey, asyncio.Task] = {}
        self._stopping: set[asyncio.Task] = set()
        self._changed = asyncio.Condition()
        # Every runner's prefix messages, with its key (cluster/prefix_share.py sets it).
        self.on_prefix: Callable[[RunnerKey, Any], None] | None = None
        # Every runner's asks for guesses from other nodes (the cluster sets its relay).
        self.proposals = ProposalHook()
        # Whether the node's budget has room for a runner to hold this many more bytes of
        # KV (the cluster's worker sets it); None: no budget, every ask is granted.
        self.kv_room: Callable[[RunnerKey, int], bool] | None = None

    # ---- starting and stopping ----------------------------------------------------------------

    async def start(self, key: RunnerKey, source: ModelSource,
                    parallel: ParallelConfig | None = None,
                    memory_limit: int | None = None,
                    backend: BackendName = DEFAULT_BACKEND) -> RunnerSupervisor:
        """Spawn the runner for key and wait until it has loaded (RunnerUnavailable if it
        cannot). A key already running is an error: one runner per (instance, rank).
        memory_limit: the most it may hold (its KV cache is sized within it); backend: what
        serves the model (shoal's engine, or one of the backends this node runs)."""
        if key in self._runners:
            raise ValueError(f"runner {key} is already registered")
        supervisor = self._make(source, parallel, backend)
        supervisor.on_prefix = lambda message: self._prefix_message(key, message)
        supervisor.proposals = self.proposals
        supervisor.kv_room = lambda extra: self._kv_room(key, extra)
        if memory_limit is not None:
            supervisor.limit_memory(memory_limit)
        self._runners[key] = supervisor
        start = asyncio.ensure_future(supervisor.start())
        self._starts[key] = start
        await self._notify()
        try:
            await asyncio.shield(start)
        finally:
            await self._notify()
        return supervisor

    def _kv_room(self, key: RunnerKey, extra_bytes: int) -> bool:
        return self.kv_room is None or self.kv_room(key, extra_bytes)

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends this node runs besides shoal's engine."""
        return tuple(self._backends)

    def _make(self, source: ModelSource, parallel: ParallelConfig | None,
              backend: BackendName) -> RunnerSupervisor:
        if backend == DEFAULT_BACKEND:
            return self._make_supervisor(source, parallel)
        make = self._backends.get(backend)
        if make is None:
            raise RunnerUnavailable(f"model {source.model_id!r} is to be served by {backend}, "
                                    f"which this node does not run")
        if parallel is not None:
            raise RunnerUnavailable(f"{backend} serves a model whole on one node; "
                                    f"{source.model_id!r} was split across nodes")
        return make(source)

    def _prefix_message(self, key: RunnerKey, message: Any) -> None:
        if self.on_prefix is not None and self._runners.get(key) is not None:
            self.on_prefix(key, message)

    def stop(self, key: RunnerKey) -> None:
        """Shut key's runner down in the background (bounded by its supervisor)."""
        supervisor = self._runners.pop(key, None)
        start = self._starts.pop(key, None)
        if start is not None and not start.done():
            start.cancel()
        if supervisor is None:
            return
        task = asyncio.get_running_loop().create_task(self._shut_down(supervisor))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def _shut_down(self, supervisor: RunnerSupervisor) -> None:
        await self._notify()  # waiters on this key learn it is gone
        await supervisor.shutdown()

    async def drain(self, timeout_s: float) -> None:
        """Until every runner being stopped has exited (its memory is free), or timeout_s."""
        if self._stopping:
            await asyncio.wait(set(self._stopping), timeout=timeout_s)

    async def close(self) -> None:
        for key in list(self._runners):
            self.stop(key)
        if self._stopping:
            await asyncio.wait(set(self._stopping), timeout=_CLOSE_WAIT_S)

    # ---- lookups ------------------------------------------------------------------------------

    def get(self, key: RunnerKey) -> RunnerSupervisor | None:
        return self._runners.get(key)

    def items(self) -> list[tuple[RunnerKey, RunnerSupervisor]]:
        return list(self._runners.items())

    @property
    def supervisors(self) -> list[RunnerSupervisor]:
        return list(self._runners.values())

    async def wait_ready(self, key: RunnerKey, timeout_s: float,
                         wanted: Callable[[], str | None] | None = None) -> RunnerSupervisor:
        """key's runner once it serves: waits for it to be registered (the worker starts it
        when the state lists its instance) and loaded. RunnerUnavailable when it fails, is
        stopped, or is not ready within timeout_s; or, while it is not registered yet, when
        wanted() gives a reason it never will be (its instance was deleted, say)."""
        deadline = time.monotonic() + timeout_s
        async with self._changed:
            while key not in self._runners:
                gone = wanted() if wanted is not None else None
                if gone is not None:
                    raise RunnerUnavailable(gone)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RunnerUnavailable(f"no runner started for {key[0]} within "
                                            f"{timeout_s:.0f} s")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, _RECHECK_S)):
                        await self._changed.wait()
        supervisor = self._runners[key]
        start = self._starts.get(key)
        left = max(0.0, deadline - time.monotonic())
        if start is not None and not start.done():
            try:
                async with asyncio.timeout(left):
                    await asyncio.shield(start)
            except TimeoutError:
                raise RunnerUnavailable(f"model {supervisor.model_id!r} did not load within "
                                        f"{timeout_s:.0f} s") from None
            except asyncio.CancelledError:
                if start.cancelled():
                    raise RunnerUnavailable(f"model {supervisor.model_id!r} was unloaded "
                                            "while loading") from None
                raise
        elif start is not None and not start.cancelled() and start.exception() is not None:
            raise RunnerUnavailable(str(start.exception()))
        if self._runners.get(key) is not supervisor:
            raise RunnerUnavailable(f"model {supervisor.model_id!r} was unloaded")
        await supervisor.wait_ready(max(0.0, deadline - time.monotonic()))
        return supervisor

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
