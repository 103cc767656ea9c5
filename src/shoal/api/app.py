"""The node's FastAPI application: OpenAI, Ollama and Anthropic routes, /health, and errors
in the dialect of the route that failed."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shoal.api import admin, diagnostics, traces
from shoal.api import requests as request_routes
from shoal.api.anthropic import errors as anthropic_errors
from shoal.api.anthropic import messages as anthropic_messages
from shoal.api.auth import ApiKeys, RequireApiKey
from shoal.api.dashboard import routes as dashboard
from shoal.api.errors import install_error_handlers, register_error_dialect
from shoal.api.ollama import embed as ollama_embed
from shoal.api.ollama import errors as ollama_errors
from shoal.api.ollama import generate as ollama_generate
from shoal.api.ollama import models as ollama_models
from shoal.api.ollama import pull as ollama_pull
from shoal.api.openai import chat, completions, embeddings, images, models, responses
from shoal.api.requests import RequestIds
from shoal.api.router_view import RouterView
from shoal.api.trace_context import TraceContext
from shoal.catalog.resolve import list_models


def create_app(router: RouterView, keepalive_s: float = 15.0,
               list_available: Callable[[], Sequence[Any]] | None = None,
               lifespan: Any = None, cluster: Any = None,
               api_keys: ApiKeys | None = None, diagnose: Any = None,
               puller: Any = None, data_dir_watch: Any = None) -> FastAPI:
    """The HTTP app over router (shoal.router.Router, or a fake with the same view), with
    the cluster routes when cluster (shoal.cluster.service.ClusterService) is given and the
    diagnostics routes' answers from diagnose (node_diagnostics.NodeDiagnostics); pulls
    (POST /api/pull, DELETE /api/delete) go through puller (shoal.catalog.pull.puller.Puller;
    None: one into the default data dir); /health warns of what data_dir_watch
    (diagnostics/data_dir.py's DataDirWatch) finds; every route but /health and / wants one
    of api_keys when there are any."""
    app = FastAPI(title="shoal", lifespan=lifespan)
    if api_keys:
        app.add_middleware(RequireApiKey, keys=api_keys)
    app.state.metrics = router.metrics
    app.add_middleware(RequestIds, metrics=app.state.metrics)  # a 401 too
    # The node's own spans (the router records queue and load waits there too).
    app.state.spans = router.spans
    app.add_middleware(TraceContext, spans=app.state.spans)  # outermost: traceparent on all
    app.include_router(request_routes.router)
    app.include_router(traces.router)
    app.state.diagnostics = diagnose
    app.include_router(diagnostics.router)
    app.state.router = router
    app.state.cluster = cluster
    app.state.keepalive_s = keepalive_s
    app.state.list_available = list_available or list_models
    app.state.puller = puller
    app.state.data_dir_watch = data_dir_watch
    app.state.started_at = int(time.time())
    install_error_handlers(app)
    app.include_router(dashboard.router)
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(embeddings.router)
    app.include_router(images.router)
    app.include_router(models.router)
    register_error_dialect(app, "/api/", ollama_errors.render)
    app.include_router(ollama_generate.router)
    app.include_router(ollama_embed.router)
    app.include_router(ollama_models.router)
    app.include_router(ollama_pull.router)
    app.include_router(responses.router)
    register_error_dialect(app, "/v1/messages", anthropic_errors.render)
    app.include_router(anthropic_messages.router)
    if cluster is not None:
        app.include_router(admin.router)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        registry = request.app.state.metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        supervisors = request.app.state.router.supervisors
        states = [s.describe() for s in supervisors]
        ready = all(s.state == "ready" for s in supervisors)
        failed = any(s.state in ("failed", "stopped") for s in supervisors)
        status = "ok" if ready else ("degraded" if failed else "loading")
        body: dict[str, Any] = {"status": status, "models": states}
        queue = request.app.state.router.queue  # this node's admission queue
        body["queue"] = {"waiting": queue.depth(), "running": queue.running()}
        puller = request.app.state.puller
        body["pulls"] = puller.in_progress() if puller is not None else []
        # Warnings leave the status alone: the node still serves (a full data dir, say).
        watch = request.app.state.data_dir_watch
        body["warnings"] = [watch.warning] if watch is not None and watch.warning else []
        return JSONResponse(body, status_code=200 if ready else 503)

    return app
