"""The synchronous engine on a real GGUF with a real tokenizer: batching, stops, seeds, aborts, limits."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.detok import TextOutput, held_back
from engine.llm_engine import LLMEngine
from engine.moe import TopKRouter
from engine.types import Request, RequestError, RequestOutput, SamplingParams


def make_engine(path: Path, **sched: int | str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(str(path), device="cpu", max_context=256),
                                  scheduler=SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 64,
                                                               **sched})))


def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def text_of(outs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outs)


@pytest.fixture(scope="module", params=["off", "on"], ids=["in-turn", "decode-ahead"])
def engine(tiny_gguf: Path, request: pytest.FixtureRequest) -> LLMEngine:
    """Every test on this engine runs with each step read before the next is launched, and with decode ahead (the
    next decode step launched, fed on the device, before the last one's tokens are read)."""
    engine = make_engine(tiny_gguf, decode_ahead=request.param)
    assert engine.decodes_ahead == (request.param == "on")
    return engine


def test_cpu_misses_with_no_cache_decode_ahead(tiny_gguf: Path) -> None:
    """Every routed expert in host RAM, computed by the CPU, no slot: the cache decides nothing, so decode steps may go
    ahead, with the tokens of steps read in turn; a cache (or another miss mode) decides between steps."""
    def engine(ahead: str, budget_mib: int = 0, miss_mode: str = "cpu") -> LLMEngine:
        return LLMEngine(EngineConfig(model=ModelConfig(str(tiny_gguf), device="cpu", max_context=256),
                                      cache=CacheConfig(cpu_moe=True, budget_mib=budget_mib, miss_mode=miss_mode),
                                      scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                                decode_ahead=ahead)))

    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    texts = {}
    for ahead in ("on", "off"):
        e = engine(ahead)
        assert e.decodes_ahead == (ahead == "on")
        e.add_request(Request("a", prompt(e), params))
        texts[ahead] = text_of(run_all(e)["a"])
        assert e.cache.cpu_work().experts > 0
    assert texts["on"] == texts["off"]
    assert not engine("on", budget_mib=1).decodes_ahead and not engine("on", miss_mode="stream").decodes_ahead


def prompt(engine: LLMEngine, text: str = "The quick brown fox") -> tuple[int, ...]:
    return tuple(engine.tokenizer.encode(text))


def test_max_tokens_and_finish_reason(engine: LLMEngine) -> None:
    engine.add_request(Request("a", prompt(engine), SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)))
    outs = run_all(engine)["a"]
    assert sum(len(o.new_token_ids) for o in outs) == 7
    assert outs[-1].finished and outs[-1].finish_reason == "length" and not any(o.finished for o in outs[:-1])
    ids = [t for o in outs for t in o.new_token_ids]
    assert text_of(outs) == engine.tokenizer.decode(ids)


