"""CLI and node configuration: flags over env over defaults, `shoal models`, `shoal run`."""

from __future__ import annotations

import json

import pytest
from fakes import fake_engine_config, fake_supervisor_options

from shoal.cli.app import main
from shoal.config import (
    ClusterSettings,
    NodeConfig,
    ServerConfig,
    build_cluster_settings,
    build_node_config,
    parse_size,
)
from shoal.node import BackgroundNode
from shoal.runner.supervisor import RunnerSupervisor


def test_parse_size():
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("2GB") == 2 * 1000**3
    assert parse_size("1024") == 1024
    with pytest.raises(ValueError, match="invalid size"):
        parse_size("lots")


def test_flags_beat_env_beat_defaults(tmp_path):
    env = {"SHOAL_PORT": "9000", "SHOAL_HOST": "0.0.0.0", "SHOAL_MODELS": "a, b",
           "SHOAL_THREADS": "3", "SHOAL_KV_CACHE_MEMORY": "1GiB", "SHOAL_DATA_DIR": str(tmp_path)}
    config = build_node_config(port=9100, env=env)
    assert config.server.port == 9100 and config.server.host == "0.0.0.0"
    assert config.models == ("a", "b")
    assert config.engine.threads == 3 and config.engine.kv_cache_bytes == 1024**3
    assert config.data_dir == tmp_path
    defaults = build_node_config(env={})
    assert defaults.server.port == 8470 and defaults.server.host == "127.0.0.1"
    assert defaults.models == () and defaults.engine.dtype == "auto"


@pytest.mark.parametrize("kwargs,env,message", [
    ({"port": 70000}, {}, "port"),
    ({}, {"SHOAL_PORT": "http"}, "port"),
    ({"threads": 0}, {}, "threads"),
    ({"dtype": "float8"}, {}, "dtype"),
    ({"kv_cache_memory": "12zz"}, {}, "invalid size"),
    ({"kv_disk": "lots"}, {}, "invalid size"),
    ({"kv_disk": "1KiB"}, {}, "at least 1 MiB"),
    ({"kv_disk": "1GiB"}, {"SHOAL_KV_DISK_TTL": "-5m"}, "TTL must be positive"),
    ({"kv_disk": "1GiB", "kv_disk_ttl": "soon"}, {}, "invalid duration"),
    ({}, {"SHOAL_KV_CACHE_DTYPE": "fp8"}, "one of auto, bfloat16, float32, int8, not 'fp8'"),
])
def test_bad_values_raise_value_errors(kwargs, env, message):
    with pytest.raises(ValueError, match=message):
        build_node_config(env=env, **kwargs)


def test_cluster_settings_from_flags_and_env():
    env = {"SHOAL_PEERS": "tcp/10.0.0.2:7447, tcp/10.0.0.3:7447",
           "SHOAL_CLUSTER_SECRET": "hunter2",
           "SHOAL_DISCOVERY": "off", "SHOAL_FORCE_MASTER": "yes", "SHOAL_NODE_NAME": "left"}
    settings = build_cluster_settings(listen=["tcp/0.0.0.0:7447"], env=env)
    assert settings.peers == ("tcp/10.0.0.2:7447", "tcp/10.0.0.3:7447")
    assert settings.listen == ("tcp/0.0.0.0:7447",) and settings.name == "left"
    assert settings.discovery is False and settings.force_master and not settings.standalone
    assert settings.secret == "hunter2" and "hunter2" not in repr(settings)  # never shown
    assert build_cluster_settings(env={}).discovery is None  # on unless peers are given
    assert build_cluster_settings(env={"SHOAL_DISCOVERY_INTERFACE": "lo"}
                                  ).discovery_interface == "lo"
    with pytest.raises(ValueError, match="SHOAL_DISCOVERY"):
        build_cluster_settings(env={"SHOAL_DISCOVERY": "maybe"})
    with pytest.raises(ValueError, match="standalone"):
        build_cluster_settings(standalone=True, peers=["tcp/10.0.0.2:7447"], env={})
    no_preload = build_node_config(preload=False, env={})
    assert no_preload.preload is False
    with pytest.raises(ValueError, match="preloading is off"):
        build_node_config(models=["smollm2"], preload=False, env={})


