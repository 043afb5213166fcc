"""The text of a continuation is the text its prompt is continued by: `decode(prompt + output)` minus
`decode(prompt)`, for SentencePiece and byte-level BPE vocabularies, in the engine's text output and
in what the engine returns."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detok import TextOutput
from engine.gguf.tokenizer import Tokenizer
from engine.types import Request, SamplingParams
from tests.engine_runs import greedy_ids
from tests.spm_vocab import spm_vocab
from tools.embedded_vocab import build_embedded_vocab

SHARED_VOCABS = ("llama-spm", "qwen2", "gpt-2", "llama-bpe")
HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                            HealthCheck.function_scoped_fixture])
# words of the test vocabularies, characters only byte fallback covers, and spacing
TEXT = st.lists(st.sampled_from(["The", "capital", "of", "France", "is", "clar", "Rule", "Hello", "world", "12",
                                 " ", "  ", "\n", "!", "\u00e9t\u00e9", "\U0001f999", "\u4f60\u597d"]),
                min_size=1, max_size=12).map(" ".join)


@pytest.fixture(params=["spm", "embedded-bpe", *SHARED_VOCABS])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "spm":
        return Tokenizer.from_metadata(spm_vocab())
    if request.param == "embedded-bpe":
        return Tokenizer.from_metadata(build_embedded_vocab())
    return request.getfixturevalue("vocabs").tokenizer(request.param)


def continuation(tokenizer: Tokenizer, prompt: list[int], output: list[int], stops: tuple[str, ...] = ()) -> str:
    text = TextOutput(tokenizer, stops, prompt)
    chunks = []
    for token_id in output:
        if text.add(token_id):
            break
        chunks.append(text.emit())
    return "".join(chunks) + text.finish()


def expected_continuation(tokenizer: Tokenizer, prompt: list[int], output: list[int]) -> str | None:
    """decode(prompt + output)[len(decode(prompt)):], or None where the prompt ends inside a character."""
    whole, head = tokenizer.decode([*prompt, *output]), tokenizer.decode(prompt)
    return whole[len(head):] if whole.startswith(head) else None


def test_spm_continuation_keeps_the_space_of_its_first_token() -> None:
    tok = Tokenizer.from_metadata(spm_vocab())
    prompt, output = tok.encode("The capital of France is"), tok.encode("clar Rule", add_special=False)
    assert [tok.token_text(t) for t in output] == [" clar", " Rule"]
    assert continuation(tok, prompt, output) == " clar Rule"
    # Only the start of the whole sequence (or what follows a special token) drops it.
    assert continuation(tok, [tok.bos_id], output) == "clar Rule"
    assert continuation(tok, [], output) == "clar Rule"


def test_continuation_equals_the_suffix_of_the_whole_decode(tokenizer: Tokenizer) -> None:
    @HYPOTHESIS
    @given(TEXT, st.integers(0, 64))
    def check(text: str, cut: int) -> None:
        ids = tokenizer.encode(text)
        cut = min(cut, len(ids))
        prompt, output = ids[:cut], ids[cut:]
        expected = expected_continuation(tokenizer, prompt, output)
        if expected is not None:
            assert continuation(tokenizer, prompt, output) == expected

    check()


def test_stop_string_in_a_continuation_counts_its_leading_space() -> None:
    tok = Tokenizer.from_metadata(spm_vocab())
    prompt, output = tok.encode("The capital of"), tok.encode("France is clar", add_special=False)
    assert continuation(tok, prompt, output, stops=(" is",)) == " France"


def test_engine_text_continues_the_prompt(spm_gguf: Path) -> None:
    engine, prompt, output = greedy_ids(spm_gguf, "The capital of France is", 6)
    assert engine.tokenizer.token_text(output[0]).startswith(" ")  # the case that lost its space
    engine.add_request(Request("b", tuple(prompt), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
    text = ""
    while engine.has_unfinished():
        text += "".join(out.new_text for out in engine.step())
    assert text == expected_continuation(engine.tokenizer, prompt, output)
    assert text.startswith(" ")
