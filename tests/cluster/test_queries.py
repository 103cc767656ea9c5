"""Questions to every node: each answers with its handler's body; a node that is silent,
has no handler or fails is reported with the reason, within the asker's bound; answers
never reach the data plane's streams."""

from __future__ import annotations

import asyncio
import time

from shoal.cluster.data_plane import RemoteStreams
from shoal.cluster.queries import ClusterQueries
from shoal.cluster.transport import MemoryHub


def test_every_node_answers_or_is_named_with_the_reason():
    async def main():
        hub = MemoryHub()
        asker, fast, failing, silent, bare = (
            hub.connect(name) for name in ("asker", "fast", "failing", "silent", "bare"))
        queries = {name: ClusterQueries(t) for name, t in
                   (("asker", asker), ("fast", fast), ("failing", failing),
                    ("silent", silent), ("bare", bare))}
        streams = RemoteStreams(asker)
        streams.start()

        async def echo(args):
            return {"echo": args["x"]}

        async def fail(args):
            raise RuntimeError("disk on fire")

        async def hang(args):
            await asyncio.sleep(60)

        queries["fast"].serve("q", echo)
        queries["failing"].serve("q", fail)
        queries["silent"].serve("q", hang)
        for q in queries.values():
            q.start()
        await asyncio.sleep(0)  # peers announced
        started = time.monotonic()
        answers = await queries["asker"].ask("q", {"x": 7}, timeout_s=0.3)
        took = time.monotonic() - started
        only_fast = await queries["asker"].ask("q", {"x": 8}, timeout_s=5.0,
                                               nodes=frozenset({"fast"}))
        for q in queries.values():
            await q.stop()
        return answers, took, only_fast, streams.unknown

    answers, took, only_fast, unknown = asyncio.run(main())
    assert answers["fast"].body == {"echo": 7} and answers["fast"].error is None
    assert answers["failing"].error == "RuntimeError: disk on fire"
    assert answers["silent"].error == "no answer within 0.3 s"
    assert answers["bare"].error == "this node does not answer 'q'"
    assert set(answers) == {"fast", "failing", "silent", "bare"}  # never itself
    assert 0.3 <= took < 1.0
    assert only_fast["fast"].body == {"echo": 8} and set(only_fast) == {"fast"}
    assert unknown == 0  # the answers went past the data plane


def test_a_node_alone_has_no_one_to_ask():
    async def main():
        queries = ClusterQueries(MemoryHub().connect("alone"))
        queries.start()
        return await queries.ask("q", {}, timeout_s=5.0)

    assert asyncio.run(main()) == {}
