"""What the HTTP app needs of the node's router: shoal.router.Router has all of it, and so
do the scripted routers of the API tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from shoal.metrics import NodeMetrics
from shoal.pool.queue import AdmissionQueue
from shoal.protocol import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorChunk,
    GenerationRequest,
    ImageRequest,
)
from shoal.runner.supervisor import RunnerSupervisor
from shoal.tracing.spans import SpanBuffer


class RouterView(Protocol):
    metrics: NodeMetrics  # GET /metrics; the middleware counts every HTTP answer there
    spans: SpanBuffer  # the node process's spans: the app's server spans go there too
    queue: AdmissionQueue  # this node's admission queue (GET /health)

    @property
    def supervisors(self) -> Sequence[RunnerSupervisor]:
        """The serving runners this node runs now (GET /health, /api/ps)."""
        ...

    def submit(self, request: GenerationRequest) -> AsyncIterator[Any]:
        """The request's chunks: AcceptedChunk first, or one ErrorChunk."""
        ...

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult | ErrorChunk: ...

    def generate_images(self, request: ImageRequest) -> AsyncIterator[Any]:
        """The request's image chunks, ImagesDone last, or one ErrorChunk."""
        ...

    async def load(self, name: str, keep_alive_s: float | None = None) -> bool: ...

    def cancel(self, request_id: str) -> bool:
        """End a generation accepted by this node; False if there is none such."""
        ...

    def canonical_id(self, name: str) -> str: ...
