"""Prompt log-probabilities (vLLM's `prompt_logprobs`) and whole-vocabulary scoring, against HF
transformers' logits of the same tiny model; logits only at the positions a request asks for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.model import ForwardBatch, SeqSpan
from engine.types import Request, RequestError, RequestOutput, SamplingParams
from tests.hf_models import tiny_model, write_hf_gguf
from tools.embedded_vocab import build_embedded_vocab

VOCAB = build_embedded_vocab()
PROMPT_LEN = 21
TOLERANCE = 1e-4  # float32 against float32, summed in another order


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_model("qwen3_moe", seed=5, vocab_size=len(VOCAB["tokenizer.ggml.tokens"]))


@pytest.fixture(scope="module")
def model_path(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_gguf(hf, tmp_path_factory.mktemp("plp") / "model.gguf", metadata=VOCAB)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 4000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(9)).tolist()


@pytest.fixture(scope="module")
def expected(hf: Any, prompt: list[int]) -> torch.Tensor:
    """HF's log-softmax at every prompt position `[PROMPT_LEN, vocab]`."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def make_engine(path: Path, batch_tokens: int = 64) -> LLMEngine:
    return LLMEngine(EngineConfig(ModelConfig(str(path), device="cpu", max_context=128),
                                  scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=batch_tokens)))


def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def check_prompt_logprobs(outs: list[RequestOutput], prompt: list[int], expected: torch.Tensor, top: int) -> None:
    first, *rest = outs
    assert all(o.prompt_logprobs == () for o in rest)  # only the first output carries them
    lps = first.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for pos, lp in enumerate(lps[1:]):  # position pos predicts prompt[pos + 1]
        assert lp is not None and lp.token_id == prompt[pos + 1]
        assert abs(lp.logprob - float(expected[pos, prompt[pos + 1]])) < TOLERANCE
        values, ids = torch.topk(expected[pos], top)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert max(abs(v - float(e)) for (_, v), e in zip(lp.top, values, strict=True)) < TOLERANCE if top else True


@pytest.mark.parametrize("batch_tokens", [64, 8], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_equal_transformers(model_path: Path, prompt: list[int], expected: torch.Tensor,
                                            batch_tokens: int) -> None:
    engine = make_engine(model_path, batch_tokens)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3, logprobs=1)
    engine.add_request(Request("a", tuple(prompt), params))
    outs = run_all(engine)["a"]
    check_prompt_logprobs(outs, prompt, expected, 3)
    # the first sampled token's logprob is the last prompt position's prediction
    assert abs(outs[0].logprobs[0].logprob - float(expected[-1, outs[0].new_token_ids[0]])) < TOLERANCE


def test_prompt_logprobs_beside_other_requests(model_path: Path, prompt: list[int], expected: torch.Tensor) -> None:
    """A decoding request and one that does not ask run in the same steps; neither changes the other."""
    engine = make_engine(model_path, 16)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request(Request("alone", tuple(prompt[:9]), greedy))
    alone = [t for o in run_all(engine)["alone"] for t in o.new_token_ids]
    engine.add_request(Request("plain", tuple(prompt[:9]), greedy))
    engine.step()  # "plain" is decoding while "asks" prefills in chunks
    engine.add_request(Request("asks", tuple(prompt), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                                     prompt_logprobs=0)))
    outs = run_all(engine)
    assert [t for o in outs["plain"] for t in o.new_token_ids] == alone[1:]
    assert all(o.prompt_logprobs == () for o in outs["plain"])
    check_prompt_logprobs(outs["asks"], prompt, expected, 0)


def test_logits_only_at_the_positions_asked_for(model_path: Path, prompt: list[int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(model_path)
    rows: list[int] = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda batch, *a: rows.append(len(batch.logit_rows)) or
                        forward(batch, *a))
    engine.add_request(Request("a", tuple(prompt), SamplingParams(max_tokens=2, temperature=0)))
    run_all(engine)
    assert rows == [1, 1]  # the prompt's last token, then the decoded one
    engine.add_request(Request("b", tuple(prompt), SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)))
    run_all(engine)
    assert rows == [1, 1, PROMPT_LEN, 1]


def test_forward_batch_rows() -> None:
    spans = [SeqSpan(0, 8, 1), SeqSpan(1, 0, 5), SeqSpan(2, 3, 4)]
    ids = [[1], [2] * 5, [3] * 4]
    assert ForwardBatch.build(spans, ids, torch.device("cpu")).logit_rows.tolist() == [0, 5, 9]
    rows = ForwardBatch.build(spans, ids, torch.device("cpu"), [8, 2, 0]).logit_rows.tolist()
    assert rows == [0, 3, 4, 5, 6, 7, 8, 9]  # sequence 1 from position 2, sequence 2 from its first


def test_score_equals_transformers(model_path: Path, prompt: list[int], expected: torch.Tensor) -> None:
    engine = make_engine(model_path, 8)  # three chunks; the first ends before `first`
    got = engine.score(prompt, first=10)
    assert got.shape == (PROMPT_LEN - 11, expected.shape[1])
    assert float((got - expected[10:-1]).abs().max()) < TOLERANCE


def test_prompt_logprobs_range_is_checked() -> None:
    with pytest.raises(RequestError) as error:
        SamplingParams(prompt_logprobs=21)
    assert error.value.param == "prompt_logprobs"
