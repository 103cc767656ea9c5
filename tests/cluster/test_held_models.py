"""The model files a node advertises: listed with sizes and hashes, served by path only
when advertised, and placement's view of them."""

from __future__ import annotations

import hashlib

from shoal.catalog.file_hashes import FileHashes
from shoal.cluster.held_models import HeldModels
from shoal.cluster.telemetry import NodeReading
from shoal.engine.config import ModelSource
from shoal.ids import NodeId


def test_held_models_list_each_file_with_size_and_sha256(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" * 1000)
    secret = tmp_path / "secret.txt"
    secret.write_text("not a model file")
    sources = [(ModelSource(model_id="tiny", format="gguf", path=gguf), ["tiny", "t:latest"])]
    held = HeldModels(lambda: sources, FileHashes())
    assert held.current() == ()
    [model] = held.scan()
    assert model.model == "tiny" and model.names == ("t:latest",) and model.size == 4000
    [file] = model.files
    assert (file.path, file.sha256) == ("tiny.gguf", hashlib.sha256(gguf.read_bytes()).hexdigest())
    assert held.find("T:LATEST") == model
    assert held.path_of("tiny", "tiny.gguf") == gguf
    assert held.path_of("tiny", "secret.txt") is None  # never a file it did not advertise
    assert held.path_of("tiny", "../secret.txt") is None


def test_a_reading_tells_placement_which_models_a_node_holds(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    held = HeldModels(lambda: [(ModelSource(model_id="Tiny", format="gguf", path=gguf),
                                ["org/tiny"])], FileHashes())
    reading = NodeReading(node_id=NodeId("a"), taken_at=1.0, memory_total=2**30,
                          memory_available=2**30, models=held.scan())
    wire = NodeReading.model_validate(reading.model_dump(mode="json"))  # over the network
    assert wire.held("org/tiny").files == reading.models[0].files
    assert wire.capacity().holds_model("tiny") and wire.capacity().holds_model("ORG/TINY")
    assert not wire.capacity().holds_model("other")
