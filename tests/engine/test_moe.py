"""Mixture-of-experts families on tiny random models: greedy tokens against transformers from
both file formats, rows grouped by expert, only chosen experts read, memory, the engine."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from forward_helpers import all_position_logits, chunk, loaded_greedy, step
from forward_helpers import load_checkpoint as load
from forward_helpers import load_packed as packed
from tiny_models import MOE_FAMILIES, ExpertTypes
from tokenizer_fixtures import tiny_byte_level_metadata
from transformers_refs import transformers_greedy

from shoal.engine.backends.choose import choose_backend
from shoal.engine.config import EngineConfig, ModelSource
from shoal.engine.engine import Engine
from shoal.engine.errors import UnsupportedModel
from shoal.engine.model_runner import ModelRunner
from shoal.engine.models.layers.experts import MixtureOfExperts
from shoal.engine.models.loader import load_model
from shoal.engine.parallel.shard import TensorShard
from shoal.engine.sampling import SamplingParams
from shoal.engine.speculation.config import SpeculativeConfig

PROMPTS = [
    [3, 17, 99, 42, 5, 77, 8, 120, 64, 33, 2, 91, 15],
    [7, 7, 7, 100, 1],
    [50, 60, 70, 80, 90, 100, 110, 120, 10, 20, 30, 40, 45, 55, 65, 75, 85],
]
NEW_TOKENS = 40
BLOCK = 4
BLOCKS_PER_REQUEST = 16  # 64 tokens: any prompt here plus NEW_TOKENS


def ours_greedy(loaded, prompts=PROMPTS, steps=NEW_TOKENS) -> list[list[int]]:
    return loaded_greedy(loaded, prompts, steps, BLOCK, BLOCKS_PER_REQUEST)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_float32_greedy_tokens_equal_transformers(tiny_checkpoints, family, fmt):
    checkpoint = tiny_checkpoints[family]
    loaded = load(checkpoint, fmt)
    assert loaded.config.architecture == tiny_models.architecture(family)
    assert loaded.config.num_experts == 8
    reference = checkpoint.hf_model if fmt == "safetensors" else checkpoint.gguf_reference
    for prompt, tokens in zip(PROMPTS, ours_greedy(loaded)):
        assert tokens == transformers_greedy(reference, prompt, NEW_TOKENS)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_packed_next_tokens_follow_float32(tiny_checkpoints, family):
    """The default precision (packed GGUF experts, bf16 activations, float32 routing) read
    along the float32 greedy continuations of the same file: its next token is float32's
    wherever float32's top two logits are 0.05 apart or more (logits' spread here: ~0.7),
    and at 95% of all positions. Measured: qwen3moe 155/155, qwen2moe 154/155, mixtral
    153/155 (the dense llama's 152/155), every miss a near-tie (margin < 0.04); free-running
    greedy runs agree on 40/40 tokens of each prompt for qwen3moe and qwen2moe, 40, 40 and
    13 for mixtral (llama: 5, 40 and 4). glm4moe: 151/155, misses at margins 0.002, 0.003,
    0.009 and 0.054, the last where bf16 moves a near-tied router's choice (that position's
    logits move 0.19, the others' at most 0.023), so its margin is 0.1; free-running 31, 37
    and 35 of 40. DeepSeek over its latent cache (torch attention in float32 over bf16
    latents): deepseek3 (V3's shape) 152/155, misses at margins 0.0004, 0.009 and 0.065, the
    last where bf16 moves a near-tied router's choice (the four rows whose choice moved
    move 0.46-0.79, the others at most 0.04), so its margin is 0.1 too; free-running 40, 19
    and 31; deepseek2 (V2-Lite's) 152/155, misses at margins 0.0004, 0.003 and 0.011,
    free-running 17, 14 and 40."""
    checkpoint = tiny_checkpoints[family]
    exact, fast = load(checkpoint, "gguf"), packed(checkpoint)
    agree = total = 0
    for prompt, tokens in zip(PROMPTS, ours_greedy(exact)):
        ids, blocks = prompt + tokens, list(range(BLOCKS_PER_REQUEST))
        reference = all_position_logits(ModelRunner(exact, BLOCKS_PER_REQUEST, BLOCK), ids,
                                        blocks)
        ours = all_position_logits(ModelRunner(fast, BLOCKS_PER_REQUEST, BLOCK), ids, blocks)
        top_two = reference.topk(2, dim=-1).values
        decided = top_two[:, 0] - top_two[:, 1] >= DECIDED_MARGIN.get(family, 0.05)
        same = ours.argmax(-1) == reference.argmax(-1)
        assert same[decided].all()
        agree, total = agree + int(same.sum()), total + len(ids)
    assert agree >= 0.95 * total


# Where float32's top two logits are this far apart bf16 must pick the same token (families
# whose routing near-ties bf16 moves, further than the default 0.05).
DECIDED_MARGIN = {"glm4moe": 0.1, "deepseek3": 0.1}


def _expert_calls(model) -> list[tuple[int, int, int]]:
    """Records (layer, expert, rows) for every expert call of the model's MoE layers (run
    by the per-expert loop: the compiled grouped form gives its bits, as
    test_the_grouped_kernel_equals_the_expert_loop_bit_for_bit checks, and so does the
    fused decoder's, as test_the_decoders_compiled_layer_is_the_python_layer_bit_for_bit
    does: both are turned off here)."""
    model.fused_decode_allowed = False
    calls: list[tuple[int, int, int]] = []
    for layer, block in enumerate(model.blocks):
        assert isinstance(block.mlp, MixtureOfExperts) == model.config.has_experts(layer)
        if not isinstance(block.mlp, MixtureOfExperts):
            continue
        block.mlp.grouped = None
        for index, expert in enumerate(block.mlp.experts):
            def counted(x, prompt_from=None, _run=expert.forward, _at=(layer, index)):
                calls.append((*_at, x.shape[0]))
                return _run(x, prompt_from)
            expert.forward = counted
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_reads_each_chosen_expert_once_and_no_other(tiny_checkpoints, dtype):
    checkpoint = tiny_checkpoints["qwen3moe"]
    loaded = packed(checkpoint) if dtype == "bfloat16" else load(checkpoint, "gguf")
    top_k, layers = loaded.config.num_experts_per_token, loaded.config.num_layers
    calls = _expert_calls(loaded.module)
    runner = ModelRunner(loaded, 48, BLOCK)
    prompt = PROMPTS[2]
    logits = step(runner, chunk("a", prompt, 0, range(16)))
    # The prompt's rows: each expert at most once per layer, every row's k choices served
    # (the last layer runs on the sampled row alone).
    for layer in range(layers):
        mine = [(expert, rows) for at, expert, rows in calls if at == layer]
        assert len({expert for expert, _ in mine}) == len(mine)
        rows = len(prompt) if layer < layers - 1 else 1
        assert sum(count for _, count in mine) == rows * top_k
    calls.clear()
    step(runner, chunk("a", [int(logits[0].argmax())], len(prompt), range(16)))
    # One generated row: its k experts in each layer, one row each, and no other expert.
    assert sorted(layer for layer, _, _ in calls) == [i for i in range(layers)
                                                      for _ in range(top_k)]
    assert all(rows == 1 for _, _, rows in calls)
    assert len(calls) == layers * top_k < layers * loaded.config.num_experts


@pytest.mark.parametrize("family", ["qwen3moe", "glm4moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_sharing_experts_in_a_batch_equal_rows_run_alone(tiny_checkpoints, dtype, family):
    # Five rows choose 10 of 8 experts per layer: some expert serves two rows or more.
    checkpoint = tiny_checkpoints[family]
    loaded = packed(checkpoint) if dtype == "bfloat16" else load(checkpoint, "gguf")
    calls = _expert_calls(loaded.module)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0][3:], PROMPTS[2][:6]]
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(prompts))]
    alone = ModelRunner(loaded, 16 * len(prompts), BLOCK)
    together = ModelRunner(loaded, 16 * len(prompts), BLOCK)
    firsts = [step(alone, chunk(str(i), p, 0, tables[i])) for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        step(together, chunk(str(i), p, 0, tables[i]))
    tokens, lengths = [int(f[0].argmax()) for f in firsts], [len(p) for p in prompts]
    shared = 0
    for _ in range(8):
        chunks = [chunk(str(i), [tokens[i]], lengths[i], tables[i]) for i in range(len(prompts))]
        calls.clear()
        batched = step(together, *chunks)
        shared += sum(rows > 1 for _, _, rows in calls)
        separate = torch.cat([step(alone, c) for c in chunks])
        if dtype == "bfloat16":  # packed rows are computed alone: the same bits
            assert torch.equal(batched, separate)
        else:
            torch.testing.assert_close(batched, separate, atol=1e-5, rtol=1e-5)
        tokens = [int(row.argmax()) for row in batched]
        assert tokens == [int(row.argmax()) for row in separate]
        lengths = [n + 1 for n in lengths]
    moe_layers = sum(map(loaded.config.has_experts, range(loaded.config.num_layers)))
    assert shared >= 8 * moe_layers  # every MoE layer of every step shared one


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_prompt_and_generated_rows_keep_their_own_arithmetic_in_one_group(tiny_checkpoints,
                                                                          family):
    # Packed linears compute generated and prompt rows each their own way (different bits
    # here); an expert's group mixes both kinds and must still tell them apart.
    model = packed(tiny_checkpoints[family]).module
    experts = model.blocks[model.config.first_dense_layers].mlp
    torch.manual_seed(0)
    x = torch.randn(120, experts.router.weight.shape[1]).to(torch.bfloat16)
    with torch.inference_mode():
        for generated in (1, 40):  # ~30 rows per expert: every group holds both kinds
            together = experts(x, generated)
            apart = torch.cat([experts(x[:generated], None), experts(x[generated:], 0)])
            assert torch.equal(together, apart)
        assert not torch.equal(experts(x, None), experts(x, 0))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_grouped_kernel_equals_the_expert_loop_bit_for_bit(tiny_checkpoints, family):
    # Packed experts run as one compiled call per step (GroupedExperts); the Python loop over
    # experts is its definition: the same bits for generated rows, prompt rows and a mix,
    # one row or many (groups of one to ~40 rows).
    loaded = packed(tiny_checkpoints[family])
    torch.manual_seed(0)
    for block in loaded.module.blocks:
        experts = block.mlp
        if not isinstance(experts, MixtureOfExperts):  # GLM's and DeepSeek's dense layers
            continue
        assert experts.grouped is not None
        x = torch.randn(120, experts.router.weight.shape[1]).to(torch.bfloat16)
        with torch.inference_mode():
            for rows, prompt_from in ((1, None), (1, 0), (5, None), (120, None), (120, 0),
                                      (120, 1), (120, 40)):
                grouped = experts(x[:rows], prompt_from)
                compiled, experts.grouped = experts.grouped, None
                loop = experts(x[:rows], prompt_from)
                experts.grouped = compiled
                assert torch.equal(grouped, loop), (rows, prompt_from)


@pytest.mark.parametrize("family", ["qwen3moe", "qwen2moe", "mixtral"])
def test_the_decoders_compiled_layer_is_the_python_layer_bit_for_bit(tiny_checkpoints, family):
    # The fused decoder's mixture-of-experts MLP (kernels' RoutedFeedForward: router, experts
    # and qwen2moe's gated shared expert in one call) on generated rows, against the layer.
    from shoal.engine.backends.fused_decode import _experts

    loaded = packed(tiny_checkpoints[family])
    block = loaded.module.blocks[0]
    compiled = _experts(block, loaded.module.plan.backend.kernel)
    assert compiled is not None and (family != "qwen2moe" or block.mlp.shared.gate is not None)
    torch.manual_seed(1)
    x = torch.randn(64, block.mlp.router.weight.shape[1]).to(torch.bfloat16)
    with torch.inference_mode():
        for rows in (1, 2, 4, 5, 64):  # up to 4 rows an expert: one parallel region
            assert torch.equal(compiled.forward(x[:rows]), block.mlp(x[:rows], rows)), rows


def test_an_expert_share_runs_compiled_as_its_loop(tiny_checkpoints):
    # An expert-parallel rank holds experts [1, n): the compiled call skips the choices of
    # expert 0 (another rank's) exactly as the loop does, and the two shares add up to all.
    loaded = packed(tiny_checkpoints["qwen3moe"])
    whole = loaded.module.blocks[0].mlp
    backend = choose_backend(torch.device("cpu"), torch.bfloat16)
    held = list(whole.experts)
    low = backend.experts(whole.router, held[:1], None, first_expert=0)
    high = backend.experts(whole.router, held[1:], None, first_expert=1)
    assert low.grouped is not None and high.grouped is not None
    torch.manual_seed(0)
    x = torch.randn(64, whole.router.weight.shape[1]).to(torch.bfloat16)
    with torch.inference_mode():
        compiled = high.routed(x, 32)
        high.grouped = None
        assert torch.equal(compiled, high.routed(x, 32))
        torch.testing.assert_close(low.routed(x, 32) + compiled, whole.routed(x, 32))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_packed_experts_hold_about_the_files_bytes(tiny_checkpoints, family):
    # Measured: 0.99x the file packed (qwen3moe 0.993, qwen2moe 0.988, mixtral 0.994),
    # ~5x in float32.
    checkpoint = tiny_checkpoints[family]
    fast = packed(checkpoint)
    file_bytes = checkpoint.gguf_path.stat().st_size
    assert fast.weight_bytes <= 1.2 * file_bytes
    assert load(checkpoint, "gguf").weight_bytes > 2 * fast.weight_bytes  # fp32: dense


# Expert tensors in llama.cpp's K-quant mixes (K-quant rows take 256 values: a tiny
# qwen3moe of hidden size 256 and experts of 256).
K_QUANT_EXPERTS = [ExpertTypes(gate="Q4_K", up="Q5_K", down="Q6_K"),
                   ExpertTypes(gate="Q8_0", up="Q6_K", down="Q4_K")]


@pytest.fixture(scope="module")
def k_quant_checkpoint(tmp_path_factory):
    return tiny_models.build("qwen3moe", tmp_path_factory.mktemp("k-quant"),
                             expert_types=K_QUANT_EXPERTS, hidden_size=256,
                             moe_intermediate_size=256, num_experts=4, head_dim=64)


def test_k_quant_experts_match_transformers_in_float32(k_quant_checkpoint):
    loaded = load(k_quant_checkpoint, "gguf")
    for prompt, tokens in zip(PROMPTS, ours_greedy(loaded, steps=32)):
        assert tokens == transformers_greedy(k_quant_checkpoint.gguf_reference, prompt, 32)


def test_k_quant_experts_stay_packed_at_the_files_bytes(k_quant_checkpoint):
    """Measured: 1.019x (layer 0: Q4_K, Q5_K, Q6_K) and 1.010x (layer 1) the file's expert
    bytes."""
    import gguf

    fast = packed(k_quant_checkpoint)
    tensors = gguf.GGUFReader(k_quant_checkpoint.gguf_path).tensors
    for index, block in enumerate(fast.module.blocks):
        types = {t.name.split(".")[2]: t.tensor_type.name for t in tensors
                 if t.name.startswith(f"blk.{index}.") and "_exps" in t.name}
        expected = K_QUANT_EXPERTS[index]
        assert types == {"ffn_gate_exps": expected.gate, "ffn_up_exps": expected.up,
                         "ffn_down_exps": expected.down}
        file_bytes = sum(int(t.n_bytes) for t in tensors
                         if t.name.startswith(f"blk.{index}.") and "_exps" in t.name)
        held = sum(e.gate_up.nbytes() + e.down.nbytes() for e in block.mlp.experts)
        assert file_bytes <= held <= 1.05 * file_bytes
    assert fast.weight_bytes < load(k_quant_checkpoint, "gguf").weight_bytes / 3


def _by_expert(weights: torch.Tensor, experts: torch.Tensor):
    order = experts.argsort(dim=-1)
    return weights.gather(1, order), experts.gather(1, order)


@pytest.mark.parametrize("family", ["glm4moe", "deepseek3", "deepseek2"])
def test_grouped_routing_is_transformers_and_the_groups_matter(tiny_checkpoints, family):
    """GLM-4.5's and DeepSeek-V3's routers (sigmoid scores, a per-expert bias steering the
    choice, weights renormalised and scaled by 1.5) and DeepSeek-V2's (softmax scores, scaled
    by 2), each over 4 groups of 2 experts of which a row's best 2 (V2: its best 1)
    compete: the same experts and the same weight bits as transformers' router, and the
    groups change some rows' choice against a top-2 over all experts."""
    from shoal.engine.models.layers.experts import GroupedRouter

    checkpoint = tiny_checkpoints[family]
    loaded = load(checkpoint, "safetensors")
    assert loaded.config.num_layers == 3  # any prediction layer after them is never loaded
    router = loaded.module.blocks[1].mlp.router
    torch.manual_seed(0)
    x = torch.randn(512, loaded.config.hidden_size)
    with torch.no_grad():
        _, expected_weights, expected = checkpoint.hf_model.model.layers[1].mlp.gate(x)
    weights, chosen = router(x)
    ours, theirs = _by_expert(weights, chosen), _by_expert(expected_weights, expected)
    assert torch.equal(ours[1], theirs[1]) and torch.equal(ours[0], theirs[0])
    if router.normalize:
        torch.testing.assert_close(weights.sum(dim=-1), torch.full((512,), router.scale))
    ungrouped = GroupedRouter(router.weight, 2, router.normalize, router.scoring,
                              score_bias=router.score_bias, scale=router.scale)
    moved = (chosen.sort().values != ungrouped(x)[1].sort().values).any(dim=-1)
    assert 0 < int(moved.sum()) < 512


