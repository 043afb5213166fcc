"""Interop with llama.cpp itself, through its CPU tools (skipped where they are absent): tiny Mixtral
(llama with experts, SentencePiece vocabulary), Qwen3-MoE (byte-level BPE), DeepSeek-V2/V3 (MLA, shared
experts, grouped sigmoid routing with the correction bias, YaRN), gpt-oss and Gemma 4 (its SentencePiece-style
BPE, merged gate/up experts, shared-KV layers) files written by our writer, quantized by
`llama-quantize` as users get them, loaded by both.

The reference is llama.cpp on the file's F32 dequantization (`llama-quantize --allow-requantize X F32`)
with its KV cache in F32 and flash attention off: there both sides compute float32 math (llama.cpp's
kernels on quantized weights round activations to 8 bits; its default F16 KV cache and CPU flash
attention round K and V, which moves tiny random models' routers by up to 0.5 nats). Its
log-probabilities come from `llama-perplexity --kl-divergence-base`: the second half of each chunk of a
text, teacher-forced. Ours come from the quantized file through generation's own path (a
prefill, then one decode step per token) for the first chunk and through `LLMEngine.score` for the
next."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from engine.config import EngineConfig, ModelConfig
from engine.gguf.reader import GGUFFile
from engine.gguf.tokenizer import Tokenizer
from engine.llm_engine import LLMEngine
from ops.quants import QType
from service.commands.logits_file import BaseFile, open_base
from tests.engine_runs import teacher_forced
from tests.hf_models import tiny_model, write_hf_gguf
from tests.spm_vocab import spm_vocab
from tools.corpus import CORPUS
from tools.embedded_vocab import build_embedded_vocab, build_vocab
from tools.synth import PRESETS, with_overrides, write_synth

CTX, CHUNKS = 64, 2
F_GELU = torch.nn.functional.gelu
# nats per token against llama.cpp on the F32 dequantization; measured <= 4.2e-4 over the whole vocabulary
# (the CPU kernel's two int8 activation planes), 0.05-0.5 with one plane
QUANT_TOLERANCE = 0.02
F32_TOLERANCE = 1e-3  # the same F32 file on both sides: float32 sums in other orders and the base file's
# 16-bit log-probabilities (steps of 16/65535 nats); measured <= 9.1e-5
FLOAT32 = ("-ctk", "f32", "-ctv", "f32", "-fa", "off")  # llama.cpp's KV cache and attention in float32
SHAPE = dict(hidden_size=256, num_hidden_layers=4)  # K-quants need 256-column rows
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # 128-column expert FFNs: llama.cpp's Q4_K_M falls back to Q5_0 and Q8_0 for their ffn_down
    "mixtral": ("mixtral", spm_vocab(), dict(head_dim=64, intermediate_size=128)),
    "qwen3moe": ("qwen3_moe", build_embedded_vocab(), dict(head_dim=64, moe_intermediate_size=128,
                                                           mlp_only_layers=[])),
    # llama.cpp scores V2's expert groups as V3's (their best two), so V2 here routes without groups
    "deepseek_v2": ("deepseek_v2", build_vocab("deepseek-v3"), dict(moe_intermediate_size=128,
                                                                    topk_method="greedy")),
    "deepseek_v3": ("deepseek_v3", build_vocab("deepseek-v3"), dict(moe_intermediate_size=128)),
    # without YaRN: llama.cpp rounds its correction range to whole dimensions, gpt-oss does not
    "gpt_oss": ("gpt_oss", build_vocab("gpt-oss"), dict(head_dim=64, intermediate_size=128,
                                                        rope_parameters={"rope_type": "default",
                                                                         "rope_theta": 150000.0})),
    # llama.cpp's shared-KV layers read layer n - 1 (full) or n - 2 (sliding) of the n that own a cache: the
    # last two owners are a sliding and a full layer, as in Gemma 4's released files
    "gemma4": ("gemma4_text", build_vocab("gemma4"), dict(head_dim=64, global_head_dim=128, intermediate_size=256,
                                                         moe_intermediate_size=128,
                                                         layer_types=["sliding_attention", "sliding_attention",
                                                                      "full_attention", "full_attention"])),
}
# Quantized files of these architectures run their experts through the float path: the comparison checks the
# architecture; the CPU kernel's own rounding is the mixtral and qwen3moe cases' and tests/ops/'s to check
FLOAT_EXPERTS = {"deepseek_v2", "deepseek_v3"}


def tool(llama_cpp: Path, name: str, *args: str | Path) -> str:
    done = subprocess.run([llama_cpp / name, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{name} failed:\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def quantize(llama_cpp: Path, src: Path, qtype: str) -> Path:
    dst = src.with_name(f"{src.stem}-{qtype}.gguf")
    if not dst.exists():
        tool(llama_cpp, "llama-quantize", "--allow-requantize", src, dst, qtype)
    return dst


def llama_cpp_base(llama_cpp: Path, model: Path, text: Path) -> BaseFile:
    """llama.cpp's log-probabilities of the text's chunks, read back from its KL-divergence base file."""
    path = model.with_suffix(".kld")
    tool(llama_cpp, "llama-perplexity", "-m", model, "-f", text, "-c", CTX, "--chunks", CHUNKS, "-t", 2,
         *FLOAT32, "--kl-divergence-base", path)
    return open_base(path)


def our_logprobs(model: Path, base: BaseFile) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(ours, llama.cpp's, the tokens predicted) per chunk: the first decoded step by step, the rest scored."""
    engine = LLMEngine(EngineConfig(ModelConfig(str(model), device="cpu", max_context=CTX)))
    first = CTX // 2
    for i in range(base.num_chunks):
        ids = base.tokens[i].tolist()
        if engine.tokenizer.spec.add_bos:  # llama.cpp scores each chunk with a BOS first
            ids[0] = engine.tokenizer.bos_id
        rows = teacher_forced(engine, ids[:-1], first + 1) if i == 0 else engine.score(ids, first)
        yield rows.numpy(), base.chunk(i), base.tokens[i][first + 1:]
    engine.close()


