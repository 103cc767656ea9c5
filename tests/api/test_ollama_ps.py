"""GET /api/ps reports what each runner holds: "size" is weights plus the KV cache in use,
"shoal" splits it up (in-process app; supervisors stand as their runners last reported)."""

from __future__ import annotations

from fakes import ScriptedRouter, fake_engine_config
from fastapi.testclient import TestClient

from shoal.api.app import create_app
from shoal.runner.messages import MemoryUsage, ModelInfo
from shoal.runner.supervisor import RunnerSupervisor


def ready_supervisor(tmp_path, model_id: str, memory: MemoryUsage | None) -> RunnerSupervisor:
    supervisor = RunnerSupervisor(fake_engine_config(tmp_path, model_id))  # never started
    supervisor.state = "ready"
    supervisor.model_info = ModelInfo(model_id=model_id, max_model_len=64, vocab_size=10,
                                      has_chat_template=True)
    supervisor.memory = memory
    return supervisor


def test_ps_size_is_what_the_runner_holds_now(tmp_path):
    router = ScriptedRouter()
    router.supervisors = [
        ready_supervisor(tmp_path, "measured", MemoryUsage(
            weights_bytes=100_000, kv_bytes_in_use=3_000, kv_bytes_cached=2_000,
            kv_bytes_granted=20_000, kv_bytes_capacity=50_000, rss_bytes=900_000)),
        ready_supervisor(tmp_path, "unreported", None),  # loaded, no report yet
        ready_supervisor(tmp_path, "blind", MemoryUsage(rss_bytes=800_000)),
        ready_supervisor(tmp_path, "offloaded", MemoryUsage(rss_bytes=300_000,
                                                            device_bytes=5_000_000)),
    ]
    stopped = ready_supervisor(tmp_path, "stopped", MemoryUsage(weights_bytes=1))
    stopped.state = "stopped"
    router.supervisors.append(stopped)
    client = TestClient(create_app(router, list_available=list))
    models = {m["model"]: m for m in client.get("/api/ps").json()["models"]}
    file_size = (tmp_path / "unreported.gguf").stat().st_size
    assert list(models) == ["measured", "unreported", "blind", "offloaded"]
    measured = models["measured"]
    # what the runner holds (its RSS: weights, KV touched, its floor) + the KV granted
    # but not yet touched; never the KV capacity
    assert measured["size"] == 900_000 + 15_000 and measured["size_vram"] == 0
    assert measured["shoal"] == {"weights_bytes": 100_000, "kv_bytes_in_use": 3_000,
                                 "kv_bytes_cached": 2_000, "kv_bytes_granted": 20_000,
                                 "kv_bytes_capacity": 50_000, "rss_bytes": 900_000,
                                 "device_bytes": None}
    assert measured["expires_at"] is None and measured["context_length"] == 64
    assert models["unreported"]["size"] == file_size and "shoal" not in models["unreported"]
    assert models["blind"]["size"] == 800_000  # no KV figures: its RSS
    assert models["blind"]["shoal"]["weights_bytes"] is None
    assert models["blind"]["shoal"]["rss_bytes"] == 800_000
    # On a GPU (llama-server's buffers there): Ollama's size counts them, size_vram too.
    offloaded = models["offloaded"]
    assert (offloaded["size"], offloaded["size_vram"]) == (5_300_000, 5_000_000)
    tags = {m["model"]: m for m in client.get("/api/tags").json()["models"]}
    assert tags["measured"]["size"] == file_size  # /api/tags keeps the weight file's size
    assert tags["measured"]["digest"] == measured["digest"]
    health = {m["model"]: m for m in client.get("/health").json()["models"]}
    assert health["measured"]["size_bytes"] == 915_000
    assert health["unreported"]["size_bytes"] is None
