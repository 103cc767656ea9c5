"""Node configuration: frozen dataclasses built once from flags and SHOAL_* environment.

Precedence: command-line flag, then environment, then default. Everything a user can set is
validated in __post_init__ with a ValueError that names it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.api.auth import read_keys_file
from shoal.backend_names import BackendName, parse_backend_assignment
from shoal.catalog.cards import load_builtin_catalog
from shoal.catalog.pull.settings import PullSettings
from shoal.catalog.resolve import cluster_model_id, find_card, resolve_model
from shoal.cluster.settings import DEFAULT_PEER_FETCH_RATE, ClusterSettings
from shoal.cluster.tls import read_cluster_tls
from shoal.config_values import as_bool, as_float, as_int, as_list, parse_size, pick
from shoal.durations import parse_duration_s
from shoal.engine.config import KV_CACHE_DTYPES, EngineConfig, KvDiskConfig, ModelSource
from shoal.engine.speculation.config import SpeculativeConfig, parse_assignment
from shoal.paths import default_data_dir
from shoal.pool.queue import QueueLimits

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
@dataclass(frozen=True)
class ServerConfig:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    # Seconds between SSE keep-alive comments on a silent stream.
    keepalive_s: float = 15.0
    # Keys every API and admin route wants (--api-key, --api-keys-file); none: open. Never
    # shown in a repr or a log.
    api_keys: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if any(not key.strip() for key in self.api_keys):
            raise ValueError("an API key must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, not {self.port}")
        if self.keepalive_s <= 0:
            raise ValueError("keepalive_s must be positive")


@dataclass(frozen=True)
class EngineDefaults:
    """Engine settings applied to every model this node loads."""

    dtype: str = "auto"
    threads: int | None = None
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    # --speculative: (model name as given, how it speculates), applied by speculation_for.
    speculative: tuple[tuple[str, SpeculativeConfig], ...] = ()
    # --kv-disk / --kv-disk-ttl: the SSD tier's bytes per model (None: off), entries' TTL.
    kv_disk_bytes: int | None = None
    kv_disk_ttl_s: float = 7 * 24 * 3600.0

    def speculation_for(self, model_id: str) -> SpeculativeConfig | None:
        """The speculation named for a model, by its id or any catalogue name of it."""
        catalog = load_builtin_catalog() if self.speculative else ()
        for name, speculative in self.speculative:
            card = find_card(name, catalog)
            if name.lower() == model_id.lower() or (card is not None and any(
                    model_id.lower() == other.lower() for other in card.names)):
                return speculative
        return None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16 or float32, not {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"not {self.kv_cache_dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, not {self.threads}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1024 * 1024:
            raise ValueError("kv cache memory must be at least 1 MiB")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError("max model length must be >= 16")
        if self.kv_disk_bytes is not None:  # the same checks as the engine's, at start
            KvDiskConfig(Path("."), self.kv_disk_bytes, self.kv_disk_ttl_s)


@dataclass(frozen=True)
class RunnerLimits:
    load_timeout_s: float = 600.0
    # Requests in flight per model beyond which new ones get 429.
    max_in_flight: int = 256
    # How long the ranks of a multi-rank instance may take to form their process group.
    group_connect_deadline_s: float = 120.0

    def __post_init__(self) -> None:
        if self.load_timeout_s <= 0:
            raise ValueError("load timeout must be positive")
        if self.group_connect_deadline_s <= 0:
            raise ValueError("SHOAL_GROUP_CONNECT_DEADLINE must be positive")
        if self.max_in_flight < 1:
            raise ValueError("max in-flight requests must be >= 1")


@dataclass(frozen=True)
class PoolSettings:
    """How this node shares its memory among models and its turns among requests."""

    memory_budget: int | None = None  # None: what placement reckons the node can use
    max_loaded_models: int | None = None  # None: no limit
    pinned: tuple[str, ...] = ()  # models loaded at start and never evicted
    queue: QueueLimits = field(default_factory=QueueLimits)  # --max-queue, --parallel, ...
    clients_file: Path | None = None  # --clients: per-client tiers (pool/clients.py)
    tasks_file: Path | None = None  # --tasks: fallback ladders (router/ladders.py)

    def __post_init__(self) -> None:
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError("memory budget must be positive")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError(f"max loaded models must be >= 1, not {self.max_loaded_models}")
        if any(not m.strip() for m in self.pinned):
            raise ValueError("pinned model names must not be empty")


@dataclass(frozen=True)
class BackendSettings:
    """The backends this node may run besides shoal's engine, and which serves which model."""

    # --llama-server (SHOAL_LLAMA_SERVER): the binary; None: llama-server on PATH, if any.
    llama_server: Path | None = None
    # --backend MODEL=NAME (SHOAL_BACKENDS, comma-separated), by any name of the model.
    assigned: tuple[tuple[str, BackendName], ...] = ()

    def __post_init__(self) -> None:
        names = [model.lower() for model, _ in self.assigned]
        if len(set(names)) != len(names):
            raise ValueError("--backend names a model twice")

    def backend_for(self, model_id: str) -> BackendName | None:
        """The backend assigned to a model: --backend by its id or any catalogue name of it,
        else its catalogue card's; None: the default choice (cluster/backends.py)."""
        card = find_card(model_id, _catalog())
        for name, backend in self.assigned:
            if name.lower() == model_id.lower() or (
                    card is not None and find_card(name, _catalog()) is card):
                return backend
        return card.backend if card is not None else None


