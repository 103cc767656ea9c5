"""Wires one node: config -> runner registry and pool -> cluster membership -> router ->
FastAPI app -> uvicorn.

SIGINT / SIGTERM stop the HTTP server, then the node's part in the cluster, then every
runner (Shutdown -> SIGTERM -> SIGKILL). BackgroundNode runs the same thing on a thread, for
`shoal run` and for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ipaddress
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

from shoal import logs
from shoal.api.app import create_app
from shoal.api.auth import ApiKeys
from shoal.catalog.pull.errors import PullError
from shoal.catalog.pull.puller import Puller
from shoal.catalog.resolve import DEFAULT_MODEL_ID, ModelNotFound, list_models, resolve_model
from shoal.cluster.setup import open_cluster
from shoal.cluster.telemetry import GpuReading
from shoal.cluster.transport.base import TransportError
from shoal.config import NodeConfig
from shoal.config_file import ConfigFileError
from shoal.diagnostics.data_dir import DataDirWatch
from shoal.diagnostics.error_log import RecentErrors
from shoal.node_diagnostics import NodeDiagnostics
from shoal.pool.clients import load_clients
from shoal.pool.pool import ModelPool
from shoal.pool.queue import AdmissionQueue
from shoal.router import ModelUnavailable, Router
from shoal.router.ladders import load_ladders
from shoal.runner.backends import LLAMA_SERVER, NodeBackends, detect_backends
from shoal.runner.image import image_runner_options
from shoal.runner.llama_server.binary import LlamaServerNotUsable
from shoal.runner.llama_server.launch import LaunchSettings
from shoal.runner.llama_server.supervisor import LlamaServerSupervisor
from shoal.runner.options import SupervisorOptions
from shoal.runner.registry import BackendFactory, RunnerRegistry, SupervisorFactory
from shoal.runner.supervisor import RunnerSupervisor
from shoal.tracing.otlp import OtlpExporter

log = logging.getLogger("shoal.node")


class NodeStartError(RuntimeError):
    """The node could not start (a model failed to load, the port is taken)."""


def print_progress(model_id: str, stage: str, fraction: float) -> None:
    """Loading progress on stderr: one line per stage, overwritten in place on a terminal."""
    line = f"loading {model_id}: {stage} {fraction * 100:5.1f}%"
    if os.environ.get(logs.ENV) == "json":  # stderr holds only JSON lines
        if fraction >= 1.0 or stage in ("starting", "tokenizer"):
            log.info(line)
    elif sys.stderr.isatty():
        print(f"\r{line}\033[K", end="\n" if fraction >= 1.0 else "", file=sys.stderr,
              flush=True)
    elif fraction >= 1.0 or stage in ("starting", "tokenizer"):
        print(line, file=sys.stderr, flush=True)


def runner_factory(config: NodeConfig,
                   on_progress: Callable[[str, str, float], None] | None = print_progress,
                   options: SupervisorOptions | None = None) -> SupervisorFactory:
    """How this node starts a runner: alone for a single-rank instance; for a rank of a
    multi-rank instance, one that joins the instance's group and is never restarted alone
    (its group would not take it back)."""
    single = options or SupervisorOptions(load_timeout_s=config.runner.load_timeout_s,
                                          max_in_flight=config.runner.max_in_flight)

    def make(source: Any, parallel: Any) -> RunnerSupervisor:
        if source.task == "image":  # a diffusers pipeline, in the image runner
            return RunnerSupervisor(config.engine_config(source), image_runner_options(single),
                                    on_progress)
        if parallel is None:
            return RunnerSupervisor(config.engine_config(source), single, on_progress)
        ranked = dataclasses.replace(
            single, load_timeout_s=single.load_timeout_s + parallel.connect_timeout_s,
            max_crashes=1)
        # The ranks prove the cluster secret to each other (engine/parallel/proof.py).
        parallel = dataclasses.replace(parallel, rank_key=config.cluster.rank_key)
        engine = dataclasses.replace(config.engine_config(source), parallel=parallel)
        return RunnerSupervisor(engine, ranked, on_progress)

    return make


def backend_factories(config: NodeConfig, backends: NodeBackends,
                      on_progress: Callable[[str, str, float], None] | None = print_progress,
                      ) -> dict[str, BackendFactory]:
    """How this node starts a runner of each backend it runs besides shoal's engine: a
    llama-server process per model, with --parallel slots and the engine's context and
    threads."""
    if backends.llama_server is None:
        return {}
    launch = LaunchSettings(binary=backends.llama_server.path, slots=config.pool.queue.parallel,
                            context=config.engine.max_model_len, threads=config.engine.threads,
                            devices=tuple(d.name for d in backends.llama_server.devices),
                            buffer_log=backends.llama_server.log_verbosity)
    options = SupervisorOptions(load_timeout_s=config.runner.load_timeout_s,
                                max_in_flight=config.runner.max_in_flight)

    def make(source: Any) -> LlamaServerSupervisor:
        return LlamaServerSupervisor(config.engine_config(source), launch, options, on_progress)

    return {LLAMA_SERVER: make}


def find_backends(config: NodeConfig) -> NodeBackends:
    """The backends this node runs, logged one line each (NodeStartError when the named
    llama-server cannot run)."""
    try:
        backends = detect_backends(config.backends.llama_server)
    except LlamaServerNotUsable as error:
        raise NodeStartError(f"--llama-server: {error}") from error
    for line in backends.describe():
        log.info("%s", line)
    return backends


def make_pool(config: NodeConfig, make_supervisor: SupervisorFactory | None = None,
              resolve: Callable[[str], Any] | None = None,
              puller: Puller | None = None,
              backends: NodeBackends | None = None) -> ModelPool:
    """This node's runner registry, the pool over it and its admission queue; a malformed
    --clients file is a NodeStartError naming file, line and reason."""
    settings = config.pool
    tiers = _read_file(load_clients, settings.clients_file)
    queue = AdmissionQueue(settings.queue, tiers)
    registry = RunnerRegistry(make_supervisor or runner_factory(config),
                              backend_factories(config, backends or NodeBackends()))
    # Without a download, a model on no disk here is copied from a peer before any pull.
    here = None if resolve is not None else functools.partial(resolve_model,
                                                               data_dir=config.data_dir)
    return ModelPool(registry, resolve=resolve or node_resolver(config, puller),
                     keep_alive_s=config.keep_alive_s, queue=queue, resolve_here=here)


def _read_file(load: Callable[[Any], Any], path: Any) -> Any:
    if path is None:
        return None
    try:
        return load(path)
    except ConfigFileError as error:
        raise NodeStartError(str(error)) from error


def node_resolver(config: NodeConfig, puller: Puller | None = None) -> Callable[[str], Any]:
    """resolve_model with this node's data dir (where models from part packages are joined
    and pulled models are stored); with a puller, a model that is not on disk is pulled
    first when --pull-on-demand allows it."""
    resolve = functools.partial(resolve_model, data_dir=config.data_dir)
    if puller is None:
        return resolve

    def resolve_or_pull(name: str) -> Any:
        try:
            return resolve(name)
        except ModelNotFound:
            if not puller.may_pull_on_demand(name):
                raise
        log.info("model %s is not on disk: pulling it (--pull-on-demand)", name)
        try:
            puller.pull(name)
        except (PullError, ValueError) as error:
            raise ModelNotFound(f"model {name!r} is not on disk, and pulling it failed: "
                                f"{error}") from error
        return resolve(name)

    return resolve_or_pull


def make_puller(config: NodeConfig) -> Puller:
    """This node's puller into its data dir's model store."""
    return Puller(config.data_dir, config.pull)


def _protect_in_use(puller: Puller, router: Router, config: NodeConfig) -> None:
    """--models-disk never evicts a model this node has loaded or pins."""
    def keep(entry: Any) -> bool:
        names = [s.model_id for s in router.supervisors] + list(config.pool.pinned)
        return any(entry.answers_to(name) for name in names)

    puller.keep = keep
    puller.observers.append(router.metrics.count_pulled)
    if router.cluster is not None:  # copies from peers: counted as pulled ("peer"), and
        transfer = router.cluster.transfer  # bounded by --models-disk as pulls are
        transfer.observers.append(router.metrics.count_pulled)
        transfer.make_room = puller.make_room


def default_models(config: NodeConfig) -> tuple[str, ...]:
    """Models loaded at start (not pinned): those named, else the catalogue default unless
    pinned models were named instead; none without preloading."""
    if config.models or not config.preload:
        return config.models
    if config.pool.pinned:
        return ()
    return (DEFAULT_MODEL_ID,)


def make_router(config: NodeConfig, pool: ModelPool, cluster: Any) -> Router:
    """The node's router with its task ladders (a malformed --tasks file is a
    NodeStartError naming file, line and reason)."""
    ladders = _read_file(load_ladders, config.pool.tasks_file) or {}
    return Router(pool, cluster, ladders=ladders, memory_wait_s=config.pool.queue.timeout_s,
                  backend_of=config.backends.backend_for)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the node owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


async def serve(config: NodeConfig, stop: asyncio.Event | None = None,
                on_listening: Callable[[str], None] | None = None,
                list_available: Callable[[], Any] | None = None,
                make_supervisor: SupervisorFactory | None = None,
                resolve: Callable[[str], Any] | None = None) -> None:
    """Run the node until stop is set (or SIGINT/SIGTERM arrives on the main thread).

    The node joins the cluster its config names (a standalone node is a cluster of one).
    make_supervisor and resolve replace how runners start and names resolve (tests)."""
    stop = stop or asyncio.Event()
    _install_signal_handlers(stop)
    addresses: list[str] = []
    puller = make_puller(config)
    backends = await asyncio.to_thread(find_backends, config)
    pool = make_pool(config, make_supervisor, resolve, puller, backends)
    cluster = await _join_cluster(config, pool, addresses, backends)
    try:
        router = make_router(config, pool, cluster)
    except NodeStartError:
        await cluster.stop()
        await pool.shutdown()
        raise
    _protect_in_use(puller, router, config)
    pool.spans.exporter = exporter = OtlpExporter.from_env(
        {"shoal.role": "node", "shoal.node_id": cluster.node_id, "process.pid": os.getpid()})
    errors = RecentErrors()
    logging.getLogger().addHandler(errors)  # this node's recent errors, for diagnostics
    diagnose = NodeDiagnostics(config, pool, cluster, errors)
    data_dir_watch = DataDirWatch(config.data_dir)
    data_dir_watch.start()
    try:
        await _preload(router, default_models(config), stop)
        await _preload(router, config.pool.pinned, stop, pinned=True)
        if stop.is_set():
            return
        api_keys = ApiKeys(config.server.api_keys)
        if not api_keys and not is_loopback(config.server.host):
            log.warning("serving on %s with no API key: anyone who can reach this address "
                        "can use every route (set --api-key or --api-keys-file)",
                        config.server.host)
        app = create_app(router, keepalive_s=config.server.keepalive_s,
                         list_available=list_available or functools.partial(
                             list_models, data_dir=config.data_dir),
                         cluster=cluster, api_keys=api_keys, diagnose=diagnose, puller=puller,
                         data_dir_watch=data_dir_watch)
        server = _Server(uvicorn.Config(app, host=config.server.host, port=config.server.port,
                                        log_level="warning", lifespan="off",
                                        # its records go to our handler (--log-format)
                                        log_config=None))
        server_task = asyncio.ensure_future(server.serve())
        await _wait_started(server, server_task)
        url = _bound_url(server)
        addresses.extend(advertised_addresses(url))
        if on_listening is not None:
            on_listening(url)
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({server_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        server.should_exit = True
        await server_task
    finally:
        await data_dir_watch.stop()
        await cluster.stop()
        await router.shutdown()
        logging.getLogger().removeHandler(errors)
        if exporter is not None:
            await asyncio.to_thread(exporter.shutdown)  # sends what is queued (bounded)


def is_loopback(host: str) -> bool:
    """Whether host (a name or an address) only ever means this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _listed_gpus(backends: NodeBackends) -> tuple[GpuReading, ...]:
    """The accelerators llama-server listed at start, with their memory then: telemetry's
    reading where nothing on the machine reads them live (no NVML: Metal, Vulkan)."""
    if backends.llama_server is None:
        return ()
    return tuple(GpuReading(index=index, name=device.description or device.name,
                            memory_total=device.total_bytes, memory_available=device.free_bytes)
                 for index, device in enumerate(backends.llama_server.devices))


