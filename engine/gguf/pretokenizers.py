"""Pre-tokenizers of byte-level BPE vocabularies, chosen by `tokenizer.ggml.pre`.

The regexes are llama.cpp's (`llm_tokenizer_bpe` in src/llama-vocab.cpp). llama.cpp applies them in
order, each one splitting the pieces left by the previous one and keeping unmatched text as pieces of
its own; `Split(behavior="isolated")` in a `Sequence` does exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

# (?i:'s|...) spelled out, as llama.cpp does, so only ASCII letters match case-insensitively.
CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = CONTRACTIONS + (
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = CONTRACTIONS + (
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Where llama.cpp rewrites \p{Lu}.. classes for std::regex, the tokenizer.json original is kept: the
# rewrite splits non-ASCII lowercase letters differently from the tokenizer the model was trained with.
GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BAILING = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
# The cased letters (Unicode category LC) as DeepSeek's tokenizer lists them.
DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    "\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[" + DEEPSEEK_LETTERS + "]+",
    r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    CJK_HANGUL,
    r"\p{N}+",
)
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK_HANGUL, r"\p{N}")
DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")
FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")
STARCODER = (r"\p{N}", GPT2)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """How llama.cpp splits text before BPE for one `tokenizer.ggml.pre` value."""

    name: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is taken whole
    add_bos: bool = False  # llama.cpp's default for `tokenizer.ggml.add_bos_token`


def _family(names: str, regexes: tuple[str, ...], **flags: bool) -> dict[str, PreTokenizerSpec]:
    return {name: PreTokenizerSpec(name, regexes, **flags) for name in names.split()}


PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    **_family("default", DEFAULT),
    **_family("gpt-2 phi-2 olmo mpt jais exaone4 roberta-bpe trillion", (GPT2,)),
    **_family("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2", (LLAMA3,),
              ignore_merges=True, add_bos=True),
    **_family("dbrx smaug-bpe glm4 chatglm-bpe", (LLAMA3,)),
    **_family("qwen2 deepseek-r1-qwen kormo megrez stablelm2 hunyuan", (QWEN2,)),
    **_family("qwen35", (QWEN35,)),
    **_family("gpt-4o llama4 minimax-m2", (GPT4O,)),
    **_family("bailingmoe bailingmoe2 llada-moe", (BAILING,)),
    **_family("deepseek-llm", DEEPSEEK_LLM),
    **_family("deepseek-coder", DEEPSEEK_CODER),
    **_family("deepseek-v3 hunyuan-dense", DEEPSEEK_V3),
    **_family("falcon", FALCON),
    **_family("starcoder refact command-r smollm codeshell exaone", STARCODER),
}  # fmt: skip


def pre_tokenizer_spec(name: str) -> PreTokenizerSpec:
    """The spec for a `tokenizer.ggml.pre` value; ValueError naming it when it is not supported."""
    if name not in PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported pre-tokenizer {name!r} (tokenizer.ggml.pre); known: {sorted(PRE_TOKENIZERS)}"
        )
    return PRE_TOKENIZERS[name]


def build_pre_tokenizer(spec: PreTokenizerSpec) -> pre_tokenizers.PreTokenizer:
    """Regex splits in llama.cpp's order, then the GPT-2 byte-to-unicode mapping."""
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in spec.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, byte_level])
