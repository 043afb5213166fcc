"""`moecache perplexity`: perplexity against HF transformers' log-probabilities of the same chunks, the
KL-divergence base file in llama.cpp's layout, and KL statistics against an independent computation."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.gguf.tokenizer import Tokenizer
from ops.quants import QType
from service.cli import main
from service.commands.logits_file import decode_rows, encode_rows, open_base, row_width
from tests.hf_models import round_trip_weights, tiny_model, write_hf_gguf
from tests.spm_vocab import SENTENCES, spm_vocab
from tools.embedded_vocab import build_embedded_vocab

CTX, CHUNKS = 32, 3
VOCABS = {"qwen3_moe": build_embedded_vocab(), "mixtral": spm_vocab()}  # byte-level BPE; SPM adding BOS


def vocab_size(vocab: dict[str, Any]) -> int:
    return len(vocab["tokenizer.ggml.tokens"])


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("\n".join(SENTENCES * 12), encoding="utf-8")
    return path


def hf_and_gguf(model_type: str, path: Path, qtype: QType = QType.F32, seed: int = 0) -> tuple[Any, Path]:
    hf = tiny_model(model_type, seed=seed, vocab_size=vocab_size(VOCABS[model_type]))
    write_hf_gguf(hf, path, qtype, metadata=VOCABS[model_type])
    if qtype != QType.F32:
        round_trip_weights(hf, qtype)
    return hf, path


def hf_chunk_logprobs(hf: Any, tokenizer: Tokenizer, text: Path) -> tuple[list[torch.Tensor], list[list[int]]]:
    """HF's log-probabilities of each chunk's scored positions, and the chunks as llama.cpp scores them."""
    tokens = tokenizer.encode(text.read_text(encoding="utf-8"))
    rows, chunks = [], []
    for i in range(CHUNKS):
        ids = tokens[i * CTX:(i + 1) * CTX]
        if tokenizer.spec.add_bos:
            ids = [tokenizer.bos_id, *ids[1:]]
        with torch.no_grad():
            rows.append(torch.log_softmax(hf(torch.tensor([ids])).logits[0, CTX // 2:-1].float(), dim=-1))
        chunks.append(tokens[i * CTX:(i + 1) * CTX])
    return rows, chunks


def run_json(capsys: pytest.CaptureFixture, *args: str) -> dict[str, float]:
    assert main(["perplexity", "--device", "cpu", "-c", str(CTX), "--chunks", str(CHUNKS), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("model_type", list(VOCABS))
def test_perplexity_equals_transformers(model_type: str, tmp_path: Path, text: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    hf, path = hf_and_gguf(model_type, tmp_path / "model.gguf")
    rows, chunks = hf_chunk_logprobs(hf, Tokenizer.from_metadata(VOCABS[model_type]), text)
    nll = [-float(r[j, c[CTX // 2 + 1 + j]]) for r, c in zip(rows, chunks, strict=True) for j in range(len(r))]
    out = run_json(capsys, "-m", str(path), "-f", str(text))
    assert out["tokens"] == CHUNKS * (CTX - 1 - CTX // 2)
    assert out["ppl"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-4)


def test_a_run_against_itself_with_another_cache(tmp_path: Path, text: Path, capsys: pytest.CaptureFixture) -> None:
    _, path = hf_and_gguf("qwen3_moe", tmp_path / "model.gguf", QType.Q8_0)
    base = tmp_path / "base.kld"
    run_json(capsys, "-m", str(path), "-f", str(text), "--kl-divergence-base", str(base))
    out = run_json(capsys, "-m", str(path), "--kl-divergence-base", str(base), "--kl-divergence", "--cpu-moe",
                   "--moe-cache-mib", "1")
    assert out["same_top"] == 1.0 and out["max_kld"] < 1e-5 and out["max_abs_dlogprob"] < 1e-3


def test_kl_divergence_equals_an_independent_computation(tmp_path: Path, text: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """Base: a model; run: the same with its weights perturbed. KL(base || run) from HF's two models."""
    hf_base, base_path = hf_and_gguf("qwen3_moe", tmp_path / "base.gguf", seed=2)
    hf_run = tiny_model("qwen3_moe", seed=2, vocab_size=vocab_size(VOCABS["qwen3_moe"]))
    with torch.no_grad():
        for p in hf_run.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * p.std() * 0.2)
    run_path = write_hf_gguf(hf_run, tmp_path / "run.gguf", metadata=VOCABS["qwen3_moe"])
    tokenizer = Tokenizer.from_metadata(VOCABS["qwen3_moe"])
    base_rows, _ = hf_chunk_logprobs(hf_base, tokenizer, text)
    run_rows, _ = hf_chunk_logprobs(hf_run, tokenizer, text)
    pairs = list(zip(base_rows, run_rows, strict=True))
    kld = torch.cat([(b.exp() * (b - r)).masked_fill(b <= -16, 0).sum(-1)  # as llama.cpp: base tokens above -16
                     for b, r in pairs])
    same = torch.cat([b.argmax(-1) == r.argmax(-1) for b, r in pairs])
    base = tmp_path / "base.kld"
    run_json(capsys, "-m", str(base_path), "-f", str(text), "--kl-divergence-base", str(base))
    out = run_json(capsys, "-m", str(run_path), "--kl-divergence-base", str(base), "--kl-divergence")
    assert float(kld.mean()) > 1e-2 and 0 < float(same.float().mean()) < 1  # the runs differ
    assert out["mean_kld"] == pytest.approx(float(kld.mean()), rel=1e-2)
    assert out["max_kld"] == pytest.approx(float(kld.max()), rel=1e-2)
    assert out["same_top"] == pytest.approx(float(same.float().mean()))


