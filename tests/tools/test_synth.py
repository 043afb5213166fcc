"""Random-weight models as llama.cpp reads them: the file type named, SentencePiece scores padded; every
token, the padding too, decodes to text."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGUFReader, LlamaFileType

from engine.arch import get_arch
from engine.gguf.reader import GGUFFile
from engine.gguf.tokenizer import Tokenizer
from ops.quants import QType
from tests.engine_runs import greedy_ids
from tests.spm_vocab import spm_vocab
from tools.embedded_vocab import build_embedded_vocab, build_vocab
from tools.gguf_writer import TensorSpec, file_type
from tools.synth import PRESETS, padded_vocab, with_overrides, write_synth

TOKENS = "tokenizer.ggml.tokens"


def test_file_type_is_the_type_holding_the_most_bytes() -> None:
    def spec(qtype: QType, rows: int, cols: int = 256) -> TensorSpec:
        return TensorSpec("t", (rows, cols), qtype, lambda: b"")

    # many small F32 norms do not make a model "all F32" (what llama.cpp guesses from tensor counts)
    specs = [spec(QType.F32, 1, 64)] * 20 + [spec(QType.Q4_K, 64), spec(QType.Q8_0, 16)]
    assert file_type(specs) == LlamaFileType.MOSTLY_Q4_K_M


def test_spm_synth_model_pads_scores_and_names_its_file_type(tmp_path: Path) -> None:
    preset = with_overrides(PRESETS["mixtral-8x7b"], num_layers=1, hidden=256, num_heads=4, num_kv_heads=2,
                            head_dim=64, num_experts=8, top_k=2, expert_ff=256, vocab_size=512)
    path = tmp_path / "spm.gguf"
    write_synth(path, preset, spm_vocab(), seed=1)
    fields = GGUFReader(path).fields
    assert fields["general.file_type"].contents() == LlamaFileType.MOSTLY_Q4_K_M
    assert len(fields["tokenizer.ggml.scores"].contents()) == 512
    padded, plain = Tokenizer.from_metadata(GGUFFile(path).metadata), Tokenizer.from_metadata(spm_vocab())
    assert padded.encode("The capital of France") == plain.encode("The capital of France")


def test_deepseek2_tiny_has_its_family_tokenizer_and_generates(preset_gguf: Callable[[str], Path]) -> None:
    path = preset_gguf("deepseek2-tiny")
    metadata = GGUFFile(path).metadata
    assert metadata["tokenizer.ggml.pre"] == "deepseek-v3" and metadata["deepseek2.expert_gating_func"] == 2
    tokenizer = Tokenizer.from_metadata(metadata)
    prompt = tokenizer.decode(tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))
    assert prompt == "<\uff5cbegin\u2581of\u2581sentence\uff5c><\uff5cUser\uff5c>Hi<\uff5cAssistant\uff5c>"
    _, _, output = greedy_ids(path, "Once upon a time", 8)
    assert len(output) == 8


def test_gpt_oss_tiny_has_its_family_tokenizer_and_generates(preset_gguf: Callable[[str], Path]) -> None:
    path = preset_gguf("gpt-oss-tiny")
    metadata = GGUFFile(path).metadata
    assert metadata["tokenizer.ggml.pre"] == "gpt-4o" and metadata["gpt-oss.attention.sliding_window"] == 16
    tokenizer = Tokenizer.from_metadata(metadata)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(prompt) == "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    assert tokenizer.spec.tokens[tokenizer.spec.eos_id] == "<|return|>"
    _, _, output = greedy_ids(path, "Once upon a time", 8)
    assert len(output) == 8


def test_every_token_of_a_padded_synth_model_decodes_to_text(tmp_path: Path) -> None:
    # the padding (the big presets' vocabularies are larger than the tokenizer's) is sampled like any token
    preset = with_overrides(PRESETS["tiny"], num_layers=1, vocab_size=len(build_embedded_vocab()[TOKENS]) + 300)
    path = tmp_path / "tiny.gguf"
    write_synth(path, preset, build_embedded_vocab(), seed=1)
    tokenizer = Tokenizer.from_metadata(GGUFFile(path).metadata)
    assert tokenizer.vocab_size == preset.hparams.vocab_size
    assert all(tokenizer.decode([token_id]) for token_id in range(tokenizer.vocab_size))
    padding = [tokenizer.decode([token_id]) for token_id in range(tokenizer.vocab_size - 300, tokenizer.vocab_size)]
    assert all(text.isprintable() and not text.isspace() for text in padding)
    assert len(set(padding)) == 300


def test_padding_leaves_the_encoding_of_text_unchanged(tmp_path: Path) -> None:
    vocab = build_embedded_vocab()
    padded = Tokenizer.from_metadata(padded_vocab(vocab, len(vocab[TOKENS]) + 50))
    text = "The capital of France <|pad_3|> is Paris"
    assert padded.encode(text) == Tokenizer.from_metadata(vocab).encode(text)


def test_gemma4_tiny_has_its_family_tokenizer_and_generates(preset_gguf: Callable[[str], Path]) -> None:
    path = preset_gguf("gemma4-tiny")
    gguf = GGUFFile(path)
    metadata = gguf.metadata
    assert metadata["tokenizer.ggml.model"] == "gemma4" and metadata["gemma4.attention.sliding_window"] == 16
    assert metadata["gemma4.attention.head_count_kv"] == [2, 1, 2, 1] and gguf.has("blk.0.ffn_gate_up_exps.weight")
    assert not gguf.has("blk.1.attn_v.weight") and not gguf.has("output.weight")  # keys as values, tied output
    tokenizer = Tokenizer.from_metadata(metadata)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert tokenizer.decode(prompt) == "<bos><|turn>user\nHi<turn|>\n<|turn>model\n"
    assert tokenizer.spec.tokens[tokenizer.spec.eot_id] == "<turn|>"
    _, _, output = greedy_ids(path, "Once upon a time", 8)
    assert len(output) == 8


@pytest.mark.parametrize("name", ["gemma4-26b-a4b", "gemma4-tiny"])
def test_gemma4_hyperparameters_round_trip_through_the_file(tmp_path: Path, name: str) -> None:
    """Per-kind head sizes, KV heads and rope bases, the window pattern and the soft-cap, written as llama.cpp
    reads them and read back unchanged."""
    preset = PRESETS[name]
    path = tmp_path / f"{name}.gguf"
    write_synth(path, preset, build_vocab("gemma4"), sparse=True)
    gguf = GGUFFile(path)
    vocab_size = len(gguf.metadata["tokenizer.ggml.tokens"])
    read = get_arch("gemma4").hparams(gguf.metadata, vocab_size)
    assert read.rms_eps == pytest.approx(preset.hparams.rms_eps)  # stored as float32
    assert replace(read, rms_eps=preset.hparams.rms_eps) == replace(preset.hparams, vocab_size=vocab_size)
