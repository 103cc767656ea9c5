"""The KV grant: the runner asks before its KV cache grows, the node answers from its budget."""

from __future__ import annotations

from types import SimpleNamespace

from fakes import FakeClock, fake_engine_config

from shoal.engine.kv.block_pool import BlockPool
from shoal.runner import kv_grant
from shoal.runner.kv_grant import GrantFigures, KVGrantKeeper, blocks_to_ask
from shoal.runner.messages import AskKV, GrantKV, MemoryUsage, ReleasedKV
from shoal.runner.supervisor import RunnerSupervisor

BYTES_PER_BLOCK = 1000


class PoolEngine:
    """The engine's grant surface over a real block pool (16 tokens a block: a step of
    4096 tokens is 256 blocks)."""

    def __init__(self, num_blocks: int = 1024) -> None:
        self.config = SimpleNamespace(block_size=16)
        self.pool = BlockPool(num_blocks)

    def kv_bytes_per_block(self) -> int:
        return BYTES_PER_BLOCK

    def grant_kv_blocks(self, num_blocks: int) -> None:
        self.pool.set_grant(num_blocks)

    def release_kv_blocks(self, keep_blocks: int) -> int:
        return len(self.pool.release_free_tail(keep_blocks))

    def stats(self) -> dict:
        return {"num_running": 0, "kv_blocks_used": self.pool.num_used_blocks,
                "kv_blocks_granted": self.pool.granted_blocks,
                "kv_blocks_total": self.pool.num_blocks,
                "kv_blocks_short": self.pool.shortfall_blocks}


def keeper(engine: PoolEngine) -> tuple[KVGrantKeeper, list[AskKV], FakeClock]:
    sent: list[AskKV] = []
    clock = FakeClock()
    grants = KVGrantKeeper(engine, sent.append, clock=clock)
    grants.start()
    return grants, sent, clock


def test_ask_for_a_step_when_requests_near_the_grant():
    figures = GrantFigures(used=100, granted=256, total=1024, short=0)
    assert blocks_to_ask(figures, 256) == 0
    assert blocks_to_ask(GrantFigures(200, 256, 1024, 0), 256) == 256
    assert blocks_to_ask(GrantFigures(10, 256, 1024, 300), 256) == 300  # what was lacked
    assert blocks_to_ask(GrantFigures(900, 900, 1000, 0), 256) == 100  # capacity is the end
    assert blocks_to_ask(GrantFigures(1000, 1000, 1000, 5), 256) == 0


def test_the_runner_starts_at_one_step_and_grows_only_when_granted():
    engine = PoolEngine()
    grants, sent, clock = keeper(engine)
    assert engine.pool.granted_blocks == grants.step_blocks == 256
    engine.pool.allocate(200)
    grants.maybe_ask()
    assert sent == [AskKV(granted_blocks=256, more_blocks=256, bytes_per_block=BYTES_PER_BLOCK)]
    clock.now += 1.0
    grants.maybe_ask()
    assert len(sent) == 1  # one ask out at a time
    assert not engine.pool.can_allocate(100)  # the grant holds until the node answers
    grants.on_grant(GrantKV(granted_blocks=512))
    assert engine.pool.granted_blocks == 512 and engine.pool.can_allocate(100)


def test_a_refusal_puts_the_next_ask_off_and_a_starved_loop_waits():
    engine = PoolEngine()
    grants, sent, clock = keeper(engine)
    engine.pool.allocate(250)
    assert not engine.pool.can_allocate(10)  # a request lacks blocks
    grants.maybe_ask()
    grants.on_grant(GrantKV(granted_blocks=256))  # the node has no room
    assert engine.pool.granted_blocks == 256 and grants.starved
    clock.now += kv_grant.ASK_RETRY_S - 0.1
    grants.maybe_ask()
    assert len(sent) == 1
    clock.now += 0.1
    grants.maybe_ask()
    assert len(sent) == 2


