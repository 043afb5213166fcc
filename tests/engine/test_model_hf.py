"""Our forward pass against HF transformers on tiny random models of every supported architecture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.gguf.reader import GGUFFile
from engine.kv_cache import KVCache
from engine.model import ForwardBatch, Model, SeqSpan
from engine.weights import MoE, load_weights
from ops.quants import QType
from tests.engine.reference_experts import ReferenceExperts
from tests.hf_models import round_trip_weights, tiny_model, write_hf_gguf

MODEL_TYPES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss", "gemma4_text"]
PROMPT_LEN, PREFILL = 40, 24


def load_model(path: Path) -> Model:
    weights = load_weights(GGUFFile(path), torch.device("cpu"), torch.float32)
    experts = {i: layer.ffn.experts for i, layer in enumerate(weights.layers) if isinstance(layer.ffn, MoE)}
    return Model(weights, ReferenceExperts(experts))


def new_kv(model: Model, slots: int = 1, length: int = 128) -> KVCache:
    return KVCache.for_model(model.hp, slots, length, torch.float32, torch.device("cpu"))


def run(model: Model, kv: KVCache, ids: list[int], start: int) -> torch.Tensor:
    batch = ForwardBatch.build([SeqSpan(0, start, len(ids))], [ids], torch.device("cpu"))
    return model.forward(batch, kv)[0]


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("qtype", [QType.F32, QType.Q8_0], ids=["f32", "q8_0"])
def test_logits_match_transformers(tmp_path: Path, model_type: str, qtype: QType) -> None:
    hf = tiny_model(model_type)
    path = write_hf_gguf(hf, tmp_path / "model.gguf", qtype)
    if qtype != QType.F32:
        round_trip_weights(hf, qtype)  # the reference runs on the weights the GGUF holds
    ids = torch.randint(0, hf.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, ids)
    model, kv = load_model(path), None
    kv = new_kv(model)
    # A prefill chunk, then token-by-token decoding through the KV cache.
    assert rel_error(run(model, kv, ids[:PREFILL], 0), ref[PREFILL - 1]) < 1e-4
    for pos in range(PREFILL, PROMPT_LEN):
        assert rel_error(run(model, kv, [ids[pos]], pos), ref[pos]) < 1e-4, f"position {pos}"


def test_gpt_oss_mxfp4_experts_match_transformers(tmp_path: Path) -> None:
    """gpt-oss as released: MXFP4 experts with their biases, everything else in float."""
    hf = tiny_model("gpt_oss")
    path = write_hf_gguf(hf, tmp_path / "model.gguf", expert_qtype=QType.MXFP4)
    round_trip_weights(hf, QType.MXFP4, experts_only=True)
    ids = torch.randint(0, hf.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, ids)
    model = load_model(path)
    assert model.w.layers[0].ffn.experts.gate_type == QType.MXFP4  # type: ignore[union-attr]
    kv = new_kv(model)
    assert rel_error(run(model, kv, ids[:PREFILL], 0), ref[PREFILL - 1]) < 1e-4
    for pos in range(PREFILL, PROMPT_LEN):
        assert rel_error(run(model, kv, [ids[pos]], pos), ref[pos]) < 1e-4, f"position {pos}"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_greedy_generation_matches_transformers(tmp_path: Path, model_type: str) -> None:
    hf = tiny_model(model_type, seed=3)
    model = load_model(write_hf_gguf(hf, tmp_path / "model.gguf"))
    prompt = torch.randint(0, hf.config.vocab_size, (32,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                               return_dict_in_generate=False)[0, len(prompt):].tolist()
    kv, out, pos = new_kv(model), [], 0
    logits = run(model, kv, prompt, 0)
    pos = len(prompt)
    for _ in range(32):
        out.append(int(logits.argmax()))
        logits = run(model, kv, [out[-1]], pos)
        pos += 1
    assert out == expected


def test_batched_sequences_match_single(tmp_path: Path) -> None:
    """Several sequences in one forward (mixed prefill and decode) give each its own logits."""
    hf = tiny_model("qwen3_moe")
    model = load_model(write_hf_gguf(hf, tmp_path / "model.gguf"))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 17, 5)]
    singles = [hf_logits(hf, p)[-1] for p in prompts]
    kv = new_kv(model, slots=3)
    # sequence 0 prefilled alone first, then decodes its last token while 1 and 2 prefill.
    run(model, kv, prompts[0][:-1], 0)
    spans = [SeqSpan(0, 8, 1), SeqSpan(1, 0, 17), SeqSpan(2, 0, 5)]
    batch = ForwardBatch.build(spans, [prompts[0][-1:], prompts[1], prompts[2]], torch.device("cpu"))
    logits = model.forward(batch, kv)
    for row, ref in zip(logits, singles):
        assert rel_error(row, ref) < 1e-4


def test_mla_caches_one_latent_per_token(tmp_path: Path) -> None:
    """DeepSeek's KV cache holds each token's latent and rotary key once, not every head's K and V."""
    model = load_model(write_hf_gguf(tiny_model("deepseek_v3"), tmp_path / "model.gguf"))
    m, kv = model.hp.mla, new_kv(model, slots=2, length=16)
    assert m is not None and kv.is_latent and kv.v[0].data_ptr() == kv.k[0].data_ptr()
    assert kv.num_bytes == model.hp.num_layers * 2 * 16 * (m.kv_lora_rank + m.rope_dim) * 4
    full = model.hp.num_heads * (m.nope_dim + m.rope_dim + m.v_dim)  # what MHA would cache per token and layer
    assert full > 4 * (m.kv_lora_rank + m.rope_dim)


def test_gemma4_layout(tmp_path: Path) -> None:
    """Gemma 4's merged gate/up experts are split into views of the file's bytes (nothing copied), and its KV
    cache holds each layer's own shape: wide full-attention heads, nothing for a shared-KV layer."""
    model = load_model(write_hf_gguf(tiny_model("gemma4_text"), tmp_path / "model.gguf"))
    bank = model.w.layers[0].ffn.experts  # type: ignore[union-attr]
    assert bank.up.data_ptr() - bank.gate.data_ptr() == bank.gate[0].numel()  # up follows gate in each expert
    assert bank.gate.stride(0) == 2 * bank.gate[0].numel() and not bank.is_contiguous
    hp, kv = model.hp, new_kv(model, slots=2, length=16)
    assert [tuple(k.shape) for k in kv.k] == [(2, 2, 16, 16), (2, 1, 16, 32), (2, 2, 16, 16), (2, 0, 16, 32)]
    assert hp.kv_layer(3) == 1 and hp.kv_layer(2) == 2


def test_gemma4_dense_matches_transformers(tmp_path: Path) -> None:
    """Gemma 4 without experts (31B's layout): every layer's GELU MLP alone between its norms."""
    hf = tiny_model("gemma4_text", enable_moe_block=False, num_experts=None, top_k_experts=None,
                    moe_intermediate_size=None)
    model = load_model(write_hf_gguf(hf, tmp_path / "model.gguf"))
    assert not model.w.moe_layers
    ids = torch.randint(0, hf.config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    ref, kv = hf_logits(hf, ids), new_kv(model)
    assert rel_error(run(model, kv, ids[:PREFILL], 0), ref[PREFILL - 1]) < 1e-4
    for pos in range(PREFILL, PROMPT_LEN):
        assert rel_error(run(model, kv, [ids[pos]], pos), ref[pos]) < 1e-4, f"position {pos}"
