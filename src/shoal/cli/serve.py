"""shoal serve: run a node serving the named models (the catalogue default with none)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from shoal.config import DEFAULT_PORT, build_node_config
from shoal.node import NodeStartError, serve


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", default=None, help="state and caches (SHOAL_DATA_DIR)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default=None,
                        help="compute dtype (SHOAL_DTYPE; default auto)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per runner (SHOAL_THREADS)")
    parser.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                        help="KV cache size per model, e.g. 2GiB (SHOAL_KV_CACHE_MEMORY)")


def add_parser(commands) -> None:
    parser = commands.add_parser("serve", help="serve models over an OpenAI-compatible API")
    parser.add_argument("--host", default=None, help="bind address (SHOAL_HOST; 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None,
                        help=f"port (SHOAL_PORT; {DEFAULT_PORT})")
    parser.add_argument("--model", action="append", default=[], metavar="ID_OR_PATH",
                        help="model to load at start; repeat for several (SHOAL_MODELS)")
    parser.add_argument("--keep-alive", default=None, metavar="DURATION",
                        help="how long a model loaded on demand stays loaded after its last "
                             "request, e.g. 300, 5m, -1 for ever (SHOAL_KEEP_ALIVE; 5m)")
    add_engine_flags(parser)
    parser.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    config = build_node_config(host=args.host, port=args.port, models=args.model,
                               data_dir=args.data_dir, dtype=args.dtype, threads=args.threads,
                               kv_cache_memory=args.kv_cache_memory,
                               keep_alive=args.keep_alive)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def announce(url: str) -> None:
        print(f"shoal is serving on {url} (OpenAI API at {url}/v1)", file=sys.stderr,
              flush=True)

    try:
        asyncio.run(serve(config, on_listening=announce))
    except NodeStartError as error:
        print(f"shoal: {error}", file=sys.stderr)
        return 1
    return 0
