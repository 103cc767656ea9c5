"""Proposals between nodes over an in-memory hub: a verifier's node asks the proposer the
cards choose, sends only new tokens per request, gets n-gram guesses; a proposer that
lost a session asks for the whole context; a silent proposer costs one deadline and is
avoided; a forgotten request's session goes; idle sessions expire."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fakes import FakeClock

from shoal.cluster.cards import CapabilityCard, ModelRole
from shoal.cluster.proposal_relay import ProposalRelay
from shoal.cluster.proposer_service import SOURCES, ProposerConfig, ProposerService
from shoal.cluster.transport import MemoryHub
from shoal.engine.speculation.proposer import Proposal

TARGET = "smollm2-135m-instruct"
# An n-gram source guesses that "1 2 3 4" goes on as it did: 5 6 7.
CONTEXT = [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3, 4]


def proposer_card(node: str) -> CapabilityCard:
    return CapabilityCard(node_id=node, announced_at=0.0, ttl_s=1e12, models=(
        ModelRole(model=TARGET, role="proposer", source="ngram"),))


def test_asks_go_to_the_chosen_node_with_only_new_tokens():
    async def main():
        hub = MemoryHub()
        verifier, proposer_node = hub.connect("v"), hub.connect("p")
        service = ProposerService(proposer_node, ProposerConfig(offers={TARGET: "ngram"}))
        service.start()
        relay = ProposalRelay(verifier, lambda: [proposer_card("p")])
        relay.start()
        await asyncio.sleep(0)
        seen = []
        proposer_node.subscribe_data(lambda m: seen.append(m) if m.get("proposal") == "ask"
                                     else None)
        first = await relay.ask(TARGET, "r1", 0, CONTEXT, 3, timeout_s=2.0)
        second = await relay.ask(TARGET, "r1", len(CONTEXT), [5, 6], 4, timeout_s=2.0)
        sessions = service.active_sessions()
        relay.forget(TARGET, "r1")
        await asyncio.sleep(0.01)
        return first, second, [len(m["tokens"]) for m in seen], sessions, service

    first, second, sent, sessions, service = asyncio.run(main())
    assert first["outcome"] == "ok" and first["tokens"] == [5, 6, 7]
    assert first["probs"] == [1.0, 1.0, 1.0]
    assert second["outcome"] == "ok" and second["tokens"] == [7, 9, 1, 2]
    assert sent == [len(CONTEXT), 2]  # the second ask carried only the new tokens
    assert sessions == 1 and service.active_sessions() == 0  # forgotten


def test_unknown_session_asks_for_resync_and_cut_back_is_idempotent():
    service = ProposerService(MemoryHub().connect("p"), ProposerConfig(offers={TARGET: "ngram"}))
    ask = {"from": "v", "target": TARGET, "request_id": "r", "k": 3, "call": 1}
    assert service.answer({**ask, "cut": 4, "tokens": [1]})["outcome"] == "resync"
    assert service.answer({**ask, "cut": 0, "tokens": CONTEXT})["tokens"] == [5, 6, 7]
    # The verifier never got that answer and sends again from the same point: same result.
    again = service.answer({**ask, "cut": 0, "tokens": CONTEXT})
    assert again["tokens"] == [5, 6, 7]
    # Earlier tokens changed: cut back to 8 and go on differently.
    changed = service.answer({**ask, "cut": 8, "tokens": [1, 2]})
    assert changed["tokens"] == [3, 4, 5]
    assert service.answer({**ask, "target": "other-model", "cut": 0,
                           "tokens": [1]})["outcome"] == "none"
    with pytest.raises(ValueError):
        service.answer({**ask, "cut": 0, "tokens": [1], "k": 99})


def test_idle_sessions_expire():
    clock = FakeClock()
    service = ProposerService(MemoryHub().connect("p"), ProposerConfig(
        offers={TARGET: "ngram"}, session_idle_s=10.0), clock=clock)
    ask = {"from": "v", "target": TARGET, "k": 2, "call": 1, "cut": 0, "tokens": CONTEXT}
    service.answer({**ask, "request_id": "old"})
    clock.now = 8.0
    service.answer({**ask, "request_id": "new"})
    assert service.active_sessions() == 2
    clock.now = 12.0
    assert service.active_sessions() == 1


def test_a_silent_proposer_costs_one_deadline_then_is_avoided():
    async def main():
        hub = MemoryHub()
        verifier = hub.connect("v")
        hub.connect("silent")  # offers in its card, never answers
        working = hub.connect("p")
        service = ProposerService(working, ProposerConfig(offers={TARGET: "ngram"}))
        service.start()
        clock = FakeClock()
        # "p" is busier, so the cards prefer "silent" until it misses a deadline.
        cards = [proposer_card("silent"), proposer_card("p").model_copy(
            update={"load": proposer_card("p").load.model_copy(update={"in_flight": 5})})]
        relay = ProposalRelay(verifier, lambda: cards, clock=clock)
        relay.start()
        await asyncio.sleep(0)
        started = asyncio.get_running_loop().time()
        missed = await relay.ask(TARGET, "r", 0, CONTEXT, 3, timeout_s=0.05)
        waited = asyncio.get_running_loop().time() - started
        moved = await relay.ask(TARGET, "r", len(CONTEXT), [5], 3, timeout_s=1.0)
        fresh = await relay.ask(TARGET, "r", 0, CONTEXT, 3, timeout_s=1.0)
        clock.now = 100.0  # long after the avoidance: the cards' first choice again
        back = relay.proposer_for(TARGET, "other")
        hub.drop("silent")  # gone from the peers: not chosen even though its card lives
        gone = relay.proposer_for(TARGET, "another")
        return missed, waited, moved, fresh, back, gone

    missed, waited, moved, fresh, back, gone = asyncio.run(main())
    assert missed["outcome"] == "none" and 0.05 <= waited < 0.5
    assert moved["outcome"] == "resync"  # the new node has none of the context
    assert fresh["outcome"] == "ok" and fresh["tokens"] == [5, 6, 7]
    assert back == "silent" and gone == "p"


def test_a_blocking_source_guesses_on_one_worker_thread_off_the_loop(monkeypatch):
    class SlowDraft:
        """A stand-in for a draft model: slow, not reentrant, guesses with probabilities."""

        blocking = True

        def __init__(self) -> None:
            self.active = self.most_active = 0
            self.threads: set[str] = set()
            self.forgotten: list[str] = []

        def propose(self, key, context, k):
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            self.threads.add(threading.current_thread().name)
            time.sleep(0.05)
            self.active -= 1
            return Proposal([context[-1]] * k, [0.5] * k)

        def forget(self, key):
            self.forgotten.append(key)

    draft = SlowDraft()
    monkeypatch.setitem(SOURCES, "draft", lambda target, source, data_dir: draft)

    async def main():
        hub = MemoryHub()
        verifier, proposer_node = hub.connect("v"), hub.connect("p")
        service = ProposerService(proposer_node, ProposerConfig(
            offers={TARGET: "draft:tiny-draft"}))
        service.start()
        relay = ProposalRelay(verifier, lambda: [proposer_card("p")])
        relay.start()
        await asyncio.sleep(0)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        ticking = asyncio.get_running_loop().create_task(ticker())
        answers = await asyncio.gather(*(relay.ask(TARGET, f"r{i}", 0, [1, 2, 3 + i], 2, 5.0)
                                         for i in range(3)))
        ticking.cancel()
        relay.forget(TARGET, "r0")
        await asyncio.sleep(0.05)
        await service.stop()
        return answers, ticks

    answers, ticks = asyncio.run(main())
    assert [(a["outcome"], a["tokens"], a["probs"]) for a in answers] == [
        ("ok", [3 + i] * 2, [0.5, 0.5]) for i in range(3)]
    assert draft.most_active == 1 and all(t.startswith("proposer") for t in draft.threads)
    assert ticks >= 10  # the loop went on while the draft guessed (3 x 50 ms)
    assert draft.forgotten == ["v/r0"]


def test_a_node_proposing_for_its_own_verifier_answers_without_the_transport():
    async def main():
        alone = MemoryHub().connect("solo")
        service = ProposerService(alone, ProposerConfig(offers={TARGET: "ngram"}))
        relay = ProposalRelay(alone, lambda: [proposer_card("solo")], local=service)
        sent = []
        alone.send_data = lambda node, payload: sent.append(payload)  # must not be used
        answer = await relay.ask(TARGET, "r", 0, CONTEXT, 3, timeout_s=1.0)
        sessions = service.active_sessions()
        relay.forget(TARGET, "r")
        return answer, sessions, service.active_sessions(), sent

    answer, sessions, after_forget, sent = asyncio.run(main())
    assert answer["outcome"] == "ok" and answer["tokens"] == [5, 6, 7]
    assert (sessions, after_forget, sent) == (1, 0, [])


def gguf_with_tokenizer(path, metadata):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, "llama")
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    writer.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("same", [True, False])
def test_a_draft_is_checked_against_the_tokenizer_copied_for_a_target_held_elsewhere(
        tmp_path, monkeypatch, same):
    from engine.tokenizer_fixtures import tiny_byte_level_metadata  # tests/engine

    from shoal.engine.config import ModelSource

    metadata = tiny_byte_level_metadata()
    other = dict(metadata, **{"tokenizer.ggml.tokens": ["<|other|>",
                                                        *metadata["tokenizer.ggml.tokens"][1:]]})
    draft_file = gguf_with_tokenizer(tmp_path / "draft.gguf", metadata)
    target_file = gguf_with_tokenizer(tmp_path / "target.gguf", metadata if same else other)
    copied = []

    class Draft:
        blocking = True

        def files(self):
            return ModelSource(model_id="draft", format="gguf", path=draft_file)

        def propose(self, key, context, k):
            return Proposal([7] * k, [0.5] * k)

        def forget(self, key):
            pass

    async def tokenizer_from_a_peer(target):
        copied.append(target)
        return ModelSource(model_id=target, format="gguf", path=target_file)

    monkeypatch.setitem(SOURCES, "draft", lambda target, source, data_dir: Draft())

    async def main():
        service = ProposerService(MemoryHub().connect("p"), ProposerConfig(
            offers={"held-elsewhere": "draft:draft"}, data_dir=tmp_path / "data"),
            target_tokenizer=tokenizer_from_a_peer)
        ask = {"from": "v", "request_id": "r", "target": "held-elsewhere", "cut": 0,
               "tokens": [1, 2], "k": 2}
        answers = [await service.answer_here(dict(ask, request_id=f"r{i}")) for i in range(2)]
        await service.stop()
        return answers

    answers = asyncio.run(main())
    assert copied == ["held-elsewhere"]  # once, not per ask
    assert [a["outcome"] for a in answers] == (["ok", "ok"] if same else ["none", "none"])
