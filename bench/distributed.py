"""One node versus a 2-rank pipeline and a 2-rank tensor instance, on loopback; prints JSON.

    python bench/distributed.py [--model ID] [--dtype auto] [--tokens 128] [--prompt 200]
                                [--rounds 3] [--layout both|separate|shared]

Each configuration runs as separate processes (one per rank) joined by torch.distributed
(gloo) on 127.0.0.1, the way a multi-node instance runs. For each: time to first token of a
--prompt token prompt, batch-1 decode tokens/s, and rank 0's time blocked on the other ranks
per decoded token (for the pipeline that wait includes rank 1's layers; for tensor shards it
is the all-reduces). Also: the round trip of a hidden-state sized message between two ranks
over their link (how the ranks send them) and over gloo, and a two-rank all-reduce.
The pipeline's overhead is its decode time per token over one node's, minus 1.

Two layouts of the ranks on this machine's cores:
- separate: each rank is pinned to its own half of the cores and uses that many threads, as
  two machines would be; "one node" is one such half. This is how a multi-node instance runs.
- shared: every rank may use every core. A pipeline's ranks take turns, so each runs with all
  the cores' threads; tensor ranks compute at once and split them. "One node" uses every
  core. On a small machine this is the worst case: the ranks' thread teams contend for the
  same cores at every hand-over.
Configurations run in turn, --rounds times, and the medians are reported: this kind of
machine's speed drifts within a minute, and turn-about keeps every configuration under the
same drift. Every process gets the OpenMP settings of shoal's runner processes
(runner/process_env.py), without which a pipeline's idle rank spins on the cores the busy
one needs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import time

WORDS = ("river stone market lantern orchard signal harbor meadow copper violin thunder "
         "garden compass mirror velvet canyon ember glacier quartz").split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_config(model: str, dtype: str, threads: int, parallel=None):
    from shoal.catalog.resolve import resolve_model
    from shoal.engine.config import EngineConfig

    return EngineConfig(source=resolve_model(model), dtype=dtype, threads=threads,
                        kv_cache_bytes=256 * 2**20, parallel=parallel)


def measure(engine, prompt_tokens: int, new_tokens: int) -> dict:
    from shoal.engine.sampling import SamplingParams

    text = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(prompt_tokens * 2))
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)[:prompt_tokens]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request("warm", prompt[:32], SamplingParams(temperature=0.0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    waited = getattr(engine.executor, "wait_s", 0.0)
    engine.add_request("bench", prompt, params)
    start = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    waited = getattr(engine.executor, "wait_s", 0.0) - waited
    decode_s = end - first
    return {"ttft_s": first - start, "decode_tokens_per_s": (new_tokens - 1) / decode_s,
            "decode_ms_per_token": 1e3 * decode_s / (new_tokens - 1),
            "rank0_wait_ms_per_token": 1e3 * waited / new_tokens}


def pin(cores: list[int] | None) -> None:
    """Keep this process (and the threads it starts) on the given cores, as a node would be."""
    if cores is not None:
        os.sched_setaffinity(0, cores)


def run_rank(rank: int, args: dict, port: int, results) -> None:
    pin(args["cores"][rank] if args.get("cores") else None)
    from shoal.engine.config import EngineConfig  # noqa: F401 - torch loaded per process
    from shoal.engine.parallel.config import ParallelConfig

    layers = args["layers"][rank]
    parallel = ParallelConfig(rank=rank, world_size=2, sharding=args["sharding"],
                              layer_start=layers[0], layer_end=layers[1],
                              master_addr="127.0.0.1", master_port=port)
    config = engine_config(args["model"], args["dtype"], args["threads"], parallel)
    if rank == 0:
        from shoal.engine.engine import Engine

        engine = Engine(config)
        try:
            results.put(measure(engine, args["prompt"], args["tokens"]))
        finally:
            engine.close()
    else:
        from shoal.engine.parallel.follower import FollowerEngine

        FollowerEngine(config).run()


def first_result(target, argument_sets: list[tuple], timeout_s: float = 600) -> dict:
    """One spawned process per argument set, each running target(*arguments, results); the
    first result any of them puts. Then every process is joined (stragglers killed)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=target, args=(*arguments, results))
             for arguments in argument_sets]
    for proc in procs:
        proc.start()
    try:
        return results.get(timeout=timeout_s)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def run_parallel(args: dict) -> dict:
    port = free_port()
    return first_result(run_rank, [(rank, args, port) for rank in (0, 1)])


def run_single(args: dict, results) -> None:
    pin(args["cores"][0] if args.get("cores") else None)
    from shoal.engine.engine import Engine

    engine = Engine(engine_config(args["model"], args["dtype"], args["threads"]))
    results.put(measure(engine, args["prompt"], args["tokens"]))


def single(args: dict) -> dict:
    return first_result(run_single, [(args,)])