@functools.cache
def _catalog() -> tuple[Any, ...]:
    return load_builtin_catalog()  # package data: it cannot change while shoal runs


@dataclass(frozen=True)
class NodeConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    # Model ids, aliases or paths preloaded at start; empty means the catalogue default.
    models: tuple[str, ...] = ()
    data_dir: Path = field(default_factory=default_data_dir)
    engine: EngineDefaults = field(default_factory=EngineDefaults)
    runner: RunnerLimits = field(default_factory=RunnerLimits)
    # Seconds a model loaded on demand stays loaded after its last request; None keeps it
    # loaded. Models in `models` stay loaded unless a request's keep_alive says otherwise.
    keep_alive_s: float | None = 300.0
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    # False: load nothing at start (not even the default model); models load on first use.
    preload: bool = True
    pool: PoolSettings = field(default_factory=PoolSettings)
    # shoal pull / POST /api/pull: the store's bound, pull-on-demand, the Ollama registry.
    pull: PullSettings = field(default_factory=PullSettings)
    # llama-server and the models assigned to a backend (--llama-server, --backend).
    backends: BackendSettings = field(default_factory=BackendSettings)

    def __post_init__(self) -> None:
        if any(not m.strip() for m in self.models):
            raise ValueError("model names must not be empty")
        if self.models and not self.preload:
            raise ValueError("models to load at start were named, but preloading is off")
        if self.keep_alive_s is not None and self.keep_alive_s < 0:
            raise ValueError("keep_alive_s must be >= 0, or None to keep models loaded")

    def engine_config(self, source: ModelSource) -> EngineConfig:
        speculative = self.engine.speculation_for(source.model_id)
        return EngineConfig(source=source, dtype=self.engine.dtype,  # type: ignore[arg-type]
                            threads=self.engine.threads,
                            # The queue lets --parallel requests of a model run at once:
                            # the engine's batch, and the KV capacity, are sized for that.
                            max_num_seqs=self.pool.queue.parallel,
                            max_num_batched_tokens=max(EngineConfig.max_num_batched_tokens,
                                                       self.pool.queue.parallel),
                            kv_cache_bytes=self.engine.kv_cache_bytes,
                            max_model_len=self.engine.max_model_len,
                            kv_cache_dtype=self.engine.kv_cache_dtype,  # type: ignore[arg-type]
                            speculative=speculative,
                            draft_source=self._draft_source(speculative),
                            cache_dir=self.data_dir / "cache",
                            kv_disk=None if self.engine.kv_disk_bytes is None else KvDiskConfig(
                                self.data_dir / "kv", self.engine.kv_disk_bytes,
                                self.engine.kv_disk_ttl_s))

    def _draft_source(self, speculative: SpeculativeConfig | None) -> ModelSource | None:
        if speculative is None or speculative.method != "draft":
            return None
        return resolve_model(speculative.draft_model, data_dir=self.data_dir)


