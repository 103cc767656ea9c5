"""File hashes: computed once per file version, kept across restarts, redone after a change;
a model's file listing."""

from __future__ import annotations

import hashlib
import os

from shoal.catalog.file_hashes import FileHashes, model_files
from shoal.engine.config import ModelSource


def test_a_file_is_hashed_once_per_version_and_the_cache_survives_a_restart(tmp_path):
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    hashes = FileHashes.of_data_dir(tmp_path / "data")
    expected = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert hashes.cached(weights) is None
    assert hashes.sha256(weights) == expected
    assert hashes.sha256(weights) == expected and hashes.computed == 1
    again = FileHashes.of_data_dir(tmp_path / "data")  # a restarted node
    assert again.cached(weights) == expected
    assert again.sha256(weights) == expected and again.computed == 0
    # Rewritten: another size or mtime is another version, hashed anew.
    weights.write_bytes(b"GGUF changed")
    os.utime(weights, ns=(1, 1))
    assert again.cached(weights) is None
    assert again.sha256(weights) == hashlib.sha256(b"GGUF changed").hexdigest()
    assert again.computed == 1


def test_a_models_files_are_its_gguf_or_the_plain_files_of_its_directory(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 10)
    [only] = model_files(ModelSource(model_id="m", format="gguf", path=gguf))
    assert (only.relative, only.size) == ("m.gguf", 10)
    checkpoint = tmp_path / "ckpt"
    (checkpoint / "sub").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", ".last-used", "shoal-model.json"):
        (checkpoint / name).write_text("{}")
    files = model_files(ModelSource(model_id="c", format="safetensors", path=checkpoint))
    assert [f.relative for f in files] == ["config.json", "model.safetensors"]


def test_the_same_read_hashes_each_chunk_kept_by_the_files_sha256(tmp_path):
    from shoal.catalog.file_hashes import CHUNK_BYTES

    weights = tmp_path / "model.gguf"
    data = os.urandom(CHUNK_BYTES + 100)
    weights.write_bytes(data)
    hashes = FileHashes.of_data_dir(tmp_path / "data")
    digest = hashes.sha256(weights)
    expected = hashlib.sha256(data[:CHUNK_BYTES]).digest() + \
        hashlib.sha256(data[CHUNK_BYTES:]).digest()
    assert hashes.chunk_digests(digest) == expected
    again = FileHashes.of_data_dir(tmp_path / "data")  # a restarted node
    assert again.chunk_digests(digest) == expected and again.computed == 0
    assert again.chunk_digests("0" * 64) is None
