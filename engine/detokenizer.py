"""`IncrementalDetokenizer`: token ids in, text deltas out, with stop strings. No torch.

Byte-level BPE can split one UTF-8 character over several tokens; decoding such a prefix
yields U+FFFD, so text is only released once it decodes cleanly. Decoding restarts from a
few tokens back (`prefix_offset`) so merges across the boundary come out as a full decode
would produce them.

Stop strings are matched on the text, so they may span tokens. Text that could still be the
start of a stop string is held back until it cannot be, and a matched stop string (and all
after it) is cut, so a client never receives text it must take back.
"""
from __future__ import annotations

from typing import Callable

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: list[int], stop: list[str]):
        self._decode = decode
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self.text = ""  # all output text decoded so far (before any stop cut)
        self._emitted = 0  # characters of self.text already handed out
        self.stopped = False

    def add(self, token_id: int) -> None:
        self._ids.append(token_id)
        self._release()
        self._check_stop()

    def _release(self) -> bool:
        """Append the text of the tokens after the window, if it decodes cleanly; whether it did."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return True
        return False

    @property
    def has_stop(self) -> bool:
        return bool(self._stop)

    def add_many(self, token_ids: list[int]) -> None:
        """`add` of each token in turn, for what anyone can read after it: without stop strings,
        when the new tokens end on a whole character, the text is decoded once, over the window
        and every new token (a speculative step emits several: two decodes a token were about a
        tenth of a batch-1 step's bookkeeping beside the forward). The window's context tokens
        stay in front, so the new text is what the token-by-token deltas add up to. Otherwise
        (a stop string to look for, a character still split) token by token, as `add` would."""
        if self._stop or len(token_ids) <= 1:
            for token_id in token_ids:
                self.add(token_id)
            return
        self._ids.extend(token_ids)
        if self._release():
            return
        del self._ids[-len(token_ids):]
        for token_id in token_ids:
            self.add(token_id)

    def _check_stop(self) -> None:
        if self.stopped or not self._stop:
            return
        window_start = max(0, self._emitted - max(len(s) for s in self._stop))
        hits = [i for s in self._stop if (i := self.text.find(s, window_start)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _holdback(self) -> int:
        """How many trailing characters could begin a stop string."""
        for n in range(min(len(self.text), max((len(s) for s in self._stop), default=0)), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self._stop):
                return n
        return 0

    def take_delta(self, final: bool = False) -> str:
        """New text safe to send; `final` releases everything left."""
        if final and not self.stopped and self._read_offset < len(self._ids):
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
            self.text += self._decode(self._ids[self._prefix_offset:])[len(prefix):]
            self._read_offset = len(self._ids)
            self._check_stop()
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._holdback()
        delta = self.text[self._emitted:end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta
