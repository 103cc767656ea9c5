"""shoal diagnose: save a running node's diagnosis (GET /v1/diagnostics/node, or with
--cluster every node's) as JSON for a bug report, and print where it went."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from shoal.cli.errors import CommandFailed, node_failed
from shoal.cli.run import api_headers, server_url

# The node waits up to 5 s for each other node; leave room for that and the transfer.
_TIMEOUT_S = 30.0


def add_parser(commands) -> None:
    parser = commands.add_parser("diagnose", help="save a running node's diagnosis (versions, "
                                                  "configuration without secrets, memory, "
                                                  "runners' recent phases, errors) as JSON")
    parser.add_argument("--output", "-o", default=None,
                        help="file to write (default: shoal-diagnostics-DATE-TIME.json here)")
    parser.add_argument("--cluster", action="store_true",
                        help="every node of the cluster, not only this one")
    parser.add_argument("--url", default=None,
                        help="a running shoal node (SHOAL_HOST / SHOAL_PORT)")
    parser.set_defaults(handler=run_diagnose)


def default_output(now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path(f"shoal-diagnostics-{stamp}.json")


def run_diagnose(args: argparse.Namespace) -> int:
    base = server_url(args.url)
    url = f"{base}/v1/diagnostics/{'cluster' if args.cluster else 'node'}"
    try:
        response = httpx.get(url, headers=api_headers(), timeout=_TIMEOUT_S)
    except httpx.HTTPError as error:
        raise node_failed(base, error) from error
    if response.status_code != 200:
        raise CommandFailed(f"{url} answered {response.status_code}: {response.text[:300]}")
    path = Path(args.output) if args.output else default_output()
    try:
        path.write_text(json.dumps(response.json(), indent=2) + "\n", encoding="utf-8")
    except (OSError, ValueError) as error:
        raise CommandFailed(f"cannot write {path}: {error}") from error
    print(path)
    return 0
