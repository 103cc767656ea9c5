"""Carries out the worker's plan on this node.

Each step (on every replicated event, every registry change, and every tick) the driver:
1. refreshes its local view: the phase of every runner this node keeps for an instance,
   read from the node's runner registry;
2. performs plan() actions until plan() has nothing left (starting a rank's runner in the
   registry, tearing one down, forwarding a task's chunks to its owner, aborting or failing
   a task);
3. reports runner phases the state does not show yet (after a failover the new master
   starts without any, so they are reported again).
Anything sent that the state does not reflect after `resend_s` is sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shoal.catalog.measured_sizes import MeasuredSizes
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
from shoal.cluster.instances import Instance, Rank
from shoal.cluster.node_budget import Accelerators, has_room_for, holdings
from shoal.cluster.placement import load_refusal
from shoal.cluster.state import ClusterState, RunnerPhase, RunnerStatus, Task
from shoal.cluster.transport.base import Transport, TransportError
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
from shoal.engine.config import ModelSource
from shoal.engine.parallel.config import ParallelConfig
from shoal.ids import InstanceId, NodeId, RequestId, RunnerId, new_command_id
from shoal.pool.pool import ModelPool
from shoal.protocol import ErrorChunk
from shoal.runner.supervisor import RunnerSupervisor
from shoal.sharding import MULTI_RANK_SHARDINGS

log = logging.getLogger("shoal.cluster.worker")

# The supervisor's states as runner phases.
_PHASES: dict[str, RunnerPhase] = {"starting": "loading", "restarting": "loading",
                                   "ready": "ready", "failed": "failed", "stopped": "stopped"}
# plan() is called until it returns None; this bounds one step should it ever not converge.
_MAX_ACTIONS_PER_STEP = 256
# A rank's measured memory is reported again once it moves by this much (not on every page).
MEMORY_REPORT_STEP = 32 * 2**20
# How long a rank waits for the other ranks of its group to connect, by default.
DEFAULT_GROUP_CONNECT_S = 120.0


def parallel_config(instance: Instance, rank: Rank, connect_timeout_s: float) -> ParallelConfig:
    """A multi-rank instance's rank as its runner joins the group: the master's rendezvous,
    the rank's layers (and experts), the group-formation deadline."""
    if instance.rendezvous is None or instance.sharding not in MULTI_RANK_SHARDINGS:
        raise ValueError(f"instance {instance.instance_id} is not a multi-rank instance")
    return ParallelConfig(rank=rank.rank, world_size=rank.world_size,
                          sharding=instance.sharding, layer_start=rank.layer_start,
                          layer_end=rank.layer_end, master_addr=instance.rendezvous.host,
                          master_port=instance.rendezvous.port,
                          connect_timeout_s=connect_timeout_s,
                          compress_hidden=instance.request.hidden_int8,
                          expert_start=rank.expert_start, expert_end=rank.expert_end)