def ping(rank: int, port: int, hidden: int, cores, results) -> None:
    pin(cores[rank] if cores else None)
    import torch

    from shoal.engine.parallel.config import ParallelConfig
    from shoal.engine.parallel.group import RankGroup

    group = RankGroup.join(ParallelConfig(rank=rank, world_size=2, sharding="pipeline",
                                          layer_start=0, layer_end=1, master_addr="127.0.0.1",
                                          master_port=port), torch.device("cpu"))
    tensor = torch.zeros(1, hidden)
    peer = 1 - rank

    def link_round() -> None:  # how hidden states travel between pipeline ranks
        nonlocal tensor
        if rank == 0:
            group.send_tensor(tensor, peer)
        tensor = group.recv_tensor((1, hidden), torch.float32, peer)
        if rank == 1:
            group.send_tensor(tensor, peer)

    gloo = group.process_group

    def gloo_round() -> None:  # the same through torch.distributed's gloo group
        if rank == 0:
            gloo.send([tensor], peer, 0).wait()
        gloo.recv([tensor], peer, 0).wait()
        if rank == 1:
            gloo.send([tensor], peer, 0).wait()

    timings = {"hidden_round_trip_us": link_round,
               "hidden_round_trip_gloo_us": gloo_round,
               "all_reduce_us": lambda: group.all_reduce_(tensor)}
    result = {}
    for name, once in timings.items():
        rounds = 500
        start = time.perf_counter()
        for _ in range(rounds):
            once()
        result[name] = 1e6 * (time.perf_counter() - start) / rounds
    if rank == 0:
        results.put(result)
    group.close()


def messaging(hidden: int) -> dict:
    """Hand-off and all-reduce times between two ranks, each on its own half of the cores."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // 2
    per_rank = [cores[:share], cores[share:2 * share]] if share else None
    port = free_port()
    return first_result(ping, [(rank, port, hidden, per_rank) for rank in (0, 1)],
                        timeout_s=120)


def layout_configs(layout: str, base: dict, layers: int) -> dict[str, tuple]:
    """name -> (runner, args) of the three configurations in one layout of the cores."""
    cores = sorted(os.sched_getaffinity(0))
    half = layers // 2
    pipeline = {"sharding": "pipeline", "layers": [(0, half), (half, layers)]}
    tensor = {"sharding": "tensor", "layers": [(0, layers), (0, layers)]}
    if layout == "separate":
        share = max(1, len(cores) // 2)
        per_rank = [cores[:share], cores[share:2 * share] or cores[:share]]
        return {"one_node": (single, {**base, "threads": share, "cores": per_rank[:1]}),
                "pipeline_2": (run_parallel, {**base, **pipeline, "threads": share,
                                              "cores": per_rank}),
                "tensor_2": (run_parallel, {**base, **tensor, "threads": share,
                                            "cores": per_rank})}
    return {"one_node": (single, {**base, "threads": len(cores)}),
            "pipeline_2": (run_parallel, {**base, **pipeline, "threads": len(cores)}),
            "tensor_2": (run_parallel, {**base, **tensor,
                                        "threads": max(1, len(cores) // 2)})}


def median_run(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def measure_layout(layout: str, base: dict, layers: int, rounds: int) -> dict:
    configs = layout_configs(layout, base, layers)
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, (runner, args) in configs.items():
            runs[name].append(runner(args))
    result = {name: median_run(config_runs) for name, config_runs in runs.items()}
    result["threads_per_rank"] = configs["pipeline_2"][1]["threads"]
    result["pipeline_overhead_per_token"] = (result["pipeline_2"]["decode_ms_per_token"]
                                             / result["one_node"]["decode_ms_per_token"] - 1)
    result["pipeline_overhead_each_round"] = [
        pipe["decode_ms_per_token"] / one["decode_ms_per_token"] - 1
        for one, pipe in zip(runs["one_node"], runs["pipeline_2"])]
    return result


def main() -> None:
    from shoal.catalog.resolve import DEFAULT_MODEL_ID, resolve_model
    from shoal.engine.models.loader import read_model_config
    from shoal.runner.process_env import runner_environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_ID)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layout", choices=("both", "separate", "shared"), default="both")
    args = parser.parse_args()
    # Every configuration runs with the environment shoal gives its runner processes.
    os.environ.update(runner_environment())
    config = read_model_config(resolve_model(args.model))
    base = {"model": args.model, "dtype": args.dtype, "tokens": args.tokens,
            "prompt": args.prompt}
    layouts = ("separate", "shared") if args.layout == "both" else (args.layout,)
    result = {"model": args.model, "dtype": args.dtype, "cores": len(os.sched_getaffinity(0)),
              "rounds": args.rounds}
    for layout in layouts:
        result[layout] = measure_layout(layout, base, config.num_layers, args.rounds)
    result["messaging"] = messaging(config.hidden_size)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
