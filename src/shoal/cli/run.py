"""shoal run [MODEL] [PROMPT]: a one-shot answer, or an interactive chat without a prompt.

Talks to a running node (--url, or SHOAL_HOST / SHOAL_PORT); if none answers, starts one
in-process for the duration of the command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

import httpx

from shoal.catalog.resolve import DEFAULT_MODEL_ID
from shoal.cli.errors import CommandFailed, node_failed
from shoal.cli.local_pull import pull_if_missing
from shoal.cli.serve import add_engine_flags
from shoal.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ClusterSettings,
    NodeConfig,
    ServerConfig,
    build_node_config,
)
from shoal.node import BackgroundNode

_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=5.0)


class RunError(CommandFailed):
    """A request failed; the message is the server's error message."""


def add_parser(commands) -> None:
    parser = commands.add_parser("run", help="ask a model once, or chat interactively")
    parser.add_argument("model", nargs="?", default=None, help="model id, alias or path")
    parser.add_argument("prompt", nargs="?", default=None,
                        help="the prompt; omit it for an interactive chat")
    parser.add_argument("--url", default=None, help="a running shoal node")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    add_engine_flags(parser)
    parser.set_defaults(handler=run_run)


def server_url(explicit: str | None) -> str:
    if explicit:
        return explicit.rstrip("/")
    host = os.environ.get("SHOAL_HOST") or DEFAULT_HOST
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{host}:{os.environ.get('SHOAL_PORT') or DEFAULT_PORT}"


def api_headers() -> dict[str, str]:
    """The node's API key from SHOAL_API_KEY, for nodes started with --api-key."""
    key = os.environ.get("SHOAL_API_KEY", "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}


def server_answers(url: str) -> bool:
    """Whether a shoal node listens at url (one that wants a key answers too: 401)."""
    try:
        status = httpx.get(url + "/v1/models", headers=api_headers(), timeout=2.0).status_code
        return status in (200, 401)
    except httpx.HTTPError:
        return False


def stream_chat(url: str, body: dict) -> Iterator[str]:
    """Text deltas of one streamed chat completion; RunError on an error body or event."""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                      headers=api_headers(), timeout=_TIMEOUT) as response:
        if response.status_code != 200:
            response.read()
            raise RunError(_error_message(response.text, response.status_code))
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RunError(event["error"].get("message", "unknown error"))
            for choice in event.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    yield text


def _error_message(text: str, status: int) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {text[:200]}"


def answer(url: str, body: dict, out=None) -> str:
    """Stream one reply to out (stdout by default); returns its whole text."""
    out = out or sys.stdout
    parts = []
    for delta in stream_chat(url, body):
        parts.append(delta)
        out.write(delta)
        out.flush()
    out.write("\n")
    return "".join(parts)


def interactive(url: str, body: dict) -> None:
    history: list[dict] = []
    print("Chatting with " + body["model"] + ". /bye or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if line.strip() in ("/bye", "/exit", "/quit"):
            return
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = answer(url, {**body, "messages": history})
        except RunError as error:
            history.pop()
            print(f"error: {error}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": reply})


def run_run(args: argparse.Namespace) -> int:
    model = args.model or DEFAULT_MODEL_ID
    url = server_url(args.url)
    node = None
    if args.url is None and not server_answers(url):
        pull_if_missing(model, args.data_dir, out=sys.stderr)
        node = _start_local_node(args, model)
        url = node.start()
    body: dict = {"model": model}
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        body["temperature"] = args.temperature
    try:
        if args.prompt is not None:
            answer(url, {**body, "messages": [{"role": "user", "content": args.prompt}]})
        else:
            interactive(url, body)
    except httpx.HTTPError as error:
        raise node_failed(url, error) from error
    finally:
        if node is not None:
            node.stop()
    return 0


def _start_local_node(args: argparse.Namespace, model: str):
    base = build_node_config(models=[model], data_dir=args.data_dir, dtype=args.dtype,
                             threads=args.threads, kv_cache_memory=args.kv_cache_memory)
    # A node for this command alone: no network, no cluster to join.
    config = NodeConfig(server=ServerConfig(host="127.0.0.1", port=0), models=base.models,
                        data_dir=base.data_dir, engine=base.engine, runner=base.runner,
                        cluster=ClusterSettings(standalone=True))
    print(f"no shoal server answers; starting one for {model}", file=sys.stderr)
    return BackgroundNode(config)
