"""The runners this node keeps for ranks of multi-rank instances.

A rank's runner is not a model of the node's pool: it holds part of a model and serves only
through its instance (rank 0 takes the instance's requests). Each is a runner supervisor of
its own, keyed by runner id, started with the rank's ParallelConfig: the master's rendezvous
for the group, the rank's layers, and the group-formation deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from shoal.cluster.background import cancel_and_wait
from shoal.cluster.instances import Instance, Rank
from shoal.engine.config import ModelSource
from shoal.engine.parallel.config import ParallelConfig
from shoal.ids import RunnerId

log = logging.getLogger("shoal.cluster.ranks")

# (where the weights are, the rank's place in its group) -> a RunnerSupervisor
RankSupervisorFactory = Callable[[ModelSource, ParallelConfig], Any]


def parallel_config(instance: Instance, rank: Rank, connect_timeout_s: float) -> ParallelConfig:
    if instance.rendezvous is None or instance.sharding not in ("pipeline", "tensor"):
        raise ValueError(f"instance {instance.instance_id} is not a multi-rank instance")
    return ParallelConfig(rank=rank.rank, world_size=rank.world_size,
                          sharding=instance.sharding, layer_start=rank.layer_start,
                          layer_end=rank.layer_end, master_addr=instance.rendezvous.host,
                          master_port=instance.rendezvous.port,
                          connect_timeout_s=connect_timeout_s,
                          compress_hidden=instance.request.hidden_int8)


class RankRunners:
    def __init__(self, make_supervisor: RankSupervisorFactory,
                 resolve: Callable[[str], ModelSource], connect_timeout_s: float = 120.0) -> None:
        self._make_supervisor = make_supervisor
        self._resolve = resolve
        self.connect_timeout_s = connect_timeout_s
        self._supervisors: dict[RunnerId, Any] = {}
        self._stopping: set[asyncio.Task] = set()

    async def start(self, instance: Instance, rank: Rank) -> Any:
        """Spawn the rank's runner and wait until it has joined its group and loaded its part
        (RunnerUnavailable, or the resolver's error, if it cannot)."""
        source = await asyncio.to_thread(self._resolve, instance.model)
        supervisor = self._make_supervisor(
            source, parallel_config(instance, rank, self.connect_timeout_s))
        self._supervisors[rank.runner_id] = supervisor
        log.info("starting rank %d of %d of %s (%s, layers %d-%d)", rank.rank, rank.world_size,
                 instance.model, instance.sharding, rank.layer_start, rank.layer_end)
        await supervisor.start()
        return supervisor

    def supervisor(self, runner_id: RunnerId) -> Any | None:
        return self._supervisors.get(runner_id)

    def state(self, runner_id: RunnerId) -> str | None:
        supervisor = self._supervisors.get(runner_id)
        return None if supervisor is None else supervisor.state

    def error(self, runner_id: RunnerId) -> str | None:
        supervisor = self._supervisors.get(runner_id)
        return None if supervisor is None else supervisor.last_error

    def stop(self, runner_id: RunnerId) -> None:
        """Shut the rank's runner down in the background (bounded by the supervisor)."""
        supervisor = self._supervisors.pop(runner_id, None)
        if supervisor is not None:
            task = asyncio.get_running_loop().create_task(supervisor.shutdown())
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    async def close(self) -> None:
        for runner_id in list(self._supervisors):
            self.stop(runner_id)
        if self._stopping:
            await asyncio.wait(set(self._stopping), timeout=15.0)
        await cancel_and_wait(self._stopping)
