"""Tokenizer from GGUF metadata: llama.cpp's test vectors, special tokens, streaming detokenization and
the embedded default vocabulary."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.gguf.backends import byte_level_decoding
from engine.gguf.pretokenizers import PRE_TOKENIZERS, build_pre_tokenizer, pre_tokenizer_spec
from engine.gguf.tokenizer import IncrementalDetokenizer, Tokenizer, partition
from tests.vocab_files import KNOWN_VOCABS, VocabFiles
from tools.embedded_vocab import build_embedded_vocab

CASE_SEPARATOR = "\n__ggml_vocab_test__\n"
HYPOTHESIS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def vocab_cases(path: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 cases: inputs split on the separator line, one output line each.

    As in test-tokenizer-0.cpp, a separator at the very end does not start an empty case."""
    raw = path.with_name(path.name + ".inp").read_bytes().decode()
    inputs = raw.split(CASE_SEPARATOR)
    if raw.endswith(CASE_SEPARATOR):
        inputs.pop()
    outputs = path.with_name(path.name + ".out").read_text(encoding="utf-8").splitlines()
    assert len(inputs) == len(outputs), f"{path.name}: {len(inputs)} inputs, {len(outputs)} outputs"
    return [(text, [int(x) for x in line.split()]) for text, line in zip(inputs, outputs, strict=True)]


def mismatches(tokenizer: Tokenizer, cases: list[tuple[str, list[int]]]) -> list[str]:
    # llama.cpp's test tokenizes with add_special=false, parse_special=false.
    failed = []
    for text, expected in cases:
        got = tokenizer.encode(text, add_special=False)
        if got != expected:
            failed.append(f"{text!r}: got {got}, expected {expected}")
    return failed


# --- llama.cpp test vectors ---------------------------------------------------------------------


@pytest.mark.parametrize("name", KNOWN_VOCABS)
def test_encoding_matches_llama_cpp_vectors(vocabs: VocabFiles, name: str) -> None:
    cases = vocab_cases(vocabs.path(name))
    assert len(cases) > 30
    assert mismatches(vocabs.tokenizer(name), cases) == []


def test_every_other_vocab_file_matches_its_vectors(vocabs: VocabFiles) -> None:
    if not vocabs.others():
        pytest.skip("no vocab files besides " + ", ".join(KNOWN_VOCABS))
    for name in vocabs.others():
        assert mismatches(vocabs.tokenizer(name), vocab_cases(vocabs.path(name))) == [], name


@pytest.mark.parametrize("name", KNOWN_VOCABS)
def test_decode_inverts_encode_on_vectors(vocabs: VocabFiles, name: str) -> None:
    tokenizer = vocabs.tokenizer(name)
    for text, expected in vocab_cases(vocabs.path(name)):
        assert tokenizer.decode(expected) == text
        assert tokenizer.decode(tokenizer.encode(text, add_special=True), skip_special=True) == text


# --- pre-tokenizers without test vectors here ---------------------------------------------------


def pre_split(name: str, text: str) -> list[str]:
    """Pieces of `text` before BPE, mapped back from the byte-level alphabet to text."""
    to_byte = byte_level_decoding()
    pieces = build_pre_tokenizer(pre_tokenizer_spec(name)).pre_tokenize_str(text)
    return [bytes(to_byte[ord(c)] for c in piece).decode() for piece, _ in pieces]


@pytest.mark.parametrize(
    ("name", "text", "pieces"),
    [
        ("deepseek-v3", "Hello world 12345 \u4f60\u597d it's",
         ["Hello", " world", " ", "123", "45", " ", "\u4f60\u597d", " it", "'s"]),
        ("deepseek-llm", "Hello, \u4e16\u754c! 2024\n",
         ["Hello", ",", " ", "\u4e16\u754c", "!", " ", "2024", "\n"]),
        ("deepseek-coder", "def f(x):\n  return x1",
         ["def", " f", "(", "x", "):", "\n", " ", " return", " x", "1"]),
        ("olmo", "Hello  world's 123", ["Hello", " ", " world", "'s", " 123"]),
        ("default", "a+b=3333", ["a", "+", "b", "=", "333", "3"]),
        ("gpt-4o", "HelloWorld a\u00c9", ["Hello", "World", " a", "\u00c9"]),
    ],
)  # fmt: skip
def test_pre_tokenizer_splits_like_llama_cpp_regexes(name: str, text: str, pieces: list[str]) -> None:
    assert pre_split(name, text) == pieces


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_keeps_all_text(name: str) -> None:
    text = "Hello, World! It's 2024-01-01 \u2615 \u4f60\u597d \n\n  x\t"
    assert "".join(pre_split(name, text)) == text


