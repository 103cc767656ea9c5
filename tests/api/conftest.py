import os
import sys

import pytest

# tests/fakes.py is shared by the runner, api and cli tests.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fakes import fake_engine_config, fake_runner_env, fake_supervisor_options

from shoal.catalog.resolve import ModelNotFound
from shoal.config import ClusterSettings, NodeConfig, ServerConfig
from shoal.node import BackgroundNode
from shoal.runner.supervisor import RunnerSupervisor


@pytest.fixture(scope="module")
def fake_node(tmp_path_factory):
    """A node on a free port serving the fake engine as "fake-model" (alias "fake"), and
    as "fake-harmony" and "fake-think", reasoning models speaking harmony and writing
    <think> tags (tests/fakes.py).

    "broken-model" resolves to a model whose load fails; other names are not found.
    """
    tmp = tmp_path_factory.mktemp("fake-node")
    abort_log = tmp / "aborts.txt"
    sources = {name: fake_engine_config(tmp, model_id).source
               for name, model_id in (("fake-model", "fake-model"), ("fake", "fake-model"),
                                      ("broken-model", "fake-fail-load"),
                                      ("fake-harmony", "fake-harmony"),
                                      ("fake-think", "fake-think"))}

    def resolve(name):
        if name not in sources:
            raise ModelNotFound(f"model {name!r} not found")
        return sources[name]

    options = fake_supervisor_options(
        env={**fake_runner_env(), "SHOAL_FAKE_ABORT_LOG": str(abort_log)}, max_in_flight=4)

    def make_supervisor(source, _parallel):
        return RunnerSupervisor(fake_engine_config(tmp, source.model_id), options)

    config = NodeConfig(server=ServerConfig(port=0, keepalive_s=0.3), models=("fake-model",),
                        data_dir=tmp, cluster=ClusterSettings(standalone=True))
    node = BackgroundNode(config, make_supervisor=make_supervisor, resolve=resolve,
                          list_available=list)
    node.start()
    node.abort_log = abort_log
    yield node
    node.stop()
