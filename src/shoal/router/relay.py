"""What of a generation request's attempts reaches its client, for the single retry.

An attempt whose serving runner or node is lost before the client has seen any of its
answer is sent once more, to another instance when there is one (router.py), and the client
never learns of it. "Seen" means a chunk that shows the client something: a token chunk
whose text the runner still holds back (an incomplete UTF-8 sequence, a possible stop
string) shows nothing, so such chunks wait here until one that does comes, and a lost
attempt's are dropped with it.
"""

from __future__ import annotations

from typing import Any

# Errors that say the serving runner or node went away (or its instance could not take the
# request): before the client has seen the answer begin, the request is retried once.
LOST_SERVER_CODES = ("runner_crashed", "unavailable")


def shows_nothing(chunk: Any) -> bool:
    """A token or reasoning chunk with no text (and no logprobs) to show its client."""
    return (chunk.kind in ("token", "reasoning") and not chunk.text
            and not getattr(chunk, "logprobs", ()))


class Relay:
    """Passes one request's chunks on to its client, across its attempts, under its own
    request id: one AcceptedChunk, and text-less chunks held until the answer shows."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.accepted = False  # an AcceptedChunk went to the client (a retry sends none)
        self.started = False  # a chunk past the AcceptedChunk went to the client
        self._held: list[Any] = []

    def lost(self, chunk: Any, retry_left: bool) -> bool:
        """chunk ends an attempt that the client has seen nothing of, with a retry left."""
        return (retry_left and not self.started and chunk.kind == "error"
                and chunk.code in LOST_SERVER_CODES)

    def drop_attempt(self) -> None:
        """The attempt was lost: what it held back never reaches the client."""
        self._held.clear()

    def pass_on(self, chunk: Any) -> list[Any]:
        """What goes to the client now, given chunk."""
        if chunk.kind == "accepted":
            if self.accepted:
                return []
            self.accepted = True
            return [self._own(chunk)]
        if not self.started and shows_nothing(chunk):
            self._held.append(chunk)
            return []
        self.started = True
        held, self._held = self._held, []
        return [self._own(c) for c in (*held, chunk)]

    def _own(self, chunk: Any) -> Any:
        if chunk.request_id == self.request_id:
            return chunk
        return chunk.model_copy(update={"request_id": self.request_id})
