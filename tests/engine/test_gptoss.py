"""gpt-oss on a tiny random model: greedy tokens against transformers from safetensors and
from GGUF with MXFP4 experts, bf16 against float32, batches and prefix caching on both
backends; its parts (YaRN, the router, the clamped SwiGLU) against transformers' own."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from forward_helpers import all_position_logits, chunk, loaded_greedy, step
from forward_helpers import load_checkpoint as load
from forward_helpers import load_packed as packed
from tokenizer_fixtures import tiny_byte_level_metadata
from transformers_refs import transformers_greedy

from shoal.engine.backends.packing import QTYPES, QuantLinear
from shoal.engine.config import EngineConfig, ModelSource
from shoal.engine.engine import Engine
from shoal.engine.model_runner import ModelRunner
from shoal.engine.models.config import YarnScaling
from shoal.engine.models.layers.experts import ClampedSwiGLU, LogitTopKRouter
from shoal.engine.models.layers.linear import DenseLinear
from shoal.engine.models.layers.rotary import yarn_frequencies
from shoal.engine.sampling import SamplingParams

# ~20-token prompts: past the sliding window of 8, so sliding layers drop keys.
PROMPTS = [
    [3, 17, 99, 42, 5, 77, 8, 120, 64, 33, 2, 91, 15, 4, 9, 100, 101, 7, 12, 13],
    [7, 7, 7, 100, 1, 9, 30],
    [50, 60, 70, 80, 90, 100, 110, 120, 10, 20, 30, 40, 45, 55, 65, 75, 85, 1, 2, 3, 4, 5],
]
NEW_TOKENS = 32
BLOCK = 4
BLOCKS_PER_REQUEST = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_models.build("gpt-oss", tmp_path_factory.mktemp("gpt-oss"))


def ours_greedy(loaded, prompts=PROMPTS, steps=NEW_TOKENS) -> list[list[int]]:
    return loaded_greedy(loaded, prompts, steps, BLOCK, BLOCKS_PER_REQUEST)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_float32_greedy_tokens_equal_transformers(checkpoint, fmt):
    """From GGUF the experts are MXFP4: transformers runs on the file's dequantized values."""
    loaded = load(checkpoint, fmt)
    config = loaded.config
    assert config.architecture == "gpt-oss" and config.num_experts == 8
    assert config.layer_types == ("sliding", "full", "sliding", "full")
    assert config.sliding_window == 8 and config.rope_yarn.factor == 4.0
    reference = checkpoint.hf_model if fmt == "safetensors" else checkpoint.gguf_reference
    for prompt, tokens in zip(PROMPTS, ours_greedy(loaded)):
        assert tokens == transformers_greedy(reference, prompt, NEW_TOKENS)


def test_gguf_experts_stay_packed_in_mxfp4(checkpoint):
    fast = packed(checkpoint)
    expert = fast.module.blocks[0].mlp.experts[0]
    assert isinstance(expert, ClampedSwiGLU) and isinstance(expert.gate_up, QuantLinear)
    assert fast.weight_bytes <= 1.2 * checkpoint.gguf_path.stat().st_size
    # The GGUF file's gate expert tensors are MXFP4, the kernel's type code for it.
    from shoal.engine.weights.gguf_file import GGUFFile
    assert GGUFFile(checkpoint.gguf_path).tensors["blk.0.ffn_gate_exps.weight"].type_name \
        == "MXFP4" and "MXFP4" in QTYPES
    assert isinstance(load(checkpoint, "gguf").module.blocks[0].mlp.experts[0].gate_up,
                      DenseLinear)  # float32: dequantized


def test_the_grouped_kernel_equals_the_expert_loop_bit_for_bit(checkpoint):
    # Packed clamped-SwiGLU experts run as one compiled call per step (GroupedExperts); the
    # Python loop over experts is its definition: the same bits for generated rows, prompt
    # rows and a mix, one row or many.
    experts = packed(checkpoint).module.blocks[0].mlp
    assert experts.grouped is not None
    torch.manual_seed(0)
    x = torch.randn(40, experts.router.weight.shape[1]).to(torch.bfloat16)
    with torch.inference_mode():
        for rows, prompt_from in ((1, None), (1, 0), (5, None), (40, 0), (40, 17)):
            grouped = experts(x[:rows], prompt_from)
            compiled, experts.grouped = experts.grouped, None
            loop = experts(x[:rows], prompt_from)
            experts.grouped = compiled
            assert torch.equal(grouped, loop), (rows, prompt_from)