def test_batched_greedy_equals_alone(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    texts = ["Hello there", "Once upon a time in a land", "1 2 3"]
    alone = {}
    for i, t in enumerate(texts):
        engine.add_request(Request(f"s{i}", prompt(engine, t), params))
        alone[f"s{i}"] = text_of(run_all(engine)[f"s{i}"])
    for i, t in enumerate(texts):
        engine.add_request(Request(f"s{i}", prompt(engine, t), params))
    together = {k: text_of(v) for k, v in run_all(engine).items()}
    assert together == alone


def test_same_seed_same_text(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    engine.add_request(Request("x", prompt(engine), params))
    first = text_of(run_all(engine)["x"])
    engine.add_request(Request("y", prompt(engine), params))
    engine.add_request(Request("z", prompt(engine, "other"), SamplingParams(max_tokens=16, seed=1)))
    assert text_of(run_all(engine)["y"]) == first


def test_stop_string_cuts_the_text(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine.add_request(Request("a", prompt(engine), params))
    full = text_of(run_all(engine)["a"])
    stop = full[8:11]
    assert len(stop) == 3 and full.find(stop) == 8
    engine.add_request(Request("b", prompt(engine), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                                   stop=(stop,))))
    outs = run_all(engine)["b"]
    assert text_of(outs) == full[:8] and outs[-1].finish_reason == "stop"


def test_stop_token_ends_without_its_text(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine.add_request(Request("a", prompt(engine), params))
    ids = [t for o in run_all(engine)["a"] for t in o.new_token_ids]
    engine.add_request(Request("b", prompt(engine), SamplingParams(max_tokens=24, temperature=0,
                                                                   stop_token_ids=(ids[5],))))
    outs = run_all(engine)["b"]
    got = [t for o in outs for t in o.new_token_ids]
    assert got == ids[:ids.index(ids[5]) + 1] and outs[-1].finish_reason == "stop"
    assert text_of(outs) == engine.tokenizer.decode(got[:-1])


def test_abort_frees_the_slot(engine: LLMEngine) -> None:
    engine.add_request(Request("a", prompt(engine), SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.step()
    out = engine.abort("a")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert engine.scheduler.num_running == 0 and not engine.has_unfinished()
    assert engine.abort("a") is None


def test_context_overflow_is_a_request_error(engine: LLMEngine) -> None:
    with pytest.raises(RequestError, match=r"maximum context length is 256 tokens.*prompt has 4 tokens"):
        engine.add_request(Request("a", prompt(engine), SamplingParams(max_tokens=300)))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request(Request("b", (), SamplingParams()))
    assert not engine.has_unfinished()


def test_a_running_id_is_refused_and_no_model_file_is_a_clear_error(engine: LLMEngine) -> None:
    engine.add_request(Request("a", prompt(engine), SamplingParams(max_tokens=2, ignore_eos=True)))
    with pytest.raises(RequestError, match="'a' is already running"):
        engine.add_request(Request("a", prompt(engine), SamplingParams()))
    run_all(engine)
    with pytest.raises(ValueError, match="no model file"):
        LLMEngine(EngineConfig(model=ModelConfig(None, device="cpu")))


@dataclass
class SpyRouter:
    """The model's router, noting the requests it is told to forget."""

    inner: TopKRouter
    released: list[Hashable] = field(default_factory=list)

    def __call__(self, moe_index: int, logits: torch.Tensor,
                 token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner(moe_index, logits, token_mask)

    def begin_step(self, token_keys: Sequence[Hashable]) -> None:
        pass

    def while_running(self) -> None:
        pass

    def release(self, request_id: Hashable) -> None:
        self.released.append(request_id)


def test_the_router_forgets_each_ended_request_before_the_next_step(engine: LLMEngine) -> None:
    hp = engine.weights.hparams
    engine.step()  # idle: reports the requests of the tests before
    spy = SpyRouter(TopKRouter(hp.top_k, hp.norm_topk))
    engine.set_router(spy)
    try:
        engine.add_request(Request("a", prompt(engine), SamplingParams(max_tokens=1, ignore_eos=True)))
        engine.add_request(Request("b", prompt(engine), SamplingParams(max_tokens=9, ignore_eos=True)))
        engine.step()  # a's prompt gives its only token: a ends
        assert spy.released == []
        engine.abort("b")
        engine.step()
        assert spy.released == ["a", "b"] and not engine.has_unfinished()
    finally:
        engine.set_router(spy.inner)


@pytest.mark.parametrize("ahead", ["off", "on"])
def test_more_requests_than_slots_all_finish(tiny_gguf: Path, ahead: str) -> None:
    engine = make_engine(tiny_gguf, max_num_seqs=2, max_num_batched_tokens=16, decode_ahead=ahead)
    for i in range(5):
        engine.add_request(Request(f"r{i}", prompt(engine, f"request number {i} " * 3),
                                   SamplingParams(max_tokens=5, ignore_eos=True)))
    outs = run_all(engine)
    assert sorted(outs) == [f"r{i}" for i in range(5)]
    assert all(o[-1].finish_reason == "length" for o in outs.values())
    assert engine.stats().num_running == 0 and engine.scheduler.free_slots


def test_decode_ahead_gives_the_tokens_of_steps_in_turn_and_drops_the_rows_of_ended_sequences(tiny_gguf: Path) -> None:
    """Four sequences end mid-batch in every way (a stop token, a stop string, their token limits) while steps are
    launched ahead: each request's tokens, text and finish reason are those of steps read in turn, steps did run
    ahead, and a sequence's row of a step ahead after its end reached no output."""
    def run(ahead: str) -> tuple[dict[str, tuple[list[int], str, str | None]], int]:
        engine = make_engine(tiny_gguf, decode_ahead=ahead)
        fed: list[bool] = []
        forward = engine.runner.forward

        def spy(spans: list, token_ids: list, logits_from: list | None = None, feed: object = None) -> torch.Tensor:
            fed.append(feed is not None)
            return forward(spans, token_ids, logits_from, feed)

        engine.runner.forward = spy  # type: ignore[method-assign,assignment]
        free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        engine.add_request(Request("free", prompt(engine), free))
        ids = [t for o in run_all(engine)["free"] for t in o.new_token_ids]
        text = engine.tokenizer.decode(ids)
        requests = {"token": SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(ids[6],)),
                    "string": SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=(text[12:15],)),
                    "short": SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                    "seeded": SamplingParams(max_tokens=19, temperature=0.9, seed=7, ignore_eos=True)}
        for name, params in requests.items():  # the last two continue other prompts
            engine.add_request(Request(name, prompt(engine, "Once upon a time" if params.max_tokens < 30 else
                                                    "The quick brown fox"), params))
        outs = run_all(engine)
        assert not engine.has_unfinished() and engine._ahead is None
        return {k: ([t for o in v for t in o.new_token_ids], text_of(v), v[-1].finish_reason)
                for k, v in outs.items()}, sum(fed)

    in_turn, fed_in_turn = run("off")
    ahead, fed_ahead = run("on")
    assert ahead == in_turn and fed_in_turn == 0 and fed_ahead > 10
    assert [in_turn[k][2] for k in ("token", "string", "short", "seeded")] == ["stop", "stop", "length", "length"]
    assert len(in_turn["short"][0]) == 4 and len(in_turn["seeded"][0]) == 19


def test_held_back_and_text_output(engine: LLMEngine) -> None:
    assert held_back("abc<|e", ("<|end|>",)) == 3 and held_back("abc", ("xyz",)) == 0
    out = TextOutput(engine.tokenizer, ("STOP",))
    out._append("hello ST")
    assert out.emit() == "hello "
    out._append("OP and more")
    assert out.hit_stop and out.finish() == ""
    assert out.text == "hello "


def test_a_given_prefill_budget_beside_decodes_outlives_a_new_cache(tiny_gguf: Path) -> None:
    from engine.config import CacheConfig

    given = make_engine(tiny_gguf, prefill_while_decoding=32)
    given.reconfigure_cache(CacheConfig(cpu_moe=True, budget_mib=0))
    assert given.cache.placement.host_layers and given.scheduler.config.prefill_while_decoding == 32
    given.close()


def test_a_steps_decoding_sequences_attend_as_each_alone_beside_a_prompt_chunk(engine: LLMEngine) -> None:
    """A step that decodes three sequences and prefills a chunk of a fourth: the decoding tokens attend in one launch
    (`Model.prefill_attention`), each as its own one-token span would."""
    from engine.model import ForwardBatch, SeqSpan
    from ops.fused import prefill_attention

    model, kv, hp = engine.model, engine.kv, engine.model.hp
    generator = torch.Generator().manual_seed(0)
    for layer in range(hp.num_layers):  # every slot's first 40 positions written
        k = torch.randn(4 * 40, hp.num_kv_heads, hp.head_dim, generator=generator)
        slots = torch.arange(4).repeat_interleave(40)
        kv.write(layer, slots, torch.arange(40).repeat(4), k, torch.randn(k.shape, generator=generator))
    spans = [SeqSpan(0, 17, 1), SeqSpan(2, 39, 1), SeqSpan(1, 5, 1), SeqSpan(3, 20, 6)]
    batch = ForwardBatch.build(spans, [[1], [1], [1], [1] * 6], torch.device("cpu"))
    q = torch.randn(batch.num_tokens, hp.num_heads, hp.head_dim, generator=generator)
    layer = hp.num_layers - 1
    got = model.prefill_attention(layer, q, batch, kv, None)
    row, expected = 0, []
    for span in spans:
        keys, values = kv.window(layer, span.end)
        expected.append(prefill_attention(q[row:row + span.num_tokens], keys, values, span.slot, span.start,
                                          model.scale, hp.window(layer)))
        row += span.num_tokens
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-5)