def test_moe_layers_mixed_with_dense_ones_are_refused(tmp_path):
    checkpoint_dir = tmp_path / "hf"
    tiny_models.hf_model("qwen3moe", mlp_only_layers=[1]).save_pretrained(checkpoint_dir)
    with pytest.raises(UnsupportedModel, match="mlp_only_layers"):
        load_model(ModelSource("tiny", "safetensors", checkpoint_dir), "float32")


@pytest.mark.parametrize("family", ["qwen3moe", "glm4moe", "deepseek3"])
def test_tensor_parallel_expert_layers_are_refused_by_name(tiny_checkpoints, family):
    checkpoint = tiny_checkpoints[family]
    with pytest.raises(UnsupportedModel, match="pipeline"):
        load_model(ModelSource("tiny", "gguf", checkpoint.gguf_path), "float32",
                   shard=TensorShard(0, 2), reduce=lambda partial: partial)


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """qwen3moe with a byte-level tokenizer in its GGUF file (the engine encodes and
    detokenizes): its vocabulary is the tokenizer's."""
    metadata = tiny_byte_level_metadata()
    return tiny_models.build("qwen3moe", tmp_path_factory.mktemp("moe-chat"), metadata=metadata,
                             vocab_size=len(metadata["tokenizer.ggml.tokens"]))


