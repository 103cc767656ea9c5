"""Incremental detokenization and stop strings, applied to one request's stream of tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded as context before the first generated one, so a generated token's
# leading space (SentencePiece "▁") survives decoders that strip it at the start of a text.
_CONTEXT_TOKENS = 5
_MAX_PENDING_TOKENS = 8


class _Decodes(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that are always whole UTF-8 characters.

    Decodes a sliding window: tokens[prefix_offset:read_offset] is text already emitted (kept as
    context), tokens[read_offset:] is new. A delta is emitted only when the window's text no
    longer ends in U+FFFD, i.e. when a multi-byte character split over tokens is complete.
    """

    def __init__(self, tokenizer: _Decodes, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        """The text this token completes ("" while a character is still incomplete)."""
        self._tokens.append(token_id)
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text):
            return ""
        # A UTF-8 character spans at most 4 byte tokens; past that, the bytes are truly invalid
        # and their U+FFFD is the text.
        pending = len(self._tokens) - self._read_offset
        if window_text.endswith(_REPLACEMENT) and pending < _MAX_PENDING_TOKENS:
            return ""
        return self._advance(prefix_text, window_text)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end of the stream)."""
        if self._read_offset >= len(self._tokens):
            return ""
        prefix_text, window_text = self._decode_window()
        if len(window_text) <= len(prefix_text):
            return ""
        return self._advance(prefix_text, window_text)

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        prefix = self._tokens[self._prefix_offset:self._read_offset]
        window = self._tokens[self._prefix_offset:]
        return (decode(prefix, skip_special_tokens=self._skip_special),
                decode(window, skip_special_tokens=self._skip_special))

    def _advance(self, prefix_text: str, window_text: str) -> str:
        delta = window_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self.text += delta
        return delta


class StopChecker:
    """Applies stop strings to streamed text, across any split into pieces.

    feed() returns the text that is safe to emit: it holds back the longest suffix that could
    still grow into a stop string, and when a stop string completes it returns the text before
    it and reports stopped. The stop string itself is never emitted.
    """

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self._stop = tuple(stop)
        self._held = ""
        self.stopped = False
        self.stop_string: str | None = None  # the one that matched

    def feed(self, text: str) -> tuple[str, bool]:
        """(text to emit now, whether a stop string has completed)."""
        if self.stopped:
            return "", True
        if not self._stop:
            return text, False
        buffer = self._held + text
        match_at, matched = self._earliest_match(buffer)
        if matched is not None:
            self.stopped, self.stop_string, self._held = True, matched, ""
            return buffer[:match_at], True
        keep = self._partial_suffix_length(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], False

    def flush(self) -> str:
        """The held-back text, at the natural end of the stream."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _earliest_match(self, buffer: str) -> tuple[int, str | None]:
        best_at, best = len(buffer) + 1, None
        for stop in self._stop:
            at = buffer.find(stop)
            if at != -1 and at < best_at:
                best_at, best = at, stop
        return best_at, best

    def _partial_suffix_length(self, buffer: str) -> int:
        # Longest suffix of buffer that is a proper prefix of some stop string.
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if stop.startswith(buffer[len(buffer) - length:]):
                    longest = length
                    break
        return longest