def test_base_file_layout(tmp_path: Path, text: Path, capsys: pytest.CaptureFixture) -> None:
    _, path = hf_and_gguf("mixtral", tmp_path / "model.gguf")
    base = tmp_path / "base.kld"
    run_json(capsys, "-m", str(path), "-f", str(text), "--kl-divergence-base", str(base))
    raw, num_vocab = base.read_bytes(), vocab_size(VOCABS["mixtral"])
    assert raw[:8] == b"_logits_" and np.frombuffer(raw[8:20], "<i4").tolist() == [CTX, num_vocab, CHUNKS]
    tokens = Tokenizer.from_metadata(VOCABS["mixtral"]).encode(text.read_text(encoding="utf-8"))
    # the tokens as read from the text: the BOS the chunks are scored with is not written
    assert np.frombuffer(raw[20:20 + 4 * CTX * CHUNKS], "<i4").tolist() == tokens[:CTX * CHUNKS]
    assert len(raw) == 20 + 4 * CTX * CHUNKS + 2 * CHUNKS * (CTX - 1 - CTX // 2) * row_width(num_vocab)
    assert open_base(base).tokens.shape == (CHUNKS, CTX)


def test_rows_keep_16_nats_in_16_bits() -> None:
    logprobs = torch.log_softmax(torch.randn(5, 1001) * 4, dim=-1).numpy()
    decoded = decode_rows(encode_rows(logprobs), 1001)
    kept = logprobs > logprobs.max(axis=1, keepdims=True) - 16
    assert np.abs(decoded - logprobs)[kept].max() <= 16 / 65535
    assert (decoded[~kept] <= logprobs.max(axis=1, keepdims=True).repeat(1001, 1)[~kept] - 16 + 1e-4).all()


def test_clear_errors(tmp_path: Path, text: Path, capsys: pytest.CaptureFixture) -> None:
    _, path = hf_and_gguf("qwen3_moe", tmp_path / "model.gguf")
    assert main(["perplexity", "-m", str(path), "--device", "cpu", "-f", str(text), "-c", "4096"]) == 2
    assert "needs at least 8192" in capsys.readouterr().err
    other = tmp_path / "other.kld"
    other.write_bytes(b"not a base file")
    assert main(["perplexity", "-m", str(path), "--device", "cpu", "--kl-divergence-base", str(other),
                 "--kl-divergence"]) == 2
    assert "_logits_" in capsys.readouterr().err


def test_sweep_compares_every_miss_mode_and_policy(tmp_path: Path, text: Path, capsys: pytest.CaptureFixture) -> None:
    _, path = hf_and_gguf("mixtral", tmp_path / "model.gguf", QType.Q8_0)
    base = tmp_path / "base.kld"
    run_json(capsys, "-m", str(path), "-f", str(text), "--kl-divergence-base", str(base))
    # batches of 16 tokens go through the cache (prefill batches above 32 would be staged instead)
    assert main(["perplexity", "--device", "cpu", "-m", str(path), "--kl-divergence-base", str(base),
                 "--kl-divergence", "--sweep", "--moe-cache-mib", "1", "--max-batch-tokens", "16", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert {(r["miss_mode"], r["policy"]) for r in rows} == {(m, p) for m in ("cpu", "stream", "hybrid")
                                                             for p in ("lru", "decay", "lfru")}
    assert all(r["max_kld"] < 1e-5 and r["same_top"] == 1.0 and 0 < r["hit_ratio"] < 1 for r in rows)
