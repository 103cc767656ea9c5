"""What a model held once loaded, kept per version of its files across restarts."""

from __future__ import annotations

import os

from shoal.catalog.measured_sizes import MeasuredSizes
from shoal.engine.config import ModelSource


def test_a_measured_size_persists_per_file_version(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"\0" * 100)
    source = ModelSource(model_id="m", format="gguf", path=path)
    sizes = MeasuredSizes.of_data_dir(tmp_path / "data")
    assert sizes.get(source) is None
    sizes.record(source, 123_000)
    assert sizes.get(source) == 123_000
    restarted = MeasuredSizes.of_data_dir(tmp_path / "data")
    assert restarted.get(source) == 123_000
    path.write_bytes(b"\0" * 101)  # another version of the file: estimated afresh
    os.utime(path, ns=(1, 1))
    assert restarted.get(source) is None
    path.unlink()  # files gone: nothing to key a size on, nothing recorded
    sizes.record(source, 5)
    assert sizes.get(source) is None


def test_an_unreadable_sizes_file_is_ignored(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / ".measured-sizes.json").write_text("{not json")
    path = tmp_path / "model.gguf"
    path.write_bytes(b"\0")
    assert MeasuredSizes.of_data_dir(tmp_path).get(
        ModelSource(model_id="m", format="gguf", path=path)) is None


def test_each_backend_has_its_own_size_for_one_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"\0" * 100)
    source = ModelSource(model_id="m", format="gguf", path=path)
    sizes = MeasuredSizes.of_data_dir(tmp_path / "data")
    sizes.record(source, 290_000, "llama-server")
    assert sizes.get(source) is None  # the engine has not loaded it yet
    assert sizes.get(source, "llama-server") == 290_000
    sizes.record(source, 470_000)
    assert (sizes.get(source), sizes.get(source, "llama-server")) == (470_000, 290_000)
