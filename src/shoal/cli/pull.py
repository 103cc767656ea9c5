"""shoal pull MODEL: fetch a model's weights, with a progress bar.

Through a running node when one answers (POST /api/pull, the verb and route Ollama's clients
use; --url names it), else straight into this machine's data dir (--data-dir). Names: a
catalogue id, org/repo, org/repo:QUANT, org/repo/file.gguf, hf.co/org/repo:QUANT, an Ollama
library name (llama3.2, qwen3:8b) or ns/name:tag.

Exits 0 once the pull reports success; 1 with the reason when it fails (a bad name, an
unknown model, no network, a full disk, a missing API key) or the node's stream ends early.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from typing import Any

import httpx

from shoal.cli.errors import CommandFailed, node_failed
from shoal.cli.local_pull import pull_here
from shoal.cli.progress_bar import ProgressBar, describe
from shoal.cli.run import api_headers, server_answers, server_url

# A node's pull has no overall bound (read timeouts bound a stalled source); a long quiet
# spell without a progress line (pip installing a catalogue model's packages) is allowed.
_TIMEOUT = httpx.Timeout(connect=5.0, read=1800.0, write=30.0, pool=5.0)

__all__ = ["describe", "progress_events", "pull", "run_pull"]


class PullError(RuntimeError):
    """The pull failed; the message says why, in the node's words where it gave any."""


def add_parser(commands) -> None:
    parser = commands.add_parser("pull", help="download a model (Hugging Face, Ollama's "
                                              "library, the catalogue)")
    parser.add_argument("model", help="org/repo[:QUANT], hf.co/org/repo:QUANT, llama3.2, "
                                      "ns/name:tag, or a catalogue id")
    parser.add_argument("--url", default=None,
                        help="pull through this running shoal node (default: the node at "
                             "SHOAL_HOST / SHOAL_PORT if one answers, else into --data-dir)")
    parser.add_argument("--data-dir", default=None,
                        help="where to store the model when no node answers "
                             "(SHOAL_DATA_DIR)")
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


def pull(url: str, model: str, headers: dict[str, str]) -> Iterator[dict[str, Any]]:
    """POST /api/pull, streamed; the progress events as they arrive."""
    with httpx.stream("POST", url + "/api/pull", json={"model": model, "stream": True},
                      headers=headers, timeout=_TIMEOUT) as response:
        if response.status_code != 200:
            response.read()
            raise PullError(error_message(response.text, response.status_code))
        yield from progress_events(response.iter_lines())


def run_pull(args: argparse.Namespace) -> int:
    if args.url is None and not server_answers(server_url(None)):
        return _pull_here(args)
    url = server_url(args.url)
    bar = ProgressBar()
    last: dict[str, Any] | None = None
    try:
        for event in pull(url, args.model, api_headers()):
            bar.show(event)
            last = event
    except PullError as error:
        raise CommandFailed(f"pull {args.model}: {error}") from error
    except httpx.HTTPError as error:
        raise node_failed(url, error) from error
    finally:
        bar.close()
    if last is None or last.get("status") != "success":
        raise CommandFailed(f"pull {args.model}: the node's answer ended before it reported "
                            "success")
    return 0


def _pull_here(args: argparse.Namespace) -> int:
    """No node answers: pull into this machine's data dir in this process."""
    pulled = pull_here(args.model, args.data_dir)
    print(f"{pulled.name}: {pulled.path}")
    return 0
