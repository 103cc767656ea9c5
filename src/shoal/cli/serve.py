"""shoal serve: run a node serving the named models (the catalogue default with none)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from shoal import logs
from shoal.catalog.resolve import resolve_model
from shoal.cli.errors import CommandFailed
from shoal.config import (
    DEFAULT_PORT,
    NodeConfig,
    build_backend_settings,
    build_cluster_settings,
    build_node_config,
    build_pool_settings,
    build_pull_settings,
)
from shoal.engine.config import KV_CACHE_DTYPES
from shoal.node import serve


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", default=None, help="state and caches (SHOAL_DATA_DIR)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default=None,
                        help="compute dtype (SHOAL_DTYPE; default auto)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                        default=None, help="KV cache elements (SHOAL_KV_CACHE_DTYPE; default "
                        "auto: bfloat16 with bf16 compute, float32 with --dtype float32; "
                        "int8: half of bf16's bytes, a scale per token and head)")
    parser.add_argument("--speculative", action="append", default=[],
                        metavar="MODEL=ngram[:K]",
                        help="speculative decoding for MODEL: ngram[:K] guesses up to K "
                             "tokens from the request's own text, remote[:K] asks a node "
                             "that offers --propose-for MODEL; repeat per model "
                             "(SHOAL_SPECULATIVE, comma-separated)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per runner (SHOAL_THREADS)")
    parser.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                        help="the most KV cache one model may hold, e.g. 2GiB (default: its "
                             "context for every parallel slot; SHOAL_KV_CACHE_MEMORY)")


def add_parser(commands) -> None:
    parser = commands.add_parser("serve", help="serve models over an OpenAI-compatible API")
    parser.add_argument("--kv-disk", default=None, metavar="SIZE",
                        help="keep prefix KV blocks on disk under the data dir, up to SIZE per "
                             "model, e.g. 4GiB; they survive restarts (SHOAL_KV_DISK; off)")
    parser.add_argument("--kv-disk-ttl", default=None, metavar="DURATION",
                        help="drop a block kept on disk after this long unused, e.g. 24h "
                             "(SHOAL_KV_DISK_TTL; 168h)")
    parser.add_argument("--host", default=None, help="bind address (SHOAL_HOST; 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None,
                        help=f"port (SHOAL_PORT; {DEFAULT_PORT})")
    parser.add_argument("--model", action="append", default=[], metavar="ID_OR_PATH",
                        help="model to load at start; repeat for several (SHOAL_MODELS)")
    parser.add_argument("--no-preload", dest="preload", action="store_false", default=None,
                        help="load nothing at start, not even the default model "
                             "(SHOAL_PRELOAD=false)")
    parser.add_argument("--keep-alive", default=None, metavar="DURATION",
                        help="how long a model loaded on demand stays loaded after its last "
                             "request, e.g. 300, 5m, -1 for ever (SHOAL_KEEP_ALIVE; 5m)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="a key every API and admin route wants (Authorization: Bearer "
                             "KEY, or x-api-key); repeat for several (SHOAL_API_KEY)")
    parser.add_argument("--api-keys-file", default=None, metavar="FILE",
                        help="file of API keys, one per line (SHOAL_API_KEYS_FILE)")
    parser.add_argument("--log-format", choices=logs.FORMATS, default=None,
                        help="stderr as text, or one JSON object per line "
                             "(SHOAL_LOG_FORMAT; text)")
    add_engine_flags(parser)
    add_pool_flags(parser)
    add_pull_flags(parser)
    add_backend_flags(parser)
    add_cluster_flags(parser)
    parser.set_defaults(handler=run_serve)


def add_pull_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("pulling models")
    group.add_argument("--pull-on-demand", choices=("off", "catalog", "all"), default=None,
                       help="a request naming a model that is not on disk pulls it first: "
                            "catalogue models only, any pullable name, or never "
                            "(SHOAL_PULL_ON_DEMAND; catalog)")
    group.add_argument("--models-disk", default=None, metavar="SIZE",
                       help="bound the pulled-model store, e.g. 50GB; models neither pinned "
                            "nor loaded are removed least recently used first to make room "
                            "(SHOAL_MODELS_DISK; no bound)")
    group.add_argument("--ollama-registry", default=None, metavar="URL",
                       help="Ollama registry to pull library models from "
                            "(SHOAL_OLLAMA_REGISTRY; https://registry.ollama.ai)")


def add_pool_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models and requests")
    group.add_argument("--memory-budget", default=None, metavar="SIZE",
                       help="what this node's models may hold in all, e.g. 8GiB; idle models "
                            "are evicted to make room (SHOAL_MEMORY_BUDGET; default: the "
                            "memory the node can use)")
    group.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                       help="models this node holds at most (SHOAL_MAX_LOADED_MODELS; no "
                            "limit)")
    group.add_argument("--pin", action="append", default=[], metavar="MODEL",
                       help="load MODEL at start and never evict it; repeat for several "
                            "(SHOAL_PIN)")
    group.add_argument("--max-queue", type=int, default=None, metavar="N",
                       help="requests waiting for a turn on this node; more are refused "
                            "(SHOAL_MAX_QUEUE; 512)")
    group.add_argument("--queue-timeout", default=None, metavar="DURATION",
                       help="the longest a request waits for its turn, e.g. 30s "
                            "(SHOAL_QUEUE_TIMEOUT; 5m)")
    group.add_argument("--parallel", type=int, default=None, metavar="N",
                       help="requests one model serves at once on this node; more wait in "
                            "the queue (SHOAL_PARALLEL; 32)")
    group.add_argument("--clients", default=None, metavar="FILE",
                       help="TOML file of client tiers: concurrency, queue and priority caps "
                            "(SHOAL_CLIENTS)")
    group.add_argument("--tasks", default=None, metavar="FILE",
                       help="TOML file of fallback ladders, asked for as model task:NAME "
                            "(SHOAL_TASKS)")


def add_backend_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("backends")
    group.add_argument("--llama-server", default=None, metavar="PATH",
                       help="llama.cpp's llama-server binary (any build: CUDA, Metal, Vulkan, "
                            "ROCm, CPU) for models shoal's engine does not run or that are "
                            "assigned to it (SHOAL_LLAMA_SERVER; default: llama-server on "
                            "PATH, if any)")
    group.add_argument("--backend", action="append", default=[], metavar="MODEL=NAME",
                       help="serve MODEL with backend NAME (engine, llama-server); repeat for "
                            "several (SHOAL_BACKENDS, comma-separated)")


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster")
    group.add_argument("--listen", action="append", default=[], metavar="ENDPOINT",
                       help="cluster endpoint to listen on, e.g. tcp/0.0.0.0:7447; repeat "
                            "or comma-separate (SHOAL_LISTEN; Zenoh picks one)")
    group.add_argument("--peers", action="append", default=[], metavar="ENDPOINTS",
                       help="cluster endpoints of other nodes to dial, e.g. "
                            "tcp/192.168.1.5:7447 (SHOAL_PEERS)")
    group.add_argument("--cluster-secret", default=None, metavar="SECRET",
                       help="only nodes with the same secret form a cluster "
                            "(SHOAL_CLUSTER_SECRET)")
    group.add_argument("--cluster-tls", default=None, metavar="DIR",
                       help="mutual TLS between nodes and a secret between ranks, from the "
                            "files `shoal cluster certs DIR` made (SHOAL_CLUSTER_TLS)")
    group.add_argument("--force-master", action="store_true", default=None,
                       help="this node wins every master election (SHOAL_FORCE_MASTER)")
    group.add_argument("--discovery", dest="discovery", action="store_true", default=None,
                       help="find nodes by multicast scouting (SHOAL_DISCOVERY; on unless "
                            "--peers is given)")
    group.add_argument("--no-discovery", dest="discovery", action="store_false",
                       help="do not scout for nodes; only --peers are dialled")
    group.add_argument("--discovery-interface", default=None, metavar="NAME",
                       help="network interface to scout on, e.g. eth0 or lo "
                            "(SHOAL_DISCOVERY_INTERFACE; Zenoh picks)")
    group.add_argument("--propose-for", action="append", default=[],
                       metavar="TARGET[=SOURCE]",
                       help="guess tokens for verifiers of TARGET on other nodes (their "
                            "--speculative TARGET=remote); SOURCE: ngram (the default) or "
                            "draft:MODEL (a smaller model of the same tokenizer); "
                            "repeat per target (SHOAL_PROPOSE_FOR, comma-separated)")
    group.add_argument("--peer-fetch-rate", default=None, metavar="SIZE",
                       help="at most SIZE a second (e.g. 100MB) when this node copies a model's "
                            "files from another node, or off (SHOAL_PEER_FETCH_RATE; 256MiB)")
    group.add_argument("--standalone", action="store_true", default=None,
                       help="join no cluster and open no cluster port (SHOAL_STANDALONE)")
    group.add_argument("--name", default=None,
                       help="this node's name in the cluster (SHOAL_NODE_NAME; host name)")


def check_draft_models(config: NodeConfig) -> None:
    """Refuse, at start, a draft model that is missing or does not share its target's
    tokenizer (ValueError or ModelNotFound, naming both)."""
    pairs = [(name, speculative.draft_model) for name, speculative in config.engine.speculative
             if speculative.method == "draft"]
    # A proposer node's draft (--propose-for TARGET=draft:MODEL) guesses for TARGET too.
    pairs += [(target, source.partition(":")[2]) for target, source in config.cluster.propose_for
              if source.startswith("draft:")]
    if not pairs:
        return  # the node process itself never imports torch (~1.4 s of every start)
    from shoal.engine.speculation.draft import check_draft_pair  # torch: only with draft pairs

    for name, draft_name in pairs:
        target = resolve_model(name, data_dir=config.data_dir)
        draft = resolve_model(draft_name, data_dir=config.data_dir)
        check_draft_pair(target, draft, config.data_dir / "cache")


def run_serve(args: argparse.Namespace) -> int:
    cluster = build_cluster_settings(
        standalone=args.standalone, listen=args.listen, peers=args.peers,
        secret=args.cluster_secret, force_master=args.force_master, discovery=args.discovery,
        name=args.name, tls_dir=args.cluster_tls, discovery_interface=args.discovery_interface,
        propose_for=args.propose_for, peer_fetch_rate=args.peer_fetch_rate)
    config = build_node_config(host=args.host, port=args.port, models=args.model,
                               data_dir=args.data_dir, dtype=args.dtype, threads=args.threads,
                               kv_cache_dtype=args.kv_cache_dtype,
                               kv_cache_memory=args.kv_cache_memory,
                               kv_disk=args.kv_disk, kv_disk_ttl=args.kv_disk_ttl,
                               keep_alive=args.keep_alive, preload=args.preload,
                               api_keys=args.api_key, api_keys_file=args.api_keys_file,
                               speculative=args.speculative,
                               cluster=cluster, pool=build_pool_settings(
                                   memory_budget=args.memory_budget,
                                   max_loaded_models=args.max_loaded_models, pin=args.pin,
                                   max_queue=args.max_queue, queue_timeout=args.queue_timeout,
                                   parallel=args.parallel, clients=args.clients,
                                   tasks=args.tasks),
                               pull=build_pull_settings(
                                   models_disk=args.models_disk,
                                   on_demand=args.pull_on_demand,
                                   ollama_registry=args.ollama_registry),
                               backends=build_backend_settings(
                                   llama_server=args.llama_server, assigned=args.backend))
    try:
        check_draft_models(config)
    except (ValueError, LookupError) as error:
        raise CommandFailed(f"--speculative: {error}") from error
    chosen = logs.configure("node", "%(asctime)s %(name)s %(levelname)s %(message)s",
                            args.log_format)

    def announce(url: str) -> None:
        line = f"shoal is serving on {url} (OpenAI API at {url}/v1)"
        if chosen == "json":  # every line of stderr stays one JSON object
            logging.getLogger("shoal.serve").info(line)
        else:
            print(line, file=sys.stderr, flush=True)

    asyncio.run(serve(config, on_listening=announce))  # main reports a NodeStartError
    return 0
