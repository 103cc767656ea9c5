"""One node versus a 2-rank pipeline and a 2-rank tensor instance, on loopback; prints JSON.

    python bench/distributed.py [--model ID] [--dtype auto] [--tokens 128] [--prompt 200]
                                [--rounds 9] [--layout both|separate|shared]

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
Each configuration's processes start once and stay up; the configurations then measure in
turn, --rounds times (a fresh prompt each turn), and the medians are reported: this kind of
machine's speed drifts within a minute, and short turns about keep every configuration
under the same drift. Every process gets the OpenMP settings of shoal's runner processes
(runner/process_env.py), without which a pipeline's idle rank spins on the cores the busy
one needs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
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


def measure(engine, prompt_tokens: int, new_tokens: int, turn: int) -> dict:
    """One request of a prompt_tokens prompt (its own words each turn: no prefix-cache hit)
    and new_tokens greedy tokens, after a short warm-up request."""
    from shoal.engine.sampling import SamplingParams

    text = " ".join(WORDS[(i * 7 + turn) % len(WORDS)] for i in range(prompt_tokens * 2))
    prompt = engine.tokenizer.encode(f"Turn {turn}: {text}",
                                     add_special_tokens=False)[:prompt_tokens]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    warm = engine.tokenizer.encode(f"Warm-up {turn}: {text[:200]}", add_special_tokens=False)
    engine.add_request(f"warm-{turn}", warm[:32], SamplingParams(temperature=0.0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    waited = 0.0
    engine.add_request(f"bench-{turn}", prompt, params)
    start = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if first is None and output.token_ids:
                first = time.perf_counter()
                waited = getattr(engine.executor, "wait_s", 0.0)  # decode waits from here
    end = time.perf_counter()
    waited = getattr(engine.executor, "wait_s", 0.0) - waited
    decode_s = end - first
    return {"ttft_s": first - start, "decode_tokens_per_s": (new_tokens - 1) / decode_s,
            "decode_ms_per_token": 1e3 * decode_s / (new_tokens - 1),
            "rank0_wait_ms_per_token": 1e3 * waited / (new_tokens - 1)}


def pin(cores: list[int] | None) -> None:
    """Keep this process (and the threads it starts) on the given cores, as a node would be."""
    if cores is not None:
        os.sched_setaffinity(0, cores)


def serve_rank(rank: int, args: dict, port: int | None, commands, results) -> None:
    """One process of a configuration: rank 0 (or one node) measures a turn per command
    until it gets None; a follower rank serves rank 0's plans until rank 0 closes."""
    pin(args["cores"][rank] if args.get("cores") else None)
    from shoal.engine.parallel.config import ParallelConfig

    parallel = None
    if port is not None:
        layers = args["layers"][rank]
        experts = args["experts"][rank] if "experts" in args else (0, 0)  # expert sharding
        parallel = ParallelConfig(rank=rank, world_size=2, sharding=args["sharding"],
                                  layer_start=layers[0], layer_end=layers[1],
                                  master_addr="127.0.0.1", master_port=port,
                                  expert_start=experts[0], expert_end=experts[1])
    config = engine_config(args["model"], args["dtype"], args["threads"], parallel)
    if rank != 0:
        from shoal.engine.parallel.follower import FollowerEngine

        FollowerEngine(config).run()
        return
    from shoal.engine.engine import Engine

    engine = Engine(config)
    results.put("ready")
    try:
        while True:
            try:
                turn = commands.get(timeout=0.25)
            except queue.Empty:
                engine.idle()  # keeps the other rank's waits alive
                continue
            if turn is None:
                return
            results.put(measure(engine, args["prompt"], args["tokens"], turn))
    finally:
        engine.close()


class Configuration:
    """The processes of one configuration, started once and kept for every turn (each
    waits, its cores idle, while another configuration measures)."""

    def __init__(self, args: dict) -> None:
        context = multiprocessing.get_context("spawn")
        self.args = args
        self._commands = context.Queue()
        self._results = context.Queue()
        ranks = (0, 1) if "sharding" in args else (0,)
        port = free_port() if len(ranks) > 1 else None
        self._procs = [context.Process(target=serve_rank, daemon=True,
                                       args=(rank, args, port, self._commands, self._results))
                       for rank in ranks]
        for proc in self._procs:
            proc.start()
        if self._results.get(timeout=600) != "ready":
            raise RuntimeError("a configuration did not start")

    def measure(self, turn: int) -> dict:
        self._commands.put(turn)
        return self._results.get(timeout=600)

    def stop(self) -> None:
        self._commands.put(None)
        for proc in self._procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


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


def core_halves() -> list[list[int]]:
    """This machine's cores split in two halves, one per rank (both the one core if that is
    all there is)."""
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // 2)
    return [cores[:share], cores[share:2 * share] or cores[:share]]


def ping(rank: int, port: int, hidden: int, cores, results) -> None:
    pin(cores[rank])
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
    rounds = 500
    for name, once in timings.items():
        start = time.perf_counter()
        for _ in range(rounds):
            once()
        result[name] = 1e6 * (time.perf_counter() - start) / rounds
    if rank == 0:
        results.put(result)
    group.close()


def messaging(hidden: int) -> dict:
    """Hand-off and all-reduce times between two ranks, each on its own half of the cores."""
    per_rank = core_halves()
    port = free_port()
    return first_result(ping, [(rank, port, hidden, per_rank) for rank in (0, 1)],
                        timeout_s=120)


def layout_configs(layout: str, base: dict, layers: int) -> dict[str, dict]:
    """name -> process arguments of the three configurations in one layout of the cores."""
    cores = sorted(os.sched_getaffinity(0))
    half = layers // 2
    pipeline = {"sharding": "pipeline", "layers": [(0, half), (half, layers)]}
    tensor = {"sharding": "tensor", "layers": [(0, layers), (0, layers)]}
    if layout == "separate":
        per_rank = core_halves()
        share = len(per_rank[0])
        return {"one_node": {**base, "threads": share, "cores": per_rank[:1]},
                "pipeline_2": {**base, **pipeline, "threads": share, "cores": per_rank},
                "tensor_2": {**base, **tensor, "threads": share, "cores": per_rank}}
    return {"one_node": {**base, "threads": len(cores)},
            "pipeline_2": {**base, **pipeline, "threads": len(cores)},
            "tensor_2": {**base, **tensor, "threads": max(1, len(cores) // 2)}}


def median_run(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def measure_layout(layout: str, base: dict, layers: int, rounds: int) -> dict:
    configs = {name: Configuration(args)
               for name, args in layout_configs(layout, base, layers).items()}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    try:
        for turn in range(rounds):
            for name, config in configs.items():
                runs[name].append(config.measure(turn))
    finally:
        for config in configs.values():
            config.stop()
    result = {name: median_run(config_runs) for name, config_runs in runs.items()}
    result["threads_per_rank"] = configs["pipeline_2"].args["threads"]
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
    parser.add_argument("--rounds", type=int, default=9)
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