def test_the_supervisor_grants_within_the_node_s_room_and_counts_it_at_once(tmp_path):
    supervisor = RunnerSupervisor(fake_engine_config(tmp_path))
    room = [5 * BYTES_PER_BLOCK]
    supervisor.kv_room = lambda extra: extra <= room[0]
    supervisor.memory = MemoryUsage(rss_bytes=10_000, kv_bytes_in_use=2 * BYTES_PER_BLOCK,
                                    kv_bytes_granted=4 * BYTES_PER_BLOCK,
                                    kv_bytes_capacity=10**9)
    assert supervisor.memory.footprint_bytes == 12_000
    ask = AskKV(granted_blocks=4, more_blocks=4, bytes_per_block=BYTES_PER_BLOCK)
    assert supervisor._answer_kv(ask) == GrantKV(granted_blocks=8)
    assert supervisor.memory.footprint_bytes == 16_000  # counted before a block is touched
    room[0] = 0
    assert supervisor._answer_kv(ask.model_copy(update={"granted_blocks": 8})) == \
        GrantKV(granted_blocks=8)
    # A report measured before the runner saw the grant does not shrink what is counted.
    supervisor._record_memory(MemoryUsage(rss_bytes=10_000, kv_bytes_in_use=0,
                                          kv_bytes_granted=4 * BYTES_PER_BLOCK))
    assert supervisor.memory.kv_bytes_granted == 8 * BYTES_PER_BLOCK


def test_a_runner_s_grant_grows_through_its_supervisor_only_while_the_node_has_room(tmp_path):
    import asyncio

    from fakes import KV_BYTES_PER_BLOCK, fake_supervisor_options

    from shoal.engine.sampling import SamplingParams
    from shoal.protocol import GenerationRequest

    step = 256  # 4096 tokens of 16-token blocks
    prompt = "FOREVER SLOW " + " ".join(f"w{i}" for i in range(4 * 140))  # 141 blocks of 4
    room = [0]

    async def granted_while_running(supervisor: RunnerSupervisor, request_id: str) -> int:
        stream = supervisor.submit(GenerationRequest(
            request_id=request_id, model="fake-model", prompt=prompt, sampling=SamplingParams()))
        assert (await anext(stream)).kind == "accepted"
        # Steps run; the runner asks once it nears its grant (again ASK_RETRY_S after a
        # refusal), and the supervisor answers at once.
        deadline = asyncio.get_running_loop().time() + kv_grant.ASK_RETRY_S + 1.0
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
            if supervisor.memory.kv_bytes_granted > step * KV_BYTES_PER_BLOCK:
                break
        granted = supervisor.memory.kv_bytes_granted
        await stream.aclose()
        return granted

    async def main() -> list[int]:
        supervisor = RunnerSupervisor(fake_engine_config(tmp_path), fake_supervisor_options(
            fake_engine="grant", load_timeout_s=120.0))
        supervisor.kv_room = lambda extra: extra <= room[0]
        try:
            await supervisor.start()
            seen = [supervisor.memory.kv_bytes_granted]
            seen.append(await granted_while_running(supervisor, "a"))  # no room: it stays
            room[0] = 10**9
            seen.append(await granted_while_running(supervisor, "b"))
        finally:
            await supervisor.shutdown()
        return seen

    assert asyncio.run(main()) == [step * KV_BYTES_PER_BLOCK, step * KV_BYTES_PER_BLOCK,
                                   2 * step * KV_BYTES_PER_BLOCK]


def test_an_idle_runner_gives_its_kv_back_to_the_first_step_once_per_idle_spell():
    engine = PoolEngine()
    sent: list = []
    clock = FakeClock()
    grants = KVGrantKeeper(engine, sent.append, clock=clock)
    grants.start()
    engine.pool.set_grant(512)
    engine.pool.free(engine.pool.allocate(400))
    grants.rest()
    assert grants.seconds_until_release() == kv_grant.IDLE_RELEASE_S
    clock.now += kv_grant.IDLE_RELEASE_S
    grants.rest()
    assert sent == [ReleasedKV(granted_blocks=256, bytes_per_block=BYTES_PER_BLOCK)]
    assert engine.pool.num_touched_blocks == 256 and grants.seconds_until_release() is None
    clock.now += kv_grant.IDLE_RELEASE_S
    grants.rest()
    assert len(sent) == 1
    grants.busy()  # a new spell of work, then of rest
    grants.rest()
    assert grants.seconds_until_release() == kv_grant.IDLE_RELEASE_S


def test_the_supervisor_counts_a_released_grant_down(tmp_path):
    supervisor = RunnerSupervisor(fake_engine_config(tmp_path))
    supervisor.memory = MemoryUsage(rss_bytes=10_000, kv_bytes_in_use=0,
                                    kv_bytes_granted=8 * BYTES_PER_BLOCK)
    supervisor._record_memory(supervisor.memory)
    supervisor._dispatch(None, ReleasedKV(granted_blocks=4, bytes_per_block=BYTES_PER_BLOCK))
    assert supervisor.memory.kv_bytes_granted == 4 * BYTES_PER_BLOCK
