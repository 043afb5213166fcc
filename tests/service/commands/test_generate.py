"""`moecache generate` prints the text that continues the prompt, leading space of a SentencePiece
token included."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.cli import main
from tests.engine_runs import greedy_continuation

PROMPT = "The capital of France is"


def test_generate_prints_the_continuation_with_its_first_space(spm_gguf: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    args = ["generate", "-m", str(spm_gguf), "--device", "cpu", "-p", PROMPT, "-n", "4", "--temperature", "0",
            "--ignore-eos", "-c", "128"]
    assert main(args) == 0
    expected = greedy_continuation(spm_gguf, PROMPT, 4)
    assert capsys.readouterr().out == expected + "\n"
    assert expected.startswith(" ")
