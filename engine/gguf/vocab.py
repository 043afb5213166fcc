"""The tokenizer part of GGUF metadata, parsed once into a typed value.

Defaults and the end-of-generation rules follow llama.cpp's `llama_vocab::load`, since GGUF files are
written for it: a key that is absent means what llama.cpp assumes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from engine.gguf.pretokenizers import PreTokenizerSpec, pre_tokenizer_spec

KEY = "tokenizer.ggml."


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Texts llama.cpp treats as the end of a turn or of generation, whatever type the file gives them.
END_MARKERS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
        "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
        "<end_of_utterance>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<|fim_pad|>", "<|fim_repo|>",
        "<|repo_name|>", "<|file_sep|>", "<turn|>",
    }
)  # fmt: skip

# `tokenizer.ggml.model` values and the vocabulary kind each one means. Gemma 4's is SentencePiece-style BPE:
# spaces as '▁', merges ranked by their order over UTF-8 characters, <0xXX> byte fallback, a BOS always added
MODEL_KINDS = {"gpt2": "bpe", "llama": "spm", "gemma4": "gemma4"}
MERGED_KINDS = ("bpe", "gemma4")  # the kinds whose vocabulary carries merges
SPM_DEFAULT_IDS = {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}


@dataclass(frozen=True)
class VocabSpec:
    """Everything needed to build a tokenizer; `token_types` already has llama.cpp's overrides."""

    kind: str  # "bpe" (byte-level BPE), "spm" (SentencePiece scores, byte fallback) or "gemma4" (merges, ▁, fallback)
    pre: PreTokenizerSpec | None  # None for "spm"
    tokens: Sequence[str]
    token_types: Sequence[int]
    scores: Sequence[float]
    merges: Sequence[str]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    pad_id: int | None
    end_marker_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    def __post_init__(self) -> None:
        if self.add_bos and self.bos_id is None:
            raise ValueError(f"{KEY}add_bos_token is true, but {KEY}bos_token_id is not set")
        if self.add_eos and self.eos_id is None:
            raise ValueError(f"{KEY}add_eos_token is true, but {KEY}eos_token_id is not set")


def parse_vocab(metadata: Mapping[str, Any]) -> VocabSpec:
    """Read the `tokenizer.*` keys of decoded GGUF metadata; a clear ValueError for what is unsupported."""
    kind = _model_kind(metadata)
    tokens = list(metadata[KEY + "tokens"])
    end_markers = _end_marker_ids(tokens)
    pre = pre_tokenizer_spec(metadata.get(KEY + "pre") or "default") if kind == "bpe" else None
    add_bos = pre.add_bos if pre is not None else True
    # NOTE: llama.cpp adds Gemma 4's BOS whatever the file says
    return VocabSpec(
        kind=kind,
        pre=pre,
        tokens=tokens,
        token_types=_token_types(metadata, len(tokens), end_markers),
        scores=_per_token(metadata, "scores", len(tokens), 0.0),
        merges=list(metadata.get(KEY + "merges") or []),
        bos_id=_token_id(metadata, "bos_token_id", kind, len(tokens)),
        eos_id=_token_id(metadata, "eos_token_id", kind, len(tokens)),
        eot_id=_token_id(metadata, "eot_token_id", kind, len(tokens)),
        eom_id=_token_id(metadata, "eom_token_id", kind, len(tokens)),
        pad_id=_token_id(metadata, "padding_token_id", kind, len(tokens)),
        end_marker_ids=end_markers,
        add_bos=kind == "gemma4" or bool(metadata.get(KEY + "add_bos_token", add_bos)),
        add_eos=bool(metadata.get(KEY + "add_eos_token", False)),
        add_space_prefix=kind == "spm" and bool(metadata.get(KEY + "add_space_prefix", True)),
        chat_template=metadata.get("tokenizer.chat_template") or None,
    )


def _model_kind(metadata: Mapping[str, Any]) -> str:
    model = metadata.get(KEY + "model")
    if model not in MODEL_KINDS:
        raise ValueError(f"unsupported tokenizer model {model!r} (supported: {sorted(MODEL_KINDS)})")
    if KEY + "tokens" not in metadata:
        raise ValueError(f"GGUF metadata has no {KEY}tokens")
    if MODEL_KINDS[model] in MERGED_KINDS and not metadata.get(KEY + "merges"):
        raise ValueError(f"BPE vocabulary ({model}) without {KEY}merges")
    return MODEL_KINDS[model]


def _token_id(metadata: Mapping[str, Any], name: str, kind: str, num_tokens: int) -> int | None:
    default = SPM_DEFAULT_IDS.get(name) if kind == "spm" else None
    value = metadata.get(KEY + name, default)
    if value is None or not 0 <= int(value) < num_tokens:
        return default if default is not None and default < num_tokens else None
    return int(value)


def _end_marker_ids(tokens: Sequence[str]) -> frozenset[int]:
    ids = {token_id for token_id, text in enumerate(tokens) if text in END_MARKERS}
    # gpt-oss style vocabularies end a message with <|end|> but a turn with <|return|> or <|call|>.
    if {"<|return|>", "<|call|>", "<|end|>"} <= {tokens[i] for i in ids}:
        ids = {i for i in ids if tokens[i] != "<|end|>"}
    return frozenset(ids)


def _per_token(metadata: Mapping[str, Any], name: str, num_tokens: int, default: Any) -> list:
    values = list(metadata.get(KEY + name) or [default] * num_tokens)
    if len(values) != num_tokens:
        raise ValueError(f"{num_tokens} tokens but {len(values)} values in {KEY}{name}")
    return values


def _token_types(metadata: Mapping[str, Any], num_tokens: int, end_markers: frozenset[int]) -> list[int]:
    types = _per_token(metadata, "token_type", num_tokens, TokenType.NORMAL)
    # llama.cpp makes every end marker a control token, even when the file says otherwise.
    for token_id in end_markers:
        types[token_id] = TokenType.CONTROL
    return types


def stop_token_ids(spec: VocabSpec) -> frozenset[int]:
    """eos, eot, eom and every end marker in the vocabulary (llama.cpp's end-of-generation set)."""
    fixed = {spec.eos_id, spec.eot_id, spec.eom_id}
    return spec.end_marker_ids | {i for i in fixed if i is not None}