# --- BOS/EOS, special tokens, stop tokens ------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "bos_first"), [("gpt-2", False), ("llama-bpe", True), ("llama-spm", True), ("qwen2", False)]
)
def test_bos_is_added_as_the_vocabulary_says(vocabs: VocabFiles, name: str, bos_first: bool) -> None:
    tokenizer = vocabs.tokenizer(name)
    plain = tokenizer.encode("Hello world", add_special=False)
    assert tokenizer.encode("Hello world") == ([tokenizer.bos_id] if bos_first else []) + plain


def test_metadata_flags_override_bos_and_eos_defaults(vocabs: VocabFiles) -> None:
    metadata = vocabs.metadata("llama-bpe")
    flipped = Tokenizer.from_metadata(
        {**metadata, "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True}
    )
    plain = flipped.encode("Hello", add_special=False)
    assert flipped.encode("Hello") == [*plain, 128001]


@pytest.mark.parametrize(
    ("name", "stops"),
    [("gpt-2", {50256}), ("llama-bpe", {128001, 128009}), ("llama-spm", {2}), ("qwen2", {151643, 151645})],
)
def test_stop_tokens_are_eos_and_end_markers(vocabs: VocabFiles, name: str, stops: set[int]) -> None:
    assert vocabs.tokenizer(name).stop_token_ids == stops


def test_control_tokens_are_parsed_only_on_request(vocabs: VocabFiles) -> None:
    tokenizer = vocabs.tokenizer("qwen2")
    text = "<|im_start|>user\nHi<|im_end|>"
    parsed = tokenizer.encode(text, parse_special=True)
    assert parsed[0] == 151644 and parsed[-1] == 151645
    assert parsed[1:-1] == tokenizer.encode("user\nHi")
    literal = tokenizer.encode(text)
    assert 151644 not in literal and 151645 not in literal
    assert tokenizer.decode(literal) == text


def test_user_defined_tokens_are_always_whole(vocabs: VocabFiles) -> None:
    # llama.cpp and transformers match user-defined (added, non-special) tokens in any text.
    tokenizer = vocabs.tokenizer("qwen2")
    assert tokenizer.encode("a[PAD151646]b") == [*tokenizer.encode("a"), 151646, *tokenizer.encode("b")]


def test_skip_special_drops_control_tokens_only(vocabs: VocabFiles) -> None:
    tokenizer = vocabs.tokenizer("qwen2")
    ids = [151644, *tokenizer.encode("hi"), 151646, 151645]
    assert tokenizer.decode(ids) == "<|im_start|>hi[PAD151646]<|im_end|>"
    assert tokenizer.decode(ids, skip_special=True) == "hi[PAD151646]"


def test_spm_adds_a_space_after_special_tokens_and_decode_removes_it(vocabs: VocabFiles) -> None:
    tokenizer = vocabs.tokenizer("llama-spm")
    ids = tokenizer.encode("<s>Hello</s>Hello", add_special=False, parse_special=True)
    hello = tokenizer.encode("Hello", add_special=False)
    assert ids == [1, *hello, 2, *hello]
    assert tokenizer.decode(ids) == "<s>Hello</s>Hello"
    assert tokenizer.decode([*hello, *hello]) == "Hello Hello"


def test_token_text_shows_spaces_and_bytes(vocabs: VocabFiles) -> None:
    spm = vocabs.tokenizer("llama-spm")
    assert spm.token_text(15043) == " Hello"
    assert spm.token_text(13) == "\n"  # <0x0A>
    assert spm.token_text(1) == "<s>"
    gpt2 = vocabs.tokenizer("gpt-2")
    assert gpt2.token_text(gpt2.encode(" world")[0]) == " world"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gpt2.decode([gpt2.vocab_size])


def test_unknown_pre_tokenizer_is_named_in_the_error() -> None:
    metadata = {**build_embedded_vocab(), "tokenizer.ggml.pre": "no-such-pre"}
    with pytest.raises(ValueError, match="no-such-pre"):
        Tokenizer.from_metadata(metadata)


def test_unknown_tokenizer_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="'rwkv'"):
        Tokenizer.from_metadata({**build_embedded_vocab(), "tokenizer.ggml.model": "rwkv"})


