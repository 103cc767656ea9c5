"""Request traces: W3C trace context, bounded span buffers per process, the engine's step
spans, Chrome trace JSON, and OTLP export. Pure Python (no asyncio, torch or HTTP), so the
engine, the runner and the node all record through it."""
