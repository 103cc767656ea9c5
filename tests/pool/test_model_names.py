"""A name on no disk here: copied from a peer before any pull from the outside source."""

from __future__ import annotations

import asyncio

import pytest

from shoal.catalog.resolve import ModelNotFound
from shoal.engine.config import ModelSource
from shoal.pool.names import ModelNames


def test_a_missing_model_comes_from_a_peer_first_and_from_outside_only_without_one(tmp_path):
    weights = tmp_path / "m.gguf"
    weights.write_bytes(b"GGUF")
    here: set[str] = set()
    calls: list[str] = []

    def resolve_here(name):
        if name not in here:
            raise ModelNotFound(f"{name} is not on disk")
        return ModelSource(model_id=name, format="gguf", path=weights)

    def resolve_or_pull(name):
        calls.append(f"pull {name}")
        here.add(name)
        return resolve_here(name)

    async def from_peers(name):
        calls.append(f"peer {name}")
        if name == "held":
            here.add(name)
            return True
        if name == "broken":
            raise ModelNotFound("every holder failed")
        return False

    names = ModelNames(resolve_or_pull, resolve_here)
    names.fetch_from_peers = from_peers

    async def main():
        assert (await names.resolve("held")).model_id == "held"
        assert (await names.resolve("held")).model_id == "held"  # on disk now: no copy
        assert (await names.resolve("elsewhere")).model_id == "elsewhere"
        assert (await names.resolve("broken")).model_id == "broken"  # the outside finishes
        assert (await names.resolve("skip", from_peers=False)).model_id == "skip"

    asyncio.run(main())
    assert calls == ["peer held", "peer elsewhere", "pull elsewhere", "peer broken",
                     "pull broken", "pull skip"]

    def nowhere(name):
        raise ModelNotFound(f"no source has {name}")

    failing = ModelNames(nowhere)
    failing.fetch_from_peers = from_peers
    with pytest.raises(ModelNotFound, match="every holder failed; no source has broken"):
        asyncio.run(failing.resolve("broken"))
