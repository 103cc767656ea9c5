"""Reasoning between <think> tags (Qwen3's way): split from the answer however the text is
cut, the newlines around the tags belonging to neither, and tool calls still found."""

from __future__ import annotations

import itertools

import pytest

from shoal.engine.outputs import RequestOutput
from shoal.runner.think_stream import ThinkSplitter, ThinkStream, opens_thinking, \
    uses_think_tags
from shoal.runner.tool_stream import IndexedCall, ReasoningPiece, TextPiece

REPLY = "<think>\nThe user greets me.\nReply kindly.\n</think>\n\nHello <b> there!"


def split(text: str, cuts=(), inside: bool = False) -> tuple[str, str]:
    splitter = ThinkSplitter(inside)
    reasoning = answer = ""
    bounds = [0, *cuts, len(text)]
    for start, end in itertools.pairwise(bounds):
        r, a = splitter.feed(text[start:end], final=end == len(text))
        reasoning, answer = reasoning + r, answer + a
    return reasoning, answer


WHOLE = ("The user greets me.\nReply kindly.", "Hello <b> there!")


@pytest.mark.parametrize("cut", range(1, len(REPLY)))
def test_any_cut_splits_the_same(cut):
    assert split(REPLY, (cut,)) == WHOLE


def test_character_by_character():
    assert split(REPLY, tuple(range(1, len(REPLY)))) == WHOLE


def test_a_prompt_that_opened_the_block():
    assert split(REPLY.removeprefix("<think>"), (3, 9, 40), inside=True) == WHOLE
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_reply_without_reasoning_is_all_answer():
    assert split("Just <this>.", (2,)) == ("", "Just <this>.")
    assert split("<thi", ()) == ("", "<thi")  # cut short before the tag was whole


def test_templates_that_use_think_tags():
    assert uses_think_tags("{{ content.split('</think>')[-1] }}")
    assert not uses_think_tags("<|im_start|>{{ m.content }}")


def output(text: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id="r", text=text, token_ids=(token,), finished=finished,
                         finish_reason="stop" if finished else None)


def run(stream: ThinkStream, pieces) -> list:
    out = []
    for index, text in enumerate(pieces):
        out += stream.feed(output(text, index, finished=index == len(pieces) - 1))
    return out


def test_the_stream_counts_withholds_and_finds_calls():
    pieces = ["<think>\nNeed", " weather.\n</think>\n\n<tool_call>\n",
              '{"name": "get_weather", "arguments": {"city": "Paris"}}', "\n</tool_call>"]
    stream = ThinkStream(["get_weather"])
    out = run(stream, pieces)
    assert "".join(p.text for p in out if isinstance(p, ReasoningPiece)) == "Need weather."
    [call] = [p for p in out if isinstance(p, IndexedCall)]
    assert call.call.arguments == '{"city": "Paris"}'
    assert not any(isinstance(p, TextPiece) and p.text.strip() for p in out)
    assert stream.finish_reason("stop") == "tool_calls"
    assert stream.reasoning_tokens == 2
    quiet = ThinkStream([], return_reasoning=False)
    out = run(quiet, ["<think>\nhm\n</think>\n\n", "Hi"])
    assert [type(p) for p in out] == [TextPiece] and out[0].text == "Hi"
    assert out[0].token_ids == (0, 1)  # the reasoning's tokens ride with the answer


def test_logprobs_are_the_answers_only():
    from shoal.engine.outputs import TokenLogprob

    stream = ThinkStream([])
    texts = ["<think>", "hm", "</think>", "Hi", " you"]
    out = []
    for index, text in enumerate(texts):
        out += stream.feed(RequestOutput(
            request_id="r", text=text, token_ids=(index,), finished=index == len(texts) - 1,
            logprobs=(TokenLogprob(token_id=index, token=text, logprob=-1.0),)))
    answer = [p for p in out if isinstance(p, TextPiece)]
    assert [lp.token for p in answer for lp in p.logprobs] == ["Hi", " you"]
