"""A tiny mixture-of-experts model (qwen3moe) over two real nodes on 127.0.0.1: an expert
instance (each node holds half of every layer's experts) and a pipeline instance answer in
float32 exactly as a single node does, several requests at once; killing an expert rank
mid-stream ends the stream with an error in bounded time and the model serves again
(multinode, slow)."""

from __future__ import annotations


import pytest
from engine import tiny_models  # tests/engine, a namespace package on tests/'s path
from engine.tokenizer_fixtures import tiny_byte_level_metadata
from test_multinode import cluster_of, start_nodes, stopping, wait_for
from test_multinode_parallel import (
    answers, assert_killing_rank1_mid_stream_ends_it_and_the_model_serves_again, delete, place)

pytestmark = [pytest.mark.multinode, pytest.mark.slow]


# A hub id every node resolves the same way, from the Hugging Face cache the nodes are given
# (a path's model id is its file's stem, which another node cannot resolve).
MODEL = "shoal-tests/tiny-qwen3moe"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A hub cache holding the tiny model's GGUF (long context for the kill)."""
    cache = tmp_path_factory.mktemp("hub")
    snapshot = cache / "models--shoal-tests--tiny-qwen3moe" / "snapshots" / "main"
    snapshot.mkdir(parents=True)
    metadata = tiny_byte_level_metadata()
    checkpoint = tiny_models.build("qwen3moe", tmp_path_factory.mktemp("moe"),
                                   metadata=metadata, max_position_embeddings=4096,
                                   vocab_size=len(metadata["tokenizer.ggml.tokens"]))
    checkpoint.gguf_path.rename(snapshot / "tiny-qwen3moe.gguf")
    return cache


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, hub_cache):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_CACHE", str(hub_cache))  # the node processes inherit it
        nodes = start_nodes(tmp_path_factory.mktemp("experts"), 2,
                            extra={0: ["--dtype", "float32"], 1: ["--dtype", "float32"]})
    with stopping(nodes):
        wait_for(lambda: all(len((cluster_of(n) or {}).get("nodes", [])) == 2 for n in nodes),
                 20, "a two-node cluster")
        yield nodes


def test_expert_and_pipeline_instances_answer_as_one_node(two_nodes):
    first, second = two_nodes
    single = place(first, MODEL, "single", 1)
    expected = answers(first, MODEL)
    delete(first, single["instance_id"], two_nodes)
    for sharding in ("expert", "pipeline"):
        instance = place(first, MODEL, sharding, 2)
        ranks = instance["ranks"]
        assert instance["sharding"] == sharding and len({r["node_id"] for r in ranks}) == 2
        if sharding == "expert":  # every layer on both, the 8 experts split between them
            assert [r["layers"] for r in ranks] == [[0, 2], [0, 2]]
            assert ranks[0]["experts"][0] == 0 and ranks[1]["experts"][1] == 8
            assert ranks[0]["experts"][1] == ranks[1]["experts"][0]
        assert answers(second, MODEL) == expected, sharding
        delete(first, instance["instance_id"], two_nodes)


def test_killing_an_expert_rank_mid_stream_ends_it_with_an_error_and_serves_again(two_nodes):
    first = two_nodes[0]
    instance = place(first, MODEL, "expert", 2)
    assert_killing_rank1_mid_stream_ends_it_and_the_model_serves_again(
        two_nodes, instance, MODEL, 3000)
