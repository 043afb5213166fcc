"""A small SentencePiece-style (`llama`) vocabulary written by the tests themselves, so SPM behaviour is
covered where llama.cpp's ggml-vocab-llama-spm.gguf is not present: <unk>, <s>, </s>, the 256 byte
tokens, the characters of a few sentences and every prefix of their words (so BPE merges reach each
whole word, the longer prefix scoring higher)."""

from __future__ import annotations

from typing import Any

from engine.gguf.vocab import TokenType

SPACE = "\u2581"
SENTENCES = (
    "The capital of France is clar Rule and the capital of Spain is Madrid.",
    "Once upon a time there was a hare who laughed at a slow tortoise.",
    "Hello world, hello moecache: 12 experts, 3 layers!",
)


def spm_vocab(sentences: tuple[str, ...] = SENTENCES) -> dict[str, Any]:
    """GGUF tokenizer metadata of the vocabulary (`tokenizer.ggml.*`)."""
    pieces: dict[str, float] = {}
    for sentence in sentences:
        for char in sentence.replace(" ", SPACE):
            pieces.setdefault(char, -100.0)
        for word in sentence.split():
            marked = SPACE + word
            for end in range(2, len(marked) + 1):
                pieces[marked[:end]] = max(pieces.get(marked[:end], -100.0), float(end))
    pieces.setdefault(SPACE, -100.0)
    special = [("<unk>", TokenType.UNKNOWN), ("<s>", TokenType.CONTROL), ("</s>", TokenType.CONTROL)]
    byte_tokens = [(f"<0x{b:02X}>", TokenType.BYTE) for b in range(256)]
    tokens = [t for t, _ in special + byte_tokens] + list(pieces)
    types = [int(k) for _, k in special + byte_tokens] + [int(TokenType.NORMAL)] * len(pieces)
    scores = [0.0] * (len(special) + len(byte_tokens)) + list(pieces.values())
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }
