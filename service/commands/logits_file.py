"""llama.cpp's `--kl-divergence-base` file: the log-probabilities of a base run, so that another run (of
moecache or of `llama-perplexity --kl-divergence`) can be compared with it token by token.

Layout (llama.cpp `tools/perplexity/perplexity.cpp`, little endian): the 8 bytes `_logits_`, then int32
n_ctx, n_vocab, n_chunk, then the int32 tokens of every chunk `[n_chunk, n_ctx]`, then per chunk the
rows of its scored positions (n_ctx/2 .. n_ctx-2), each `2 * ((n_vocab + 1) // 2) + 4` uint16: two
float32 (scale, min log-probability) and one uint16 per token, log p = scale * q + min. The range kept
is the 16 nats below the most likely token; anything lower reads as the minimum.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

MAGIC = b"_logits_"
RANGE_NATS = 16.0  # log-probabilities kept below the most likely token
LEVELS = 65535


def row_width(num_vocab: int) -> int:
    """uint16 per stored row: the two float32 and the vocabulary, padded to an even count."""
    return 2 * ((num_vocab + 1) // 2) + 4


def scored_rows(num_ctx: int) -> int:
    """Rows stored per chunk: positions n_ctx/2 .. n_ctx-2 (each predicting the next token)."""
    return num_ctx - 1 - num_ctx // 2


def encode_rows(logprobs: np.ndarray) -> np.ndarray:
    """float32 log-probabilities `[rows, vocab]` -> the file's uint16 rows `[rows, row_width(vocab)]`."""
    num_rows, num_vocab = logprobs.shape
    top = logprobs.max(axis=1, keepdims=True)
    low = np.maximum(logprobs.min(axis=1, keepdims=True), top - RANGE_NATS)
    scale = ((top - low) / LEVELS).astype(np.float32)
    inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    codes = np.where(logprobs > low, np.rint((logprobs - low) * inverse), 0)
    out = np.zeros((num_rows, row_width(num_vocab)), dtype=np.uint16)
    out[:, :4] = np.concatenate([scale, low.astype(np.float32)], axis=1).view(np.uint16)
    out[:, 4:4 + num_vocab] = codes.astype(np.uint16)
    return out


def decode_rows(rows: np.ndarray, num_vocab: int) -> np.ndarray:
    """The file's uint16 rows -> float32 log-probabilities `[rows, vocab]`."""
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)  # [rows, 2]: scale, min
    return (rows[:, 4:4 + num_vocab] * head[:, :1] + head[:, 1:2]).astype(np.float32)


def write_header(out: BinaryIO, num_ctx: int, num_vocab: int, tokens: np.ndarray) -> None:
    """`tokens`: int32 `[n_chunk, n_ctx]`, as read from the text (before a BOS takes the first place)."""
    out.write(MAGIC)
    out.write(np.array([num_ctx, num_vocab, tokens.shape[0]], dtype="<i4").tobytes())
    out.write(np.ascontiguousarray(tokens, dtype="<i4").tobytes())


@dataclass(frozen=True)
class BaseFile:
    """A base file opened for reading; chunks are read from a memory map."""

    num_ctx: int
    num_vocab: int
    tokens: np.ndarray  # int32 [n_chunk, n_ctx]
    rows: np.ndarray  # uint16 [n_chunk, scored_rows(n_ctx), row_width(n_vocab)]

    @property
    def num_chunks(self) -> int:
        return int(self.tokens.shape[0])

    def chunk(self, index: int) -> np.ndarray:
        """float32 log-probabilities `[scored_rows(n_ctx), vocab]` of chunk `index`."""
        return decode_rows(np.asarray(self.rows[index]), self.num_vocab)


def open_base(path: str | Path) -> BaseFile:
    data = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(data[:8]) != MAGIC:
        raise ValueError(f"{path} does not look like a file of log-probabilities (no {MAGIC.decode()} header)")
    num_ctx, num_vocab, num_chunks = (int(v) for v in data[8:20].view("<i4"))
    tokens_end = 20 + 4 * num_ctx * num_chunks
    shape = (num_chunks, scored_rows(num_ctx), row_width(num_vocab))
    if num_ctx < 2 or num_vocab < 1 or num_chunks < 1 or data.size != tokens_end + 2 * int(np.prod(shape)):
        raise ValueError(f"{path}: {data.size} bytes do not hold {num_chunks} chunks of {num_ctx} tokens over a "
                         f"vocabulary of {num_vocab}")
    tokens = data[20:tokens_end].view("<i4").reshape(num_chunks, num_ctx)
    return BaseFile(num_ctx, num_vocab, tokens, data[tokens_end:].view("<u2").reshape(shape))
