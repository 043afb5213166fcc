"""Streaming detokenization: text of generated tokens as they come, never half a character."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.gguf.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns generated token ids into text chunks whose concatenation equals `decode` of all ids.

    Bytes of a character split across tokens (byte fallback, byte-level BPE) are held back until the
    character is complete. `prompt_ids` give the context of the first token: a SentencePiece vocabulary
    drops its leading space only at the start of a sequence or after a special token.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, skip_special: bool = False
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._at_start = (
            prompt_ids is None or len(prompt_ids) == 0 or tokenizer.is_boundary(int(prompt_ids[-1]))
        )
        # The incremental decoder keeps an incomplete UTF-8 tail and replaces invalid bytes exactly as a
        # one-shot decode of all the bytes would.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """New complete text after this token (may be empty while a character is incomplete)."""
        piece = self._tokenizer.render(token_id, self._at_start, self._skip_special)
        self._at_start = self._tokenizer.is_boundary(token_id)
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Whatever is held back, once no more tokens come (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)
