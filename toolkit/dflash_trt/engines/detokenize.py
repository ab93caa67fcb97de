"""Incremental detokenization and stop-word handling for streamed steps (no torch needed)."""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"  # what a decoder makes of the bytes of an unfinished UTF-8 character


def complete_text(text: str) -> str:
    """Text without a trailing unfinished character: a response that max_tokens (or a stop
    token) cuts inside a multi-byte character ends before it, never with U+FFFD. Every
    engine's final text follows this rule, streamed or not; the token ids keep every token."""
    return text.rstrip(REPLACEMENT)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that are always complete UTF-8.

    Decodes a short window of recent tokens (not the whole text each time) and holds back text
    while the last token ends inside a multi-byte character (decoded as U+FFFD). The deltas
    joined equal `complete_text(tokenizer.decode(all tokens))`.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0  # window start: tokens before it never change the text again
        self.read_offset = 0  # tokens up to here have been turned into emitted text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty)."""
        self.tokens.extend(token_ids)
        before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset:])
        if after.endswith(REPLACEMENT) or len(after) <= len(before):
            return ""  # an incomplete UTF-8 sequence (or nothing visible yet): wait for more
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is still held back, less a trailing unfinished character (complete_text)."""
        before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return complete_text(after[len(before):]) if after.startswith(before) else ""


class StopWordFilter:
    """Cuts the text at the first stop word, holding back text that may be a stop word's start."""

    def __init__(self, stop_words: Sequence[str]):
        self.stop_words = [w for w in stop_words if w]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, stopped)."""
        self.pending += text
        hits = [i for i in (self.pending.find(w) for w in self.stop_words) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        hold = 0
        for word in self.stop_words:
            for n in range(min(len(word) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(word[:n]):
                    hold = max(hold, n)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
