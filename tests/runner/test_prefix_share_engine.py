"""The runner's side of prefix KV between nodes, on two real engines in float32 (slow): a
request held for its missing prefix, the holder's export in parts through msgpack (as the
node processes carry it), the import, then the request admitted: the prefix counts as cached
and the output is token-identical to the holder's local prefill. Parts that do not belong
to the request are refused."""

from __future__ import annotations

import msgpack
import pytest

from shoal.catalog.resolve import DEFAULT_MODEL_ID, resolve_model
from shoal.engine.config import EngineConfig
from shoal.engine.engine import Engine
from shoal.engine.sampling import SamplingParams
from shoal.protocol import GenerationRequest
from shoal.runner.kv_wire import split_blocks
from shoal.runner.prefix_messages import (
    PrefixExport,
    PrefixExportPart,
    PrefixFetched,
    PrefixPart,
    PrefixReport,
    PrefixWanted,
)
from shoal.runner.prefix_share import RunnerPrefixShare

pytestmark = pytest.mark.slow

TEXT = " ".join(["The lighthouse keeper counted the ships that passed the rocks."] * 20)
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_engine(cache_dir) -> Engine:
    return Engine(EngineConfig(source=resolve_model(DEFAULT_MODEL_ID), dtype="float32",
                               kv_cache_bytes=64 * 2**20, max_num_batched_tokens=256,
                               cache_dir=cache_dir))


def generate(engine: Engine, request_id: str, ids: list[int]) -> tuple[list[int], int]:
    engine.add_request(request_id, ids, PARAMS)
    tokens, last = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.extend(output.token_ids)
            last = output
    return tokens, last.cached_tokens


def over_the_wire(message):
    """As a frame and a Zenoh payload carry it: msgpack out and back."""
    return msgpack.unpackb(msgpack.packb(message.model_dump(mode="python")), raw=False)


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("cache")
    return make_engine(cache_dir), make_engine(cache_dir)


def test_a_held_request_imports_the_holder_s_blocks_and_answers_as_a_local_prefill(
        two_engines):
    holder, asker = two_engines
    ids = holder.tokenizer.encode(TEXT)
    expected, _ = generate(holder, "first", ids)
    sent_by_holder, sent_by_asker = [], []
    holder_share = RunnerPrefixShare(holder, sent_by_holder.append)
    asker_share = RunnerPrefixShare(asker, sent_by_asker.append)
    assert holder_share.compat == asker_share.compat

    holder_share.maybe_report(now=1e9)
    report = sent_by_holder.pop()
    assert isinstance(report, PrefixReport) and len(report.stored) >= len(ids) // 16 - 1

    request = GenerationRequest(request_id="again", model="m", prompt=TEXT)
    assert asker_share.hold(request, ids)
    wanted = sent_by_asker.pop()
    assert isinstance(wanted, PrefixWanted) and wanted.have_blocks == 0

    holder_share.export(PrefixExport(export_id="x", compat=wanted.compat,
                                     token_ids=wanted.token_ids, start_block=0))
    parts = [PrefixExportPart.model_validate(over_the_wire(m)) for m in sent_by_holder]
    assert parts[-1].last and not any(p.last for p in parts[:-1])
    for part in parts:
        asker_share.on_part(PrefixPart(request_id="again", blocks=part.blocks))
    held = asker_share.on_fetched(PrefixFetched(request_id="again"))
    assert held is not None and held.imported_blocks == len(wanted.block_hashes)
    tokens, cached = generate(asker, "again", held.token_ids)
    assert tokens == expected
    assert cached == len(wanted.block_hashes) * 16


def test_blocks_another_request_asked_for_are_refused(two_engines):
    holder, asker = two_engines
    ids = holder.tokenizer.encode("An entirely different story about a baker. " * 20)
    generate(holder, "other", ids)
    sent = []
    asker_share = RunnerPrefixShare(asker, sent.append)
    mine = asker.tokenizer.encode("Yet another tale, of a miller and his mill. " * 20)
    assert asker_share.hold(GenerationRequest(request_id="mine", model="m", prompt="x"), mine)
    foreign = split_blocks(holder.export_prefix(ids))[0]
    from shoal.runner.kv_wire import blocks_to_wire

    asker_share.on_part(PrefixPart(request_id="mine", blocks=blocks_to_wire(foreign)))
    assert asker_share.held["mine"].imported_blocks == 0
    assert asker.export_prefix(ids) is None  # nothing of the foreign prefix entered


def test_a_request_held_past_its_bound_is_released(two_engines):
    _, asker = two_engines
    share = RunnerPrefixShare(asker, lambda _m: None, fetch_wait_s=0.01)
    ids = asker.tokenizer.encode("A river runs through the old valley town. " * 20)
    assert share.hold(GenerationRequest(request_id="late", model="m", prompt="x"), ids)
    assert share.overdue(now=0.0) == []
    late = share.overdue(now=1e12)
    assert [h.request.request_id for h in late] == ["late"] and not share.held
