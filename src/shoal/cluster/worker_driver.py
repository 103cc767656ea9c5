"""Carries out the worker's plan on this node, against the local model pool.

Each step (on every replicated event, every pool change, and every tick) the driver:
1. refreshes its local view: the phase of every runner it keeps for an instance, read from
   the pool;
2. performs plan() actions until plan() has nothing left (hosting a placed instance's model,
   tearing one down, forwarding a task's chunks to its owner, aborting or failing a task);
3. mirrors the pool into the state: a model the pool runs on its own (preloaded, or loaded on
   first use) becomes a local instance, and one it unloaded is deleted;
4. reports runner phases the state does not show yet (after a failover the new master
   starts without any, so they are reported again).
Commands and worker events may be lost (a master dying between receipt and indexing), so
anything still different from the state after `resend_s` is sent again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shoal.cluster.background import cancel_and_wait
from shoal.cluster.data_plane import ChunkSender
from shoal.cluster.events import (
    AdoptInstance,
    Command,
    DeleteInstance,
    RefusePlacement,
    RunnerStatusChanged,
    TaskFailed,
    TaskFinished,
    WorkerEvent,
)
from shoal.cluster.instances import Instance, InstanceOrigin, PlacementRequest, Rank
from shoal.cluster.model_facts import ModelFacts, model_facts_from_source
from shoal.cluster.placement import load_refusal
from shoal.cluster.state import ClusterState, RunnerPhase, RunnerStatus
from shoal.cluster.transport.base import Transport
from shoal.cluster.worker import (
    AbortTask,
    Action,
    DispatchTask,
    FailTask,
    LoadShard,
    LocalRunner,
    LocalView,
    StartRunner,
    TaskProgress,
    TearDown,
    plan,
)
from shoal.ids import InstanceId, NodeId, RequestId, RunnerId, new_command_id, runner_id_for
from shoal.pool.pool import Residency
from shoal.protocol import ErrorChunk, GenerationRequest

log = logging.getLogger("shoal.cluster.worker")

# The supervisor's states as runner phases.
_PHASES: dict[str, RunnerPhase] = {"starting": "loading", "restarting": "loading",
                                   "ready": "ready", "failed": "failed", "stopped": "stopped"}
# plan() is called until it returns None; this bounds one step should it ever not converge.
_MAX_ACTIONS_PER_STEP = 256


class Pool(Protocol):
    """The part of shoal.pool.pool.ModelPool the worker drives."""

    def residencies(self) -> list[Residency]: ...

    def on_change(self, listener: Callable[[str], None]) -> None: ...

    async def host(self, name: str, instance_id: str) -> Any: ...

    def unhost(self, model_id: str, instance_id: str) -> None: ...

    def unload(self, model_id: str) -> None: ...

    def submit(self, request: GenerationRequest) -> Any: ...

    def source_of(self, model_id: str) -> Any: ...


class ClusterLink(Protocol):
    """How the worker reaches the master and the replicated state (ControlPlane + Replica)."""

    @property
    def state(self) -> ClusterState: ...

    def send_command(self, command: Command) -> None: ...

    def send_worker_event(self, event: WorkerEvent) -> None: ...


@dataclass(frozen=True)
class WorkerConfig:
    tick_s: float = 0.5
    resend_s: float = 2.0

    def __post_init__(self) -> None:
        if self.tick_s <= 0 or self.resend_s <= 0:
            raise ValueError("worker tick_s and resend_s must be positive")


@dataclass
class _Runner:
    """A rank this node keeps for an instance."""

    runner_id: RunnerId
    instance_id: InstanceId
    model_id: str
    origin: InstanceOrigin
    generation: int | None
    phase: RunnerPhase
    message: str = ""
    loading: asyncio.Task | None = None


@dataclass
class _Resends:
    """When each kind of message was last sent, so a lost one is repeated but not spammed."""

    sent: dict[Any, float] = field(default_factory=dict)

    def due(self, key: Any, now: float, every_s: float) -> bool:
        last = self.sent.get(key)
        if last is not None and now - last < every_s:
            return False
        self.sent[key] = now
        return True

    def forget(self, keep: Callable[[Any], bool]) -> None:
        self.sent = {k: v for k, v in self.sent.items() if keep(k)}


def local_instance_id(node_id: NodeId, model_id: str, generation: int) -> InstanceId:
    """A local instance's id, derived so that repeating AdoptInstance is harmless."""
    digest = hashlib.sha256(f"{node_id}\0{model_id}\0{generation}".encode()).hexdigest()
    return InstanceId(f"inst-{digest[:16]}")


