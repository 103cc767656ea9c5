"""GET /: the dashboard for browsers (an Accept header that takes text/html), Ollama's
liveness answer for every other client; GET /dashboard/{name}: the page's files.

The page and its files carry no data, so they stay open when the node has API keys
(api/auth.py); the page's own requests (GET /cluster, /health, /api/ps, /metrics,
/v1/models, POST /v1/chat/completions) carry the key the user enters.
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response

from shoal.api.errors import APIError
from shoal.api.ollama.models import liveness

router = APIRouter()

PREFIX = "/dashboard/"
# The only files served, with their content types: a fixed list, so no path can reach
# anything else in the package.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "api.js": "text/javascript; charset=utf-8",
    "cluster.js": "text/javascript; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
}
# A node upgraded in place serves new files: browsers revalidate instead of caching.
NO_CACHE = {"Cache-Control": "no-cache"}


@functools.cache
def asset_bytes(name: str) -> bytes:
    """A file of the page, read once (package data cannot change while shoal runs)."""
    return resources.files(__package__).joinpath(name).read_bytes()


def wants_html(accept: str) -> bool:
    """Whether an Accept header takes text/html (browsers send it first; curl, Ollama's and
    other API clients send */* or JSON), not counting a range it refuses with q=0."""
    for media_range in accept.lower().split(","):
        media_type, *params = (part.strip() for part in media_range.split(";"))
        if media_type != "text/html":
            continue
        quality = next((p[2:] for p in params if p.startswith("q=")), "1")
        try:
            return float(quality) > 0
        except ValueError:
            return True  # a malformed weight: the range itself still names HTML
    return False


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def root(request: Request) -> Response:
    if not wants_html(request.headers.get("accept", "")):
        response = liveness()
    else:
        response = Response(asset_bytes("index.html"), media_type=ASSETS["index.html"],
                            headers=NO_CACHE)
    response.headers["Vary"] = "Accept"  # one URL, two answers: caches must tell them apart
    return response


@router.get(PREFIX + "{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise APIError(404, f"the dashboard has no file {name!r}", code="not_found")
    return Response(asset_bytes(name), media_type=media_type, headers=NO_CACHE)