def test_special_tokens_are_split_longest_first() -> None:
    # With "<a>" tried first, "x<a><b>y" would become "x", <a>, "<b>y".
    metadata = build_embedded_vocab()
    size = len(metadata["tokenizer.ggml.tokens"])
    tokenizer = Tokenizer.from_metadata(
        {
            **metadata,
            "tokenizer.ggml.tokens": [*metadata["tokenizer.ggml.tokens"], "<a>", "<a><"],
            "tokenizer.ggml.token_type": [*metadata["tokenizer.ggml.token_type"], 4, 4],
        }
    )
    assert tokenizer.encode("x<a><b>y") == [*tokenizer.encode("x"), size + 1, *tokenizer.encode("b>y")]
    assert tokenizer.encode("<a>b<a>") == [size, *tokenizer.encode("b"), size]
    assert partition("", [("<a>", size)]) == []


# --- incremental detokenization ---------------------------------------------------------------


def stream(tokenizer: Tokenizer, ids: list[int], prompt_ids: list[int] | None = None) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    return [detokenizer.add(token_id) for token_id in ids] + [detokenizer.flush()]


def partial_char_ids(tokenizer: Tokenizer) -> list[int]:
    """Tokens whose bytes are not whole characters: the ones streaming must hold back."""
    ids = []
    for token_id in range(tokenizer.vocab_size):
        try:
            tokenizer.token_bytes(token_id).decode()
        except UnicodeDecodeError:
            ids.append(token_id)
    return ids


def check_stream(tokenizer: Tokenizer, ids: list[int]) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    emitted = ""
    for count, token_id in enumerate(ids, start=1):
        emitted += detokenizer.add(token_id)
        # Only held-back bytes of an unfinished last character may be missing: they decode now to one
        # U+FFFD per invalid run (up to three: a lead byte followed by bytes that cannot continue it).
        full = tokenizer.decode(ids[:count])
        assert full.startswith(emitted) and set(full[len(emitted):]) <= {"\ufffd"} and len(full) - len(emitted) <= 3
    assert emitted + detokenizer.flush() == tokenizer.decode(ids)


@pytest.mark.parametrize("name", KNOWN_VOCABS)
def test_stream_equals_decode_for_random_tokens(vocabs: VocabFiles, name: str) -> None:
    tokenizer = vocabs.tokenizer(name)
    partial = partial_char_ids(tokenizer)
    assert partial, "every vocabulary here has byte pieces"
    token = st.one_of(st.integers(0, tokenizer.vocab_size - 1), st.sampled_from(partial))

    @HYPOTHESIS
    @given(st.lists(token, max_size=40))
    def check(ids: list[int]) -> None:
        check_stream(tokenizer, ids)

    check()


def test_stream_holds_back_split_characters(vocabs: VocabFiles) -> None:
    qwen = vocabs.tokenizer("qwen2")
    # Byte-level BPE: the llama emoji is split over three tokens, " \xf0\x9f", "\xa6", "\x99".
    assert stream(qwen, [419, 374, 11162, 99, 247, 13, 10821]) == [
        " this", " is", " ", "", "\U0001f999", ".", "cpp", ""
    ]  # fmt: skip
    spm = vocabs.tokenizer("llama-spm")
    # SentencePiece byte fallback: four <0xXX> tokens make the emoji; the first "▁" is the added prefix.
    assert stream(spm, [29871, 445, 338, 29871, 243, 162, 169, 156, 29889, 8223]) == [
        "", " this", " is", " ", "", "", "", "\U0001f999", ".", "cpp", ""
    ]  # fmt: skip


