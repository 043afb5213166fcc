"""Per-request text output: incremental detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from engine.gguf.tokenizer import IncrementalDetokenizer, Tokenizer


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class TextOutput:
    """The text of one request as it grows. `emit` returns only what no stop string can take back.

    The text continues `prompt_ids`: it equals `decode(prompt + output)[len(decode(prompt)):]`, so a
    SentencePiece vocabulary keeps the leading space of the first generated token after a prompt."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...], prompt_ids: Sequence[int] = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = stops
        self.text = ""
        self.sent = 0  # characters already emitted
        self.hit_stop = False

    def add(self, token: int) -> bool:
        """Append a token's text; True when a stop string appeared (the text is cut before it)."""
        return self._append(self.detok.add(token))

    def _append(self, new_text: str) -> bool:
        self.text += new_text
        for stop in self.stops:
            index = self.text.find(stop, max(0, self.sent - len(stop)))
            if index >= 0:
                self.text, self.hit_stop = self.text[:index], True
        return self.hit_stop

    def emit(self) -> str:
        end = max(self.sent, len(self.text) - held_back(self.text, self.stops))
        chunk, self.sent = self.text[self.sent:end], end
        return chunk

    def finish(self) -> str:
        """Everything not yet emitted, once no more tokens come."""
        if not self.hit_stop:
            self._append(self.detok.flush())
        chunk, self.sent = self.text[self.sent:], len(self.text)
        return chunk
