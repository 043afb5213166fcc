"""KV cache types (`ops.kv_quant`) and the torch path of attention over a quantized cache (`ops.fused`):
rows quantized and dequantized bit for bit as gguf-py (a row's block scales first, then its codes),
attention over a quantized cache equal to attention over its dequantized values, and within a stated error of
attention over the unquantized cache."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from ops import kv_quant
from ops.fused import decode_attention_sdpa, prefill_attention_sdpa, write_kv_torch
from ops.quants import QType

QUANTIZED = [QType.Q8_0, QType.Q4_0]
# relative RMS error of the attention output over a quantized cache of unit Gaussian K and V (head_dim
# 128), measured over seeds: q8_0 0.75%, q4_0 12.6% (the output, not the rows: errors average over keys)
OUTPUT_ERROR_BOUNDS = {QType.Q8_0: 0.015, QType.Q4_0: 0.2}


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_round_trip_bit_for_bit_as_gguf(qtype: QType, dtype: torch.dtype) -> None:
    x = (torch.randn(3, 2, 5, 96, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)  # [slots, heads, pos, d]
    raw = kv_quant.quantize_rows(x, qtype)
    assert raw.dtype == torch.uint8 and raw.shape == (3, 2, 5, kv_quant.row_bytes(qtype, 96, dtype))
    expected = gguf.quants.quantize(x.float().reshape(-1, 32).numpy(), qtype)  # [blocks, type_size]
    n = 96 // 32
    rows = torch.from_numpy(expected).view(-1, n, expected.shape[1])  # a row's blocks, as gguf lays them out
    scales, codes = raw.reshape(-1, raw.shape[-1]).split([2 * n, raw.shape[-1] - 2 * n], dim=1)
    assert torch.equal(scales, rows[:, :, :2].flatten(1))  # the blocks' fp16 scales first
    assert torch.equal(codes, rows[:, :, 2:].flatten(1))  # then their codes, block after block
    assert torch.equal(kv_quant.from_planar(raw, qtype).reshape(-1, expected.shape[1]), torch.from_numpy(expected))
    values = kv_quant.dense(raw, qtype, 96, dtype)
    decoded = torch.from_numpy(np.asarray(gguf.quants.dequantize(expected, qtype), dtype=np.float32))
    assert values.dtype == dtype and torch.equal(values, decoded.to(dtype).view(3, 2, 5, 96))


def test_row_bytes_and_refusals() -> None:
    assert kv_quant.row_bytes(None, 128, torch.bfloat16) == 256
    assert kv_quant.row_bytes(QType.Q8_0, 128, torch.bfloat16) == 4 * 34
    assert kv_quant.row_bytes(QType.Q4_0, 128, torch.bfloat16) == 4 * 18
    with pytest.raises(ValueError, match="q4_0 KV cache needs head_dim a multiple of 32, got 80"):
        kv_quant.row_bytes(QType.Q4_0, 80, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16, q8_0, q4_0.*'q5_0'"):
        kv_quant.kv_qtype("q5_0")
    assert [kv_quant.kv_qtype(name) for name in kv_quant.KV_CACHE_TYPES] == [None, QType.Q8_0, QType.Q4_0]


def random_caches(qtype_k: QType | None, qtype_v: QType | None, dtype: torch.dtype,
                  seed: int) -> tuple[torch.Tensor, ...]:
    """Unquantized caches `[slots, kv_heads, max_len, 128]` and the same values written through
    `write_kv_torch` into caches of the given types."""
    generator = torch.Generator().manual_seed(seed)
    slots, kv_heads, max_len, head_dim = 3, 2, 64, 128
    k = torch.randn(slots * max_len, kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(k.shape, generator=generator).to(dtype)
    slot_ids, positions = torch.arange(slots * max_len) // max_len, torch.arange(slots * max_len) % max_len
    caches = []
    for k_qtype, v_qtype in ((None, None), (qtype_k, qtype_v)):
        k_cache = kv_quant.zeros((slots, kv_heads, max_len), k_qtype, head_dim, dtype)
        v_cache = kv_quant.zeros((slots, kv_heads, max_len), v_qtype, head_dim, dtype)
        write_kv_torch(k_cache, v_cache, slot_ids, positions, k, v, k_qtype, v_qtype)
        caches += [k_cache, v_cache]
    return tuple(caches)


@pytest.mark.parametrize("qtypes", [(QType.Q8_0, QType.Q8_0), (QType.Q4_0, QType.Q4_0), (QType.Q8_0, QType.Q4_0),
                                    (None, QType.Q4_0)], ids=lambda t: f"{t[0] and t[0].name}-{t[1] and t[1].name}")
def test_torch_attention_over_a_quantized_cache(qtypes: tuple[QType | None, QType | None]) -> None:
    dtype, scale = torch.float32, 128 ** -0.5
    k_ref, v_ref, k_cache, v_cache = random_caches(*qtypes, dtype, seed=1)
    k_dense, v_dense = (kv_quant.dense(c, t, 128, dtype) for c, t in ((k_cache, qtypes[0]), (v_cache, qtypes[1])))
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(5, 8, 128, generator=generator)
    slot_ids, positions = torch.tensor([0, 2, 1, 2, 0]), torch.tensor([0, 63, 17, 40, 5])
    out = decode_attention_sdpa(q, k_cache, v_cache, slot_ids, positions, scale, k_qtype=qtypes[0],
                                v_qtype=qtypes[1])
    assert torch.equal(out, decode_attention_sdpa(q, k_dense, v_dense, slot_ids, positions, scale))
    ref = decode_attention_sdpa(q, k_ref, v_ref, slot_ids, positions, scale)
    bound = max(OUTPUT_ERROR_BOUNDS.get(t, 0.0) for t in qtypes)  # type: ignore[arg-type]
    assert 0 < rel_rms(out, ref) < bound
    # a prefill chunk of slot 1 at positions 20..43 (causal), the same values
    q_chunk = torch.randn(24, 8, 128, generator=generator)
    out = prefill_attention_sdpa(q_chunk, k_cache, v_cache, 1, 20, scale, k_qtype=qtypes[0], v_qtype=qtypes[1])
    assert torch.equal(out, prefill_attention_sdpa(q_chunk, k_dense, v_dense, 1, 20, scale))
    assert 0 < rel_rms(out, prefill_attention_sdpa(q_chunk, k_ref, v_ref, 1, 20, scale)) < bound