def moe_engine(checkpoint, cache_dir, speculative: SpeculativeConfig | None = None) -> Engine:
    return Engine(EngineConfig(
        source=ModelSource("tiny-moe", "gguf", checkpoint.gguf_path), dtype="float32",
        threads=2, kv_cache_bytes=4 * 2**20, block_size=8, max_num_batched_tokens=64,
        speculative=speculative, cache_dir=cache_dir))


def run_requests(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]
                 ) -> dict[str, dict]:
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, ids, params)
    results = {rid: {"ids": [], "cached": 0, "drafts": 0} for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            entry = results[out.request_id]
            entry["ids"].extend(out.token_ids)
            entry["cached"] = max(entry["cached"], out.cached_tokens)
            entry["drafts"] = max(entry["drafts"], out.draft_tokens)
    return results


def test_the_engine_batches_and_caches_prefixes_of_a_moe_model(chat_checkpoint, tmp_path):
    engine = moe_engine(chat_checkpoint, tmp_path)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = {str(i): [(7 * i + j * 13) % 250 + 3 for j in range(10 + 3 * i)] for i in range(4)}
    first = run_requests(engine, {rid: (ids, greedy) for rid, ids in prompts.items()})
    reference = chat_checkpoint.gguf_reference
    for request_id, ids in prompts.items():
        assert first[request_id]["ids"] == transformers_greedy(reference, ids, 12)
    # Its prompt's full blocks are cached now.
    again = run_requests(engine, {"again": (prompts["3"], greedy)})["again"]
    assert again["cached"] >= 16
    assert again["ids"] == first["3"]["ids"]


def test_guessing_leaves_a_batch_of_eight_moe_requests_as_they_were(chat_checkpoint, tmp_path):
    """n-gram speculation over a batch of 8 (greedy and seeded sampling): the same tokens
    as without it."""
    loop = [40, 41, 42, 43, 44, 45] * 4  # repeats: the n-gram proposer has guesses to make
    requests = {}
    for i in range(8):
        params = (SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True) if i % 2
                  else SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True))
        requests[str(i)] = (loop[i:] + [3 + i], params)
    plain = run_requests(moe_engine(chat_checkpoint, tmp_path / "plain"), requests)
    guessed = run_requests(moe_engine(chat_checkpoint, tmp_path / "guessed",
                                      SpeculativeConfig("ngram")), requests)
    assert {rid: r["ids"] for rid, r in guessed.items()} == \
        {rid: r["ids"] for rid, r in plain.items()}
    assert sum(r["drafts"] for r in guessed.values()) > 0
