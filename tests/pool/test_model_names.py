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


def test_another_node_s_path_is_asked_of_peers_and_found_here_by_the_id_that_node_gives_it(
        tmp_path):
    """Node A serves /models/tiny.gguf as "tiny" (its stem); this node has no such path: it
    copies the model from A by that id and resolves the copy by it, and the path means the
    model from then on."""
    weights = tmp_path / "tiny.gguf"
    weights.write_bytes(b"GGUF")
    here: set[str] = set()
    asked: list[str] = []

    def resolve_here(name):
        if name not in here:
            raise ModelNotFound(f"{name} is not on disk")
        return ModelSource(model_id=name, format="gguf", path=weights)

    async def from_peers(name):
        asked.append(name)
        here.add(name)  # the copy lands in the store under the holder's id
        return True

    names = ModelNames(resolve_here)
    names.fetch_from_peers = from_peers
    names.cluster_id = lambda name: name.rsplit("/", 1)[-1].removesuffix(".gguf")

    async def main():
        assert await names.peer_id("/models/tiny.gguf") == "tiny"
        assert await names.identify("/models/tiny.gguf") == ("tiny", resolve_here("tiny"))
        assert await names.identify("/models/tiny.gguf") == ("tiny", None)  # known now

    asyncio.run(main())
    assert asked == ["tiny"]
