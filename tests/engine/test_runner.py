"""The model runner's first-chunk graphs (`engine.runner`): a prompt's first chunk padded to a captured size, its
padding rows writing the scratch slot and routing to no expert, attending over the chunk's own keys and values,
gives the chunk's logits and KV cache as the unpadded eager step does (on the CPU: the batch a graph replays, run
eagerly). The graphs themselves are captured in tests/engine/test_gpu_engine.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model import ForwardBatch, SeqSpan
from engine.runner import chunk_batch, chunk_sizes, stage_chunk


def test_chunk_sizes_run_from_above_a_decode_step_to_the_budget() -> None:
    assert chunk_sizes(32, 512) == [64, 128, 256, 512]
    assert chunk_sizes(32, 600) == [64, 128, 256, 512, 600]
    assert chunk_sizes(32, 48) == [48]
    assert chunk_sizes(32, 32) == []


@pytest.mark.parametrize("size", [64, 128])
def test_a_padded_first_chunk_gives_the_chunks_logits_and_cache(tiny_gguf: Path, size: int) -> None:
    engine = LLMEngine(EngineConfig(model=ModelConfig(str(tiny_gguf), device="cpu", max_context=256),
                                    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128)))
    runner, kv, cpu = engine.runner, engine.kv, torch.device("cpu")
    ids = list(torch.randint(1, engine.weights.hparams.vocab_size, (40,), generator=torch.Generator().manual_seed(3)))
    ids, span = [int(t) for t in ids], SeqSpan(1, 0, 40)  # more tokens than a decode step's 32

    expected = runner._step(ForwardBatch.build([span], [ids], cpu)).clone()
    keys = [kv.k[layer][1, :, :40].clone() for layer in range(len(kv.k))]
    for layer in range(len(kv.k)):  # the slot forgotten: the padded chunk must write it again
        kv.k[layer][1].zero_()
        kv.v[layer][1].zero_()

    inputs, batch = chunk_batch(size, runner.scratch_slot, cpu)
    staged = torch.empty((3, size), dtype=torch.int64)
    staged[1] = torch.arange(size)
    stage_chunk(staged.numpy(), span, ids, runner.scratch_slot)
    inputs.copy_(staged)
    got = runner._step(batch)

    assert batch.logit_rows.tolist() == [39] and int(batch.token_mask.sum()) == 40
    assert got.shape == expected.shape == (1, engine.weights.hparams.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for layer, k in enumerate(keys):
        torch.testing.assert_close(kv.k[layer][1, :, :40], k, rtol=1e-4, atol=1e-4)
        assert not kv.k[layer][1, :, 40:size].any()  # the padding wrote the scratch slot, not this one
    wrong = inputs.clone()
    wrong[0, 39] = (ids[39] + 1) % engine.weights.hparams.vocab_size
    inputs.copy_(wrong)
    assert not torch.allclose(runner._step(batch), expected, rtol=1e-4, atol=1e-4)  # the last real row's logits


@pytest.mark.parametrize("window, sinks", [(0, False), (5, False), (0, True), (5, True)])
def test_chunk_attention_is_prefill_attention_from_a_cache_holding_the_chunk(window: int, sinks: bool) -> None:
    """`ops.fused.chunk_attention` (a first chunk over its own k, v) against `prefill_attention` at start 0 over a
    slot of a cache those k, v were written to, with sliding windows and sink logits (gpt-oss)."""
    from ops.fused import chunk_attention, prefill_attention, write_kv

    generator = torch.Generator().manual_seed(5)
    n, heads, kv_heads, dim = 12, 4, 2, 16
    q, k, v = (torch.randn(n, h, dim, generator=generator) for h in (heads, kv_heads, kv_heads))
    sink = torch.randn(heads, generator=generator) if sinks else None
    k_cache, v_cache = torch.zeros(3, kv_heads, 32, dim), torch.zeros(3, kv_heads, 32, dim)
    write_kv(k_cache, v_cache, torch.full((n,), 2), torch.arange(n), k, v)
    expected = prefill_attention(q, k_cache[:, :, :n], v_cache[:, :, :n], 2, 0, 0.25, window, sink)
    torch.testing.assert_close(chunk_attention(q, k, v, 0.25, window, sink), expected)
    assert not torch.allclose(chunk_attention(q, k, v.roll(1, 0), 0.25, window, sink), expected)


def test_first_chunks_of_several_prompts_attend_each_to_its_own_in_one_launch() -> None:
    from ops.fused import chunk_attention

    generator = torch.Generator().manual_seed(6)
    heads, kv_heads, dim = 4, 2, 16
    q, k, v = (torch.randn(15, h, dim, generator=generator) for h in (heads, kv_heads, kv_heads))
    sequence = torch.tensor([0] * 5 + [1] + [2] * 9)
    for window in (0, 3):
        got = chunk_attention(q, k, v, 0.25, window, sequence=sequence)
        alone = [chunk_attention(*(t[a:b] for t in (q, k, v)), 0.25, window)
                 for a, b in ((0, 5), (5, 6), (6, 15))]
        torch.testing.assert_close(got, torch.cat(alone))
    assert not torch.allclose(chunk_attention(q, k, v, 0.25), torch.cat(alone))  # one sequence: the rows mix


def test_a_step_of_new_prompts_beside_decodes_gives_each_its_own_logits(tiny_gguf: Path) -> None:
    """Two sequences decoding and three prompts' first chunks in one step (the prompts attending over their own keys
    and values in one launch, `ForwardBatch.first_chunks`): each row's logits as its sequence's step alone."""
    engine = LLMEngine(EngineConfig(model=ModelConfig(str(tiny_gguf), device="cpu", max_context=64),
                                    scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=128)))
    runner, cpu = engine.runner, torch.device("cpu")
    prompt = lambda n, seed: [int(t) for t in torch.randint(  # noqa: E731
        1, engine.weights.hparams.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))]
    for slot in (0, 1):  # the decoding sequences' first 5 positions
        runner._step(ForwardBatch.build([SeqSpan(slot, 0, 5)], [prompt(5, slot)], cpu))
    spans = [SeqSpan(0, 5, 1), SeqSpan(1, 5, 1), SeqSpan(2, 0, 7), SeqSpan(3, 0, 3), SeqSpan(4, 0, 11)]
    ids = [[17], [23], prompt(7, 2), prompt(3, 3), prompt(11, 4)]
    batch = ForwardBatch.build(spans, ids, cpu)
    assert batch.singles == 2 and batch.first_chunks is not None
    assert batch.first_chunks.tolist() == [0] * 7 + [1] * 3 + [2] * 11
    alone = torch.cat([runner._step(ForwardBatch.build(spans[:2], ids[:2], cpu))] +
                      [runner._step(ForwardBatch.build([s], [i], cpu)) for s, i in zip(spans[2:], ids[2:])])
    torch.testing.assert_close(runner._step(batch), alone, rtol=1e-4, atol=1e-4)
    assert ForwardBatch.build(spans[:3] + [SeqSpan(3, 3, 2)], ids[:3] + [[5, 6]], cpu).first_chunks is None


def test_a_chunk_that_cannot_be_captured_runs_eagerly(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A capture a kernel refuses does not fail the request: the prompt runs eagerly, as do the prompts after it."""
    engine = LLMEngine(EngineConfig(model=ModelConfig(str(tiny_gguf), device="cpu", max_context=256),
                                    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128)))
    runner, ids = engine.runner, [(7 * i) % 50 + 1 for i in range(40)]
    expected = runner.forward([SeqSpan(0, 0, 40)], [ids]).clone()
    tried: list[int] = []

    def refuse(size: int) -> None:
        tried.append(size)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "_capture_chunk", refuse)
    runner.chunk_sizes = [64, 128]  # as on CUDA
    with caplog.at_level("WARNING", logger="engine.runner"):
        got = runner.forward([SeqSpan(0, 0, 40)], [ids])
    torch.testing.assert_close(got, expected)
    assert tried == [64] and runner.chunk_sizes == [] and "run eagerly" in caplog.text
    assert runner.chunk_size([SeqSpan(0, 0, 100)]) is None