def build_cluster_settings(*, standalone: bool | None = None, listen=None, peers=None,
                           secret: str | None = None, force_master: bool | None = None,
                           discovery: bool | None = None, name: str | None = None,
                           tls_dir: str | None = None, discovery_interface: str | None = None,
                           propose_for: Sequence[str] = (), peer_fetch_rate: str | None = None,
                           env: Mapping[str, str] | None = None) -> ClusterSettings:
    """Cluster settings from flags (None = not given) and SHOAL_* variables; ValueError
    naming the file when a --cluster-tls file is missing or unreadable."""
    env = os.environ if env is None else env
    tls_path = pick(tls_dir, env, "SHOAL_CLUSTER_TLS")
    rate = pick(peer_fetch_rate, env, "SHOAL_PEER_FETCH_RATE")
    return ClusterSettings(
        standalone=bool(as_bool(pick(standalone, env, "SHOAL_STANDALONE"),
                                 "SHOAL_STANDALONE")),
        listen=as_list(pick(listen or None, env, "SHOAL_LISTEN")),
        peers=as_list(pick(peers or None, env, "SHOAL_PEERS")),
        secret=pick(secret, env, "SHOAL_CLUSTER_SECRET") or "",
        force_master=bool(as_bool(pick(force_master, env, "SHOAL_FORCE_MASTER"),
                                   "SHOAL_FORCE_MASTER")),
        discovery=as_bool(pick(discovery, env, "SHOAL_DISCOVERY"), "SHOAL_DISCOVERY"),
        name=pick(name, env, "SHOAL_NODE_NAME") or "",
        tls=read_cluster_tls(Path(tls_path)) if tls_path else None,
        discovery_interface=pick(discovery_interface, env, "SHOAL_DISCOVERY_INTERFACE") or "",
        propose_for=_propose_for(propose_for, env),
        card_interval_s=as_float(env.get("SHOAL_CARD_INTERVAL") or None,
                                  "SHOAL_CARD_INTERVAL") or 5.0,
        card_ttl_s=as_float(env.get("SHOAL_CARD_TTL") or None, "SHOAL_CARD_TTL") or 30.0,
        peer_fetch_rate=(DEFAULT_PEER_FETCH_RATE if rate is None
                         else None if rate in ("off", "0") else parse_size(rate)))


def _propose_for(flags: Sequence[str], env: Mapping[str, str]
                 ) -> tuple[tuple[str, str], ...]:
    """--propose-for TARGET[=SOURCE] values (else SHOAL_PROPOSE_FOR, comma-separated), the
    target named by the id every node knows it by (cluster_model_id: a catalogue id, a
    pulled model's store name, a local file's id); SOURCE defaults to ngram."""
    values = list(flags) or [v for v in env.get("SHOAL_PROPOSE_FOR", "").split(",") if v.strip()]
    if not values:
        return ()
    offers = []
    for value in values:
        target, _, source = value.partition("=")
        target, source = target.strip(), source.strip() or "ngram"
        if not target:
            raise ValueError(f"--propose-for {value!r}: name the target model, as "
                             f"TARGET[=SOURCE]")
        # Named as the node serving it names it: a path by its file's id, an alias by id.
        offers.append((cluster_model_id(target), source))
    if len({target.lower() for target, _ in offers}) != len(offers):
        raise ValueError("--propose-for names a target model twice")
    return tuple(offers)