def disagreements(model: Path, base: BaseFile, tolerance: float) -> list[str]:
    """Tokens whose log-probability differs by more than `tolerance`, or whose most likely token differs
    where llama.cpp's top two are further apart than `tolerance`."""
    found = []
    for chunk, (ours, theirs, targets) in enumerate(our_logprobs(model, base)):
        assert ours.shape == theirs.shape
        for row, target in enumerate(targets):
            delta = abs(float(ours[row, target] - theirs[row, target]))
            top2 = np.sort(theirs[row])[-2:]
            argmax_differs = ours[row].argmax() != theirs[row].argmax() and top2[1] - top2[0] > tolerance
            if delta > tolerance or argmax_differs:
                found.append(f"chunk {chunk} row {row}: |Δ log p| {delta:.4f}, argmax differs: {argmax_differs}")
    return found


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("interop") / "text.txt"
    path.write_text("\n\n".join(CORPUS), encoding="utf-8")
    return path


@pytest.fixture(scope="module", params=list(MODELS))
def f32_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, vocab, extra = MODELS[request.param]
    hf = tiny_model(model_type, seed=1, vocab_size=len(vocab["tokenizer.ggml.tokens"]), **SHAPE, **extra)
    return write_hf_gguf(hf, tmp_path_factory.mktemp("interop") / f"{request.param}.gguf", metadata=vocab)


# llama.cpp's CPU GELU reads a table of fp16 inputs and outputs: without it on our side Gemma 4's F32 file
# differs by up to 3.7e-3 nats per token, with it by 5.3e-4 (measured)
FP16_GELU = {"gemma4"}


def fp16_table_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """ggml's `ggml_vec_gelu_f32` on the CPU: x rounded to fp16, its GELU rounded to fp16; exact beyond +-10."""
    table = F_GELU(x.half().float(), approximate=approximate).half().to(x.dtype)
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, table))


