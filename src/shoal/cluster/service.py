"""One node's part in the cluster, as the router and the HTTP API see it.

ClusterService runs the control plane (telemetry, replica, election, master role), the worker
driver and the data plane on one transport, and offers:
- to the router: the replicated state, placing an instance, and submit_remote(), which
  sends a request to the master as a task and yields its chunks as they stream back;
- to the pool: deleting an instance whose keep-alive ran out;
- to the API: the cluster's description, placing and deleting instances, previews.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.backend_names import DEFAULT_BACKEND
from shoal.cluster import traces
from shoal.cluster.capabilities import Capabilities
from shoal.cluster.card_exchange import CardConfig
from shoal.cluster.control_plane import ControlPlane
from shoal.cluster.decide import place_avoiding_failures, rendezvous_host
from shoal.cluster.data_plane import TERMINAL_KINDS, RemoteStream, RemoteStreams, stream_failure
from shoal.cluster.events import (
    CancelTask,
    Command,
    DeleteInstance,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    PlaceInstance,
    PlacementFailed,
    SessionStarted,
    SubmitTask,
    TaskCreated,
    TaskFailed,
    WorkerEvent,
)
from shoal.catalog.file_hashes import FileHashes
from shoal.catalog.resolve import cluster_model_id, data_dir_or_default
from shoal.catalog.store import ModelStore
from shoal.cluster.background import cancel_and_wait
from shoal.cluster.held_models import HeldModels
from shoal.cluster.instances import Instance, PlacementRequest, Rank
from shoal.cluster.model_facts import ModelFacts
from shoal.cluster.model_transfer import ModelTransfer, TransferConfig
from shoal.catalog.measured_sizes import MeasuredSizes
from shoal.cluster.node_budget import Accelerators, node_capacities
from shoal.cluster.prefix_share import PrefixShare
from shoal.cluster.queries import ClusterQueries
from shoal.cluster.placement import (
    NodeCapacity,
    Placement,
    PlacementPolicy,
    PlacementPreview,
    previews,
)
from shoal.cluster.proposer_service import ProposerConfig
from shoal.cluster.state import ClusterState
from shoal.cluster.telemetry import NodeReading
from shoal.cluster.views import describe_instance, describe_node
from shoal.cluster.worker_driver import WorkerConfig, WorkerDriver
from shoal.engine.config import ModelSource
from shoal.ids import CommandId, InstanceId, NodeId, RequestId, new_command_id
from shoal.pool.pool import ModelPool
from shoal.protocol import ErrorChunk, GenerationRequest

log = logging.getLogger("shoal.cluster")


class ClusterNotReady(RuntimeError):
    """Cluster information is still arriving (no master yet, or no memory readings)."""


class NoQuorum(ClusterNotReady):
    """This node is cut off from most of the cluster: nothing is placed from here until the
    network heals (waiting for it would only hang the request)."""


class PlacementRefused(ValueError):
    """The placement asked for is impossible; the message says why."""


@dataclass(frozen=True)
class ServiceConfig:
    # A task the master has not indexed by then is failed (it resends meanwhile).
    accept_timeout_s: float = 10.0
    resend_s: float = 2.0
    # Before the first chunk the serving node may be loading the model.
    first_chunk_timeout_s: float = 600.0
    # After the first chunk, a producer silent this long has failed.
    silence_timeout_s: float = 60.0
    # The serving node gone from the transport's peers this long ends the stream.
    peer_gone_s: float = 3.0
    # How long POST /instances waits for the master's answer.
    place_timeout_s: float = 10.0
    recent_events: int = 1000
    # How often this node lists (and hashes, once) the model files it holds, for telemetry.
    held_scan_s: float = 5.0
    transfer: TransferConfig = field(default_factory=TransferConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    cards: CardConfig = field(default_factory=CardConfig)
    proposer: ProposerConfig = field(default_factory=ProposerConfig)

    def __post_init__(self) -> None:
        for name in ("accept_timeout_s", "resend_s", "first_chunk_timeout_s",
                     "silence_timeout_s", "peer_gone_s", "place_timeout_s", "held_scan_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cluster {name} must be positive")


class ClusterService:
    def __init__(self, plane: ControlPlane, pool: ModelPool, usable_memory: Callable[[str], int],
                 config: ServiceConfig | None = None, held: HeldModels | None = None,
                 data_dir: Path | None = None, **worker_options: Any) -> None:
        """held: the model files this node advertises (None: only what its pool resolved);
        data_dir: where copies fetched from peers land (its model store); worker_options go
        to the WorkerDriver (the group-connect deadline)."""
        self.plane = plane
        self.config = config or ServiceConfig()
        self.node_id: NodeId = plane.node_id
        self.streams = RemoteStreams(plane.transport)
        self.queries = ClusterQueries(plane.transport)  # questions to every node
        self.queries.serve(traces.QUERY, lambda args: traces.own_part(
            pool, self.state, self.node_id, str(args["trace_id"])))
        self._pool = pool
        # Which instance holds which prefix KV (the router reads prefixes.index).
        self.prefixes = PrefixShare(plane.transport, pool.registry, lambda: self.state)
        # What models held once loaded here (replaces placement's estimate for them).
        self.measured_sizes = MeasuredSizes.of_data_dir(data_dir)
        self.worker = WorkerDriver(self.node_id, self, plane.transport, pool, usable_memory,
                                   self.config.worker, memory_budget=lambda: self.budget()[0],
                                   accelerators=self.accelerators,
                                   rank_source=self._rank_source,
                                   measured_sizes=self.measured_sizes, **worker_options)
        self.recent: deque[IndexedEvent] = deque(maxlen=self.config.recent_events)
        # Capability cards and the proposer roles (guessing tokens for other nodes).
        self.capabilities = Capabilities(
            plane.transport, pool, plane.telemetry.table, self.config.cards,
            self.config.proposer, target_tokenizer=lambda m: self.transfer.fetch_tokenizer(m))
        self._placements: dict[CommandId, asyncio.Future[Instance]] = {}
        self._waiters: list[asyncio.Future[None]] = []  # wait_for, woken on every event
        pool.unloader = lambda instance_id, reason: self.delete(instance_id, reason)
        # Model files between nodes: what this node holds, and copies of what it lacks.
        self.held = held or HeldModels(
            lambda: ((source, ()) for source in pool.names.sources().values()), FileHashes())
        self.transfer = ModelTransfer(
            plane.transport, self.held, ModelStore.of_data_dir(data_dir_or_default(data_dir)),
            self._peer_readings, self.config.transfer, host=self._own_host)
        pool.names.fetch_from_peers = self.transfer.fetch
        pool.names.cluster_id = functools.partial(cluster_model_id, data_dir=data_dir)
        self._scanning: asyncio.Task[None] | None = None
        self._scan_now = asyncio.Event()  # a model newly resolved here: list it at once
        pool.names.on_new_model = lambda _model: self._scan_now.set()

    async def trace(self, trace_id: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """trace_id's spans from every node (this node's from its pool): the parts that
        hold any, and {node id: why it gave no answer} (traces.py)."""
        return await traces.cluster_trace(self.queries, self._pool, self.state, self.node_id,
                                          trace_id)

    # --- life ----------------------------------------------------------------------------------

    async def start(self) -> None:
        self.plane.replica.on_event(self._on_event)
        self.plane.replica.on_reset(self._on_reset)
        self.streams.start()
        self.queries.start()
        self.transfer.start()
        self._scanning = asyncio.create_task(self._scan_held(), name="held-models")
        await self.prefixes.start()
        await self.plane.start()
        await self.capabilities.start()
        await self.worker.start()

    async def stop(self) -> None:
        await self.worker.stop()
        await self.capabilities.stop()
        await cancel_and_wait([self._scanning])
        await self.transfer.stop()
        self.streams.stop()
        await self.prefixes.stop()
        await self.queries.stop()
        await self.plane.stop()
        await self.plane.transport.close()

    async def _scan_held(self) -> None:
        """List this node's model files every held_scan_s, and at once when a model is newly
        resolved here, while it has peers to tell (a node alone never hashes its models);
        hashing runs off the event loop."""
        while True:
            if self.plane.transport.peers:
                try:
                    await asyncio.to_thread(self.held.scan)
                except Exception:  # noqa: BLE001 - the next round tries again
                    log.exception("cannot list this node's model files")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.held_scan_s):
                    await self._scan_now.wait()
            self._scan_now.clear()

    async def _rank_source(self, instance: Instance, rank: Rank) -> ModelSource | None:
        """A pipeline rank's own copy of its layers (an expert rank's, of its experts) of a
        model this node does not hold, from a peer that does; None to load the model as a
        whole."""
        if instance.sharding not in ("pipeline", "expert") or rank.world_size == 1:
            return None
        if await self._pool.names.on_disk(instance.model) is not None:
            return None
        experts = None
        if instance.sharding == "expert" and rank.experts is not None:
            experts = (*rank.experts, instance.facts.n_experts)
        path = await self.transfer.fetch_rank(instance.model, rank.layer_start,
                                              rank.layer_end, instance.facts.n_layers,
                                              experts)
        return None if path is None else ModelSource(model_id=instance.model, format="gguf",
                                                     path=path)

    def _own_host(self) -> str:
        """The address other nodes reach this one at (where its rank groups meet too)."""
        node = self.state.nodes.get(self.node_id)
        return rendezvous_host(node.addresses if node is not None else ())

    def _peer_readings(self) -> list[NodeReading]:
        """The latest readings of the other live nodes (what model files each holds)."""
        table, now = self.plane.telemetry.table, time.monotonic()
        return [reading for node, reading in table.readings().items()
                if node != self.node_id and table.is_alive(node, now)]

    # --- what the worker needs (ClusterLink) ---------------------------------------------------

    @property
    def state(self) -> ClusterState:
        return self.plane.replica.state

    def send_command(self, command: Command) -> None:
        self.plane.send_command(command)

    def send_worker_event(self, event: WorkerEvent) -> None:
        self.plane.send_worker_event(event)

    @property
    def master_id(self) -> NodeId | None:
        """The master this node follows while its presence lasts; None while an election runs.
        (A dead master's presence goes at once; the election notices only its silence.)"""
        master = self.plane.election.master
        if master == self.node_id:  # elected, but a master only with a quorum in reach
            role = self.plane.master
            return master if role is not None and role.holds_quorum() else None
        return master if master in self.plane.transport.peers else None

    @property
    def ready(self) -> bool:
        """A master is known and this node follows its session."""
        return self.master_id is not None and self.plane.replica.in_sync

    def _on_event(self, indexed: IndexedEvent) -> None:
        self.recent.append(indexed)
        event = indexed.event
        if isinstance(event, TaskCreated) and event.task.owner_node == self.node_id:
            self.streams.accept(event.task.task_id)
        elif isinstance(event, TaskFailed):
            stream = self.streams.get(event.task_id)
            if stream is not None:
                stream.fail(event.code, event.message)
        elif isinstance(event, (InstanceCreated, PlacementFailed)):
            self._answer_placement(event)
        elif isinstance(event, SessionStarted):
            self.streams.settle(self.state, self.node_id)
        self._wake_waiters()
        self.worker.wake()

    def _on_reset(self, state: ClusterState) -> None:
        """A state sync replaced the state wholesale: the events it skipped reached no
        callback, so the streams are checked against what it holds."""
        self.streams.settle(state, self.node_id)
        self._wake_waiters()
        self.worker.wake()

    async def wait_for(self, holds: Callable[[ClusterState], bool], timeout_s: float) -> bool:
        """Until holds(state) is true after some event (True), or timeout_s passes (False)."""
        deadline = time.monotonic() + timeout_s
        while not holds(self.state):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(changed)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await changed
        return True

    def _wake_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # --- serving for the router --------------------------------------------------------------

    def deletion_reason(self, instance_id: str) -> str | None:
        """Why a recently deleted instance was deleted, if this node saw it happen."""
        for indexed in reversed(self.recent):
            event = indexed.event
            if isinstance(event, InstanceDeleted) and event.instance_id == instance_id:
                return event.reason
        return None

    @property
    def peers(self) -> frozenset[NodeId]:
        """The nodes this one hears from now (itself not included)."""
        return frozenset(self.plane.transport.peers)

    async def submit_remote(self, request: GenerationRequest,
                            instance_id: str) -> AsyncIterator[Any]:
        """request served by instance_id on another node: its chunks, ending with one Finish
        or Error chunk. Every wait is bounded; closing the iterator early cancels the task."""
        task_id = RequestId(request.request_id)
        try:
            stream = self.streams.open(task_id)
        except ValueError as error:
            yield ErrorChunk(request_id=task_id, code="invalid_request", message=str(error))
            return
        instance = self.state.instances.get(InstanceId(instance_id))
        server = instance.ranks[0].node_id if instance is not None else None
        submit = SubmitTask(command_id=new_command_id(), instance_id=InstanceId(instance_id),
                            owner_node=self.node_id, request=request)
        try:
            async for chunk in self._receive(stream, submit, server):
                yield chunk
        finally:
            self.streams.close(task_id)
            if not stream.finished or stream.failed_here:  # the producer may still run
                self.send_command(CancelTask(command_id=new_command_id(), task_id=task_id))

    async def _receive(self, stream: RemoteStream, submit: SubmitTask,
                       server: NodeId | None) -> AsyncIterator[Any]:
        config = self.config
        self.send_command(submit)
        sent_at = last_sent = time.monotonic()
        last_chunk_at: float | None = None
        gone_since: float | None = None
        while True:
            try:
                chunk = await stream.next(timeout_s=0.25)
            except TimeoutError:
                now = time.monotonic()
                accepted = self.streams.accepted(stream.request_id)
                present = server == self.node_id or server in self.plane.transport.peers
                gone_since = None if present else (gone_since or now)
                failure = stream_failure(config, now, sent_at, last_chunk_at, accepted,
                                         gone_since, server)
                if failure is not None:
                    stream.fail(*failure)
                elif not accepted and now - last_sent >= config.resend_s:
                    self.send_command(submit)  # the master drops repeats of a task it has
                    last_sent = now
                continue
            last_chunk_at = time.monotonic()
            yield chunk
            if chunk.kind in TERMINAL_KINDS:
                return

    # --- administration for the API ------------------------------------------------------------

    def capacities(self) -> list[NodeCapacity]:
        readings = self.plane.telemetry.table.live_readings(list(self.state.nodes),
                                                            time.monotonic())
        return node_capacities(readings, self.state, self.policy)

    @property
    def policy(self) -> PlacementPolicy:
        return self.plane.config.master.policy

    def with_measured_size(self, facts: ModelFacts, source: ModelSource,
                           backend: str = DEFAULT_BACKEND) -> ModelFacts:
        """facts with what the model held when it last loaded here under backend, if it
        has: placement counts that for a whole copy instead of its estimate."""
        measured = self.measured_sizes.get(source, backend)
        return facts if measured is None else facts.model_copy(
            update={"measured_bytes": measured})

    def budget(self) -> tuple[int | None, int | None]:
        """This node's (memory budget, max loaded models) as it last reported them."""
        reading = self.plane.telemetry.table.reading(self.node_id)
        if reading is None:
            return None, None
        return reading.memory_budget, reading.max_loaded_models

    def accelerators(self) -> Accelerators | None:
        """This node's accelerator budget as it last reported it (None: no backend here
        keeps models on its GPUs)."""
        return Accelerators.of(self.plane.telemetry.table.reading(self.node_id))

    async def place(self, request: PlacementRequest) -> Instance:
        """Place an instance and return it once the master has created it.

        ClusterNotReady while cluster information is still arriving; PlacementRefused when
        no placement fits (the reason says why)."""
        if not self.plane.has_quorum():
            raise NoQuorum(f"{self.plane.describe_quorum()}: too few to place models until "
                           "the network heals; retry later")
        if not self.ready:
            raise ClusterNotReady("the cluster is still forming (no master yet); retry shortly")
        result = place_avoiding_failures(self.state, request, self.capacities(),
                                         self.plane.config.master.policy)
        if not isinstance(result, Placement):
            if result.pending:
                raise ClusterNotReady(result.reason)
            raise PlacementRefused(result.reason)
        command = PlaceInstance(command_id=new_command_id(), request=request)
        answer: asyncio.Future[Instance] = asyncio.get_running_loop().create_future()
        self._placements[command.command_id] = answer
        try:
            self.send_command(command)
            async with asyncio.timeout(self.config.place_timeout_s):
                return await answer
        except TimeoutError:
            raise ClusterNotReady(f"the master did not answer within "
                                  f"{self.config.place_timeout_s:.0f} s; retry") from None
        finally:
            self._placements.pop(command.command_id, None)

    def _answer_placement(self, event: InstanceCreated | PlacementFailed) -> None:
        answer = self._placements.get(event.command_id) if event.command_id else None
        if answer is None or answer.done():
            return
        if isinstance(event, InstanceCreated):
            answer.set_result(event.instance)
        else:
            answer.set_exception(PlacementRefused(event.reason))

    def delete(self, instance_id: str, reason: str = "deleted by request") -> bool:
        """Ask the master to delete an instance; False if the state has no such instance."""
        if InstanceId(instance_id) not in self.state.instances:
            return False
        self.send_command(DeleteInstance(command_id=new_command_id(),
                                         instance_id=InstanceId(instance_id), reason=reason))
        return True

    def previews(self, request: PlacementRequest) -> tuple[PlacementPreview, ...]:
        return previews(request, self.capacities(), self.plane.config.master.policy)

    def backends_running(self) -> frozenset[str]:
        """The backends some node of the cluster runs (shoal's engine always, this node's
        own before its first reading is out)."""
        return frozenset({DEFAULT_BACKEND, *self._pool.registry.backends}).union(
            *(reading.backends for reading in self.readings().values()))

    def readings(self) -> dict[NodeId, NodeReading]:
        """Every node's latest reading, this node's keep-alive expiries and queue live."""
        readings = self.plane.telemetry.table.readings()
        own = readings.get(self.node_id)
        if own is not None:
            readings[self.node_id] = own.model_copy(update={
                "expiries": self._pool.expiries(), "queue_depths": self._pool.queue.depths()})
        return readings

    def describe(self) -> dict[str, Any]:
        """GET /cluster: this node, the master, the nodes present (their liveliness token
        seen) with their readings, the instances."""
        state, readings = self.state, self.readings()
        present = self.peers | {self.node_id}
        nodes = []
        for node_id, info in sorted(state.nodes.items()):
            if node_id not in present:
                continue  # its presence is gone: the master is removing it
            nodes.append(describe_node(state, info, readings.get(node_id), self.policy))
        master = self.master_id
        if master not in {node["node_id"] for node in nodes}:
            master = None  # not yet in the state's nodes: as good as still electing
        return {"node_id": self.node_id, "master_id": master, "nodes": nodes,
                "instances": self.describe_instances(),
                # Nodes left out of a model's placements after its download or load failed.
                "load_failures": {model: dict(failed)
                                  for model, failed in state.load_failures.items()},
                "cards": self.capabilities.describe()}

    def describe_instances(self) -> list[dict[str, Any]]:
        readings = self.readings()
        return [describe_instance(self.state, i, readings)
                for i in self.state.instances.values()]
