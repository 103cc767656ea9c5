"""The node's FastAPI application: OpenAI routes, /health, errors in OpenAI's shape."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from shoal.api.errors import install_error_handlers
from shoal.api.openai import chat, completions, models


def _catalog_entries() -> Sequence[Any]:
    from shoal.catalog.resolve import list_models

    return list_models()


def create_app(router: Any, keepalive_s: float = 15.0,
               list_available: Callable[[], Sequence[Any]] | None = None,
               lifespan: Any = None) -> FastAPI:
    """The HTTP app over router (shoal.router.Router or anything with its interface)."""
    app = FastAPI(title="shoal", lifespan=lifespan)
    app.state.router = router
    app.state.keepalive_s = keepalive_s
    app.state.list_available = list_available or _catalog_entries
    app.state.started_at = int(time.time())
    install_error_handlers(app)
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(models.router)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        supervisors = request.app.state.router.supervisors
        states = [s.describe() for s in supervisors]
        ready = all(s.state == "ready" for s in supervisors)
        failed = any(s.state in ("failed", "stopped") for s in supervisors)
        status = "ok" if ready else ("degraded" if failed else "loading")
        return JSONResponse({"status": status, "models": states},
                            status_code=200 if ready else 503)

    return app
