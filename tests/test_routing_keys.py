"""Routing keys: equal prompt beginnings give equal leading keys on both sides (router and
runner compute them from the request alone), and different content parts them."""

from __future__ import annotations

from shoal.protocol import ChatMessage, GenerationRequest, ToolSpec
from shoal.routing_keys import KEY_SPAN, MAX_KEYS, prefix_keys, session_key

DOCUMENT = "The history of rivers. " * 200  # ~4.6 KB: nine keys


def chat(*turns: tuple[str, str], **fields) -> GenerationRequest:
    return GenerationRequest(request_id="r", model="m", messages=tuple(
        ChatMessage(role=role, content=content) for role, content in turns), **fields)


def test_a_later_turn_shares_the_keys_of_the_conversation_before_it():
    first = prefix_keys(chat(("system", DOCUMENT), ("user", "Name one river.")))
    later = prefix_keys(chat(("system", DOCUMENT), ("user", "Name one river."),
                             ("assistant", "The Nile."), ("user", "Another?" * 100)))
    assert len(first) >= len(DOCUMENT) // KEY_SPAN
    assert later[:len(first)] == first and len(later) > len(first)


def test_content_roles_tools_and_kinds_part_the_keys():
    base = prefix_keys(chat(("user", DOCUMENT)))
    assert prefix_keys(chat(("user", "x" + DOCUMENT)))[0] != base[0]
    assert prefix_keys(chat(("system", DOCUMENT)))[0] != base[0]
    tool = ToolSpec(name="lookup", description="find a river")
    assert prefix_keys(chat(("user", DOCUMENT), tools=(tool,)))[0] != base[0]
    as_prompt = prefix_keys(GenerationRequest(request_id="r", model="m", prompt=DOCUMENT))
    assert as_prompt and as_prompt[0] != base[0]
    # The model name is not part of a key: the router may know a model by another name.
    assert prefix_keys(chat(("user", DOCUMENT)).model_copy(update={"model": "M2"})) == base


def test_short_prompts_have_no_key_and_long_ones_are_bounded():
    assert prefix_keys(chat(("user", "hi"))) == []
    ids = tuple(range(100_000))  # ~590 KB of text
    assert len(prefix_keys(GenerationRequest(request_id="r", model="m",
                                             prompt_token_ids=ids))) == MAX_KEYS


def test_a_session_key_is_a_hash_of_the_id():
    assert session_key("chat-1") == session_key("chat-1") != session_key("chat-2")
    assert b"chat-1" not in session_key("chat-1")
