"""`shoal serve` as a subprocess, for tests that drive a real node over HTTP.

Its log goes to a file in its data dir (a pipe nobody reads would fill and stall the node);
a node that fails to become healthy fails the test with the log's tail.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

HEALTH_TIMEOUT_S = 180.0


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now and not handed out before in this test process (the OS may
    give a just-released port again, and a node started later would then find it taken)."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no fresh loopback port in 100 tries")


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    url: str
    data_dir: Path
    log_path: Path

    def log_tail(self, size: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-size:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the node vanishes as a crashed machine would (its runners notice)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit in time. The exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return None
        return self.proc.returncode


def start_serve(args: Sequence[str], data_dir: Path, port: int | None = None,
                wait_healthy: bool = True, env: dict[str, str] | None = None) -> ServeProcess:
    """`shoal serve --port PORT --data-dir DATA_DIR *args`, healthy (unless told not to wait)."""
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli.app", "serve", "--port", str(port),
             "--data-dir", str(data_dir), *args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    node = ServeProcess(proc, f"http://127.0.0.1:{port}", data_dir, log_path)
    if wait_healthy:
        wait_healthy_or_fail(node)
    return node


def wait_healthy_or_fail(node: ServeProcess, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.proc.poll() is not None:
            pytest.fail(f"shoal serve exited {node.proc.returncode}:\n{node.log_tail()}")
        try:
            if httpx.get(node.url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    node.kill()
    pytest.fail(f"shoal serve did not become healthy in {timeout_s:.0f} s:\n{node.log_tail()}")
