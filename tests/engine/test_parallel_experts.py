"""Expert parallelism: a tiny mixture-of-experts model over two ranks (each a process on
127.0.0.1) answers in float32 exactly as one engine does, tokens and logprobs, several
requests at once and one joining mid-way; each rank holds only its experts; a dense model
is refused. Top-2 routing over two ranks: the ranks' sum is one engine's, bit for bit
(engine/parallel/experts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_models
from rank_processes import run_ranks
from tokenizer_fixtures import tiny_byte_level_metadata

from shoal.engine.config import EngineConfig, ModelSource
from shoal.engine.engine import Engine
from shoal.engine.errors import UnsupportedModel
from shoal.engine.models.loader import load_model
from shoal.engine.parallel.config import ParallelConfig
from shoal.engine.parallel.experts import holds_tensor
from shoal.engine.sampling import SamplingParams

PROMPTS = [[(7 * i + j * 13) % 250 + 3 for j in range(9 + 4 * i)] for i in range(3)]
NEW_TOKENS = 24
# Uneven on purpose: rank 0 holds experts 0-4, rank 1 experts 5-7 of each layer.
EXPERT_RANGES = [(0, 5), (5, 8)]


@pytest.fixture(scope="module")
def chat_models(tmp_path_factory):
    """qwen3moe and qwen2moe (a shared expert) with a byte-level tokenizer in their GGUF."""
    metadata = tiny_byte_level_metadata()
    directory = tmp_path_factory.mktemp("expert-parallel")
    return {family: tiny_models.build(family, directory / family, metadata=metadata,
                                      vocab_size=len(metadata["tokenizer.ggml.tokens"]))
            for family in ("qwen3moe", "qwen2moe")}


def engine_config(path: str, parallel: ParallelConfig | None = None) -> EngineConfig:
    return EngineConfig(source=ModelSource("m", "gguf", Path(path)), dtype="float32",
                        threads=1, kv_cache_bytes=8 * 2**20, block_size=8, parallel=parallel)


def generate(engine) -> dict[str, list]:
    """Two greedy requests with logprobs, a third added after three steps: each request's
    (token, logprob) pairs."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=True, top_logprobs=2)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], params)
    out: dict[str, list] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            out.setdefault(output.request_id, []).extend(
                (token, logprob.logprob, [(t.token_id, t.logprob) for t in logprob.top])
                for token, logprob in zip(output.token_ids, output.logprobs))
        steps += 1
        if steps == 3:
            engine.add_request("c", PROMPTS[2], params)
    return out


def rank_main(rank: int, world: int, port: int, path: str):
    start, end = EXPERT_RANGES[rank]
    parallel = ParallelConfig(rank=rank, world_size=world, sharding="expert", layer_start=0,
                              layer_end=2, master_addr="127.0.0.1", master_port=port,
                              expert_start=start, expert_end=end)
    if rank == 0:
        engine = Engine(engine_config(path, parallel))
        try:
            return generate(engine), engine.weight_bytes()
        finally:
            engine.close()
    from shoal.engine.parallel.follower import FollowerEngine

    follower = FollowerEngine(engine_config(path, parallel))
    follower.run()
    return follower.steps, follower.weight_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3moe", "qwen2moe"])
def test_two_expert_ranks_answer_bit_for_bit_as_one_engine(chat_models, family):
    path = str(chat_models[family].gguf_path)
    one = Engine(engine_config(path))
    expected, whole_bytes = generate(one), one.weight_bytes()
    one.close()
    results = run_ranks(rank_main, 2, path, timeout_s=240)
    (answers, bytes0), (steps, bytes1) = results[0], results[1]
    assert steps > 0  # rank 1 ran every step's experts
    assert answers == expected
    # Each holds everything but the other's experts: together more than one engine (the
    # attention, embedding and router twice), each less than it.
    assert bytes0 < whole_bytes and bytes1 < bytes0 < bytes0 + bytes1


def test_a_rank_loads_only_its_experts_and_a_dense_model_is_refused(tmp_path):
    moe = tiny_models.build("qwen3moe", tmp_path / "moe")
    whole = load_model(ModelSource("m", "gguf", moe.gguf_path), "float32")
    share = load_model(ModelSource("m", "gguf", moe.gguf_path), "float32", experts=(2, 5),
                       reduce=lambda partial: partial)
    layer = share.module.blocks[0].mlp
    assert len(layer.moe.experts) == 3 and layer.moe.first_expert == 2
    assert share.weight_bytes < whole.weight_bytes
    with pytest.raises(ValueError, match="outside the model's 8 experts"):
        load_model(ModelSource("m", "gguf", moe.gguf_path), "float32", experts=(4, 9),
                   reduce=lambda partial: partial)
    dense = tiny_models.build("qwen3", tmp_path / "dense")
    with pytest.raises(UnsupportedModel, match="needs a mixture-of-experts model"):
        load_model(ModelSource("m", "gguf", dense.gguf_path), "float32", experts=(0, 1),
                   reduce=lambda partial: partial)


def test_a_rank_keeps_every_tensor_but_other_ranks_experts():
    assert holds_tensor("layers.3.experts.5.gate.weight", (4, 6))
    assert not holds_tensor("layers.3.experts.6.gate.weight", (4, 6))
    assert not holds_tensor("layers.3.experts.3.down.weight", (4, 6))
    assert holds_tensor("layers.3.router.weight", (4, 6))
    assert holds_tensor("layers.3.shared_expert.up.weight", (4, 6))
    assert holds_tensor("layers.3.experts.9.up.weight", None)


def test_an_expert_rank_needs_its_range_and_runs_every_layer():
    def config(sharding, start=0, end=0):
        return ParallelConfig(rank=0, world_size=2, sharding=sharding, layer_start=0,
                              layer_end=2, master_addr="127.0.0.1", master_port=29500,
                              expert_start=start, expert_end=end)

    expert = config("expert", 0, 4)
    assert expert.expert_range == (0, 4) and expert.runs_every_layer
    assert (expert.tp_rank, expert.tp_size) == (0, 1)  # no tensor slices of its layers
    assert config("tensor").runs_every_layer and not config("pipeline").runs_every_layer
    assert config("pipeline").expert_range is None
    with pytest.raises(ValueError, match="invalid expert range"):
        config("expert")
    with pytest.raises(ValueError, match="needs expert sharding"):
        config("pipeline", 0, 4)
