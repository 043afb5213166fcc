"""`tokenizers` models equivalent to llama.cpp's BPE and SPM tokenizers, and the bytes of each token.

The backends only see plain text: special tokens are split off before (see `tokenizer.py`), so they
carry no added tokens, post-processor or decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from tokenizers import Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from engine.gguf.pretokenizers import build_pre_tokenizer
from engine.gguf.vocab import TokenType, VocabSpec

SPACE_MARK = "\u2581"  # SentencePiece's visible space


def build_backend(spec: VocabSpec) -> Backend:
    builders = {"spm": build_spm_backend, "gemma4": build_gemma4_backend, "bpe": build_bpe_backend}
    return builders[spec.kind](spec)


def build_bpe_backend(spec: VocabSpec) -> Backend:
    """Byte-level BPE: merges ranked by their order in the file, pieces from the pre-tokenizer."""
    assert spec.pre is not None
    vocab = {text: token_id for token_id, text in enumerate(spec.tokens)}
    model = BPE(vocab=vocab, merges=split_merges(spec.merges), ignore_merges=spec.pre.ignore_merges)
    backend = Backend(model)
    backend.pre_tokenizer = build_pre_tokenizer(spec.pre)
    return backend


def build_gemma4_backend(spec: VocabSpec) -> Backend:
    """Gemma 4's SentencePiece-style BPE as llama.cpp runs it: spaces become '▁', each line (and each run of
    newlines) is one word merged by rank over its UTF-8 characters, unknown bytes fall back to <0xXX>."""
    vocab = {text: token_id for token_id, text in enumerate(spec.tokens)}
    backend = Backend(BPE(vocab=vocab, merges=split_merges(spec.merges), byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", SPACE_MARK)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    return backend


def split_merges(merges: Sequence[str]) -> list[tuple[str, str]]:
    # Like llama.cpp, split at the first space after the first character.
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ValueError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((merge[:cut], merge[cut + 1 :]))
    return pairs


def build_spm_backend(spec: VocabSpec) -> Backend:
    """llama.cpp's SPM tokenizer as BPE: whole text is one word, spaces become '▁', unknown bytes fall
    back to <0xXX> tokens; the leading space (add_space_prefix) is added by the caller."""
    vocab = {text: token_id for token_id, text in enumerate(spec.tokens)}
    unk = next(
        (t for t, kind in zip(spec.tokens, spec.token_types, strict=True) if kind == TokenType.UNKNOWN), None
    )
    model = BPE(vocab=vocab, merges=spm_merges(spec.tokens, spec.scores), byte_fallback=True,
                fuse_unk=True, unk_token=unk)  # fmt: skip
    backend = Backend(model)
    backend.normalizer = normalizers.Replace(" ", SPACE_MARK)
    return backend


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best merged score first.

    llama.cpp merges the adjacent pair whose concatenation is the highest-scoring token; ranking each
    pair by the score of what it makes gives BPE the same order.
    """
    ids = {text: token_id for token_id, text in enumerate(tokens)}
    ranked = []
    for token_id, text in enumerate(tokens):
        for cut in range(1, len(text)):
            if text[:cut] in ids and text[cut:] in ids:
                ranked.append((-scores[token_id], token_id, cut))
    ranked.sort()
    return [(tokens[token_id][:cut], tokens[token_id][cut:]) for _, token_id, cut in ranked]


@lru_cache(maxsize=1)
def byte_level_decoding() -> dict[int, int]:
    """GPT-2's byte-to-unicode table inverted: code point of the visible char -> byte."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = list(visible)
    extra = 0
    for byte in range(256):
        if byte not in visible:
            visible.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(chars, visible, strict=True))


def token_pieces(spec: VocabSpec) -> list[bytes]:
    """The bytes each token stands for, as llama.cpp's `token_to_piece` renders it with special=true."""
    to_latin1 = {char: chr(byte) for char, byte in byte_level_decoding().items()}
    return [
        _piece(spec.kind, text, kind, to_latin1)
        for text, kind in zip(spec.tokens, spec.token_types, strict=True)
    ]


def _piece(vocab_kind: str, text: str, kind: int, to_latin1: dict[int, str]) -> bytes:
    if kind in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN):
        return text.encode()
    if kind == TokenType.BYTE:
        return bytes([int(text[3:5], 16)])  # "<0xAB>"
    if kind != TokenType.NORMAL:
        return b""  # llama.cpp renders unused and undefined tokens as nothing
    if vocab_kind in ("spm", "gemma4"):
        return text.replace(SPACE_MARK, " ").encode()
    mapped = text.translate(to_latin1)
    try:
        return mapped.encode("latin-1")
    except UnicodeEncodeError:  # a char outside the byte alphabet: keep its own UTF-8 bytes
        return b"".join(c.encode("latin-1") if ord(c) < 256 else c.encode() for c in mapped)