# (instance, rank) -> the rank's own copy of what it needs of the model, or None.
RankSource = Callable[[Instance, Rank], Awaitable[ModelSource | None]]


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
    rank: int
    phase: RunnerPhase
    message: str = ""
    loading: asyncio.Task | None = None
    memory_bytes: int | None = None  # measured once loaded (MemoryUsage.footprint_bytes)
    device_bytes: int | None = None  # on the accelerators (MemoryUsage.device_bytes)


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
    def __init__(self, node_id: NodeId, link: ClusterLink, transport: Transport, pool: ModelPool,
                 usable_memory: Callable[[str], int], config: WorkerConfig | None = None,
                 group_connect_s: float = DEFAULT_GROUP_CONNECT_S,
                 memory_budget: Callable[[], int | None] = lambda: None,
                 accelerators: Callable[[], Accelerators | None] = lambda: None,
                 rank_source: RankSource | None = None,
                 measured_sizes: MeasuredSizes | None = None) -> None:
        """pool: this node's model pool (its registry runs the runners); usable_memory: bytes
        this node can give a model of a backend now (checked before starting a rank);
        memory_budget, accelerators: this node's budgets as it last reported them; rank_source: a
        rank's own copy of only what it needs, when the model is not on disk here (None:
        the whole model, as any request would find it)."""
        self.node_id = node_id
        self._link = link
        self._transport = transport
        self._pool = pool
        self._registry = pool.registry
        self._usable_memory = usable_memory
        self._memory_budget = memory_budget
        self._accelerators = accelerators
        self.config = config or WorkerConfig()
        self._group_connect_s = group_connect_s
        self._rank_source = rank_source
        self._measured_sizes = measured_sizes or MeasuredSizes()
        self._runners: dict[RunnerId, _Runner] = {}
        self._progress: dict[RequestId, TaskProgress] = {}
        self._forwarders: dict[RequestId, asyncio.Task] = {}
        self._resends = _Resends(self.config.resend_s)
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._registry.kv_room = self._kv_room

    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="worker")

    async def stop(self) -> None:
        await cancel_and_wait([self._loop_task, *self._forwarders.values(),
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
        self._report(state)
        self._prune(state)

    def _view(self) -> LocalView:
        runners = {r.runner_id: LocalRunner(r.runner_id, r.instance_id, r.phase)
                   for r in self._runners.values()}
        return LocalView(node_id=self.node_id, runners=runners, task_progress=self._progress)

    def _refresh(self, state: ClusterState) -> None:
        """Runner phases from the registry's supervisors."""
        for runner in self._runners.values():
            if runner.loading is not None and not runner.loading.done():
                continue  # starting is under way; its outcome sets the phase
            supervisor = self._registry.get((runner.instance_id, runner.rank))
            if supervisor is not None:
                runner.phase = _PHASES.get(supervisor.state, "failed")
                runner.message = ((supervisor.last_error or "failed")
                                  if runner.phase == "failed" else "")
                memory = supervisor.memory
                measured = runner.memory_bytes
                ready = memory is not None and runner.phase == "ready"
                runner.memory_bytes = memory.footprint_bytes if ready else None
                runner.device_bytes = memory.device_bytes if ready else None
                if measured is None and runner.memory_bytes is not None:
                    self._record_size(state, runner, supervisor,
                                      runner.memory_bytes + (runner.device_bytes or 0))
            elif runner.phase not in ("failed", "stopped"):
                runner.phase = "failed"
                runner.message = runner.message or "the model's runner stopped"

    def _record_size(self, state: ClusterState, runner: _Runner,
                     supervisor: RunnerSupervisor, held_bytes: int) -> None:
        """A runner's first figure after loading a whole model is what the model holds:
        kept for placement in place of its estimate (a rank's share is not the model's)."""
        instance = state.instances.get(runner.instance_id)
        if instance is not None and len(instance.ranks) == 1:
            self._measured_sizes.record(supervisor.config.source, held_bytes,
                                        supervisor.backend)

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
        runner = _Runner(rank.runner_id, instance.instance_id, instance.model, rank.rank,
                         "loading")
        self._runners[rank.runner_id] = runner
        refusal = load_refusal(instance, self.node_id,
                               self._usable_memory(instance.request.backend))
        if refusal is not None:
            log.warning("refusing rank %d of %s: %s", rank.rank, instance.instance_id, refusal)
            # Not reported as failed: the refusal alone makes the master place it anew.
            runner.phase, runner.message = "stopped", refusal
            self._link.send_command(RefusePlacement(
                command_id=new_command_id(), instance_id=instance.instance_id,
                node_id=self.node_id, reason=refusal))
            return
        runner.loading = asyncio.create_task(self._starting(runner, instance, rank),
                                             name=f"start-{rank.runner_id}")

    async def _starting(self, runner: _Runner, instance: Instance, rank: Rank) -> None:
        try:
            parallel = (parallel_config(instance, rank, self._group_connect_s)
                        if rank.world_size > 1 else None)
            source = None
            if parallel is not None and self._rank_source is not None:
                source = await self._rank_source(instance, rank)
            if source is None:
                source = await self._pool.names.source_of(instance.model)
            if parallel is not None:
                held = (f"experts {rank.expert_start}-{rank.expert_end}" if rank.experts
                        else f"layers {rank.layer_start}-{rank.layer_end}")
                log.info("starting rank %d of %d of %s (%s, %s)", rank.rank, rank.world_size,
                         instance.model, instance.sharding, held)
            else:
                log.info("starting model %s for %s", instance.model, instance.instance_id)
            await self._registry.start((instance.instance_id, rank.rank), source, parallel,
                                       self._memory_share(instance),
                                       backend=instance.request.backend)
            runner.phase, runner.message = "ready", ""
            if rank.rank == 0:
                self._pool.track(instance.instance_id, instance.request.keep_alive_s,
                                 instance.request.pinned)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - reported as the runner's failure
            log.warning("cannot start %s for %s: %s", runner.model_id, runner.instance_id,
                        error)
            runner.phase, runner.message = "failed", str(error)
        finally:
            self.wake()

    def _memory_share(self, instance: Instance) -> int | None:
        """What the instance's rank here may hold: the node's budget less what every other
        instance here holds (None when the node has no budget)."""
        budget = self._memory_budget()
        if budget is None:
            return None
        state = self._link.state
        others = sum(h.bytes for h in holdings(state, self.node_id,
                                               devices=self._accelerators())
                     if h.instance.instance_id != instance.instance_id)
        return max(0, budget - others)

    def _kv_room(self, key: tuple[str, int], extra_bytes: int) -> bool:
        """Whether a runner here may grow its KV by extra_bytes: the node's budget, less
        what every instance here holds (local runners as they hold it now), has the room."""
        budget = self._memory_budget()
        if budget is None:
            return True
        live = {instance_id: memory.footprint_bytes
                for (instance_id, _), supervisor in self._registry.items()
                if (memory := supervisor.memory) is not None
                and memory.footprint_bytes is not None}
        granted = has_room_for(self._link.state, self.node_id, budget, extra_bytes, live,
                               devices=self._accelerators())
        if not granted:
            log.debug("no room in the memory budget for %s to grow its KV cache by %.0f MiB",
                     key[0], extra_bytes / 2**20)
        return granted

    def _tear_down(self, runner_id: RunnerId, reason: str) -> None:
        runner = self._runners.pop(runner_id)
        log.info("tearing down %s of %s: %s", runner.model_id, runner.instance_id, reason)
        if runner.loading is not None and not runner.loading.done():
            runner.loading.cancel()
        self._registry.stop((runner.instance_id, runner.rank))
        if runner.rank == 0:
            self._pool.forget(runner.instance_id)

    def _dispatch(self, task: Task, runner_id: RunnerId) -> None:
        self._progress[task.task_id] = "dispatched"
        stream = self._pool.submit_for_peer(task.instance_id, task.request)
        self._forwarders[task.task_id] = asyncio.create_task(
            self._forward(task.task_id, task.owner_node, stream), name=f"forward-{task.task_id}")

    async def _forward(self, task_id: RequestId, owner: NodeId,
                       stream: AsyncIterator[Any]) -> None:
        sender = ChunkSender(self._transport, owner, task_id)
        try:
            async for chunk in stream:
                await sender.send(chunk)
        except asyncio.CancelledError:
            raise
        except TransportError as error:  # the owner's silence bound ends its stream
            log.warning("task %s: its chunks cannot reach node %s: %s", task_id, owner, error)
        except Exception as error:  # the owner must hear why its stream ended
            log.exception("forwarding task %s failed", task_id)
            with contextlib.suppress(TransportError):
                await sender.send(ErrorChunk(request_id=task_id, code="internal",
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
                    and reported.message == runner.message
                    and _same_memory(reported.memory_bytes, runner.memory_bytes)
                    and _same_memory(reported.device_bytes, runner.device_bytes)):
                continue
            if self._resends.due(("status", runner.runner_id, runner.phase, runner.message,
                                  runner.memory_bytes, runner.device_bytes)):
                self._link.send_worker_event(RunnerStatusChanged(status=RunnerStatus(
                    runner_id=runner.runner_id, instance_id=runner.instance_id,
                    node_id=self.node_id, phase=runner.phase, message=runner.message,
                    memory_bytes=runner.memory_bytes, device_bytes=runner.device_bytes)))

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


def _same_memory(reported: int | None, measured: int | None) -> bool:
    if reported is None or measured is None:
        return reported == measured
    return abs(reported - measured) < MEMORY_REPORT_STEP
