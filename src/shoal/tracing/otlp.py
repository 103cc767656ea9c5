"""OTLP export of spans (http/protobuf), on when OTEL_EXPORTER_OTLP_ENDPOINT (or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; nothing is imported or sent otherwise.

shoal records a span once it has ended, with its own W3C ids, so a span is handed to the
SDK's batch processor as a finished ReadableSpan carrying those ids: the request's server
span keeps the id its traceparent response header names, and every other span is its child.
The exporter's other settings come from the standard OTEL_* variables (headers, timeout,
OTEL_BSP_* for the batch processor); OTEL_SERVICE_NAME defaults to "shoal".
"""

from __future__ import annotations

import logging
import os
from typing import Any

from shoal.tracing.traceparent import new_span_id

log = logging.getLogger("shoal.tracing")

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_PRIMITIVES = (str, bool, int, float)


def export_wanted() -> bool:
    return any(os.environ.get(name) for name in ENDPOINT_VARIABLES)


class OtlpExporter:
    """Implements spans.Exporter over an opentelemetry-sdk BatchSpanProcessor."""

    def __init__(self, processor: Any, resource: Any) -> None:
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self._processor = processor
        self._resource = resource
        self._scope = InstrumentationScope("shoal")

    @classmethod
    def from_env(cls, attributes: dict[str, Any]) -> OtlpExporter | None:
        """An exporter when an OTLP endpoint is configured, else None. attributes describe
        this process (resource attributes: node id, role, model, rank)."""
        if not export_wanted():
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        service = os.environ.get("OTEL_SERVICE_NAME") or "shoal"
        resource = Resource.create({"service.name": service,
                                    **{k: v for k, v in attributes.items() if v is not None}})
        log.info("exporting spans over OTLP to %s", next(
            os.environ[name] for name in reversed(ENDPOINT_VARIABLES) if os.environ.get(name)))
        return cls(BatchSpanProcessor(OTLPSpanExporter()), resource)

    def export(self, trace_id: str, parent_span_id: str | None, name: str, start_ns: int,
               end_ns: int, attributes: dict[str, Any] | None = None,
               span_id: str | None = None) -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

        flags = TraceFlags(TraceFlags.SAMPLED)
        context = SpanContext(int(trace_id, 16), int(span_id or new_span_id(), 16),
                              is_remote=False, trace_flags=flags)
        parent = None
        if parent_span_id is not None:
            parent = SpanContext(int(trace_id, 16), int(parent_span_id, 16), is_remote=True,
                                 trace_flags=flags)
        self._processor.on_end(ReadableSpan(
            name, context=context, parent=parent, resource=self._resource,
            attributes=_attributes(attributes), start_time=start_ns, end_time=end_ns,
            kind=SpanKind.SERVER if span_id is not None else SpanKind.INTERNAL,
            instrumentation_scope=self._scope))

    def shutdown(self) -> None:
        """Send what is queued (bounded by the exporter's timeout) and stop."""
        try:
            self._processor.shutdown()
        except Exception as error:  # noqa: BLE001 - shutting down must not fail on export
            log.warning("OTLP exporter shutdown failed: %s", error)


def _attributes(args: dict[str, Any] | None) -> dict[str, Any]:
    """OTLP attribute values are primitives: None is left out, anything else becomes text."""
    return {key: value if isinstance(value, _PRIMITIVES) else str(value)
            for key, value in (args or {}).items() if value is not None}
