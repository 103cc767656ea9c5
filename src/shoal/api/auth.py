"""API keys: when a node has any (--api-key, --api-keys-file), every API and admin route
wants one.

A client presents its key as `Authorization: Bearer KEY` (OpenAI and Ollama clients) or
`x-api-key: KEY` (Anthropic clients). The node keeps only SHA-256 digests of its keys and
compares digests in constant time, so neither a log line, a repr nor a timing difference
gives a key away. /health and `GET /` stay open: liveness probes carry no secret, and the
dashboard's page (`/` and `/dashboard/...`) holds no data, only asks for a key.
A missing or wrong key is a 401 in the route's dialect (errors.render_error).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from shoal.api.errors import APIError, render_error

OPEN_PATHS = frozenset({"/health", "/"})
# The dashboard's files: api/dashboard/routes.py serves nothing else under this prefix.
OPEN_PREFIXES = ("/dashboard/",)


def is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The keys a node accepts, as digests; empty: the API is open."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        keys = [k.strip() for k in keys]
        if any(not k for k in keys):
            raise ValueError("an API key must not be empty")
        self._digests = tuple(sorted({_digest(k) for k in keys}))

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} key(s))"

    def allows(self, presented: str | None) -> bool:
        if presented is None:
            return False
        digest = _digest(presented)
        # Compare with every key, not up to the first match: the time taken says nothing.
        matches = [hmac.compare_digest(digest, known) for known in self._digests]
        return any(matches)


def read_keys_file(path: Path) -> tuple[str, ...]:
    """The keys in path, one per line (blank lines and # comments skipped). ValueError,
    naming the file but never a key, when it cannot be read or holds none."""
    try:
        text = path.expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or type(error).__name__
        raise ValueError(f"cannot read the API keys file {path}: {reason}") from None
    keys = tuple(line.strip() for line in text.splitlines()
                 if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"the API keys file {path} holds no keys (one per line)")
    return keys


def presented_key(headers: Any) -> str | None:
    """The key a request carries: a Bearer token, else x-api-key."""
    authorization = headers.get("authorization")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    key = headers.get("x-api-key")
    return key.strip() if key else None


class RequireApiKey:
    """ASGI middleware: a request without an accepted key gets 401, unless its path is open."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        presented = presented_key(request.headers)
        if self.keys.allows(presented):
            await self.app(scope, receive, send)
            return
        message = ("this node requires an API key: send it as 'Authorization: Bearer KEY' "
                   "or 'x-api-key: KEY'" if presented is None else
                   "the API key is not valid for this node")
        response = render_error(request, APIError(401, message, code="invalid_api_key"))
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
