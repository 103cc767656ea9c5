"""Opening this node's cluster membership from its settings: node id, transport, services.

The node id is kept in the data dir, so a restarted node is the same node to the others.
A standalone node gets an in-memory transport of its own (a cluster of one, no network);
otherwise one Zenoh peer session.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from shoal.backend_names import DEFAULT_BACKEND
from shoal.catalog.file_hashes import FileHashes
from shoal.catalog.resolve import stored_source
from shoal.catalog.store import ModelStore
from shoal.cluster.card_exchange import CardConfig
from shoal.cluster.control_plane import ClusterConfig, ControlPlane
from shoal.cluster.election import ElectionConfig
from shoal.cluster.held_models import HeldModels
from shoal.cluster.master import MasterConfig
from shoal.cluster.model_transfer import TransferConfig
from shoal.cluster.placement import PlacementPolicy
from shoal.cluster.proposer_service import ProposerConfig
from shoal.cluster.service import ClusterService, ServiceConfig
from shoal.cluster.telemetry import GpuReading, NodeReading, read_node
from shoal.cluster.transport.base import Transport
from shoal.cluster.transport.memory import MemoryHub
from shoal.cluster.transport.topics import check_node_id
from shoal.cluster.settings import ClusterSettings
from shoal.ids import NodeId, new_node_id
from shoal.pool.pool import ModelPool

log = logging.getLogger("shoal.cluster")

NODE_ID_FILE = "node_id"


def load_node_id(data_dir: Path) -> NodeId:
    """This node's id from data_dir, made and stored on first use."""
    path = data_dir / NODE_ID_FILE
    try:
        return check_node_id(path.read_text().strip())
    except FileNotFoundError:
        pass
    except ValueError as error:
        raise ValueError(f"{path} holds an invalid node id ({error}); delete it to get a "
                         "new one") from None
    node_id = new_node_id()
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(node_id + "\n")
    except OSError as error:  # a read-only or full disk: serve, under an id for this run
        log.warning("cannot store this node's id in %s (%s): it is %s until the node "
                    "restarts", path, error.strerror, node_id)
    return node_id


def cluster_config(settings: ClusterSettings, data_dir: Path,
                   kv_cache_dtype: str = "auto") -> ClusterConfig:
    """kv_cache_dtype: this node's --kv-cache-dtype, which its placements reserve KV for
    when it is the master."""
    events = data_dir / "cluster" / "events"
    policy = PlacementPolicy.for_kv_cache_dtype(kv_cache_dtype)
    if settings.standalone:
        # Alone, a campaign has nobody to hear from and nobody can go silent.
        return ClusterConfig(event_log_dir=events,
                             election=ElectionConfig(campaign_s=0.05, force_master=True),
                             master=MasterConfig(reconcile_s=0.2, policy=policy))
    return ClusterConfig(event_log_dir=events,
                         election=ElectionConfig(force_master=settings.force_master),
                         master=MasterConfig(reconcile_s=0.5, policy=policy))


async def open_transport(settings: ClusterSettings, node_id: NodeId) -> Transport:
    if settings.standalone:
        return MemoryHub().connect(node_id)
    # Here, not at the top: a standalone node never loads zenoh's native library.
    from shoal.cluster.transport.zenoh import ZenohConfig, ZenohTransport

    return await ZenohTransport.open(node_id, ZenohConfig(
        listen=settings.listen, connect=settings.peers,
        multicast_scouting=settings.discovery, secret=settings.secret, tls=settings.tls,
        scouting_interface=settings.discovery_interface))


async def open_cluster(settings: ClusterSettings, data_dir: Path, pool: ModelPool,
                       addresses: Callable[[], Sequence[str]],
                       group_connect_s: float = 120.0, memory_budget: int | None = None,
                       max_loaded_models: int | None = None,
                       kv_cache_dtype: str = "auto",
                       backend_devices: Mapping[str, Sequence[str]] | None = None,
                       device_backends: Sequence[str] = (),
                       listed_gpus: Sequence[GpuReading] = (),
                       ) -> ClusterService:
    """Join (or form) the cluster and start this node's part in it.

    pool: this node's model pool (and, through it, its runner registry); addresses: this
    node's API endpoints (host:port), read at each telemetry reading so the port can be known
    only once the HTTP server has bound it; group_connect_s: how long a rank of a multi-rank
    instance waits for its group to form; memory_budget: what this node's models may hold
    in all (None: what placement reckons the node can use, its own runners' memory counted as
    usable); max_loaded_models: how many models it may hold (None: no limit);
    backend_devices: the backends this node runs and the devices each drives (telemetry
    advertises them; None: shoal's engine alone); device_backends: those of them that keep
    models in accelerator memory; listed_gpus: that memory as a backend listed it at start,
    used where no live reading of it can be had (no NVML: a Mac, a Vulkan device)."""
    node_id = load_node_id(data_dir)
    name = settings.name or socket.gethostname()
    held = held_models(data_dir, pool)

    def read() -> NodeReading:
        reading = read_node(node_id, data_dir, name, tuple(addresses()))
        backends = dict(backend_devices or {DEFAULT_BACKEND: ()})
        reading = reading.model_copy(update={
            "gpus": reading.gpus or tuple(listed_gpus),
            "device_backends": tuple(device_backends)})
        budget = memory_budget
        if budget is None:
            budget = reading.capacity().usable_bytes + pool.resident_bytes()
        device_budget = None
        if device_backends:  # what the accelerators may hold: free now plus what we hold
            device_budget = reading.usable_device_bytes() + pool.device_bytes()
        return reading.model_copy(update={
            "backends": tuple(backends),
            "backend_devices": {name: tuple(devices) for name, devices in backends.items()},
            "memory_budget": budget, "device_budget": device_budget,
            "max_loaded_models": max_loaded_models, "queue_depths": pool.queue.depths(),
            "expiries": pool.expiries(), "models": held.current()})

    def usable_memory(backend: str = DEFAULT_BACKEND) -> int:
        return read().capacity().for_backend(backend).usable_bytes

    # Built first: a bad --propose-for source fails before any port is opened.
    service_config = ServiceConfig(
        cards=CardConfig(settings.card_interval_s, settings.card_ttl_s),
        proposer=ProposerConfig(offers=dict(settings.propose_for), data_dir=data_dir),
        transfer=TransferConfig(rate_bytes_per_s=settings.peer_fetch_rate,
                                tls=settings.tls))
    transport = await open_transport(settings, node_id)
    plane = ControlPlane(transport, cluster_config(settings, data_dir, kv_cache_dtype), read)
    service = ClusterService(plane, pool, usable_memory, service_config, held=held,
                             data_dir=data_dir, group_connect_s=group_connect_s)
    try:
        await service.start()
    except BaseException:
        await transport.close()
        raise
    log.info("node %s (%s) joined the cluster%s", node_id, name,
             " standalone" if settings.standalone else "")
    return service


def held_models(data_dir: Path, pool: ModelPool) -> HeldModels:
    """This node's model files as its telemetry lists them: the models pulled into its store
    and every model it has resolved for a request (file hashes cached in the data dir)."""
    store = ModelStore.of_data_dir(data_dir)

    def sources():
        for entry in store.entries():
            yield stored_source(entry), entry.names
        for source in pool.names.sources().values():
            yield source, ()

    return HeldModels(sources, FileHashes.of_data_dir(data_dir))
