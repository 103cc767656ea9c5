"""shoal cluster / shoal ps: what a running node knows of its cluster (GET /cluster)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import httpx

from shoal.cli.table import print_table


def add_parsers(commands) -> None:
    cluster = commands.add_parser("cluster", help="the cluster's nodes, master and instances")
    ps = commands.add_parser("ps", help="the model instances running in the cluster")
    for parser, handler in ((cluster, run_cluster), (ps, run_ps)):
        parser.add_argument("--url", default=None,
                            help="a running shoal node (SHOAL_HOST / SHOAL_PORT)")
        parser.add_argument("--json", action="store_true", help="print GET /cluster as JSON")
        parser.set_defaults(handler=handler)


def fetch_cluster(url: str | None) -> dict[str, Any] | None:
    """GET /cluster of the node at url; None (after saying why on stderr) if it fails."""
    from shoal.cli.run import server_url

    base = server_url(url)
    try:
        response = httpx.get(base + "/cluster", timeout=10.0)
    except httpx.HTTPError as error:
        print(f"shoal: no shoal node answers at {base} ({error})", file=sys.stderr)
        return None
    if response.status_code != 200:
        print(f"shoal: {base}/cluster answered {response.status_code}: {response.text[:200]}",
              file=sys.stderr)
        return None
    return response.json()


def _gib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**30:.1f}"


def _ago(when: float | None) -> str:
    return "-" if when is None else f"{max(0.0, time.time() - when):.0f}s ago"


def _ranks(instance: dict[str, Any]) -> str:
    return ", ".join(f"{r['node_id']}[{r['layers'][0]}:{r['layers'][1]}]"
                     for r in instance["ranks"])


def print_instances(cluster: dict[str, Any]) -> None:
    rows = [("INSTANCE", "MODEL", "SHARDING", "ORIGIN", "STATUS", "RANKS (node[layers])")]
    for instance in cluster["instances"]:
        rows.append((instance["instance_id"], instance["model"], instance["sharding"],
                     instance["origin"], instance["status"], _ranks(instance)))
    print_table(rows)


def run_cluster(args: argparse.Namespace) -> int:
    cluster = fetch_cluster(args.url)
    if cluster is None:
        return 1
    if args.json:
        print(json.dumps(cluster, indent=2))
        return 0
    print(f"this node: {cluster['node_id']}    master: {cluster['master_id'] or '(electing)'}")
    rows = [("NODE", "NAME", "ROLE", "API", "MEM FREE/TOTAL GiB", "BACKENDS", "SEEN")]
    for node in cluster["nodes"]:
        role = "master" if node["node_id"] == cluster["master_id"] else "follower"
        rows.append((node["node_id"], node["name"], role, ",".join(node["addresses"]) or "-",
                     f"{_gib(node['memory_available'])}/{_gib(node['memory_total'])}",
                     ",".join(node["backends"]) or "-", _ago(node["last_seen"])))
    print_table(rows)
    print()
    print_instances(cluster)
    return 0


def run_ps(args: argparse.Namespace) -> int:
    cluster = fetch_cluster(args.url)
    if cluster is None:
        return 1
    if args.json:
        print(json.dumps(cluster["instances"], indent=2))
        return 0
    print_instances(cluster)
    return 0