def test_bf16_next_tokens_follow_float32(checkpoint):
    """The default precision (MXFP4 experts packed, bf16 activations, float32 routing) read
    along float32's greedy continuations of the same GGUF: its next token is float32's at
    95% of positions. Measured 140 of 145 (plain torch in bf16: 135). The misses are not
    near-ties alone: this tiny model's router has near-tied experts, and where bf16 moves
    a row's hidden state across such a tie the layer picks another expert and the logits
    jump by 1-2.5 (the same positions jump in plain torch's bf16), where elsewhere they
    move by ~0.03."""
    exact, fast = load(checkpoint, "gguf"), packed(checkpoint)
    agree = total = 0
    for prompt, tokens in zip(PROMPTS, ours_greedy(exact)):
        ids, blocks = prompt + tokens, list(range(BLOCKS_PER_REQUEST))
        reference = all_position_logits(ModelRunner(exact, BLOCKS_PER_REQUEST, BLOCK), ids,
                                        blocks)
        ours = all_position_logits(ModelRunner(fast, BLOCKS_PER_REQUEST, BLOCK), ids, blocks)
        same = ours.argmax(-1) == reference.argmax(-1)
        agree, total = agree + int(same.sum()), total + len(ids)
    assert agree >= 0.95 * total, (agree, total)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_equals_its_rows_run_alone(checkpoint, dtype):
    loaded = packed(checkpoint) if dtype == "bfloat16" else load(checkpoint, "gguf")
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(PROMPTS))]
    alone = ModelRunner(loaded, 16 * len(PROMPTS), BLOCK)
    together = ModelRunner(loaded, 16 * len(PROMPTS), BLOCK)
    firsts = [step(alone, chunk(str(i), p, 0, tables[i])) for i, p in enumerate(PROMPTS)]
    step(together, *(chunk(str(i), p, 0, tables[i]) for i, p in enumerate(PROMPTS)))
    tokens, lengths = [int(f[0].argmax()) for f in firsts], [len(p) for p in PROMPTS]
    for _ in range(12):  # past the window in every row
        chunks = [chunk(str(i), [tokens[i]], lengths[i], tables[i]) for i in range(len(PROMPTS))]
        batched = step(together, *chunks)
        separate = torch.cat([step(alone, c) for c in chunks])
        if dtype == "bfloat16":  # packed rows are computed alone: the same bits
            assert torch.equal(batched, separate)
        else:
            torch.testing.assert_close(batched, separate, atol=1e-5, rtol=1e-5)
        tokens = [int(row.argmax()) for row in batched]
        assert tokens == [int(row.argmax()) for row in separate]
        lengths = [n + 1 for n in lengths]


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """gpt-oss with a byte-level tokenizer in its GGUF file (the engine encodes and
    detokenizes): its vocabulary is the tokenizer's."""
    metadata = tiny_byte_level_metadata()
    return tiny_models.build("gpt-oss", tmp_path_factory.mktemp("gpt-oss-chat"),
                             metadata=metadata,
                             vocab_size=len(metadata["tokenizer.ggml.tokens"]))


def run_requests(engine: Engine, requests: dict[str, list[int]], max_tokens: int
                 ) -> dict[str, dict]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for request_id, ids in requests.items():
        engine.add_request(request_id, ids, params)
    results = {rid: {"ids": [], "cached": 0} for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id]["ids"].extend(out.token_ids)
            results[out.request_id]["cached"] = max(results[out.request_id]["cached"],
                                                    out.cached_tokens)
    return results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_batches_and_reuses_cached_prefixes(chat_checkpoint, tmp_path, dtype):
    """Four requests batched, then one again from the prefix cache (its blocks reach past
    the sliding window): the same tokens; float32's are transformers' too."""
    engine = Engine(EngineConfig(
        source=ModelSource("tiny-gpt-oss", "gguf", chat_checkpoint.gguf_path), dtype=dtype,
        threads=2, kv_cache_bytes=4 * 2**20, block_size=8, max_num_batched_tokens=64,
        cache_dir=tmp_path))
    prompts = {str(i): [(7 * i + j * 13) % 250 + 3 for j in range(18 + 3 * i)] for i in range(4)}
    first = run_requests(engine, prompts, 12)
    if dtype == "float32":
        for request_id, ids in prompts.items():
            assert first[request_id]["ids"] == transformers_greedy(
                chat_checkpoint.gguf_reference, ids, 12)
    again = run_requests(engine, {"again": prompts["3"]}, 12)["again"]
    assert again["cached"] >= 24
    assert again["ids"] == first["3"]["ids"]


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_are_transformers(truncate):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                beta_slow=1.0, original_max_position_embeddings=4096, truncate=truncate)
    config = GptOssConfig(head_dim=64, rope_parameters=rope, max_position_embeddings=131072)
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours, our_factor = yarn_frequencies(64, 150000.0, YarnScaling(32.0, 4096, truncate=truncate))
    assert torch.equal(ours, expected) and our_factor == factor


def test_router_and_clamped_swiglu_are_transformers():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

    torch.manual_seed(0)
    config = GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=6,
                          num_experts_per_tok=3)
    router = GptOssTopKRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 1), router.bias.normal_(0, 1)
    x = torch.randn(20, 16) * 3
    _, scores, indices = router(x)
    weights, chosen = LogitTopKRouter(router.weight.detach(), router.bias.detach(), 3)(x)
    assert torch.equal(chosen, indices) and torch.equal(weights, scores)

    experts = GptOssExperts(config)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, 1.5)  # gate and up well past the clamps at +-7
    e = 2
    gate_up, bias = experts.gate_up_proj[e].detach(), experts.gate_up_proj_bias[e].detach()
    down, down_bias = experts.down_proj[e].detach(), experts.down_proj_bias[e].detach()
    expected = experts._apply_gate(x @ gate_up + bias) @ down + down_bias
    assert (x @ gate_up + bias).abs().max() > 7
    split = torch.cat((gate_up[:, ::2], gate_up[:, 1::2]), dim=1).t().contiguous()
    ours = ClampedSwiGLU(DenseLinear(split, torch.cat((bias[::2], bias[1::2]))),
                         DenseLinear(down.t().contiguous(), down_bias), 1.702, 7.0)
    torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)
