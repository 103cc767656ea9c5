"""Prefix blocks of a model split over two ranks (each a process on 127.0.0.1), moved to
another instance split the same way through the runners' prefix share (as between nodes),
float32 (slow): rank 0 gathers every rank's share on export, and on import each rank stores
its own; the held request is then served from the imported blocks with the output of a
local prefill. A share with a value that is not finite is refused before any rank stores
anything."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rank_processes import follow, run_ranks, split_config
from tokenizer_fixtures import smollm2_path

from shoal.engine.engine import Engine
from shoal.engine.kv.transfer import TransferError, join_blocks
from shoal.engine.sampling import SamplingParams
from shoal.protocol import GenerationRequest
from shoal.runner.kv_wire import blocks_from_wire
from shoal.runner.prefix_messages import PrefixExport, PrefixFetched, PrefixPart, PrefixWanted
from shoal.runner.prefix_share import RunnerPrefixShare

pytestmark = pytest.mark.slow

PROMPT = ("The ferry left the harbour at dawn with crates of apples, a brass bell, and two "
          "sleepy dogs who watched the gulls. ") * 6
BLOCK = 16


def generate(engine: Engine, ids: list[int]) -> tuple[list[int], int]:
    engine.add_request(f"r{len(engine._requests)}", ids,
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    tokens, cached = [], 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.extend(output.token_ids)
            cached = output.cached_tokens
    return tokens, cached


def rank_main(rank: int, world: int, port: int, path: str, sharding: str,
              layers: list[tuple[int, int]], parts: list[dict] | None):
    """Instance A (parts None): serve the prompt and export its blocks in parts. Instance B:
    refuse a tampered copy, hold the prompt for its prefix, import the parts, serve it."""
    config = split_config(rank, world, port, path, sharding, layers)
    if rank != 0:
        return follow(config)
    engine = Engine(config)
    try:
        ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
        sent: list = []
        share = RunnerPrefixShare(engine, sent.append)
        if parts is None:
            tokens, cached = generate(engine, ids)
            usable = (len(ids) - 1) // BLOCK * BLOCK
            share.export(PrefixExport(export_id="x", compat=share.compat,
                                      token_ids=tuple(ids[:usable]), start_block=0))
            return {"tokens": tokens, "cached": cached, "ids": ids, "compat": share.compat,
                    "own_tensors": len(engine.transfer.layout),
                    "parts": [m.model_dump(mode="python") for m in sent]}
        blocks = join_blocks([blocks_from_wire(part["blocks"]) for part in parts])
        tampered = list(blocks.tensors)
        tampered[-1] = tampered[-1].clone()
        tampered[-1][0, 0] = float("nan")  # the other rank's share
        try:
            engine.import_prefix(dataclasses.replace(blocks, tensors=tuple(tampered)))
            refused = ""
        except TransferError as error:
            refused = str(error)
        assert share.hold(GenerationRequest(request_id="r", model="m", prompt=PROMPT), ids)
        wanted = sent.pop()
        assert isinstance(wanted, PrefixWanted) and wanted.have_blocks == 0
        for part in parts:
            share.on_part(PrefixPart(request_id="r", blocks=part["blocks"]))
        held = share.on_fetched(PrefixFetched(request_id="r"))
        tokens, cached = generate(engine, held.token_ids)
        return {"tokens": tokens, "cached": cached, "stored": held.imported_blocks,
                "refused": refused, "compat": share.compat}
    finally:
        engine.close()


@pytest.mark.parametrize("sharding, layers", [
    ("pipeline", [(0, 13), (13, 30)]),
    ("tensor", [(0, 30), (0, 30)]),
])
def test_a_split_instance_serves_a_prompt_from_blocks_another_instance_exported(
        sharding, layers):
    path = str(smollm2_path())
    source = run_ranks(rank_main, 2, path, sharding, layers, None, timeout_s=300)
    assert isinstance(source[1], int) and source[1] > 0, source
    held = source[0]
    assert held["compat"].count(f"|{sharding}x2:0+") == 1, held["compat"]
    full = (len(held["ids"]) - 1) // BLOCK
    exported = join_blocks([blocks_from_wire(part["blocks"]) for part in held["parts"]])
    assert exported.num_blocks == full
    # Rank 0's layers, then the other rank's: 13 + 17 layers, or 30 shards of each.
    own = held["own_tensors"]
    assert own == layers[0][1] - layers[0][0]
    assert len(exported.tensors) == own + layers[1][1] - layers[1][0]
    if sharding == "tensor":  # each rank holds its own heads: the shares differ
        assert not torch.equal(exported.tensors[0], exported.tensors[own])

    target = run_ranks(rank_main, 2, path, sharding, layers, held["parts"], timeout_s=300)
    assert isinstance(target[1], int) and target[1] > 0, target
    served = target[0]
    assert served["compat"] == held["compat"]
    assert f"tensor {len(exported.tensors) - 1} holds values that are not finite" \
        in served["refused"]
    assert served["stored"] == full
    assert served["cached"] == full * BLOCK
    assert served["tokens"] == held["tokens"]
