"""min_p and the repetition penalty (the sampling fields a model's generation_config.json may set)."""

from __future__ import annotations

import pytest
import torch

from kvbridge.engine.sampling import Sampler, apply_repetition_penalty
from kvbridge.engine.sampling_params import SamplingParams


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    row = torch.tensor([2.0, -2.0, 1.0, 4.0])
    apply_repetition_penalty(row, [0, 1, 1, 99], 2.0)  # a repeated id counts once; one past the vocabulary is ignored
    assert row.tolist() == [1.0, -4.0, 1.0, 4.0]


def test_greedy_with_a_repetition_penalty_avoids_the_seen_token() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    greedy = SamplingParams(temperature=0)
    assert Sampler().sample(logits, ["a"], [greedy], [0], [[0]]).tokens == {"a": 0}
    penalised = SamplingParams(temperature=0, repetition_penalty=1.5)
    out = Sampler().sample(logits, ["a"], [penalised], [0], [[0]])
    assert out.tokens == {"a": 1}  # 3.0 / 1.5 = 2.0 < 2.5
    assert logits[0, 0].item() == 3.0  # the caller's logits are left alone


def test_logprobs_are_the_models_before_the_penalty() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    sp = SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=0)
    out = Sampler().sample(logits, ["a"], [sp], [0], [[0]])
    assert out.logprobs["a"].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())


def test_min_p_keeps_only_tokens_near_the_likeliest() -> None:
    # probabilities about 0.6, 0.3, 0.1 x 1e-3...: min_p 0.4 leaves only tokens above 0.24.
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    sp = SamplingParams(temperature=1.0, min_p=0.4, seed=3)
    sampler = Sampler()
    drawn = {sampler.sample(logits, [f"r{i}"], [SamplingParams(temperature=1.0, min_p=0.4, seed=i)]).tokens[f"r{i}"]
             for i in range(200)}
    assert drawn == {0, 1}
    unlimited = {sampler.sample(logits, [f"u{i}"], [SamplingParams(temperature=1.0, seed=i)]).tokens[f"u{i}"]
                 for i in range(200)}
    assert unlimited == {0, 1, 2}
    assert sampler.sample(logits, ["x"], [sp]).errors == {}


@pytest.mark.parametrize("fields", [dict(min_p=-0.1), dict(min_p=1.5), dict(repetition_penalty=0.0),
                                    dict(repetition_penalty=float("inf")), dict(repetition_penalty=float("nan"))])
def test_out_of_range_values_are_refused(fields: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(fields))):
        SamplingParams(**fields)
