"""What a request's model name names when the model runs only on another node."""

from __future__ import annotations

import asyncio

from shoal.catalog.resolve import ModelNotFound
from shoal.pool.names import ModelNames
from shoal.router.naming import Naming


class _Chooser:
    """Instances elsewhere in the cluster, by model id."""

    def __init__(self, models: list[str]) -> None:
        self.models = models

    def model_named(self, name: str) -> str | None:
        return next((m for m in self.models if m.lower() == name.lower()), None)


def test_another_node_s_path_names_the_instance_that_node_runs_under_its_stem():
    copies: list[str] = []

    def nowhere(name):
        raise ModelNotFound(f"{name} is not on disk")

    async def from_peers(name):
        copies.append(name)
        return False

    names = ModelNames(nowhere)
    names.fetch_from_peers = from_peers
    names.cluster_id = lambda name: name.rsplit("/", 1)[-1].removesuffix(".gguf")
    naming = Naming(names, _Chooser(["tiny"]), {})  # type: ignore[arg-type]
    named = asyncio.run(naming.identify("/models/tiny.gguf", None))
    assert named.model_id == "tiny" and named.source is None
    assert copies == []  # served where it runs: nothing is copied here
