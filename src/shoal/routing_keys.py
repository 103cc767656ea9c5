"""Keys of a request's prompt for routing it to where its prefix KV is, with no tokenizer.

The node process does not tokenize: the runner does, with the model's tokenizer and chat
template. So the router cannot hash a prompt's token blocks; instead both sides compute the
same chain of keys from the request alone: one key per KEY_SPAN bytes of the prompt's
canonical text (UTF-8) (tools first, then each message's role, name, content and tool calls in
order; or the prompt text; or the token ids). A key covers everything before it, so equal
keys mean equal prompt beginnings. The runner publishes the keys of each prompt it admits,
each paired with the hash of that prompt's last full KV block; the router prefers the
instance where the longest chain of the request's keys leads to a block it still holds.
The session key of x_session_id is hashed too: the cluster never sees the id itself.
"""

from __future__ import annotations

import hashlib
import json

from shoal.protocol import GenerationRequest

KEY_SPAN = 512
# The most keys one request yields (256 KiB of text): a bound on what a runner publishes.
MAX_KEYS = 512
_SEPARATOR = "\x1e"  # ASCII record separator: never typed, so fields cannot run together
_KEY_BYTES = 12


def canonical_text(request: GenerationRequest) -> str:
    """The request's prompt as one string whose prefixes are the prompt's prefixes."""
    if request.prompt_token_ids is not None:
        return "ids" + _SEPARATOR + ",".join(map(str, request.prompt_token_ids))
    if request.prompt is not None:
        special = "+" if request.add_special_tokens else "-"
        return "prompt" + special + _SEPARATOR + request.prompt
    tools = json.dumps([tool.model_dump(mode="json") for tool in request.tools],
                       sort_keys=True) if request.tools else ""
    parts = ["chat", tools]
    for message in request.messages or ():
        calls = json.dumps([c.model_dump(mode="json") for c in message.tool_calls],
                           sort_keys=True) if message.tool_calls else ""
        parts.append(_SEPARATOR.join((message.role, message.name or "", message.content,
                                      calls, message.tool_call_id or "")))
    # Each message ends with the separator, so a message's prefix never matches a whole one.
    return _SEPARATOR.join(parts) + _SEPARATOR


def prefix_keys(request: GenerationRequest) -> list[bytes]:
    """Chained keys of the request's canonical text, one per full KEY_SPAN bytes
    (at most MAX_KEYS): keys[i] covers the first (i + 1) * KEY_SPAN bytes."""
    text = canonical_text(request).encode("utf-8", errors="surrogatepass")
    keys: list[bytes] = []
    parent = b"shoal-routing-root"
    for start in range(0, min(len(text) // KEY_SPAN, MAX_KEYS) * KEY_SPAN, KEY_SPAN):
        digest = hashlib.blake2b(parent, digest_size=_KEY_BYTES)
        digest.update(text[start:start + KEY_SPAN])
        parent = digest.digest()
        keys.append(parent)
    return keys


def session_key(session_id: str) -> bytes:
    """What the cluster knows of a session id: a hash of it."""
    return hashlib.blake2b(session_id.encode("utf-8", errors="surrogatepass"),
                           digest_size=_KEY_BYTES, person=b"shoal-session").digest()
