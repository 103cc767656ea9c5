"""The engine's side of a proposer on another node: only new tokens travel (with the point
to cut back to), the deadline follows the measured round trip within a floor and a
ceiling, and late, missing, malformed or failing answers give None and a rest, never an
exception; the runner's link delivers answers on the socket's reader thread."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from fakes import FakeClock
from test_speculation import measured_cheap

from shoal.config import build_node_config
from shoal.engine.speculation import remote
from shoal.engine.speculation.config import SpeculativeConfig
from shoal.engine.speculation.remote import LinkAnswer, RemoteProposer
from shoal.engine.speculation.speculator import Speculator
from shoal.runner.channel import Channel
from shoal.runner.framing import recv_frame, send_frame
from shoal.runner.messages import Proposed, parse_from_runner, to_wire
from shoal.runner.proposals import ChannelProposalLink


class FakeLink:
    """Answers from a script; each answer may take `seconds` of the fake clock."""

    def __init__(self, clock: FakeClock, answers: list) -> None:
        self.clock = clock
        self.answers = answers
        self.asks: list[tuple[str, int, list[int], int, float]] = []
        self.forgotten: list[str] = []

    def ask(self, request_id, cut, tokens, k, timeout_s):
        self.asks.append((request_id, cut, list(tokens), k, timeout_s))
        answer, seconds = self.answers.pop(0)
        self.clock.now += seconds
        if isinstance(answer, Exception):
            raise answer
        return answer

    def forget(self, request_id):
        self.forgotten.append(request_id)


def ok(*tokens: int) -> LinkAnswer:
    return LinkAnswer("ok", tokens, [1.0] * len(tokens))


def test_only_new_tokens_travel_and_a_changed_context_is_cut_back():
    clock = FakeClock()
    link = FakeLink(clock, [(ok(7), 0.001), (ok(8, 9), 0.001), (ok(), 0.001),
                            (LinkAnswer("resync"), 0.001), (ok(5), 0.001)])
    proposer = RemoteProposer(link, vocab_size=100, clock=clock)
    assert proposer.propose("r", [1, 2, 3], 2).tokens == [7]
    assert proposer.propose("r", [1, 2, 3, 4, 5], 2).tokens == [8, 9]
    assert proposer.propose("r", [1, 2, 9, 4, 5, 6], 2).tokens == []
    assert proposer.propose("r", [1, 2, 9, 4, 5, 6], 2) is None  # quiet after an empty one
    assert proposer.propose("r", [1, 2, 9, 4, 5, 6, 7], 2) is None  # the far side lost it
    assert proposer.propose("r", [1, 2, 9, 4, 5, 6, 7, 8], 2).tokens == [5]
    assert [(cut, tokens) for _, cut, tokens, _, _ in link.asks] == [
        (0, [1, 2, 3]), (3, [4, 5]), (2, [9, 4, 5, 6]), (6, [7]), (0, [1, 2, 9, 4, 5, 6, 7, 8])]
    proposer.forget("r")
    proposer.forget("never-asked")
    assert link.forgotten == ["r"]


def test_empty_answers_space_out_the_asks():
    clock = FakeClock()
    link = FakeLink(clock, [(ok(), 0.001)] * 5 + [(ok(3), 0.001)] * 6)
    proposer = RemoteProposer(link, vocab_size=100, clock=clock)
    asked_at = []
    for length in range(1, 30):
        before = len(link.asks)
        proposer.propose("r", list(range(length)), 2)
        if len(link.asks) > before:
            asked_at.append(length)
    # After 1, 2, 4, 8, 8 tokens; then answers with guesses: every token again.
    assert asked_at == [1, 2, 4, 8, 16, 24, 25, 26, 27, 28, 29]


def test_deadline_follows_the_round_trip_within_floor_and_ceiling():
    clock = FakeClock()
    link = FakeLink(clock, [(ok(1), 0.010)] * 30 + [(ok(1), 0.0001)] * 30)
    proposer = RemoteProposer(link, vocab_size=100, clock=clock)
    for step in range(60):
        proposer.propose("r", list(range(step + 1)), 1)
    deadlines = [timeout for *_, timeout in link.asks]
    assert deadlines[0] == remote.CEILING_S  # nothing measured yet
    assert abs(deadlines[29] - (1.5 * 0.010 + 0.002)) < 1e-3  # a little above 10 ms
    assert deadlines[-1] == remote.FLOOR_S


def test_the_ceiling_is_what_k_guesses_could_save():
    """A verifier whose plain step takes 40 ms waits up to k steps for a slow round trip
    (one that a fixed 60 ms ceiling would miss every time); a fast one never waits longer
    than its guesses are worth, and nothing waits past MAX_CEILING_S."""
    clock = FakeClock()
    step = {"s": None}
    link = FakeLink(clock, [(ok(1), 0.090)] * 40)
    proposer = RemoteProposer(link, vocab_size=100, clock=clock, step_s=lambda: step["s"])
    assert proposer.ceiling_s(4) == remote.CEILING_S  # the step not measured yet
    step["s"] = 0.040
    assert proposer.ceiling_s(4) == pytest.approx(0.160)
    for length in range(1, 21):
        proposer.propose("r", list(range(length)), 4)
    assert link.asks[-1][-1] == pytest.approx(1.5 * 0.090 + 0.002, abs=2e-3)
    step["s"] = 0.005
    assert proposer.ceiling_s(4) == remote.CEILING_S  # never below the fixed one
    proposer.propose("r", list(range(21)), 4)
    assert link.asks[-1][-1] == remote.CEILING_S
    step["s"] = 0.5
    assert proposer.ceiling_s(8) == remote.MAX_CEILING_S


def test_failures_give_none_and_a_growing_rest_never_an_exception():
    clock = FakeClock()
    link = FakeLink(clock, [
        (None, 0.06),                          # no answer in time
        (RuntimeError("socket gone"), 0.0),    # the link itself fails
        (LinkAnswer("none"), 0.0),             # no proposer node offers this model
        (ok(1, 2, 3), 0.0),                    # more than asked for
        (LinkAnswer("ok", [5], []), 0.0),      # probabilities missing
        (ok(100), 0.0),                        # outside the vocabulary
        (ok(4), 0.0)])
    proposer = RemoteProposer(link, vocab_size=100, clock=clock)
    rests = []
    for _ in range(6):
        assert proposer.propose("r", [1, 2], 2) is None
        resting_until = proposer._resting_until
        assert proposer.propose("r", [1, 2], 2) is None  # resting: the link is not asked
        rests.append(round(resting_until - clock.now, 3))
        clock.now = resting_until
    assert len(link.asks) == 6
    assert rests == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6]
    assert proposer.latency.average_s >= 0.06  # the missed call widened the deadline
    assert proposer.propose("r", [1, 2], 2).tokens == [4]
    assert (proposer.calls, proposer.answered) == (7, 1)


def test_speculator_guesses_through_the_proposer_for_remote_requests():
    from shoal.engine.request import Request
    from shoal.engine.sampling import SamplingParams

    class Recording:
        def __init__(self):
            self.contexts, self.forgotten = [], []

        def propose(self, request_id, context, k):
            self.contexts.append(list(context))
            return None if len(self.contexts) == 1 else remote.Proposal([42] * 9, [1.0] * 9)

        def forget(self, request_id):
            self.forgotten.append(request_id)

    speculator = Speculator(SpeculativeConfig.parse("remote:3"), "m")
    measured_cheap(speculator.proposer_costs, 3)
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0.0))
    speculator.add("r", [1, 2, 3], request.params, constrained=False)
    speculator.propose([request], max_rows=64)
    assert request.draft_token_ids == []  # no proposer attached: decodes alone
    speculator.proposer = proposer = Recording()
    speculator.propose([request], max_rows=64)
    assert request.draft_token_ids == []  # None: no guesses this step
    request.output_token_ids.extend([4, 5])
    speculator.propose([request], max_rows=64)
    assert request.draft_token_ids == [42, 42, 42]  # capped at K
    assert proposer.contexts == [[1, 2, 3], [1, 2, 3, 4, 5]]
    speculator.forget("r")
    assert proposer.forgotten == ["r"]


def test_channel_link_delivers_answers_on_the_reader_thread_and_drops_late_ones():
    runner_end, node_end = socket.socketpair()
    channel = Channel(runner_end)
    link = ChannelProposalLink(channel)
    asked = []

    def node() -> None:  # the supervisor's side: answer the first ask, ignore the second
        for _ in range(2):
            ask = parse_from_runner(recv_frame(node_end))
            asked.append(ask)
            if ask.call_id == 0:
                send_frame(node_end, to_wire(Proposed(call_id=0, outcome="ok",
                                                      tokens=(3, 4), probs=(1.0, 0.5))))
        time.sleep(0.2)  # past the second ask's deadline
        send_frame(node_end, to_wire(Proposed(call_id=1, outcome="ok", tokens=(9,),
                                              probs=(1.0,))))  # too late
        send_frame(node_end, {"type": "cancel", "request_id": "x"})

    thread = threading.Thread(target=node)
    thread.start()
    answer = link.ask("r", 0, [1, 2], 2, timeout_s=5.0)
    late = link.ask("r", 2, [5], 2, timeout_s=0.05)
    thread.join(5)
    inbox = channel.receive(block=True, timeout_s=5.0)
    assert answer == LinkAnswer("ok", (3, 4), (1.0, 0.5))
    assert late is None
    assert [(a.request_id, a.cut, a.tokens, a.k) for a in asked] == [
        ("r", 0, (1, 2), 2), ("r", 2, (5,), 2)]
    assert inbox == [{"type": "cancel", "request_id": "x"}]  # answers never reach the loop
    runner_end.close()
    node_end.close()


def test_remote_speculation_is_named_like_ngram():
    assert SpeculativeConfig.parse("remote") == SpeculativeConfig("remote", 10)
    assert SpeculativeConfig.parse("remote:4") == SpeculativeConfig("remote", 4)
    with pytest.raises(ValueError, match="remote\\[:K\\]"):
        SpeculativeConfig.parse("remotely")
    with pytest.raises(ValueError, match="1..16"):
        SpeculativeConfig.parse("remote:40")
    config = build_node_config(speculative=["smollm2=remote:6"], env={})
    assert config.engine.speculation_for("smollm2-135m-instruct") == \
        SpeculativeConfig("remote", 6)


def test_the_nodes_hook_always_answers_the_runner():
    import asyncio

    from shoal.runner.messages import Propose
    from shoal.runner.proposals import ProposalHook

    class Relay:
        def __init__(self, answer):
            self.answer, self.forgotten = answer, []

        async def ask(self, model_id, request_id, cut, tokens, k, timeout_s):
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

        def forget(self, model_id, request_id):
            self.forgotten.append((model_id, request_id))

    ask = Propose(call_id=7, request_id="r", cut=0, tokens=(1, 2), k=2, timeout_s=0.01)
    hook = ProposalHook()

    def answered(relay):
        hook.relay = relay
        reply = asyncio.run(hook.ask("m", ask))
        return reply.call_id, reply.outcome, reply.tokens, reply.probs

    assert answered(None) == (7, "none", (), ())  # not in a cluster yet
    assert answered(Relay({"outcome": "ok", "tokens": [3], "probs": [1.0]})) == (
        7, "ok", (3,), (1.0,))
    assert answered(Relay({"outcome": "maybe"})) == (7, "none", (), ())
    assert answered(Relay(["not", "a", "dict"])) == (7, "none", (), ())
    assert answered(Relay(RuntimeError("relay bug"))) == (7, "none", (), ())
    relay = Relay({})
    hook.relay = relay
    hook.forget("m", "r")
    assert relay.forgotten == [("m", "r")]


def test_waiting_for_remote_guesses_counts_in_what_guessing_costs():
    from shoal.engine.request import Request
    from shoal.engine.sampling import SamplingParams

    class Slow:
        def propose(self, request_id, context, k):
            time.sleep(0.02)
            return remote.Proposal([7] * k, [1.0] * k)

        def forget(self, request_id):
            pass

    speculator = Speculator(SpeculativeConfig.parse("remote:3"), "m")
    speculator.proposer = Slow()
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0.0))
    speculator.add("r", [1, 2, 3], request.params, constrained=False)
    speculator.observe_step(0, 0.010)  # a plain step: nothing asked
    speculator.propose([request], max_rows=64)
    assert len(request.draft_token_ids) == 1  # lengths are tried from one up
    speculator.observe_step(1, 0.010)  # the first ask catches up on the context: not priced
    assert speculator.proposer_costs.relative(1) == pytest.approx(1 + 0.35)
    request.output_token_ids.append(7)
    speculator.propose([request], max_rows=64)
    speculator.observe_step(1, 0.010)  # verifying took as long as a plain step...
    assert speculator.proposer_costs.relative(1) >= 2.5  # ...but the guess took 20 ms
    assert speculator.costs.relative(1) == pytest.approx(1 + 0.35)  # n-grams unpriced