def test_kv_cache_dtype_int8_from_flag_or_env(capsys, monkeypatch):
    assert build_node_config(env={"SHOAL_KV_CACHE_DTYPE": "int8"}).engine.kv_cache_dtype == "int8"
    assert build_node_config(kv_cache_dtype="int8", env={}).engine.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--kv-cache-dtype", "int4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "'int4'" in err and "int8" in err
    monkeypatch.setenv("SHOAL_KV_CACHE_DTYPE", "int4")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve"])
    assert exit_info.value.code == 2
    assert "auto, bfloat16, float32, int8, not 'int4'" in capsys.readouterr().err


def test_bad_flag_exits_2_with_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--threads", "0"])
    assert exit_info.value.code == 2
    assert "threads must be >= 1" in capsys.readouterr().err


def test_models_lists_the_catalogue(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct (default)" in out and "LOCAL" in out
    assert "qwen2.5-coder-0.5b-instruct" in out and "qwen2.5-coder-1.5b-instruct" in out


def test_run_one_shot_and_interactive_against_a_running_node(tmp_path, capsys, monkeypatch):
    source = fake_engine_config(tmp_path).source
    options = fake_supervisor_options()
    node = BackgroundNode(
        NodeConfig(server=ServerConfig(port=0), models=("fake-model",), data_dir=tmp_path,
                   cluster=ClusterSettings(standalone=True)),
        make_supervisor=lambda s, _parallel: RunnerSupervisor(
            fake_engine_config(tmp_path, s.model_id), options),
        resolve=lambda name: source, list_available=list)
    url = node.start()
    try:
        assert main(["run", "fake-model", "hello", "--url", url, "--max-tokens", "3"]) == 0
        assert capsys.readouterr().out == "w1 w2 w3 \n"
        lines = iter(["first question", "second", "/bye"])
        monkeypatch.setattr("builtins.input", lambda _prompt: next(lines))
        assert main(["run", "fake-model", "--url", url, "--max-tokens", "2"]) == 0
        assert capsys.readouterr().out == "w1 w2 \nw1 w2 \n"
        assert main(["run", "fake-model", "RAISE", "--url", url]) == 1
        assert "engine step failed" in capsys.readouterr().err
    finally:
        node.stop()


CLUSTER = {"node_id": "n1", "master_id": "n1", "nodes": [], "instances": [
    {"instance_id": "i-local", "model": "smollm2", "sharding": "single",
     "ranks": [{"node_id": "n1", "rank": 0, "layers": [0, 30], "phase": "ready"}],
     "status": "ready", "memory_bytes": 600 * 2**20, "pinned": True, "expires_at": None,
     "queue_depth": 3},
    {"instance_id": "i-remote", "model": "qwen", "sharding": "single",
     "ranks": [{"node_id": "n2", "rank": 0, "layers": [0, 24], "phase": "ready"}],
     "status": "ready"},
]}
HELD = {"weights_bytes": 100 * 2**20, "kv_bytes_in_use": 3 * 2**20,
        "kv_bytes_capacity": 224 * 2**20, "rss_bytes": 2 * 2**30}


def answer_with(monkeypatch, ps_status=200, cluster=CLUSTER, sent_headers=None):
    import httpx

    def get(url, headers=None, timeout=None):
        if sent_headers is not None:
            sent_headers.append(headers)
        if url.endswith("/cluster"):
            return httpx.Response(200, json=cluster)
        models = [{"model": "smollm2", "size": 103 * 2**20, "shoal": HELD},
                  {"model": "qwen", "size": 5}]  # a model with no report: no "shoal"
        return httpx.Response(ps_status, json={"models": models})

    monkeypatch.setattr("shoal.cli.cluster.httpx.get", get)


def test_cli_commands_send_the_api_key_from_the_environment(monkeypatch, capsys):
    sent = []
    answer_with(monkeypatch, sent_headers=sent)
    monkeypatch.setenv("SHOAL_API_KEY", "sk-cli")
    assert main(["ps", "--url", "http://node"]) == 0
    assert sent and all(h == {"Authorization": "Bearer sk-cli"} for h in sent)
    monkeypatch.delenv("SHOAL_API_KEY")
    sent.clear()
    assert main(["cluster", "--url", "http://node"]) == 0
    assert sent == [{}]


def test_ps_shows_what_this_node_s_runners_hold(monkeypatch, capsys):
    answer_with(monkeypatch)
    assert main(["ps", "--url", "http://node"]) == 0
    header, local, remote = capsys.readouterr().out.splitlines()
    assert "WEIGHTS" in header and "KV HELD / ALL" in header and "RSS" in header
    assert "NODE" in header and "PINNED" in header and "EXPIRES" in header
    assert "BACKEND" in header and local.split()[2] == "engine"
    # per node: served by n1, holds 600 MiB, pinned, no expiry, 3 requests queued
    assert local.split()[5:11] == ["n1", "600", "MiB", "yes", "-", "3"]
    assert "100 MiB" in local and "3 MiB / 224 MiB" in local and "2.0 GiB" in local
    assert remote.split()[5:13] == ["n2", "-", "no", "-", "0", "-", "-", "-"]
    assert main(["ps", "--url", "http://node", "--json"]) == 0
    instances = json.loads(capsys.readouterr().out)
    assert instances[0]["memory"] == HELD and instances[1]["memory"] is None


def test_ps_without_figures_still_lists_instances(monkeypatch, capsys):
    answer_with(monkeypatch, ps_status=500)
    assert main(["ps", "--url", "http://node"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 3 and rows[1].split()[11:14] == ["-", "-", "-"]


def test_a_rank_s_runner_gets_the_cluster_s_rank_key_and_never_shows_it(tmp_path):
    from shoal.cluster.certs import make_cluster_certs
    from shoal.engine.config import ModelSource
    from shoal.engine.parallel.config import ParallelConfig
    from shoal.node import runner_factory
    from shoal.runner.messages import Load, parse_to_runner, to_wire

    make_cluster_certs(tmp_path / "tls")
    cluster = build_cluster_settings(tls_dir=str(tmp_path / "tls"), env={})
    config = build_node_config(cluster=cluster, data_dir=str(tmp_path), env={})
    (tmp_path / "m.gguf").write_bytes(b"")
    parallel = ParallelConfig(rank=1, world_size=2, sharding="pipeline", layer_start=0,
                              layer_end=2, master_addr="127.0.0.1", master_port=29600)
    supervisor = runner_factory(config, on_progress=None)(
        ModelSource("m", "gguf", tmp_path / "m.gguf"), parallel)
    key = supervisor.config.parallel.rank_key
    assert key and key == cluster.rank_key
    assert key not in repr(supervisor.config)
    # It reaches the runner process in its Load message (over the local socket only).
    arrived = parse_to_runner(to_wire(Load(engine=supervisor.config)))
    assert arrived.engine.parallel.rank_key == key


def test_the_kv_disk_tier_is_off_by_default_and_sized_by_flag_or_env(tmp_path):
    from pathlib import Path

    from shoal.engine.config import ModelSource

    source = ModelSource(model_id="m", format="gguf", path=Path(__file__))
    assert build_node_config(env={}).engine_config(source).kv_disk is None
    env = {"SHOAL_KV_DISK": "2GiB", "SHOAL_KV_DISK_TTL": "24h", "SHOAL_DATA_DIR": str(tmp_path)}
    disk = build_node_config(env=env).engine_config(source).kv_disk
    assert disk.max_bytes == 2 * 1024**3 and disk.ttl_s == 24 * 3600
    assert disk.root == tmp_path / "kv"
    flagged = build_node_config(kv_disk="512MiB", env=env).engine_config(source).kv_disk
    assert flagged.max_bytes == 512 * 1024**2 and flagged.ttl_s == 24 * 3600
    assert build_node_config(kv_disk="off", env=env).engine_config(source).kv_disk is None


@pytest.mark.slow
def test_serve_refuses_a_draft_model_of_another_tokenizer_naming_both(tmp_path, capsys):
    from shoal.catalog.resolve import ModelNotFound, resolve_model

    try:
        target, draft = resolve_model("gemma3-270m"), resolve_model("smollm2-135m-instruct")
    except ModelNotFound as missing:
        pytest.skip(str(missing))
    code = main(["serve", "--standalone", "--data-dir", str(tmp_path), "--speculative",
                 "gemma3-270m=draft:smollm2-135m-instruct"])
    err = capsys.readouterr().err
    assert code == 1
    assert target.model_id in err and draft.model_id in err and "tokenizers differ" in err
    code = main(["serve", "--standalone", "--data-dir", str(tmp_path), "--speculative",
                 "gemma3-270m=draft:no-such-model"])
    assert code == 1 and "no-such-model" in capsys.readouterr().err
