"""The tokenizer of a GGUF model, built from its metadata, with llama.cpp's tokenization.

Encoding splits special tokens off first (llama.cpp's `tokenizer_st_partition`), then runs each text
fragment through a `tokenizers` backend. Decoding joins the bytes of each token and decodes UTF-8 once,
so byte-fallback and byte-level pieces of one character always come back together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.gguf.backends import build_backend, token_pieces
from engine.gguf.chat import render_chat_template
from engine.gguf.detokenizer import IncrementalDetokenizer
from engine.gguf.vocab import TokenType, VocabSpec, parse_vocab, stop_token_ids

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

# A fragment is raw text, or the id of a special token found in the text.
Fragment = str | int


class Tokenizer:
    """Text <-> token ids for one vocabulary; not changed after construction."""

    def __init__(self, spec: VocabSpec) -> None:
        self.spec = spec
        self.vocab_size = len(spec.tokens)
        self.bos_id = spec.bos_id
        self.eos_id = spec.eos_id
        self.eot_id = spec.eot_id
        self.pad_id = spec.pad_id
        self.stop_token_ids = stop_token_ids(spec)
        self.chat_template = spec.chat_template
        self._backend = build_backend(spec)
        self._pieces = token_pieces(spec)
        # Control and unknown tokens: matched in text only on request, dropped by skip_special.
        self._special_ids = _ids_of_type(spec, TokenType.CONTROL, TokenType.UNKNOWN)
        self._user_ids = _ids_of_type(spec, TokenType.USER_DEFINED)
        self._all_matchers = _matchers(spec.tokens, self._special_ids | self._user_ids)
        self._user_matchers = _matchers(spec.tokens, self._user_ids)
        self._bos_ids = [spec.bos_id] if spec.add_bos and spec.bos_id is not None else []
        self._eos_ids = [spec.eos_id] if spec.add_eos and spec.eos_id is not None else []

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from decoded GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        return cls(parse_vocab(metadata))

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`. add_special adds BOS/EOS as the vocabulary asks; parse_special matches
        control tokens written in the text (user-defined tokens are always matched, as in llama.cpp)."""
        ids = list(self._bos_ids) if add_special else []
        after_special = True
        for fragment in partition(text, self._all_matchers if parse_special else self._user_matchers):
            if isinstance(fragment, int):
                ids.append(fragment)
            else:
                ids.extend(self._encode_text(fragment, add_prefix=after_special))
            after_special = isinstance(fragment, int)
        return ids + self._eos_ids if add_special else ids

    def _encode_text(self, text: str, add_prefix: bool) -> list[int]:
        # SentencePiece vocabularies encode a leading space at the start and after each special token.
        if add_prefix and self.spec.add_space_prefix:
            text = " " + text
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD. skip_special drops control and unknown tokens."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int], skip_special: bool = False) -> bytes:
        pieces = []
        at_start = True
        for token_id in ids:
            pieces.append(self.render(token_id, at_start, skip_special))
            at_start = self.is_boundary(token_id)
        return b"".join(pieces)

    def render(self, token_id: int, at_start: bool, skip_special: bool) -> bytes:
        """Bytes of one token in context: `at_start` is true at the start of a sequence or after a
        special token, where a SentencePiece vocabulary drops the space its encoding added."""
        self._check_id(token_id)
        if skip_special and token_id in self._special_ids:
            return b""
        piece = self._pieces[token_id]
        if at_start and self.spec.add_space_prefix and piece[:1] == b" " and not self.is_boundary(token_id):
            return piece[1:]
        return piece

    def is_boundary(self, token_id: int) -> bool:
        """Whether text after this token is encoded as a fresh fragment (it is a special token)."""
        return token_id in self._special_ids or token_id in self._user_ids

    def token_text(self, token_id: int) -> str:
        """The token's own text (spaces as spaces, bytes as bytes), for logprobs display."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        self._check_id(token_id)
        return self._pieces[token_id]

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")

    def special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.spec.tokens[token_id]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt text for a conversation, rendered as transformers renders the model's template."""
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.special_text(self.bos_id),
            eos_token=self.special_text(self.eos_id),
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Prompt ids of a conversation: special tokens in the template are parsed, and BOS is added only
        when the vocabulary asks for it and the template did not already write it."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        has_bos = self.bos_id is not None and text.startswith(self.spec.tokens[self.bos_id])
        return self.encode(text, add_special=not has_bos, parse_special=True)


def _ids_of_type(spec: VocabSpec, *types: TokenType) -> frozenset[int]:
    return frozenset(token_id for token_id, kind in enumerate(spec.token_types) if kind in types)


def _matchers(tokens: Sequence[str], ids: frozenset[int]) -> list[tuple[str, int]]:
    # Longest first, as llama.cpp tries special tokens; an empty text would match everywhere.
    matchers = [(tokens[i], i) for i in ids if tokens[i]]
    return sorted(matchers, key=lambda match: (-len(match[0]), match[1]))


def partition(text: str, matchers: Sequence[tuple[str, int]]) -> list[Fragment]:
    """Split `text` at every occurrence of each special token, trying the tokens in the order given."""
    fragments: list[Fragment] = [text] if text else []
    for special, token_id in matchers:
        if any(isinstance(f, str) and special in f for f in fragments):
            fragments = [part for f in fragments for part in _split_at(f, special, token_id)]
    return fragments


def _split_at(fragment: Fragment, special: str, token_id: int) -> list[Fragment]:
    if isinstance(fragment, int) or special not in fragment:
        return [fragment]
    parts: list[Fragment] = []
    for index, text in enumerate(fragment.split(special)):
        if index:
            parts.append(token_id)
        if text:
            parts.append(text)
    return parts
