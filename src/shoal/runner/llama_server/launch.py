"""How a llama-server runner is started: its command line, a free local port, and the
bounded wait for its /health to say the model is loaded."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

# Tokens of context when the node sets none (--max-model-len): the model's own window can be
# 128k tokens, whose KV cache would not fit a small machine.
DEFAULT_CONTEXT = 8192
_HEALTH_POLL_S = 0.1


@dataclass(frozen=True)
class LaunchSettings:
    """What every llama-server runner of a node is started with."""

    binary: Path
    slots: int = 4  # --parallel: requests it decodes at once
    context: int | None = None  # tokens; None: DEFAULT_CONTEXT
    threads: int | None = None
    extra_args: tuple[str, ...] = ()  # given as they are, after shoal's own
    # The devices its build drives (--list-devices names: CUDA0, MTL0, ...); empty: CPU.
    devices: tuple[str, ...] = ()
    # Ask for the log level that names each buffer it allocates (--log-verbosity 4): how its
    # runner knows what it holds on each device. Only for builds that know the flag.
    buffer_log: bool = False

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"llama-server needs at least one slot, not {self.slots}")
        if self.context is not None and self.context < 16:
            raise ValueError(f"a context of {self.context} tokens is too small")


def free_port() -> int:
    """A port on 127.0.0.1 free now (llama-server binds it a moment later; a rare race
    is a failed start the supervisor retries)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_command(settings: LaunchSettings, model_id: str, model_path: Path,
                   port: int, projector: Path | None = None) -> list[str]:
    """llama-server serving one model on 127.0.0.1:port (with projector: taking images).
    One KV pool shared by the slots (--kv-unified), so any one request may use the whole
    context; --jinja renders the model's own chat template with tools."""
    command = [str(settings.binary), "--model", str(model_path), "--alias", model_id,
               "--host", "127.0.0.1", "--port", str(port),
               "--ctx-size", str(settings.context or DEFAULT_CONTEXT),
               "--parallel", str(settings.slots), "--kv-unified", "--jinja", "--no-webui"]
    if projector is not None:
        command += ["--mmproj", str(projector)]
    if settings.threads is not None:
        command += ["--threads", str(settings.threads)]
    if settings.buffer_log:
        command += ["--log-verbosity", "4"]
    return command + list(settings.extra_args)


async def wait_healthy(client: httpx.AsyncClient, base_url: str,
                       process: asyncio.subprocess.Process, timeout_s: float) -> str | None:
    """None once GET /health answers 200 (the model is loaded); else why not: the process
    exited, or timeout_s passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.returncode is not None:
            return f"llama-server exited with code {process.returncode} while loading"
        try:
            response = await client.get(f"{base_url}/health", timeout=2.0)
            if response.status_code == 200:
                return None
        except httpx.HTTPError:
            pass  # not listening yet
        await asyncio.sleep(_HEALTH_POLL_S)
    return f"llama-server did not load the model within {timeout_s:.0f} s"