async def _join_cluster(config: NodeConfig, pool: ModelPool, addresses: list[str],
                        backends: NodeBackends) -> Any:
    try:
        return await open_cluster(config.cluster, config.data_dir, pool,
                                  lambda: tuple(addresses),
                                  config.runner.group_connect_deadline_s,
                                  memory_budget=config.pool.memory_budget,
                                  max_loaded_models=config.pool.max_loaded_models,
                                  kv_cache_dtype=config.engine.kv_cache_dtype,
                                  backend_devices=backends.devices(),
                                  device_backends=backends.device_backends,
                                  listed_gpus=_listed_gpus(backends))
    except (TransportError, ValueError, OSError) as error:
        await pool.shutdown()
        raise NodeStartError(f"cannot join the cluster: {error}") from error


async def _preload(router: Router, models: tuple[str, ...], stop: asyncio.Event,
                   pinned: bool = False) -> None:
    if not models or stop.is_set():
        return
    preload = asyncio.ensure_future(router.preload(models, pinned=pinned))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({preload, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not preload.done():
        preload.cancel()
        with contextlib.suppress(BaseException):
            await preload
        return
    try:
        preload.result()
    except (ModelNotFound, ModelUnavailable, ValueError) as error:
        raise NodeStartError(str(error)) from error


async def _wait_started(server: uvicorn.Server, task: asyncio.Task) -> None:
    while not server.started:
        if task.done():
            # uvicorn exits (SystemExit) when it cannot bind
            raise NodeStartError("the HTTP server failed to start (is the port in use?)")
        await asyncio.sleep(0.05)


def advertised_addresses(url: str) -> list[str]:
    """host:port endpoints other nodes can reach this API at: the bound address, or every
    IPv4 address of this machine (non-loopback first) when bound to all interfaces."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    if host not in ("0.0.0.0", "::", "[::]"):
        return [f"{host}:{port}"]
    import socket

    import psutil

    ips = [a.address for addresses in psutil.net_if_addrs().values() for a in addresses
           if a.family == socket.AF_INET]
    ips.sort(key=lambda ip: ip.startswith("127."))
    return [f"{ip}:{port}" for ip in ips] or [f"127.0.0.1:{port}"]


def _bound_url(server: uvicorn.Server) -> str:
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"http://{host}:{port}"


def _install_signal_handlers(stop: asyncio.Event) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


class BackgroundNode:
    """A node on a daemon thread: start() returns its URL once it listens. serve_options go
    to serve()."""

    def __init__(self, config: NodeConfig, start_timeout_s: float = 900.0,
                 **serve_options: Any) -> None:
        self.config = config
        self._serve_options = serve_options
        self._start_timeout_s = start_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None
        self.url: str | None = None
        self.error: BaseException | None = None

    def start(self) -> str:
        self._thread = threading.Thread(target=self._run, name="shoal-node", daemon=True)
        self._thread.start()
        if not self._listening.wait(self._start_timeout_s):
            raise NodeStartError(f"the node did not start within {self._start_timeout_s:.0f} s")
        if self.error is not None:
            raise NodeStartError(str(self.error)) from self.error
        if self.url is None:
            raise NodeStartError("the node stopped before it listened")
        return self.url

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await serve(self.config, stop=self._stop,
                        on_listening=self._on_listening, **self._serve_options)

        try:
            asyncio.run(main())
        except BaseException as error:  # noqa: BLE001 - reported to start()
            self.error = error
        finally:
            self._listening.set()

    def _on_listening(self, url: str) -> None:
        self.url = url
        self._listening.set()

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout_s)