def build_node_config(*, host: str | None = None, port: int | None = None,
                      models: Sequence[str] = (), data_dir: str | None = None,
                      dtype: str | None = None, threads: int | None = None,
                      kv_cache_memory: str | None = None, max_model_len: int | None = None,
                      keep_alive: str | None = None, preload: bool | None = None,
                      kv_cache_dtype: str | None = None,
                      cluster: ClusterSettings | None = None,
                      pool: PoolSettings | None = None,
                      api_keys: Sequence[str] = (), api_keys_file: str | None = None,
                      speculative: Sequence[str] = (),
                      kv_disk: str | None = None, kv_disk_ttl: str | None = None,
                      pull: PullSettings | None = None,
                      backends: BackendSettings | None = None,
                      env: Mapping[str, str] | None = None) -> NodeConfig:
    """The node's configuration from flags (None = not given) and the environment.
    ValueError when a value is invalid or the API keys file cannot be read."""
    env = os.environ if env is None else env
    env_models = [m.strip() for m in env.get("SHOAL_MODELS", "").split(",") if m.strip()]
    size = pick(kv_cache_memory, env, "SHOAL_KV_CACHE_MEMORY")
    disk = pick(kv_disk, env, "SHOAL_KV_DISK")
    disk_ttl = pick(kv_disk_ttl, env, "SHOAL_KV_DISK_TTL")
    directory = pick(data_dir, env, "SHOAL_DATA_DIR")
    port_value = as_int(pick(port, env, "SHOAL_PORT"), "port")
    server = ServerConfig(host=pick(host, env, "SHOAL_HOST") or DEFAULT_HOST,
                          port=DEFAULT_PORT if port_value is None else port_value,
                          api_keys=_api_keys(api_keys, api_keys_file, env))
    engine = EngineDefaults(
        dtype=pick(dtype, env, "SHOAL_DTYPE") or "auto",
        threads=as_int(pick(threads, env, "SHOAL_THREADS"), "threads"),
        kv_cache_bytes=None if size is None else parse_size(size),
        max_model_len=as_int(pick(max_model_len, env, "SHOAL_MAX_MODEL_LEN"),
                              "max model length"),
        kv_cache_dtype=pick(kv_cache_dtype, env, "SHOAL_KV_CACHE_DTYPE") or "auto",
        speculative=_speculative(speculative, env),
        kv_disk_bytes=None if disk in (None, "off", "0") else parse_size(disk),
        kv_disk_ttl_s=7 * 24 * 3600.0 if disk_ttl is None else parse_duration_s(disk_ttl))
    runner = RunnerLimits(
        load_timeout_s=as_float(env.get("SHOAL_LOAD_TIMEOUT") or None, "SHOAL_LOAD_TIMEOUT")
        or 600.0,
        max_in_flight=as_int(env.get("SHOAL_MAX_IN_FLIGHT") or None, "SHOAL_MAX_IN_FLIGHT")
        or 256,
        group_connect_deadline_s=as_float(env.get("SHOAL_GROUP_CONNECT_DEADLINE") or None,
                                           "SHOAL_GROUP_CONNECT_DEADLINE") or 120.0)
    keep_alive_value = pick(keep_alive, env, "SHOAL_KEEP_ALIVE")
    keep_alive_s = 300.0 if keep_alive_value is None else parse_duration_s(keep_alive_value)
    preload_value = as_bool(pick(preload, env, "SHOAL_PRELOAD"), "SHOAL_PRELOAD")
    return NodeConfig(server=server, models=tuple(models) or tuple(env_models),
                      data_dir=Path(directory).expanduser() if directory else default_data_dir(),
                      engine=engine, runner=runner,
                      keep_alive_s=None if keep_alive_s < 0 else keep_alive_s,
                      cluster=cluster or build_cluster_settings(env=env),
                      preload=True if preload_value is None else preload_value,
                      pool=pool or build_pool_settings(env=env),
                      pull=pull or build_pull_settings(env=env),
                      backends=backends or build_backend_settings(env=env))


