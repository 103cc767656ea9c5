"""Nodes in network namespaces, for fault tests run inside the namespaces tests/namespaces.py
makes (this process is root in a user namespace, in a network namespace of its own: the
"switch"). Nothing here reaches an address beyond these namespaces.

Each node lives in its own network namespace, held open by a `sleep` process, with two
links to the switch: a cluster link (veth c<i> ⇄ eth0, 10.47.0.<i>/24) bridged with the other
nodes' on br0, which faults cut (`ip link set down`) or shape (`tc ... tbf`), and a client
link (veth h<i> ⇄ eth1, 10.48.<i>.1/30) the test's HTTP requests take, so a node cut off
from the cluster still answers the test. Nodes may also dial each other through relays in the
switch (relay.py) that add latency and the cost of lost packets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from relay import Impairment, Relay
from serve_process import ServeProcess, wait_healthy_or_fail

API_PORT = 8000
CLUSTER_PORT = 7447
# The switch's address on br0 when nodes dial each other through relays, and their ports.
RELAY_ADDRESS = "10.47.0.254"
RELAY_PORTS = 7000


def ip(*args: str, pid: int | None = None) -> None:
    """`ip ARGS` in the switch, or in the network namespace of process pid."""
    enter = ["nsenter", "--target", str(pid), "--net"] if pid is not None else []
    subprocess.run([*enter, "ip", *args], check=True, capture_output=True, text=True)


def _wait_for_own_namespace(pid: int, timeout_s: float = 10.0) -> None:
    """Until process pid has left this network namespace (`unshare` has run, so what is
    wired into pid's namespace does not land in the switch's)."""
    ours = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + timeout_s
    while os.readlink(f"/proc/{pid}/ns/net") == ours:
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} did not enter a network namespace of its own")
        time.sleep(0.01)


@dataclass
class NetNode:
    index: int
    holder: subprocess.Popen  # keeps the namespace open
    serve: ServeProcess | None = None

    @property
    def cluster_address(self) -> str:
        return f"10.47.0.{self.index}"

    @property
    def api_address(self) -> str:
        return f"10.48.{self.index}.1"

    @property
    def url(self) -> str:
        return f"http://{self.api_address}:{API_PORT}"

    @property
    def cluster_link(self) -> str:
        """The switch's end of this node's cluster link."""
        return f"c{self.index}"


@dataclass
class NetCluster:
    """count node namespaces on one bridge; start() runs `shoal serve` in each."""

    tmp: Path
    count: int
    nodes: list[NetNode] = field(default_factory=list)
    relays: list[Relay] = field(default_factory=list)

    def build(self) -> NetCluster:
        ip("link", "set", "lo", "up")
        ip("link", "add", "br0", "type", "bridge")
        ip("link", "set", "br0", "up")
        for index in range(1, self.count + 1):
            holder = subprocess.Popen(["unshare", "--net", "sleep", "900"])
            _wait_for_own_namespace(holder.pid)
            node = NetNode(index, holder)
            self.nodes.append(node)
            self._wire(node)
        return self

    def _wire(self, node: NetNode) -> None:
        pid, i = node.holder.pid, node.index
        ip("link", "set", "lo", "up", pid=pid)
        ip("link", "add", f"c{i}", "type", "veth", "peer", "name", "eth0", "netns", str(pid))
        ip("link", "set", f"c{i}", "master", "br0")
        ip("link", "set", f"c{i}", "up")
        ip("addr", "add", f"{node.cluster_address}/24", "dev", "eth0", pid=pid)
        ip("link", "set", "eth0", "up", pid=pid)
        ip("link", "add", f"h{i}", "type", "veth", "peer", "name", "eth1", "netns", str(pid))
        ip("addr", "add", f"10.48.{i}.2/30", "dev", f"h{i}")
        ip("link", "set", f"h{i}", "up")
        ip("addr", "add", f"{node.api_address}/30", "dev", "eth1", pid=pid)
        ip("link", "set", "eth1", "up", pid=pid)

    def start(self, secret: str, extra: dict[int, list[str]] | None = None,
              impairment: Impairment | None = None) -> None:
        """`shoal serve` in every node's namespace, each dialling the others: directly, or
        with an impairment through relays in the switch (relay.py), one per ordered pair."""
        if impairment is not None:
            ip("addr", "add", f"{RELAY_ADDRESS}/24", "dev", "br0")
            for node in self.nodes:
                for other in self.nodes:
                    if other is not node:
                        self.relays.append(Relay(
                            (RELAY_ADDRESS, self._relay_port(node, other)),
                            (other.cluster_address, CLUSTER_PORT), impairment))
        for node in self.nodes:
            peers = ",".join(
                f"tcp/{other.cluster_address}:{CLUSTER_PORT}" if impairment is None
                else f"tcp/{RELAY_ADDRESS}:{self._relay_port(node, other)}"
                for other in self.nodes if other is not node)
            data_dir = self.tmp / f"node{node.index}"
            data_dir.mkdir(parents=True, exist_ok=True)
            log_path = data_dir / "serve.log"
            with open(log_path, "w") as log:
                proc = subprocess.Popen(
                    ["nsenter", "--target", str(node.holder.pid), "--net",
                     sys.executable, "-m", "shoal.cli.app", "serve",
                     "--host", node.api_address, "--port", str(API_PORT),
                     "--data-dir", str(data_dir),
                     "--listen", f"tcp/{node.cluster_address}:{CLUSTER_PORT}",
                     "--peers", peers, "--no-discovery", "--no-preload",
                     "--cluster-secret", secret, "--name", f"node{node.index}",
                     "--threads", "1", "--kv-cache-memory", "128MiB",
                     *(extra or {}).get(node.index, [])],
                    stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
            node.serve = ServeProcess(proc, node.url, data_dir, log_path)
        for node in self.nodes:
            wait_healthy_or_fail(node.serve)

    @staticmethod
    def _relay_port(node: NetNode, other: NetNode) -> int:
        return RELAY_PORTS + 10 * node.index + other.index

    def cut(self, node: NetNode) -> None:
        ip("link", "set", node.cluster_link, "down")

    def heal(self, node: NetNode) -> None:
        ip("link", "set", node.cluster_link, "up")

    def shape(self, node: NetNode, rate: str) -> None:
        """Hold what the switch sends node on its cluster link to rate (tc tbf)."""
        subprocess.run(["tc", "qdisc", "add", "dev", node.cluster_link, "root", "tbf",
                        "rate", rate, "burst", "16kb", "latency", "400ms"],
                       check=True, capture_output=True, text=True)

    def unshape(self, node: NetNode) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", node.cluster_link, "root"],
                       check=True, capture_output=True, text=True)

    def describe(self) -> str:
        """Each node's view of the cluster and the cluster lines of its log (on failure)."""
        lines = []
        for node in self.nodes:
            try:
                view = httpx.get(node.url + "/cluster", timeout=2).json()
                lines.append(f"node{node.index}: {view['node_id']} master {view['master_id']} "
                             f"nodes {[n['node_id'] for n in view['nodes']]}")
            except (httpx.HTTPError, ValueError, KeyError) as error:
                lines.append(f"node{node.index}: /cluster failed: {error}")
            if node.serve is not None:
                lines += [f"  {line}" for line in node.serve.log_tail(200_000).splitlines()
                          if "shoal.cluster" in line][-40:]
        return "\n".join(lines)

    def stop(self) -> None:
        for relay in self.relays:
            relay.close()
        # All asked to stop at once, then waited for: their shutdowns overlap.
        for node in self.nodes:
            if node.serve is not None and node.serve.proc.poll() is None:
                node.serve.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            if node.serve is not None:
                node.serve.stop(timeout_s=20)
        for node in self.nodes:
            if node.holder.poll() is None:
                node.holder.send_signal(signal.SIGKILL)
                node.holder.wait(5)
