"""The router: this node's pool when it runs the model, another node's instance when one
serves it and this node does not, the pool again (loading on first use) otherwise."""

from __future__ import annotations

import asyncio

from memory_pool import embed, generate, loaded, make_router, run, sources  # noqa: F401

from shoal.protocol import FinishChunk, Usage


class FakeCluster:
    """RemoteServing with one remote instance per model listed in `remote`."""

    def __init__(self, remote: dict[str, str]) -> None:
        self.remote = remote
        self.submitted = []

    def remote_instance_for(self, model_id: str) -> str | None:
        return self.remote.get(model_id)

    def model_named(self, name: str) -> str | None:
        return name if name in self.remote else None

    async def submit_remote(self, request, instance_id):
        self.submitted.append((request.model, instance_id))
        yield FinishChunk(request_id=request.request_id, finish_reason="stop",
                          usage=Usage(prompt_tokens=1, completion_tokens=0))


def test_a_model_served_elsewhere_goes_remote_unless_this_node_runs_it(sources):
    events = []
    cluster = FakeCluster({"chat": "inst-remote", "far-away": "inst-far"})

    async def main():
        router = make_router(sources, events, cluster=cluster)
        remote = await run(router, generate("chat"))
        only_there = await run(router, generate("far-away"))  # unknown here, known there
        canonical = router.canonical_id("far-away")
        await router.preload(["chat"])
        local = await run(router, generate("chat"))
        vectors = await router.embed(embed("embedder"))  # embeddings stay local
        names = loaded(router)
        await router.shutdown()
        return remote, only_there, canonical, local, vectors, names

    remote, only_there, canonical, local, vectors, names = asyncio.run(main())
    assert [c.kind for c in remote] == ["finish"]  # straight from the fake remote
    assert [c.kind for c in only_there] == ["finish"] and canonical == "far-away"
    assert cluster.submitted == [("chat", "inst-remote"), ("far-away", "inst-far")]
    assert [c.kind for c in local] == ["accepted", "finish"]
    assert vectors.kind == "embedding" and names == ["chat", "embedder"]


def test_no_instance_anywhere_loads_here_and_unknown_names_stay_404(sources):
    cluster = FakeCluster({})

    async def main():
        router = make_router(sources, [], cluster=cluster)
        here = await run(router, generate("chat"))
        unknown = await run(router, generate("nowhere"))
        await router.shutdown()
        return here, unknown

    here, unknown = asyncio.run(main())
    assert [c.kind for c in here] == ["accepted", "finish"] and cluster.submitted == []
    assert unknown[0].code == "model_not_found"
