"""FollowerEngine: a rank other than 0 of a multi-rank instance.

It has no scheduler, tokenizer or requests of its own: it joins the group, loads its part,
and run() serves rank 0's step plans until a shutdown plan, a stop request, or a GroupError.
The last pipeline rank also samples (SamplingMirror).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from shoal.engine.config import EngineConfig
from shoal.engine.core import EngineTask, NoEmbedding, NoGeneration, ProgressCallback
from shoal.engine.kv.disk_prefixes import open_rank_tier
from shoal.engine.kv_budget import kv_bytes_per_block
from shoal.engine.model_runner import ModelRunner
from shoal.engine.parallel.executor import Follower
from shoal.engine.parallel.sampling_mirror import SamplingMirror
from shoal.engine.parallel.setup import set_up_rank
from shoal.engine.sampler import Sampler
from shoal.tracing.steps import StepTracer

log = logging.getLogger("shoal.parallel")


class FollowerEngine(NoGeneration, NoEmbedding):
    task: EngineTask = "generate"
    is_follower = True
    tokenizer = None  # rank 0 reads and writes the text

    def __init__(self, config: EngineConfig, progress: ProgressCallback | None = None) -> None:
        parallel = config.parallel
        if parallel is None or parallel.rank == 0:
            raise ValueError("a FollowerEngine serves ranks 1 and up of a parallel instance")
        report = progress or (lambda _stage, _fraction: None)
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        setup = set_up_rank(config, report)
        self.config = config
        self.model_id = config.source.model_id
        self.loaded = setup.loaded
        self.vocab_size = setup.loaded.config.vocab_size
        self.max_model_len = setup.max_model_len
        self.runner = ModelRunner(setup.loaded, setup.num_blocks, config.block_size,
                                  config.device, setup.row_buffer_tokens)
        mirror = None
        if parallel.sharding == "pipeline" and parallel.is_last:
            mirror = SamplingMirror(Sampler(eos_token_ids=setup.eos_token_ids), config.device)
        self.tracer = StepTracer(rank=parallel.rank)  # the runner reads its spans
        disk = open_rank_tier(config, setup.loaded, self.runner.block_tensors)
        self._follower = Follower(self.runner, setup.group, parallel, setup.hidden_wire(),
                                  mirror, self.tracer, disk)
        report("ready", 1.0)
        log.info("rank %d of %d ready: %s layers %d-%d, %d KV blocks", parallel.rank,
                 parallel.world_size, self.model_id, parallel.layer_start, parallel.layer_end,
                 setup.num_blocks)

    def run(self, stop_requested: Callable[[], bool] = lambda: False) -> None:
        """Serve rank 0's plans (GroupError when rank 0 or a peer is gone)."""
        self._follower.run(stop_requested)

    def weight_bytes(self) -> int:
        return self.loaded.weight_bytes

    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.loaded, self.config.block_size)

    def close(self) -> None:
        pass  # the group ends with rank 0's shutdown plan, or with the process

    @property
    def steps(self) -> int:
        return self._follower.steps
