"""Tokenizer metadata for the embedded default model, trained offline-free from a shipped corpus.

A byte-level BPE with Qwen2's pre-tokenizer and ChatML special tokens, trained by `tokenizers` on
`tools.corpus`. The result is a GGUF-style metadata mapping, so the model's tokenizer goes
through the same `Tokenizer.from_metadata` as any GGUF file.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer as Backend
from tokenizers import pre_tokenizers, trainers
from tokenizers.models import BPE

from engine.gguf.chat import CHATML_TEMPLATE
from engine.gguf.pretokenizers import build_pre_tokenizer, pre_tokenizer_spec
from engine.gguf.vocab import TokenType
from tools.corpus import CORPUS

VOCAB_SIZE = 4096
PRE_TOKENIZER = "qwen2"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # appended after the learned tokens, as Qwen does


def build_embedded_vocab() -> dict[str, Any]:
    """GGUF tokenizer metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`); the same on every call."""
    tokens, merges = _trained_vocab()
    all_tokens = [*tokens, *SPECIAL_TOKENS]
    ids = {text: token_id for token_id, text in enumerate(all_tokens)}
    types = [TokenType.NORMAL] * len(tokens) + [TokenType.CONTROL] * len(SPECIAL_TOKENS)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": PRE_TOKENIZER,
        "tokenizer.ggml.tokens": all_tokens,
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": ids[ENDOFTEXT],
        "tokenizer.ggml.eos_token_id": ids[IM_END],
        "tokenizer.ggml.eot_token_id": ids[IM_END],
        "tokenizer.ggml.padding_token_id": ids[ENDOFTEXT],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": CHATML_TEMPLATE,
    }


@lru_cache(maxsize=1)
def _trained_vocab() -> tuple[tuple[str, ...], tuple[str, ...]]:
    # (tokens by id, merges as "left right"); training takes ~0.2 s, so it runs once per process.
    backend = Backend(BPE())
    backend.pre_tokenizer = build_pre_tokenizer(pre_tokenizer_spec(PRE_TOKENIZER))
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    vocab = backend.get_vocab()
    tokens = tuple(sorted(vocab, key=vocab.__getitem__))
    merges = json.loads(backend.to_str())["model"]["merges"]
    # Serialized as [left, right] pairs by recent `tokenizers`, as "left right" strings by older ones.
    return tokens, tuple(m if isinstance(m, str) else " ".join(m) for m in merges)
