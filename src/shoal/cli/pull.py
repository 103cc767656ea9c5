"""shoal pull MODEL: have a running node make a model's weights ready (POST /api/pull, the
verb and route Ollama's clients use), printing its progress lines as they come.

Exits 0 once the node reports success; 1 with the node's message when it refuses (an
unknown model, a bad name, a missing API key) or the stream ends otherwise.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from typing import Any

import httpx

from shoal.cli.errors import CommandFailed, node_failed
from shoal.cli.run import api_headers, server_url

# The node bounds a pull at 600 s (api/ollama/pull.py); wait a little longer for its answer.
_TIMEOUT = httpx.Timeout(connect=5.0, read=630.0, write=30.0, pool=5.0)


class PullError(RuntimeError):
    """The pull failed; the message says why, in the node's words where it gave any."""


def add_parser(commands) -> None:
    parser = commands.add_parser("pull", help="make a model's weights ready on the node")
    parser.add_argument("model", help="model id, alias or path")
    parser.add_argument("--url", default=None,
                        help="a running shoal node (SHOAL_HOST / SHOAL_PORT)")
    parser.set_defaults(handler=run_pull)


def error_message(text: str, status: int) -> str:
    """The message of an error body: Ollama's {"error": "..."} or OpenAI's {"error": {...}}."""
    try:
        error = json.loads(text)["error"]
        return error if isinstance(error, str) else error["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {text[:200]}"


def progress_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The events of an NDJSON pull stream; PullError at an {"error"} line or a line that is
    not a JSON object."""
    for line in lines:
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            raise PullError(f"the node sent a line that is not JSON: {line[:200]!r}") from None
        if not isinstance(event, dict):
            raise PullError(f"the node sent an unexpected line: {line[:200]!r}")
        if "error" in event:
            raise PullError(str(event["error"]))
        yield event


def describe(event: dict[str, Any]) -> str:
    """One progress line: the status, with a percentage when the event counts bytes."""
    status = str(event.get("status", ""))
    total, completed = event.get("total"), event.get("completed")
    if isinstance(total, int) and isinstance(completed, int) and total > 0:
        return (f"{status} {100 * completed / total:.0f}% "
                f"({completed / 2**20:.1f} / {total / 2**20:.1f} MiB)")
    return status


def pull(url: str, model: str, headers: dict[str, str]) -> Iterator[dict[str, Any]]:
    """POST /api/pull, streamed; the progress events as they arrive."""
    with httpx.stream("POST", url + "/api/pull", json={"model": model, "stream": True},
                      headers=headers, timeout=_TIMEOUT) as response:
        if response.status_code != 200:
            response.read()
            raise PullError(error_message(response.text, response.status_code))
        yield from progress_events(response.iter_lines())


def run_pull(args: argparse.Namespace) -> int:
    url = server_url(args.url)
    last: dict[str, Any] | None = None
    try:
        for event in pull(url, args.model, api_headers()):
            print(describe(event), flush=True)
            last = event
    except PullError as error:
        raise CommandFailed(f"pull {args.model}: {error}") from error
    except httpx.HTTPError as error:
        raise node_failed(url, error) from error
    if last is None or last.get("status") != "success":
        raise CommandFailed(f"pull {args.model}: the node's answer ended before it reported "
                            "success")
    return 0