def build_backend_settings(*, llama_server: str | None = None, assigned: Sequence[str] = (),
                           env: Mapping[str, str] | None = None) -> BackendSettings:
    """Backend settings from flags (None / empty = not given) and SHOAL_* variables."""
    env = os.environ if env is None else env
    binary = pick(llama_server, env, "SHOAL_LLAMA_SERVER")
    values = list(assigned) or as_list(env.get("SHOAL_BACKENDS") or None)
    return BackendSettings(llama_server=Path(binary).expanduser() if binary else None,
                           assigned=tuple(parse_backend_assignment(v) for v in values))


def build_pull_settings(*, models_disk: str | None = None, on_demand: str | None = None,
                        ollama_registry: str | None = None,
                        env: Mapping[str, str] | None = None) -> PullSettings:
    """Pull settings from flags (None = not given) and SHOAL_* variables."""
    env = os.environ if env is None else env
    bound = pick(models_disk, env, "SHOAL_MODELS_DISK")
    return PullSettings(
        models_disk=None if bound in (None, "off", "0") else parse_size(bound),
        on_demand=pick(on_demand, env, "SHOAL_PULL_ON_DEMAND") or "catalog",
        ollama_registry=pick(ollama_registry, env, "SHOAL_OLLAMA_REGISTRY"))


def _speculative(flags: Sequence[str], env: Mapping[str, str]
                 ) -> tuple[tuple[str, SpeculativeConfig], ...]:
    """--speculative MODEL=SPEC values, else SHOAL_SPECULATIVE (comma-separated)."""
    values = list(flags) or [v for v in env.get("SHOAL_SPECULATIVE", "").split(",") if v.strip()]
    parsed = tuple(parse_assignment(value) for value in values)
    names = [name.lower() for name, _ in parsed]
    if len(set(names)) != len(names):
        raise ValueError("--speculative names a model twice")
    return parsed


def _api_keys(flags: Sequence[str], keys_file: str | None,
              env: Mapping[str, str]) -> tuple[str, ...]:
    """--api-key values (else SHOAL_API_KEY) plus the keys of --api-keys-file (else
    SHOAL_API_KEYS_FILE)."""
    keys = tuple(flags) or tuple(k for k in (env.get("SHOAL_API_KEY"),) if k)
    path = pick(keys_file, env, "SHOAL_API_KEYS_FILE")
    if path is not None:
        keys += read_keys_file(Path(path))
    return keys


def build_pool_settings(*, memory_budget: str | None = None, max_loaded_models=None,
                        pin: Sequence[str] = (), max_queue=None, queue_timeout=None,
                        parallel=None, clients: str | None = None, tasks: str | None = None,
                        env: Mapping[str, str] | None = None) -> PoolSettings:
    """Pool settings from flags (None = not given) and SHOAL_* variables."""
    env = os.environ if env is None else env
    budget = pick(memory_budget, env, "SHOAL_MEMORY_BUDGET")
    timeout = pick(queue_timeout, env, "SHOAL_QUEUE_TIMEOUT")
    queue = as_int(pick(max_queue, env, "SHOAL_MAX_QUEUE"), "max queue")
    width = as_int(pick(parallel, env, "SHOAL_PARALLEL"), "parallel")
    limits = QueueLimits()
    clients_file = pick(clients, env, "SHOAL_CLIENTS")
    tasks_file = pick(tasks, env, "SHOAL_TASKS")
    return PoolSettings(
        memory_budget=None if budget is None else parse_size(budget),
        max_loaded_models=as_int(pick(max_loaded_models, env, "SHOAL_MAX_LOADED_MODELS"),
                                  "max loaded models"),
        pinned=tuple(pin) or as_list(env.get("SHOAL_PIN") or None),
        queue=QueueLimits(
            max_queue=limits.max_queue if queue is None else queue,
            timeout_s=limits.timeout_s if timeout is None else parse_duration_s(timeout),
            parallel=limits.parallel if width is None else width),
        clients_file=Path(clients_file).expanduser() if clients_file else None,
        tasks_file=Path(tasks_file).expanduser() if tasks_file else None)
