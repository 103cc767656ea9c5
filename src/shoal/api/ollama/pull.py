"""POST /api/pull: make a model's weights ready on this machine, reporting in Ollama's format.

shoal never downloads: a model is pulled when shoal.catalog can resolve it locally (an
installed model package, which may assemble its weights on first use; a local path; the
local Hugging Face cache). Anything else is a 404 whose message says how to get the model.
The stream is Ollama's: status lines ending in {"status": "success"}.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from shoal.api.errors import APIError
from shoal.api.ollama.adapter import model_name
from shoal.api.ollama.schemas import ModelNameRequest
from shoal.api.sse import ndjson_line
from shoal.catalog.resolve import ModelNotFound, resolve_model

router = APIRouter()

# Joining the largest catalogue model writes ~1.1 GB; this bounds a stuck disk.
PULL_TIMEOUT_S = 600.0


def _resolve(name: str) -> Path:
    return Path(resolve_model(name).path)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@router.post("/api/pull")
async def pull(body: ModelNameRequest, request: Request) -> Response:
    name = model_name(body.model_name)
    if not name:
        raise APIError(400, "model is required", param="model", code="invalid_parameter")
    try:
        async with asyncio.timeout(PULL_TIMEOUT_S):
            path = await asyncio.to_thread(_resolve, name)
    except ModelNotFound as error:
        raise APIError(404, f"pull model {name!r}: {error}", param="model",
                       code="model_not_found") from None
    except ValueError as error:
        raise APIError(400, str(error), param="model", code="invalid_parameter") from None
    except TimeoutError:
        raise APIError(504, f"pulling {name!r} took longer than {PULL_TIMEOUT_S:.0f} s",
                       code="timeout", error_type="timeout") from None
    if not body.stream:
        return JSONResponse({"status": "success"})
    size = await asyncio.to_thread(_size, path)
    digest = "sha256:" + hashlib.sha256(f"{name}\0{path}\0{size}".encode()).hexdigest()
    lines = [{"status": "pulling manifest"},
             {"status": f"pulling {digest[7:19]}", "digest": digest, "total": size,
              "completed": size},
             {"status": "success"}]
    return Response("".join(ndjson_line(line) for line in lines),
                    media_type="application/x-ndjson")
