"""Tokenizer metadata for random-weight models, trained offline-free from a shipped corpus.

Each recipe is a byte-level BPE of one model family's kind: its pre-tokenizer, its special tokens and its
chat format, trained by `tokenizers` on `tools.corpus`; Gemma 4's is its SentencePiece-style BPE
(`gemma4_vocab`). The embedded default model's is Qwen2's pre-tokenizer with ChatML. The result is a
GGUF-style metadata mapping, so a model's tokenizer goes through the same `Tokenizer.from_metadata` as any
GGUF file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tokenizers import Regex, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from engine.gguf.backends import SPACE_MARK
from engine.gguf.chat import CHATML_TEMPLATE
from engine.gguf.pretokenizers import build_pre_tokenizer, pre_tokenizer_spec
from engine.gguf.vocab import TokenType
from tools.corpus import CORPUS

VOCAB_SIZE = 4096
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
DS_BOS, DS_EOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
DS_USER, DS_ASSISTANT = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"
# DeepSeek-V3's turns, as llama.cpp's built-in `deepseek3` format writes them (src/llama-chat.cpp)
DEEPSEEK3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '" + DS_USER + "' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '" + DS_ASSISTANT + "' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '" + DS_ASSISTANT + "' }}{% endif %}"
)
# gpt-oss's o200k_harmony control tokens, and harmony's turns as llama.cpp's built-in `gpt-oss` format
# writes them (src/llama-chat.cpp): a message ends with <|end|>, the assistant's last with <|return|>
HARMONY_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                    "<|end|>", "<|message|>", "<|call|>")
HARMONY_TEMPLATE = (
    "{% for message in messages %}<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}<|return|>{% else %}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

# Gemma 4's control tokens in its order (pad, eos, bos, unk first) and its turns: `<|turn>role\n...<turn|>\n`,
# the assistant's role named "model" (llama.cpp's `common/parsers/gemma4.cpp`)
GEMMA4_CONTROL = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>")
GEMMA4_VISIBLE = ("<|channel>", "<channel|>")  # rendered as text, so a chat parser reads them (its converter)
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ message['content'] + '<turn|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)


@dataclass(frozen=True)
class VocabRecipe:
    pre: str  # tokenizer.ggml.pre
    specials: tuple[str, ...]  # control tokens, appended after the learned ones
    bos: str | None
    eos: str
    eot: str | None
    pad: str | None
    add_bos: bool
    chat_template: str


RECIPES: dict[str, VocabRecipe] = {
    # Qwen2's pre-tokenizer, ChatML; the special tokens appended after the learned ones, as Qwen does
    "embedded": VocabRecipe("qwen2", (ENDOFTEXT, IM_START, IM_END), ENDOFTEXT, IM_END, IM_END, ENDOFTEXT, False,
                            CHATML_TEMPLATE),
    "deepseek-v3": VocabRecipe("deepseek-v3", (DS_BOS, DS_EOS, DS_USER, DS_ASSISTANT), DS_BOS, DS_EOS, None,
                               DS_EOS, True, DEEPSEEK3_TEMPLATE),
    # GPT-4o's pre-tokenizer (o200k); no BOS added
    "gpt-oss": VocabRecipe("gpt-4o", HARMONY_SPECIALS, "<|startoftext|>", "<|return|>", None, "<|endoftext|>", False,
                           HARMONY_TEMPLATE),
}


def build_vocab(recipe: str) -> dict[str, Any]:
    """GGUF tokenizer metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`); the same on every call."""
    if recipe == "gemma4":
        return gemma4_vocab()
    r = RECIPES[recipe]
    tokens, merges = _trained_vocab(r.pre, len(r.specials))
    all_tokens = [*tokens, *r.specials]
    ids = {text: token_id for token_id, text in enumerate(all_tokens)}
    types = [TokenType.NORMAL] * len(tokens) + [TokenType.CONTROL] * len(r.specials)
    named = {"bos_token_id": r.bos, "eos_token_id": r.eos, "eot_token_id": r.eot, "padding_token_id": r.pad}
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": r.pre,
        "tokenizer.ggml.tokens": all_tokens,
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.merges": list(merges),
        **{f"tokenizer.ggml.{key}": ids[text] for key, text in named.items() if text is not None},
        "tokenizer.ggml.add_bos_token": r.add_bos,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": r.chat_template,
    }


def gemma4_vocab() -> dict[str, Any]:
    """Gemma 4's kind of vocabulary: control tokens, then the 256 byte-fallback tokens, then the learned ones
    (spaces as '▁', merges ranked by order)."""
    specials = (*GEMMA4_CONTROL, *GEMMA4_VISIBLE)
    byte_tokens = tuple(f"<0x{b:02X}>" for b in range(256))
    learned, merges = _trained_spm_bpe(len(specials) + len(byte_tokens))
    tokens = [*specials, *byte_tokens, *learned]
    types = [TokenType.UNKNOWN if t == "<unk>" else TokenType.CONTROL for t in GEMMA4_CONTROL]
    types += [TokenType.USER_DEFINED] * len(GEMMA4_VISIBLE) + [TokenType.BYTE] * 256
    types += [TokenType.NORMAL] * len(learned)
    ids = {text: token_id for token_id, text in enumerate(tokens)}
    return {
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": ids["<bos>"], "tokenizer.ggml.eos_token_id": ids["<eos>"],
        "tokenizer.ggml.eot_token_id": ids["<turn|>"], "tokenizer.ggml.unknown_token_id": ids["<unk>"],
        "tokenizer.ggml.padding_token_id": ids["<pad>"],
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": GEMMA4_TEMPLATE,
    }


def build_embedded_vocab() -> dict[str, Any]:
    """The embedded default model's tokenizer metadata."""
    return build_vocab("embedded")


@lru_cache(maxsize=4)
def _trained_vocab(pre: str, num_specials: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    # (tokens by id, merges as "left right"); training takes ~0.2 s, so it runs once per process and recipe
    backend = Backend(BPE())
    backend.pre_tokenizer = build_pre_tokenizer(pre_tokenizer_spec(pre))
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - num_specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    vocab = backend.get_vocab()
    tokens = tuple(sorted(vocab, key=vocab.__getitem__))
    merges = json.loads(backend.to_str())["model"]["merges"]
    # Serialized as [left, right] pairs by recent `tokenizers`, as "left right" strings by older ones.
    return tokens, tuple(m if isinstance(m, str) else " ".join(m) for m in merges)


@lru_cache(maxsize=1)
def _trained_spm_bpe(num_fixed: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    # (learned tokens, merges as "left right"): words begin at each '▁', so no merge crosses a word and
    # tokenizing a whole line unsplit (as llama.cpp does) gives the same tokens
    backend = Backend(BPE(byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", SPACE_MARK)
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n+"), behavior="isolated"),
        pre_tokenizers.Split(SPACE_MARK, behavior="merged_with_next")])
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - num_fixed, show_progress=False)
    backend.train_from_iterator(CORPUS, trainer=trainer)
    vocab = backend.get_vocab()
    merges = json.loads(backend.to_str())["model"]["merges"]
    return (tuple(sorted(vocab, key=vocab.__getitem__)),
            tuple(m if isinstance(m, str) else " ".join(m) for m in merges))