class WorkerDriver:
    def __init__(self, node_id: NodeId, link: ClusterLink, transport: Transport, pool: Pool,
                 usable_memory: Callable[[], int], config: WorkerConfig | None = None,
                 read_facts: Callable[[Any], ModelFacts] = model_facts_from_source) -> None:
        """usable_memory: bytes this node can give a model now (checked before hosting);
        read_facts: a model source's ModelFacts (it reads the weight file's header)."""
        self.node_id = node_id
        self._link = link
        self._transport = transport
        self._pool = pool
        self._usable_memory = usable_memory
        self.config = config or WorkerConfig()
        self._runners: dict[RunnerId, _Runner] = {}
        self._progress: dict[RequestId, TaskProgress] = {}
        self._forwarders: dict[RequestId, asyncio.Task] = {}
        self._facts: dict[str, ModelFacts | None] = {}
        self._facts_jobs: dict[str, asyncio.Task] = {}
        self._read_facts_of = read_facts
        self._resends = _Resends()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    async def start(self) -> None:
        self._pool.on_change(lambda _model: self.wake())
        self._loop_task = asyncio.create_task(self._run(), name="worker")

    async def stop(self) -> None:
        await cancel_and_wait([self._loop_task, *self._forwarders.values(),
                               *self._facts_jobs.values(),
                               *(r.loading for r in self._runners.values())])
        self._loop_task = None

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.config.tick_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                self.step()
            except Exception:  # the next step retries; never let the worker die
                log.exception("worker step failed")

    # --- one step ----------------------------------------------------------------------------

    def step(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        state = self._link.state
        self._refresh(state)
        for _ in range(_MAX_ACTIONS_PER_STEP):
            action = plan(state, self._view())
            if action is None:
                break
            self._perform(action)
        else:
            log.error("worker plan did not settle within %d actions", _MAX_ACTIONS_PER_STEP)
        self._mirror(state, now)
        self._report(state, now)
        self._prune(state)

    def _view(self) -> LocalView:
        runners = {r.runner_id: LocalRunner(r.runner_id, r.instance_id, r.phase)
                   for r in self._runners.values()}
        return LocalView(node_id=self.node_id, runners=runners, task_progress=self._progress)

    def _refresh(self, state: ClusterState) -> None:
        """Runner phases from the pool; local instances of this node get a runner record."""
        residencies = {r.model_id: r for r in self._pool.residencies()}
        for instance in state.instances.values():
            rank = instance.rank_on(self.node_id)
            if (instance.origin == "local" and rank is not None
                    and rank.runner_id not in self._runners):
                self._runners[rank.runner_id] = _Runner(
                    rank.runner_id, instance.instance_id, instance.model, "local",
                    instance.generation, "stopped")
        for runner in self._runners.values():
            if runner.loading is not None and not runner.loading.done():
                continue  # hosting is under way; its outcome sets the phase
            residency = residencies.get(runner.model_id)
            mirrored = residency is not None and (
                runner.origin == "placed" or residency.generation == runner.generation)
            if mirrored:
                runner.phase = _PHASES.get(residency.state, "failed")
                runner.message = (residency.error or "failed") if runner.phase == "failed" else ""
            elif runner.phase != "failed":
                runner.phase = "stopped" if runner.origin == "local" else "failed"
                runner.message = runner.message or "the model's runner stopped"

    # --- actions -----------------------------------------------------------------------------

    def _perform(self, action: Action) -> None:
        if isinstance(action, StartRunner):
            self._start_runner(action.instance, action.rank)
        elif isinstance(action, LoadShard):
            # Only multi-rank instances report "idle" and reach this; they start as failed
            # in _start_runner until ranks can form a process group.
            self._runners[action.rank.runner_id].phase = "failed"
        elif isinstance(action, TearDown):
            self._tear_down(action.runner_id, action.reason)
        elif isinstance(action, DispatchTask):
            self._progress[action.task.task_id] = "dispatched"
            self._forwarders[action.task.task_id] = asyncio.create_task(
                self._forward(action.task.task_id, action.task.owner_node,
                              action.task.request), name=f"forward-{action.task.task_id}")
        elif isinstance(action, AbortTask):
            self._progress[action.task_id] = "aborted"
            forwarder = self._forwarders.get(action.task_id)
            if forwarder is not None:
                forwarder.cancel()  # its finally reports TaskFinished
            else:
                self._link.send_worker_event(TaskFinished(task_id=action.task_id))
        elif isinstance(action, FailTask):
            self._progress[action.task_id] = "failed"
            self._link.send_worker_event(TaskFailed(task_id=action.task_id, code=action.code,
                                                    message=action.message))

    def _start_runner(self, instance: Instance, rank: Rank) -> None:
        runner = _Runner(rank.runner_id, instance.instance_id, instance.model, instance.origin,
                         instance.generation, "loading")
        self._runners[rank.runner_id] = runner
        refusal = load_refusal(instance, self.node_id, self._usable_memory())
        if refusal is not None:
            log.warning("refusing rank %d of %s: %s", rank.rank, instance.instance_id, refusal)
            # Not reported as failed: the refusal alone makes the master place it wider.
            runner.phase, runner.message = "stopped", refusal
            self._link.send_command(RefusePlacement(
                command_id=new_command_id(), instance_id=instance.instance_id,
                node_id=self.node_id, reason=refusal))
            return
        if rank.world_size > 1:
            runner.phase = "failed"
            runner.message = (f"{instance.sharding} instances over {rank.world_size} nodes "
                              "are not supported by this node yet")
            return
        log.info("hosting %s for instance %s", instance.model, instance.instance_id)
        runner.loading = asyncio.create_task(self._host(runner), name=f"host-{rank.runner_id}")

    async def _host(self, runner: _Runner) -> None:
        try:
            await self._pool.host(runner.model_id, runner.instance_id)
            runner.phase, runner.message = "ready", ""
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - reported as the runner's failure
            log.warning("cannot host %s for %s: %s", runner.model_id, runner.instance_id, error)
            runner.phase, runner.message = "failed", str(error)
        finally:
            self.wake()

    def _tear_down(self, runner_id: RunnerId, reason: str) -> None:
        runner = self._runners.pop(runner_id)
        log.info("tearing down %s of %s: %s", runner.model_id, runner.instance_id, reason)
        if runner.loading is not None and not runner.loading.done():
            runner.loading.cancel()
        if runner.origin == "placed":
            self._pool.unhost(runner.model_id, runner.instance_id)
            return
        current = next((r for r in self._pool.residencies() if r.model_id == runner.model_id),
                       None)
        if current is not None and current.generation == runner.generation:
            self._pool.unload(runner.model_id)  # the instance was deleted, not unloaded

    async def _forward(self, task_id: RequestId, owner: NodeId,
                       request: GenerationRequest) -> None:
        sender = ChunkSender(self._transport, owner, task_id)
        stream = self._pool.submit(request)
        try:
            async for chunk in stream:
                sender.send(chunk)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the owner must hear why its stream ended
            log.exception("forwarding task %s failed", task_id)
            sender.send(ErrorChunk(request_id=task_id, code="internal",
                                   message=f"serving the request failed: {error}"))
        finally:
            await stream.aclose()
            self._link.send_worker_event(TaskFinished(task_id=task_id))
            self.wake()

    # --- mirroring the pool, and reporting ----------------------------------------------------

    def _mirror(self, state: ClusterState, now: float) -> None:
        """Adopt what the pool runs on its own; delete local instances it no longer runs."""
        mine = {(i.model, i.generation): i for i in state.instances.values()
                if i.origin == "local" and i.ranks[0].node_id == self.node_id}
        running = {(r.model_id, r.generation): r for r in self._pool.residencies()
                   if r.state != "stopped"}
        for key, residency in running.items():
            if key in mine or residency.hosted:
                continue  # mirrored already, or run for a placed instance
            facts = self._facts_for(residency.model_id)
            if facts is not None and self._resends.due(("adopt", key), now,
                                                       self.config.resend_s):
                self._link.send_command(AdoptInstance(
                    command_id=new_command_id(),
                    instance=self._local_instance(facts, residency.generation)))
        for key, instance in mine.items():
            if key not in running and self._resends.due(("delete", instance.instance_id), now,
                                                        self.config.resend_s):
                self._link.send_command(DeleteInstance(
                    command_id=new_command_id(), instance_id=instance.instance_id,
                    reason=f"node {self.node_id} unloaded the model"))

    def _local_instance(self, facts: ModelFacts, generation: int) -> Instance:
        instance_id = local_instance_id(self.node_id, facts.model, generation)
        rank = Rank(runner_id=runner_id_for(instance_id, 0), node_id=self.node_id, rank=0,
                    world_size=1, layer_start=0, layer_end=facts.n_layers)
        return Instance(instance_id=instance_id, request=PlacementRequest(facts=facts),
                        sharding="single", ranks=(rank,), origin="local",
                        generation=generation)

    def _facts_for(self, model_id: str) -> ModelFacts | None:
        """The model's facts once read (in a thread: it opens the weight file's header)."""
        if model_id in self._facts:
            return self._facts[model_id]
        if model_id not in self._facts_jobs:
            self._facts_jobs[model_id] = asyncio.create_task(self._read_facts(model_id))
        return None

    async def _read_facts(self, model_id: str) -> None:
        try:
            source = self._pool.source_of(model_id)
            self._facts[model_id] = await asyncio.to_thread(self._read_facts_of, source)
        except Exception as error:  # noqa: BLE001 - such a model is served but not listed
            log.warning("model %s cannot be listed in the cluster: %s", model_id, error)
            self._facts[model_id] = None
        finally:
            self._facts_jobs.pop(model_id, None)
            self.wake()

    def _report(self, state: ClusterState, now: float) -> None:
        for runner in self._runners.values():
            if runner.instance_id not in state.instances:
                continue
            reported = state.runners.get(runner.runner_id)
            if runner.phase == "stopped" and reported is None:
                continue
            if (reported is not None and reported.phase == runner.phase
                    and reported.message == runner.message):
                continue
            key = ("status", runner.runner_id, runner.phase, runner.message)
            if self._resends.due(key, now, self.config.resend_s):
                self._link.send_worker_event(RunnerStatusChanged(status=RunnerStatus(
                    runner_id=runner.runner_id, instance_id=runner.instance_id,
                    node_id=self.node_id, phase=runner.phase, message=runner.message)))

    def _prune(self, state: ClusterState) -> None:
        for task_id in [t for t in self._progress if t not in state.tasks]:
            forwarder = self._forwarders.get(task_id)
            if forwarder is None or forwarder.done():
                self._progress.pop(task_id, None)
                self._forwarders.pop(task_id, None)
        live = set(self._runners)
        self._resends.forget(lambda key: key[0] != "status" or key[1] in live)

