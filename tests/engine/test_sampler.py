"""Sampling: greedy, temperature, top-k/p, min-p, penalties, seeds, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.sampler import SamplingState, apply_penalties, filter_logits, filter_rows, make_generator, sample
from engine.types import RequestError, SamplingParams


def state(params: SamplingParams, prompt=(), output=()) -> SamplingState:
    return SamplingState(params, list(prompt), list(output), make_generator(params.seed, torch.device("cpu")))


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 400) -> Counter:
    st = state(params)
    return Counter(sample(logits[None], [st])[0][0] for _ in range(n))


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, -1.0, -3.0])


def test_greedy_takes_the_argmax() -> None:
    assert sample(LOGITS[None], [state(SamplingParams(temperature=0.0))])[0] == [0]
    assert draws(LOGITS, SamplingParams(temperature=1.0, top_k=1), 20) == Counter({0: 20})


def test_sampling_follows_the_distribution() -> None:
    counts = draws(LOGITS, SamplingParams(temperature=1.0, seed=3), 4000)
    probs = torch.softmax(LOGITS, -1)
    for token, p in enumerate(probs.tolist()):
        assert abs(counts[token] / 4000 - p) < 0.03


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    assert set(draws(LOGITS, SamplingParams(top_k=2, seed=1))) == {0, 1}
    probs = torch.softmax(LOGITS, -1).tolist()
    # top_p 0.6: tokens 0 (0.41) and 1 (0.25) cross 0.6 -> exactly {0, 1}
    assert probs[0] < 0.6 < probs[0] + probs[1]
    assert set(draws(LOGITS, SamplingParams(top_p=0.6, seed=1))) == {0, 1}
    # min_p 0.5: keep tokens with p >= 0.5 * p_max -> 0 and 1 (0.61 of max), not 2 (0.37)
    assert set(draws(LOGITS, SamplingParams(min_p=0.5, seed=1))) == {0, 1}


def test_filters_leave_at_least_one_token() -> None:
    out = filter_logits(LOGITS.clone(), SamplingParams(top_p=1e-6, top_k=3, min_p=0.99))
    assert torch.isfinite(out).sum() == 1 and int(out.argmax()) == 0


def test_temperature_sharpens_and_flattens() -> None:
    cold = draws(LOGITS, SamplingParams(temperature=0.1, seed=2))
    hot = draws(LOGITS, SamplingParams(temperature=5.0, seed=2))
    assert cold[0] > 390 and len(hot) == 6


def test_same_seed_same_tokens_different_seed_differs() -> None:
    a = [sample(LOGITS[None], [s])[0][0] for s in [state(SamplingParams(seed=5))] for _ in range(30)]
    b = [sample(LOGITS[None], [s])[0][0] for s in [state(SamplingParams(seed=5))] for _ in range(30)]
    c = [sample(LOGITS[None], [s])[0][0] for s in [state(SamplingParams(seed=6))] for _ in range(30)]
    assert a == b and a != c


def test_seeded_row_does_not_depend_on_its_batch() -> None:
    alone = state(SamplingParams(seed=9))
    batched, other = state(SamplingParams(seed=9)), state(SamplingParams(seed=1))
    two = torch.stack([LOGITS, LOGITS.flip(0)])
    for _ in range(20):
        assert sample(LOGITS[None], [alone])[0][0] == sample(two, [batched, other])[0][0]


def test_rows_filtered_together_are_each_filtered_as_alone() -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.7, top_k=20), SamplingParams(top_p=0.8), SamplingParams(min_p=0.2),
              SamplingParams(temperature=1.3, top_k=50, top_p=0.9, min_p=0.05), SamplingParams()]
    together = filter_rows(logits, params)
    for row, p, got in zip(logits, params, together, strict=True):
        alone = filter_logits(row.clone(), p)
        assert torch.equal(torch.isinf(got), torch.isinf(alone))
        torch.testing.assert_close(got[torch.isfinite(got)], alone[torch.isfinite(alone)])
    assert [int(torch.isfinite(r).sum()) for r in together[[0, 4]]] == [20, 300]


def test_a_row_without_top_p_keeps_its_whole_vocabulary_beside_one_with_it() -> None:
    """At Qwen3's 151,936 tokens a float32 cumulative sum reaches 1 before the tail: only rows with top_p < 1 cut."""
    logits = torch.randn(2, 151936, generator=torch.Generator().manual_seed(6)) * 4
    together = filter_rows(logits, [SamplingParams(), SamplingParams(top_p=0.9)])
    assert torch.isfinite(together[0]).all() and not torch.isfinite(together[1]).all()


def test_a_mixed_batch_gives_each_row_what_it_gets_alone() -> None:
    """Greedy, seeded, penalized and logprob rows in one batch: each row's token (and logprobs) as when alone."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 2
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(seed=11, top_p=0.9),
              SamplingParams(temperature=0.0, repetition_penalty=3.0), SamplingParams(seed=12, logprobs=1, top_k=5)]
    history = [(), (), (int(logits[2].argmax()),), ()]

    def states() -> list[SamplingState]:
        return [state(p, prompt=h) for p, h in zip(params, history, strict=True)]

    batched = states()
    alone = states()
    for _ in range(10):
        tokens, lps = sample(logits.clone(), batched)
        for i, st in enumerate(alone):
            token, lp = sample(logits[i:i + 1].clone(), [st])
            assert tokens[i] == token[0] and lps[i] == lp[0]
    assert tokens[2] != int(logits[2].argmax())  # the penalty moved the greedy row off its argmax
    assert lps[0] is not None and len(lps[0].top) == 3 and lps[3] is not None and len(lps[3].top) == 1


def test_repetition_penalty_pushes_seen_tokens_down() -> None:
    logits = torch.tensor([2.0, 1.9, -1.0, -1.1])
    out = apply_penalties(logits.clone(), state(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[2]))
    assert out.tolist() == pytest.approx([1.0, 1.9, -2.0, -1.1])
    assert int(out.argmax()) == 1


def test_presence_and_frequency_penalties_count_output_tokens() -> None:
    out = apply_penalties(torch.zeros(4), state(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                                                prompt=[3], output=[1, 1, 2]))
    assert out.tolist() == pytest.approx([0.0, -1.0, -0.75, 0.0])


def test_logprobs_are_the_model_distribution() -> None:
    tokens, lps = sample(LOGITS[None], [state(SamplingParams(temperature=0.0, logprobs=2))])
    lp = lps[0]
    expected = torch.log_softmax(LOGITS, -1)
    assert lp.token_id == tokens[0] == 0
    assert math.isclose(lp.logprob, float(expected[0]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [0, 1]
    assert sample(LOGITS[None], [state(SamplingParams())])[1] == [None]


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5),
                                         ("max_tokens", 0), ("logprobs", 50), ("temperature", float("nan")),
                                         ("stop", ("",))])
def test_invalid_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
