"""shoal cluster / shoal ps: what a running node knows of its cluster (GET /cluster), and
for ps what that node's runners hold in memory (GET /api/ps). `shoal cluster certs` makes a
cluster's TLS files (cli/certs.py)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import httpx

from shoal.cli import certs
from shoal.cli.errors import CommandFailed, node_failed
from shoal.cli.run import api_headers, server_url
from shoal.cli.table import print_table


def add_parsers(commands) -> None:
    cluster = commands.add_parser("cluster", help="the cluster's nodes, master and instances")
    ps = commands.add_parser("ps", help="the model instances running in the cluster, with "
                                        "what this node's runners hold in memory")
    for parser, handler in ((cluster, run_cluster), (ps, run_ps)):
        parser.add_argument("--url", default=None,
                            help="a running shoal node (SHOAL_HOST / SHOAL_PORT)")
        parser.add_argument("--json", action="store_true", help="print the answer as JSON")
        parser.set_defaults(handler=handler)
    certs.add_parser(cluster.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND"))


def fetch_cluster(url: str | None) -> dict[str, Any]:
    """GET /cluster of the node at url; CommandFailed when it does not answer or refuses."""
    base = server_url(url)
    try:
        response = httpx.get(base + "/cluster", headers=api_headers(), timeout=10.0)
    except httpx.HTTPError as error:
        raise node_failed(base, error) from error
    if response.status_code != 200:
        raise CommandFailed(f"{base}/cluster answered {response.status_code}: "
                            f"{response.text[:200]}")
    return response.json()


def fetch_memory(url: str | None) -> dict[str, dict[str, Any]]:
    """Model id -> the memory figures ("shoal" of GET /api/ps) of the node's runners; empty
    if the node does not say (the table then shows "-")."""
    try:
        response = httpx.get(server_url(url) + "/api/ps", headers=api_headers(), timeout=10.0)
        models = response.json()["models"] if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return {}
    return {m["model"]: m["shoal"] for m in models
            if isinstance(m, dict) and isinstance(m.get("shoal"), dict)}


def _gib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**30:.1f}"


def _ago(when: float | None) -> str:
    return "-" if when is None else f"{max(0.0, time.time() - when):.0f}s ago"


def _ranks(instance: dict[str, Any]) -> str:
    return ", ".join(f"{r['node_id']}[{_held(r)}]" for r in instance["ranks"])


def _held(rank: dict[str, Any]) -> str:
    """A rank's layers, or an expert rank's experts (it holds every layer)."""
    experts = rank.get("experts")
    if experts:
        return f"experts {experts[0]}:{experts[1]}"
    return f"{rank['layers'][0]}:{rank['layers'][1]}"


def _size(size: int | None) -> str:
    if size is None:
        return "-"
    if size == 0:
        return "0"
    if size < 2**20:
        return f"{size / 2**10:.0f} KiB"
    return f"{size / 2**20:.0f} MiB" if size < 2**30 else f"{size / 2**30:.1f} GiB"


def _kv(memory: dict[str, Any]) -> str:
    """KV held (requests' blocks plus those kept for the prefix cache) over all blocks."""
    in_use, capacity = memory.get("kv_bytes_in_use"), memory.get("kv_bytes_capacity")
    held = None if in_use is None else in_use + (memory.get("kv_bytes_cached") or 0)
    return _size(held) if capacity is None else f"{_size(held)} / {_size(capacity)}"


def local_memory(cluster: dict[str, Any], memory: dict[str, dict[str, Any]]
                 ) -> dict[str, dict[str, Any]]:
    """Instance id -> its runner's figures, for single-rank instances on this node (the
    serving runners, which /api/ps describes; ranks of split instances are not among them)."""
    here = cluster["node_id"]
    return {i["instance_id"]: memory[i["model"]] for i in cluster["instances"]
            if i["model"] in memory and len(i["ranks"]) == 1
            and i["ranks"][0]["node_id"] == here}


def _figures(known: dict[str, Any]) -> tuple[str, ...]:
    return (_size(known.get("weights_bytes")), _kv(known), _size(known.get("rss_bytes")))


def print_instances(cluster: dict[str, Any],
                    memory: dict[str, dict[str, Any]] | None = None) -> None:
    """The instances, each with its serving node, what it holds, pinned, keep-alive expiry
    and that node's queue for the model; with memory (instance id -> figures) also what this
    node's runners hold."""
    header = ("INSTANCE", "MODEL", "BACKEND", "SHARDING", "STATUS", "NODE", "HELD", "PINNED",
              "EXPIRES", "QUEUE")
    held = ("WEIGHTS", "KV HELD / ALL", "RSS") if memory is not None else ()
    rows = [(*header, *held, "RANKS (node[layers])")]
    for instance in cluster["instances"]:
        figures = _figures(memory.get(instance["instance_id"], {})) if memory is not None else ()
        rows.append((instance["instance_id"], instance["model"],
                     instance.get("backend", "engine"), instance["sharding"],
                     instance["status"], instance["ranks"][0]["node_id"],
                     _size(instance.get("memory_bytes")),
                     "yes" if instance.get("pinned") else "no",
                     _expiry(instance.get("expires_at")), str(instance.get("queue_depth", 0)),
                     *figures, _ranks(instance)))
    print_table(rows)


def _expiry(when: float | None) -> str:
    return "-" if when is None else f"in {max(0.0, when - time.time()):.0f}s"


def run_cluster(args: argparse.Namespace) -> int:
    cluster = fetch_cluster(args.url)
    if args.json:
        print(json.dumps(cluster, indent=2))
        return 0
    print(f"this node: {cluster['node_id']}    master: {cluster['master_id'] or '(electing)'}")
    rows = [("NODE", "NAME", "ROLE", "API", "MEM FREE/TOTAL GiB", "HELD/BUDGET GiB", "QUEUE",
             "BACKENDS", "SEEN")]
    for node in cluster["nodes"]:
        role = "master" if node["node_id"] == cluster["master_id"] else "follower"
        rows.append((node["node_id"], node["name"], role, ",".join(node["addresses"]) or "-",
                     f"{_gib(node['memory_available'])}/{_gib(node['memory_total'])}",
                     f"{_gib(node.get('memory_held'))}/{_gib(node.get('memory_budget'))}",
                     str(node.get("queue_depth", 0)),
                     ",".join(node["backends"]) or "-", _ago(node["last_seen"])))
    print_table(rows)
    print()
    print_instances(cluster)
    return 0


def run_ps(args: argparse.Namespace) -> int:
    cluster = fetch_cluster(args.url)
    runners = fetch_memory(args.url)
    memory = local_memory(cluster, runners)
    if args.json:
        print(json.dumps([{**i, "memory": memory.get(i["instance_id"])}
                          for i in cluster["instances"]], indent=2))
        return 0
    print_instances(cluster, memory)
    return 0
