"""Carries out the worker's plan on this node.

Each step (on every replicated event, every pool change, and every tick) the driver:
1. refreshes its local view: the phase of every runner it keeps for an instance (a model
   of the local pool for single-rank instances, a rank runner for multi-rank ones);
2. performs plan() actions until plan() has nothing left (hosting a placed instance's model
   or starting a rank, tearing one down, forwarding a task's chunks to its owner, aborting
   or failing a task);
3. mirrors the pool into the state (pool_mirror.py);
4. reports runner phases the state does not show yet (after a failover the new master
   starts without any, so they are reported again).
Anything sent that the state does not reflect after `resend_s` is sent again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shoal.cluster.background import cancel_and_wait
from shoal.cluster.data_plane import ChunkSender
from shoal.cluster.events import (
    Command,
    RefusePlacement,
    RunnerStatusChanged,
    TaskFailed,
    TaskFinished,
    WorkerEvent,
)
from shoal.cluster.instances import Instance, InstanceOrigin, Rank
from shoal.cluster.model_facts import ModelFacts, model_facts_from_source
from shoal.cluster.placement import load_refusal
from shoal.cluster.pool_mirror import PoolMirror
from shoal.cluster.ranks import RankRunners
from shoal.cluster.state import ClusterState, RunnerPhase, RunnerStatus, Task
from shoal.cluster.transport.base import Transport
from shoal.cluster.worker import (
    AbortTask,
    Action,
    DispatchTask,
    FailTask,
    LocalRunner,
    LocalView,
    StartRunner,
    TaskProgress,
    TearDown,
    plan,
)
from shoal.ids import InstanceId, NodeId, RequestId, RunnerId, new_command_id
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
    multi_rank: bool
    phase: RunnerPhase
    message: str = ""
    loading: asyncio.Task | None = None


@dataclass
class _Resends:
    """When each kind of message was last sent, so a lost one is repeated but not spammed."""

    every_s: float
    sent: dict[Any, float] = field(default_factory=dict)

    def due(self, key: Any, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        last = self.sent.get(key)
        if last is not None and now - last < self.every_s:
            return False
        self.sent[key] = now
        return True

    def forget(self, keep: Callable[[Any], bool]) -> None:
        self.sent = {k: v for k, v in self.sent.items() if keep(k)}


class WorkerDriver:
    def __init__(self, node_id: NodeId, link: ClusterLink, transport: Transport, pool: Pool,
                 usable_memory: Callable[[], int], config: WorkerConfig | None = None,
                 read_facts: Callable[[Any], ModelFacts] = model_facts_from_source,
                 ranks: RankRunners | None = None) -> None:
        """usable_memory: bytes this node can give a model now (checked before hosting);
        read_facts: a model source's ModelFacts; ranks: starts rank runners of multi-rank
        instances (without it, this node refuses such ranks)."""
        self.node_id = node_id
        self._link = link
        self._transport = transport
        self._pool = pool
        self._usable_memory = usable_memory
        self.config = config or WorkerConfig()
        self._ranks = ranks
        self._runners: dict[RunnerId, _Runner] = {}
        self._progress: dict[RequestId, TaskProgress] = {}
        self._forwarders: dict[RequestId, asyncio.Task] = {}
        self._resends = _Resends(self.config.resend_s)
        self._mirror = PoolMirror(node_id, link.send_command, pool.source_of, read_facts,
                                  self.wake)
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    async def start(self) -> None:
        self._pool.on_change(lambda _model: self.wake())
        self._loop_task = asyncio.create_task(self._run(), name="worker")

    async def stop(self) -> None:
        await cancel_and_wait([self._loop_task, *self._forwarders.values(),
                               *(r.loading for r in self._runners.values())])
        await self._mirror.close()
        if self._ranks is not None:
            await self._ranks.close()
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

    def step(self) -> None:
        state = self._link.state
        self._refresh(state)
        for _ in range(_MAX_ACTIONS_PER_STEP):
            action = plan(state, self._view())
            if action is None:
                break
            self._perform(action)
        else:
            log.error("worker plan did not settle within %d actions", _MAX_ACTIONS_PER_STEP)
        self._mirror.reconcile(state, self._pool.residencies(), self._resends.due)
        self._report(state)
        self._prune(state)

    def _view(self) -> LocalView:
        runners = {r.runner_id: LocalRunner(r.runner_id, r.instance_id, r.phase)
                   for r in self._runners.values()}
        return LocalView(node_id=self.node_id, runners=runners, task_progress=self._progress)

    def _refresh(self, state: ClusterState) -> None:
        """Runner phases from their supervisors; local instances get a runner record."""
        residencies = {r.model_id: r for r in self._pool.residencies()}
        for instance in state.instances.values():
            rank = instance.rank_on(self.node_id)
            if (instance.origin == "local" and rank is not None
                    and rank.runner_id not in self._runners):
                self._runners[rank.runner_id] = _Runner(
                    rank.runner_id, instance.instance_id, instance.model, "local",
                    instance.generation, False, "stopped")
        for runner in self._runners.values():
            if runner.loading is not None and not runner.loading.done():
                continue  # starting is under way; its outcome sets the phase
            if runner.multi_rank:
                supervisor_state = self._ranks.state(runner.runner_id) if self._ranks else None
                error = self._ranks.error(runner.runner_id) if self._ranks else None
            else:
                residency = residencies.get(runner.model_id)
                mirrored = residency is not None and (
                    runner.origin == "placed" or residency.generation == runner.generation)
                supervisor_state = residency.state if mirrored else None
                error = residency.error if mirrored else None
            self._set_phase(runner, supervisor_state, error)

    @staticmethod
    def _set_phase(runner: _Runner, supervisor_state: str | None, error: str | None) -> None:
        if supervisor_state is not None:
            runner.phase = _PHASES.get(supervisor_state, "failed")
            runner.message = (error or "failed") if runner.phase == "failed" else ""
        elif runner.phase not in ("failed", "stopped"):
            runner.phase = "stopped" if runner.origin == "local" else "failed"
            runner.message = runner.message or "the model's runner stopped"

    # --- actions -----------------------------------------------------------------------------

    def _perform(self, action: Action) -> None:
        if isinstance(action, StartRunner):
            self._start_runner(action.instance, action.rank)
        elif isinstance(action, TearDown):
            self._tear_down(action.runner_id, action.reason)
        elif isinstance(action, DispatchTask):
            self._dispatch(action.task, action.runner_id)
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
                         instance.generation, rank.world_size > 1, "loading")
        self._runners[rank.runner_id] = runner
        refusal = load_refusal(instance, self.node_id, self._usable_memory())
        if refusal is None and runner.multi_rank and self._ranks is None:
            refusal = "this node cannot run ranks of multi-rank instances"
        if refusal is not None:
            log.warning("refusing rank %d of %s: %s", rank.rank, instance.instance_id, refusal)
            # Not reported as failed: the refusal alone makes the master place it anew.
            runner.phase, runner.message = "stopped", refusal
            self._link.send_command(RefusePlacement(
                command_id=new_command_id(), instance_id=instance.instance_id,
                node_id=self.node_id, reason=refusal))
            return
        start = (self._ranks.start(instance, rank) if runner.multi_rank  # type: ignore[union-attr]
                 else self._pool.host(runner.model_id, runner.instance_id))
        runner.loading = asyncio.create_task(self._starting(runner, start),
                                             name=f"start-{rank.runner_id}")

    async def _starting(self, runner: _Runner, start: Any) -> None:
        try:
            await start
            runner.phase, runner.message = "ready", ""
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - reported as the runner's failure
            log.warning("cannot start %s for %s: %s", runner.model_id, runner.instance_id,
                        error)
            runner.phase, runner.message = "failed", str(error)
        finally:
            self.wake()

    def _tear_down(self, runner_id: RunnerId, reason: str) -> None:
        runner = self._runners.pop(runner_id)
        log.info("tearing down %s of %s: %s", runner.model_id, runner.instance_id, reason)
        if runner.loading is not None and not runner.loading.done():
            runner.loading.cancel()
        if runner.multi_rank:
            if self._ranks is not None:
                self._ranks.stop(runner_id)
        elif runner.origin == "placed":
            self._pool.unhost(runner.model_id, runner.instance_id)
        else:
            current = next((r for r in self._pool.residencies()
                            if r.model_id == runner.model_id), None)
            if current is not None and current.generation == runner.generation:
                self._pool.unload(runner.model_id)  # the instance was deleted, not unloaded

    def _dispatch(self, task: Task, runner_id: RunnerId) -> None:
        self._progress[task.task_id] = "dispatched"
        runner = self._runners.get(runner_id)
        if runner is not None and runner.multi_rank and self._ranks is not None:
            supervisor = self._ranks.supervisor(runner_id)
            stream = (supervisor.submit(task.request) if supervisor is not None
                      else _refused(task.task_id, "rank 0 of the instance is gone"))
        else:
            stream = self._pool.submit(task.request)
        self._forwarders[task.task_id] = asyncio.create_task(
            self._forward(task.task_id, task.owner_node, stream), name=f"forward-{task.task_id}")

    async def _forward(self, task_id: RequestId, owner: NodeId,
                       stream: AsyncIterator[Any]) -> None:
        sender = ChunkSender(self._transport, owner, task_id)
        try:
            async for chunk in stream:
                sender.send(chunk)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the owner must hear why its stream ended
            log.exception("forwarding task %s failed", task_id)
            sender.send(ErrorChunk(request_id=task_id, code="internal",
                                   message=f"serving the request failed: {error}"))
        finally:
            await stream.aclose()
            self._link.send_worker_event(TaskFinished(task_id=task_id))
            self.wake()

    # --- reporting -----------------------------------------------------------------------------

    def _report(self, state: ClusterState) -> None:
        for runner in self._runners.values():
            if runner.instance_id not in state.instances:
                continue
            reported = state.runners.get(runner.runner_id)
            if runner.phase == "stopped" and reported is None:
                continue
            if (reported is not None and reported.phase == runner.phase
                    and reported.message == runner.message):
                continue
            if self._resends.due(("status", runner.runner_id, runner.phase, runner.message)):
                self._link.send_worker_event(RunnerStatusChanged(status=RunnerStatus(
                    runner_id=runner.runner_id, instance_id=runner.instance_id,
                    node_id=self.node_id, phase=runner.phase, message=runner.message)))

    def _prune(self, state: ClusterState) -> None:
        for task_id in [t for t in self._progress if t not in state.tasks]:
            forwarder = self._forwarders.get(task_id)
            if forwarder is not None and not forwarder.done():
                # The task left the state without finishing here (a new master's session
                # failed it): stop serving a stream nobody reads.
                forwarder.cancel()
                continue
            self._progress.pop(task_id, None)
            self._forwarders.pop(task_id, None)
        live = set(self._runners)
        self._resends.forget(lambda key: key[0] != "status" or key[1] in live)


async def _refused(task_id: str, message: str) -> AsyncIterator[Any]:
    yield ErrorChunk(request_id=task_id, code="unavailable", message=message)