def test_stream_ends_an_incomplete_character_as_replacement(vocabs: VocabFiles) -> None:
    spm = vocabs.tokenizer("llama-spm")
    assert stream(spm, [243, 162]) == ["", "", "\ufffd"]  # <0xF0> <0x9F>: half an emoji


def test_spm_leading_space_depends_on_what_came_before(vocabs: VocabFiles) -> None:
    spm = vocabs.tokenizer("llama-spm")
    hello_world = spm.encode("Hello world", add_special=False)
    assert stream(spm, hello_world) == ["Hello", " world", ""]
    assert stream(spm, hello_world, prompt_ids=[1]) == ["Hello", " world", ""]
    assert stream(spm, hello_world, prompt_ids=[1, *hello_world]) == [" Hello", " world", ""]


# --- the embedded default vocabulary ------------------------------------------------------------


def test_embedded_vocab_is_chatml_byte_level_bpe() -> None:
    metadata = build_embedded_vocab()
    tokens = metadata["tokenizer.ggml.tokens"]
    assert (metadata["tokenizer.ggml.model"], metadata["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    assert len(tokens) == 4096 and len(set(tokens)) == 4096
    tokenizer = Tokenizer.from_metadata(metadata)
    specials = [tokens.index(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert all(metadata["tokenizer.ggml.token_type"][i] == 3 for i in specials)
    assert tokenizer.stop_token_ids == {specials[0], specials[2]}
    assert tokenizer.encode("Hi") == tokenizer.encode("Hi", add_special=False)  # no BOS
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == specials[1] and specials[2] in ids
    assert tokenizer.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_embedded_vocab_is_the_same_in_a_fresh_process() -> None:
    # A different hash seed and thread count must not change the trained vocabulary.
    script = (
        "import hashlib, json, time\n"
        "start = time.perf_counter()\n"
        "from tools.embedded_vocab import build_embedded_vocab\n"
        "metadata = build_embedded_vocab()\n"
        "print(time.perf_counter() - start)\n"
        "print(hashlib.sha256(json.dumps(metadata).encode()).hexdigest())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    seconds, digest = result.stdout.split()
    assert float(seconds) < 5.0
    assert digest == hashlib.sha256(json.dumps(build_embedded_vocab()).encode()).hexdigest()
    assert build_embedded_vocab() == build_embedded_vocab()


def test_embedded_vocab_has_a_token_for_every_byte() -> None:
    tokenizer = Tokenizer.from_metadata(build_embedded_vocab())
    pieces = {tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)}
    assert all(bytes([byte]) in pieces for byte in range(256))


@HYPOTHESIS
@given(st.text())
def test_embedded_vocab_round_trips_any_text(text: str) -> None:
    tokenizer = embedded_tokenizer()
    assert tokenizer.decode(tokenizer.encode(text)) == text
    check_stream(tokenizer, tokenizer.encode(text))


@lru_cache(maxsize=1)
def embedded_tokenizer() -> Tokenizer:
    return Tokenizer.from_metadata(build_embedded_vocab())


def test_gemma4_vocabulary_is_sentencepiece_style_bpe() -> None:
    """`tokenizer.ggml.model` gemma4: spaces as '▁' merged by rank, newline runs apart, characters the
    vocabulary lacks as <0xXX> bytes, a BOS added even where the file says not to (as llama.cpp does)."""
    from tools.embedded_vocab import build_vocab

    metadata = build_vocab("gemma4")
    tokenizer = Tokenizer.from_metadata({**metadata, "tokenizer.ggml.add_bos_token": False})
    tokens = metadata["tokenizer.ggml.tokens"]
    text = "The cache computes every expert\n\nonce: \u65e5"
    ids = tokenizer.encode(text, add_special=True)
    assert ids[0] == tokens.index("<bos>") and tokenizer.decode(ids[1:]) == text
    assert tokens.index("\u2581every") in ids  # the space before a word is its '▁'
    assert [tokens[i] for i in ids[-3:]] == ["<0xE6>", "<0x97>", "<0xA5>"]  # U+65E5 is not in the vocabulary
    assert tokenizer.encode("a\nb", add_special=False) == [tokens.index(t) for t in ("a", "\n", "b")]
