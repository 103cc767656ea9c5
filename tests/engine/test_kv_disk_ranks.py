"""The SSD tier of a model split over two ranks (each a process on 127.0.0.1, each with its
own disk directory as on two nodes), float32 (slow): after both restart, a stored prompt is
served from disk with the same output; a block one rank lost is computed again, and
everything after it too."""

from __future__ import annotations

from pathlib import Path

import pytest
from rank_processes import follow, run_ranks, split_config
from tokenizer_fixtures import smollm2_path

from shoal.engine.config import KvDiskConfig
from shoal.engine.engine import Engine
from shoal.engine.kv.prefix_cache import extend_block_hashes
from shoal.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = ("The lighthouse keeper counted the ships that passed the rocks at night, and wrote "
          "each name in a ledger with the hour and the weather. ") * 6
BLOCK = 16


def rank_main(rank: int, world: int, port: int, path: str, sharding: str,
              layers: list[tuple[int, int]], disk_roots: list[str]):
    config = split_config(rank, world, port, path, sharding, layers,
                          kv_disk=KvDiskConfig(Path(disk_roots[rank]), 256 * 2**20, 3600.0))
    if rank != 0:
        return follow(config)
    engine = Engine(config)
    try:
        ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
        engine.add_request("r", ids, SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True))
        tokens, cached = [], 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens.extend(output.token_ids)
                cached = output.cached_tokens
        return {"tokens": tokens, "cached": cached, "ids": ids}
    finally:
        engine.close()  # the other rank writes out its share on the shutdown plan


def block_files(root: Path) -> list[Path]:
    return list(root.rglob("*.kv"))


@pytest.mark.parametrize("sharding, layers", [
    ("pipeline", [(0, 13), (13, 30)]),
    ("tensor", [(0, 30), (0, 30)]),
])
def test_a_split_model_serves_a_stored_prompt_from_every_rank_s_disk(tmp_path, sharding, layers):
    path = str(smollm2_path())
    roots = [tmp_path / "node0", tmp_path / "node1"]

    def serve():
        results = run_ranks(rank_main, 2, path, sharding, layers, [str(r) for r in roots],
                            timeout_s=300)
        assert isinstance(results[1], int) and results[1] > 0, results
        return results[0]

    cold = serve()
    assert cold["cached"] == 0, cold
    full = (len(cold["ids"]) - 1) // BLOCK
    for root in roots:  # each rank wrote its own share of every full block
        assert len(block_files(root)) == full, root

    warm = serve()
    assert warm["tokens"] == cold["tokens"]
    assert warm["cached"] == full * BLOCK

    # The other rank lost the prompt's fourth block: rank 0 still holds it, but only the
    # three before it are loaded; the rest is computed again.
    fourth = extend_block_hashes([], cold["ids"], BLOCK)[3]
    (lost,) = [f for f in block_files(roots[1]) if f.name == fourth.hex() + ".kv"]
    lost.unlink()
    partial = serve()
    assert partial["tokens"] == cold["tokens"]
    assert partial["cached"] == 3 * BLOCK
