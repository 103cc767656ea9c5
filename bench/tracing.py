"""What tracing costs an engine step: StepTracer.step (with the flight recorder listening,
as in a runner) for decode batches of 1, 16 and 64 traced requests, plus the two clock
reads around the step; and, with --engine, a real engine's decode step for context.

Prints JSON: per batch size, the median µs one step's tracing takes (over --steps steps,
--repeats times); with --engine, the median ms of a decode step of 16 requests on the
built-in model, so the share tracing takes can be read off.

    PYTHONPATH=src python bench/tracing.py [--steps 20000] [--repeats 5] [--engine]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

from shoal.diagnostics.flight import FlightRecorder
from shoal.tracing.steps import RequestTrace, StepTracer
from shoal.tracing.traceparent import new_span_id, new_trace_id


@dataclass(frozen=True)
class Chunk:  # the fields StepTracer reads of a ScheduledChunk
    request_id: str
    token_ids: tuple[int, ...]
    start_position: int = 0
    prompt: bool = False


def tracer_step_us(batch: int, steps: int) -> float:
    tracer = StepTracer()
    tracer.on_step = FlightRecorder().step
    chunks = [Chunk(f"r{i}", (7,), 100) for i in range(batch)]
    for chunk in chunks:
        tracer.begin(chunk.request_id, RequestTrace(new_trace_id(), new_span_id()))
    started = time.perf_counter()
    for _ in range(steps):
        start_ns = time.time_ns()
        tracer.step(chunks, start_ns, time.time_ns())
    return (time.perf_counter() - started) / steps * 1e6


def engine_step_ms(steps: int) -> float:
    from shoal.catalog.resolve import DEFAULT_MODEL_ID, resolve_model
    from shoal.engine.config import EngineConfig
    from shoal.engine.engine import Engine
    from shoal.engine.sampling import SamplingParams

    engine = Engine(EngineConfig(source=resolve_model(DEFAULT_MODEL_ID),
                                 kv_cache_bytes=128 * 2**20))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for index in range(16):
        engine.add_request(f"r{index}", engine.tokenizer.encode(f"Story {index}:"), params,
                           trace=RequestTrace(new_trace_id(), new_span_id()))
    engine.step()  # the prompts
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine", action="store_true")
    args = parser.parse_args()
    result: dict = {"tracer_step_us": {}}
    for batch in (1, 16, 64):
        runs = [tracer_step_us(batch, args.steps) for _ in range(args.repeats)]
        result["tracer_step_us"][str(batch)] = round(statistics.median(runs), 2)
    if args.engine:
        result["engine_decode_step_ms_batch16"] = round(engine_step_ms(64), 2)
        share = result["tracer_step_us"]["16"] / 1e3 / result["engine_decode_step_ms_batch16"]
        result["tracing_share_of_step_batch16"] = f"{share:.3%}"
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
