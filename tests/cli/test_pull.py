"""shoal pull MODEL against a node in this process (with an API key): progress lines with a
percentage, exit 0 on success; the node's message and exit 1 for an unknown model, a missing
key, an error line in the stream, a stream that ends early, or no node at all."""

from __future__ import annotations

import pytest
from fakes import fake_engine_config, fake_supervisor_options
from serve_process import free_port

from shoal.cli import pull as pull_command
from shoal.cli.app import main
from shoal.config import ClusterSettings, NodeConfig, ServerConfig
from shoal.node import BackgroundNode
from shoal.runner.supervisor import RunnerSupervisor

KEY = "sk-pull-test"


@pytest.fixture(scope="module")
def node_url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pull-node")
    source = fake_engine_config(tmp).source
    options = fake_supervisor_options()
    node = BackgroundNode(
        NodeConfig(server=ServerConfig(port=0, api_keys=(KEY,)), models=("fake-model",),
                   data_dir=tmp, cluster=ClusterSettings(standalone=True)),
        make_supervisor=lambda s, _parallel: RunnerSupervisor(
            fake_engine_config(tmp, s.model_id), options),
        resolve=lambda name: source, list_available=list)
    url = node.start()
    yield url
    node.stop()


def test_pull_prints_progress_and_succeeds_with_the_key(node_url, capsys, monkeypatch):
    monkeypatch.setenv("SHOAL_API_KEY", KEY)
    # The node's /api/pull resolves names through the catalogue: the built-in model is there.
    assert main(["pull", "smollm2", "--url", node_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "pulling manifest" and lines[-1] == "success"
    assert lines[1].startswith("pulling ") and " 100% (" in lines[1] and lines[1].endswith(" MiB)")


def test_pull_says_why_it_failed_and_exits_1(node_url, capsys, monkeypatch):
    monkeypatch.delenv("SHOAL_API_KEY", raising=False)
    assert main(["pull", "smollm2", "--url", node_url]) == 1
    assert "requires an API key" in capsys.readouterr().err
    monkeypatch.setenv("SHOAL_API_KEY", KEY)
    assert main(["pull", "no-such-model", "--url", node_url]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shoal: error: pull no-such-model: pull 'no-such-model:latest' "
                          "from Ollama's registry")
    assert main(["pull", "smollm2", "--url", f"http://127.0.0.1:{free_port()}"]) == 1
    assert "no shoal node answers" in capsys.readouterr().err


def test_pull_fails_on_an_error_line_or_a_stream_that_ends_early(capsys, monkeypatch):
    def ends_early(_url, _model, _headers):
        yield {"status": "pulling manifest"}

    monkeypatch.setattr(pull_command, "pull", ends_early)
    assert main(["pull", "m", "--url", "http://node"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "pulling manifest\n" and "before it reported success" in captured.err

    events = pull_command.progress_events(['{"status": "pulling manifest"}', "",
                                           '{"error": "disk full"}'])
    assert next(events) == {"status": "pulling manifest"}
    with pytest.raises(pull_command.PullError, match="disk full"):
        next(events)
    with pytest.raises(pull_command.PullError, match="not JSON"):
        list(pull_command.progress_events(["<html>"]))


def test_describe_adds_a_percentage_when_the_event_counts_bytes():
    assert pull_command.describe({"status": "pulling manifest"}) == "pulling manifest"
    event = {"status": "pulling abc", "total": 4 * 2**20, "completed": 2**20}
    assert pull_command.describe(event) == "pulling abc 25% (1.0 / 4.0 MiB)"
    assert pull_command.describe({"status": "x", "total": 0, "completed": 0}) == "x"


# -- with no node: straight into the data dir ----------------------------------------------


@pytest.fixture
def hub(monkeypatch):
    from hub_servers import HubServer

    server = HubServer()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("SHOAL_OLLAMA_REGISTRY", server.url)
    monkeypatch.setenv("SHOAL_PORT", str(free_port()))  # no node answers there
    yield server
    server.close()


def test_pull_without_a_node_fills_the_store_that_models_and_rm_use(hub, tmp_path, capsys):
    weights = b"GGUF" + b"\1" * (3 * 2**20)
    hub.add_hf_repo("org/Tiny-GGUF", {"tiny-Q4_K_M.gguf": weights, "README.md": b"hi"})
    data = str(tmp_path / "data")
    assert main(["pull", "hf.co/org/Tiny-GGUF", "--data-dir", data]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "pulling manifest" and out[-2] == "success"
    assert any(line.endswith("100% (3.0 / 3.0 MiB)") for line in out)
    assert out[-1].startswith("org/Tiny-GGUF:Q4_K_M: ") and out[-1].endswith("tiny-Q4_K_M.gguf")

    assert main(["models", "--data-dir", data]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("org/Tiny-GGUF:Q4_K_M")]
    assert row.split()[1:5] == ["chat", "gguf", "3", "MB"] and "pulled (huggingface)" in row

    assert main(["rm", "hf.co/org/Tiny-GGUF", "--data-dir", data]) == 0
    assert capsys.readouterr().out == "deleted org/Tiny-GGUF:Q4_K_M (3 MB)\n"
    assert main(["rm", "org/Tiny-GGUF", "--data-dir", data]) == 1
    assert "is not in the model store" in capsys.readouterr().err
    assert main(["pull", "org/absent", "--data-dir", data]) == 1
    assert "no such repository" in capsys.readouterr().err


def test_run_pulls_a_missing_model_before_it_starts_its_node(hub, tmp_path, monkeypatch):
    from shoal.cli import local_pull

    pulled = []
    monkeypatch.setattr(local_pull, "pull_here",
                        lambda model, data_dir, out=None: pulled.append((model, data_dir)))
    data = str(tmp_path / "data")
    local_pull.pull_if_missing("llama3.2", data)
    local_pull.pull_if_missing("./no/such/file.gguf", data)  # not pullable: the node says so
    assert pulled == [("llama3.2", data)]


def test_the_bar_redraws_one_line_per_file_on_a_terminal():
    import io

    from shoal.cli.progress_bar import ProgressBar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    bar = ProgressBar(out)
    for event in ({"status": "pulling manifest"},
                  {"status": "pulling abc", "total": 4 * 2**20, "completed": 2**20},
                  {"status": "pulling abc", "total": 4 * 2**20, "completed": 4 * 2**20},
                  {"status": "success"}):
        bar.show(event)
    bar.close()
    lines = out.getvalue().split("\n")
    assert lines[0] == "pulling manifest" and lines[-2:] == ["success", ""]
    assert lines[1].startswith("\rpulling abc [#######.") and " 25% 1.0/4.0 MiB " in lines[1]
    assert lines[1].endswith("\rpulling abc [" + "#" * 30 + "] 100% 4.0/4.0 MiB " +
                             lines[1].rsplit(" ", 2)[-2] + " MiB/s\033[K")