def test_llama_cpp_runs_our_writers_files(llama_cpp: Path, f32_model: Path, text: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if f32_model.stem in FP16_GELU:  # llama.cpp's table GELU, in torch: the experts too take the torch path
        monkeypatch.setattr(torch.nn.functional, "gelu", fp16_table_gelu)
        monkeypatch.setattr("ops.expert_ffn.native_supports", lambda bank: False)
    assert disagreements(f32_model, llama_cpp_base(llama_cpp, f32_model, text), F32_TOLERANCE) == []


@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q8_0"])
def test_quantized_file_agrees_with_llama_cpp_on_its_f32_dequantization(llama_cpp: Path, f32_model: Path,
                                                                        text: Path, qtype: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if f32_model.stem in FLOAT_EXPERTS:
        monkeypatch.setattr("ops.expert_ffn.native_supports", lambda bank: False)
    quantized = quantize(llama_cpp, f32_model, qtype)
    types = {t.tensor_type for t in GGUFReader(quantized).tensors if "exps" in t.name}
    if qtype == "Q4_K_M":
        assert {QType.Q4_K, QType.Q5_0, QType.Q8_0} <= types  # the mixed expert layout of the 128-column FFNs
    base = llama_cpp_base(llama_cpp, quantize(llama_cpp, quantized, "F32"), text)
    assert disagreements(quantized, base, QUANT_TOLERANCE) == []


def llama_cpp_ppl(llama_cpp: Path, model: Path, text: Path, attempts: int = 3) -> tuple[float, str]:
    # NOTE: llama.cpp's log is written by its own thread; on a loaded machine the process has been seen to exit
    # (status 0) before the last lines were written, so a run without its final estimate is run again
    for _ in range(attempts):
        out = tool(llama_cpp, "llama-perplexity", "-m", model, "-f", text, "-c", CTX, "--chunks", CHUNKS, "-t", 2,
                   *FLOAT32, "-lv", 4)
        if match := re.search(r"Final estimate: PPL = ([0-9.]+)", out):
            return float(match.group(1)), out
    raise AssertionError(f"no final estimate in {attempts} runs of llama-perplexity:\n{out[-2000:]}")


SYNTH = {  # preset, vocabulary, general.file_type
    "embedded-bpe": (PRESETS["tiny"], build_embedded_vocab(), "Q8_0"),
    "spm": (with_overrides(PRESETS["mixtral-8x7b"], num_layers=2, hidden=256, num_heads=4, num_kv_heads=2,
                           head_dim=64, num_experts=4, expert_ff=256, vocab_size=0, context_length=512), spm_vocab(),
            "Q4_K - Medium"),
    "deepseek2-tiny": (PRESETS["deepseek2-tiny"], build_vocab("deepseek-v3"), "Q4_K - Medium"),
    # without YaRN: llama.cpp rounds its correction range to whole dimensions, gpt-oss does not
    "gpt-oss-tiny": (replace(PRESETS["gpt-oss-tiny"], hparams=replace(PRESETS["gpt-oss-tiny"].hparams, yarn=None)),
                     build_vocab("gpt-oss"), "MXFP4 MoE"),
    "gemma4-tiny": (PRESETS["gemma4-tiny"], build_vocab("gemma4"), "Q4_K - Medium"),
}


@pytest.mark.parametrize("synth", list(SYNTH))
def test_llama_cpp_loads_synth_files(llama_cpp: Path, text: Path, tmp_path: Path, synth: str) -> None:
    preset, vocab, expected = SYNTH[synth]
    path = tmp_path / "synth.gguf"
    write_synth(path, preset, vocab, seed=2)
    _, log = llama_cpp_ppl(llama_cpp, path, text)
    # general.file_type, from the type holding the most bytes: Q8_0 embeddings, or Q4_K experts beside a
    # small vocabulary (llama.cpp would guess "all F32" from the count of F32 norms)
    assert re.search(r"file type += (.*)\n", log).group(1) == expected  # type: ignore[union-attr]
    # llama.cpp on the file's F32 dequantization and moecache on the file itself
    theirs, _ = llama_cpp_ppl(llama_cpp, quantize(llama_cpp, path, "F32"), text)
    engine = LLMEngine(EngineConfig(ModelConfig(str(path), device="cpu", max_context=CTX)))
    tokens = engine.tokenizer.encode(text.read_text(encoding="utf-8"))
    nll = []
    for i in range(CHUNKS):
        ids = tokens[i * CTX:(i + 1) * CTX]
        scored = ids if not engine.tokenizer.spec.add_bos else [engine.tokenizer.bos_id, *ids[1:]]
        rows = engine.score(scored, CTX // 2)
        nll += (-rows[torch.arange(len(rows)), torch.tensor(ids[CTX // 2 + 1:])]).tolist()
    assert float(np.exp(np.mean(nll))) == pytest.approx(theirs, rel=1e-3)


def test_llama_cpp_tokenizes_gemma4_as_we_do(llama_cpp: Path, text: Path, tmp_path: Path) -> None:
    """The gemma4 vocabulary kind: llama.cpp's tokens for the corpus and for characters the vocabulary lacks
    (byte fallback), runs of spaces and newlines."""
    path = tmp_path / "gemma4.gguf"
    write_synth(path, PRESETS["gemma4-tiny"], build_vocab("gemma4"), seed=2, sparse=True)
    sample = tmp_path / "sample.txt"
    sample.write_text(text.read_text(encoding="utf-8") + "\n\n\n  two  spaces\t\u65e5\u672c \U0001f642 caf\u00e9\n",
                      encoding="utf-8")
    out = tool(llama_cpp, "llama-tokenize", "-m", path, "-f", sample, "--ids", "--log-disable", "--no-escape")
    theirs = [int(i) for i in re.findall(r"\d+", out.strip().splitlines()[-1])]
    assert Tokenizer.from_metadata(GGUFFile(path).metadata).encode(sample.read_text(encoding="utf-8")) == theirs
