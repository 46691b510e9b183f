"""The sampler and its parameters against hostile values (issue 14, finding 2): any finite
temperature samples, out-of-range seeds are refused when the parameters are made, and a
row that cannot be sampled fails alone instead of raising out of the batch."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from kvbridge.engine.setup.generation_config import NO_DEFAULTS
from kvbridge.engine.sampling import Sampler, apply_repetition_penalty
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.server.protocol import CompletionRequest

VOCAB = 64


def logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(3)) * 8


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-38, 1e-6, 1e-5, 1e-3, 0.7, 2.0, 1e30, 1e300])
def test_any_finite_temperature_samples_a_token(temperature: float) -> None:
    rows = logits(4)
    sp = SamplingParams(temperature=temperature, seed=11)
    result = Sampler().sample(rows, ["a", "b", "c", "d"], [sp] * 4)
    assert result.errors == {}
    assert all(0 <= result.tokens[rid] < VOCAB for rid in "abcd")
    if temperature < 1e-5:  # too cold to be told from greedy: it is greedy
        assert [result.tokens[rid] for rid in "abcd"] == torch.argmax(rows, dim=-1).tolist()


def test_tiny_temperature_with_top_k_top_p_and_logprobs_is_greedy() -> None:
    rows = logits(2)
    sp = SamplingParams(temperature=1e-300, top_k=5, top_p=0.5, logprobs=3)
    result = Sampler().sample(rows, ["a", "b"], [sp, sp])
    assert [result.tokens["a"], result.tokens["b"]] == torch.argmax(rows, dim=-1).tolist()
    assert all(math.isfinite(result.logprobs[rid].logprob) for rid in "ab")


@pytest.mark.parametrize("seed", [2 ** 64, 18446744073709551616 * 7, -(2 ** 63) - 1])
def test_a_seed_that_does_not_fit_64_bits_is_refused(seed: int) -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("seed", [0, 2 ** 64 - 1, -(2 ** 63)])
def test_every_64_bit_seed_is_accepted_and_samples(seed: int) -> None:
    sp = SamplingParams(seed=seed)
    assert Sampler().sample(logits(1), ["a"], [sp]).errors == {}


@pytest.mark.parametrize("field, value", [("temperature", math.inf), ("temperature", math.nan),
                                          ("top_p", math.nan)])
def test_non_finite_sampling_values_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_row_that_cannot_be_sampled_fails_alone() -> None:
    """A row of NaN logits (a broken sequence) cannot be sampled; the other rows of the
    batch still get their tokens and the sampler is usable afterwards."""
    rows = logits(3)
    rows[1] = math.nan
    sp = SamplingParams(temperature=0.8, seed=5)
    sampler = Sampler()
    result = sampler.sample(rows, ["ok-1", "broken", "ok-2"], [sp, sp, SamplingParams(temperature=0)])
    assert set(result.errors) == {"broken"} and "sampl" in result.errors["broken"]
    assert set(result.tokens) == {"ok-1", "ok-2"}
    assert result.tokens["ok-2"] == int(torch.argmax(rows[2]))
    again = sampler.sample(logits(1), ["next"], [sp])
    assert again.errors == {} and 0 <= again.tokens["next"] < VOCAB


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.5)])
def test_a_seeded_generator_skipped_past_earlier_draws_continues_one_sequence(temperature, top_k, top_p) -> None:
    """The prefill instance samples a seeded request's first token, the decode instance the
    rest: skipping one draw makes the decode's sequence one engine's whatever the logits were."""
    rows = logits(6) / 8  # flat enough that the generator's state decides the token
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=77)
    one = Sampler()
    want = [one.sample(rows[i:i + 1], ["r"], [sp], [i]).tokens["r"] for i in range(6)]
    first = Sampler().sample(rows[0:1], ["r"], [sp], [0]).tokens["r"]
    rest = Sampler()  # a fresh sampler: its generator starts at the request's second draw
    assert [first] + [rest.sample(rows[i:i + 1], ["r"], [sp], [i]).tokens["r"] for i in range(1, 6)] == want


def test_unseeded_rows_drawn_together_follow_the_distribution() -> None:
    """Rows with temperature only and no seed are drawn at once (one uniform per row through
    the cumulative probabilities): their frequencies match softmax(logits / T), and a token of
    zero probability is never drawn."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    rows = torch.log(probs).repeat(64, 1) * 2.0  # at temperature 2 the softmax gives `probs` back
    sp = SamplingParams(temperature=2.0)
    sampler, counts = Sampler(seed=1), torch.zeros(5)
    for i in range(100):
        result = sampler.sample(rows, [f"r{j}" for j in range(64)], [sp] * 64)
        assert result.errors == {}
        for token in result.tokens.values():
            counts[token] += 1
    assert counts[4] == 0
    torch.testing.assert_close(counts / counts.sum(), probs, atol=0.01, rtol=0)


def test_an_unseeded_row_that_cannot_be_sampled_fails_alone() -> None:
    rows = logits(3)
    rows[0] = math.nan
    sp = SamplingParams(temperature=0.9)
    result = Sampler().sample(rows, ["broken", "ok-1", "ok-2"], [sp, sp, SamplingParams(temperature=1.1, top_k=4)])
    assert set(result.errors) == {"broken"} and set(result.tokens) == {"ok-1", "ok-2"}


def reference_inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """One level, entry by entry: the first entry whose running sum exceeds u x total, or the
    last entry of positive weight when the target is not below the total."""
    tokens = []
    for row, u in zip(weights.double().tolist(), uniforms.tolist()):
        total, running = sum(row), 0.0
        target, pick = u * total, max(i for i, w in enumerate(row) if w > 0)
        for i, w in enumerate(row):
            running += w
            if running > target:
                pick = i
                break
        tokens.append(pick)
    return tokens


@pytest.mark.parametrize("vocab, chunk", [(1, 4), (5, 4), (8, 4), (13, 4), (64, 8), (100, 7), (3000, 1024)])
def test_inverse_cdf_picks_what_one_cumulative_sum_picks(vocab: int, chunk: int) -> None:
    """Integer weights (exact in float64) with zeros sprinkled in, whole zero chunks, and the
    uniforms that land exactly on every boundary, on either side of it, at 0 and just below 1."""
    from kvbridge.engine.sampling import inverse_cdf

    gen = torch.Generator().manual_seed(vocab * 31 + chunk)
    base = torch.randint(0, 4, (vocab,), generator=gen).float()
    base[-1] = 0.0  # the last entry (and, below, the padding after it) weighs nothing
    if vocab > 2 * chunk:
        base[chunk:2 * chunk] = 0.0  # a whole chunk of zero weight
    base[vocab // 2] = 1.0  # at least one positive entry
    total = float(base.double().sum())
    edges = torch.cumsum(base.double(), 0)
    us = {0.0, 1.0 - 2.0 ** -53}
    for edge in edges.tolist():
        for u in (edge / total, math.nextafter(edge / total, 0.0), math.nextafter(edge / total, 1.0)):
            if 0.0 <= u < 1.0:
                us.add(u)
    uniforms = torch.tensor(sorted(us), dtype=torch.float64)
    weights = base.repeat(len(uniforms), 1)
    tokens, ok = inverse_cdf(weights, uniforms, chunk=chunk)
    assert ok.all()
    assert tokens.tolist() == reference_inverse_cdf(weights, uniforms)
    assert all(base[t] > 0 for t in tokens.tolist())


def test_inverse_cdf_over_random_float_weights_matches_the_reference() -> None:
    from kvbridge.engine.sampling import inverse_cdf

    gen = torch.Generator().manual_seed(5)
    weights = torch.rand(16, 2500, generator=gen) * (torch.rand(16, 2500, generator=gen) > 0.3)
    uniforms = torch.rand(16, dtype=torch.float64, generator=gen)
    tokens, ok = inverse_cdf(weights, uniforms, chunk=256)
    assert ok.all() and tokens.tolist() == reference_inverse_cdf(weights, uniforms)


def test_inverse_cdf_flags_rows_without_a_finite_positive_mass() -> None:
    from kvbridge.engine.sampling import inverse_cdf

    weights = torch.tensor([[0.0, 0.0, 0.0], [1.0, math.nan, 1.0], [math.inf, 1.0, 0.0], [0.0, 2.0, 0.0]])
    tokens, ok = inverse_cdf(weights, torch.full((4,), 0.5, dtype=torch.float64), chunk=2)
    assert ok.tolist() == [False, False, False, True]
    assert tokens[3] == 1 and all(0 <= t < 3 for t in tokens.tolist())  # every index valid, even unused


def test_unseeded_rows_over_a_many_chunk_vocabulary_follow_the_distribution() -> None:
    """A vocabulary of several chunks (the last one padded): the frequencies of the batched draw
    match softmax(logits / T) and tokens of zero probability are never drawn."""
    vocab = 2 * 1024 + 100
    probs = torch.zeros(vocab)
    hot = [0, 1023, 1024, 1500, 2147]  # both sides of a chunk boundary and the last entry
    probs[hot] = torch.tensor([0.1, 0.25, 0.15, 0.3, 0.2])
    rows = torch.log(probs).repeat(64, 1) * 0.5  # temperature 0.5 gives `probs` back
    sampler, counts = Sampler(seed=2), torch.zeros(vocab)
    for i in range(60):
        result = sampler.sample(rows, [f"r{j}" for j in range(64)], [SamplingParams(temperature=0.5)] * 64)
        assert result.errors == {}
        for token in result.tokens.values():
            counts[token] += 1
    assert counts.sum() == counts[hot].sum()
    torch.testing.assert_close(counts[hot] / counts.sum(), probs[hot], atol=0.015, rtol=0)


# ---- issue 44, item 7: extreme repetition penalties and huge logits never make a row inf or NaN ----------

SEEN = [3, 10, 20]  # the tokens a repetition penalty applies to (the prompt's and output's)

# The ways a row is sampled: greedy, drawn with the others (unseeded, temperature only), one by one
# (seeded), with top-k, top-p or min-p.
PATHS = {"greedy": dict(temperature=0.0), "plain": dict(), "seeded": dict(seed=7), "top_k": dict(top_k=5),
         "top_p": dict(top_p=0.9), "min_p": dict(min_p=0.1)}


def seen_logits(rows: int) -> torch.Tensor:
    """Logits whose seen tokens are 2.0, 1.5 and -1.0, the others as logits() gives them (up to about 20)."""
    out = logits(rows)
    out[:, SEEN] = torch.tensor([2.0, 1.5, -1.0])
    return out


@pytest.mark.parametrize("path", PATHS, ids=PATHS.keys())
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_a_tiny_repetition_penalty_makes_the_likeliest_seen_token_certain(path: str, temperature: float) -> None:
    """A penalty of 1e-300 multiplies a seen token's positive logit by 1e300 (vLLM accepts any penalty
    > 0): 2.0 becomes 2e300, past float32 (inf, a NaN softmax: HTTP 500 before). The limit is that the
    likeliest seen token is certain."""
    sp = SamplingParams(**{"temperature": temperature, **PATHS[path], "repetition_penalty": 1e-300})
    ids = [f"r{i}" for i in range(4)]
    result = Sampler().sample(seen_logits(4), ids, [sp] * 4, [0] * 4, [SEEN] * 4)
    assert result.errors == {} and [result.tokens[rid] for rid in ids] == [3] * 4


@pytest.mark.parametrize("path", PATHS, ids=PATHS.keys())
@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 1e-38, 3.5e38, 1e300, 1.7e308])
def test_any_finite_repetition_penalty_samples_a_token(path: str, penalty: float) -> None:
    """Subnormal penalties overflow even float64 (ties at the top, still a token); one past float32's
    range is inf there, and a seen logit of 0 times inf was NaN."""
    rows = seen_logits(4)
    rows[:, 20] = 0.0
    sp = SamplingParams(**{**PATHS[path], "repetition_penalty": penalty})
    ids = [f"r{i}" for i in range(4)]
    result = Sampler().sample(rows, ids, [sp] * 4, [0] * 4, [SEEN] * 4)
    assert result.errors == {}
    tokens = [result.tokens[rid] for rid in ids]
    if penalty < 1:  # seen tokens with positive logits win
        assert set(tokens) <= {3, 10}
    else:  # a huge penalty: seen tokens fall to 0 (positive) or -inf (negative): the rest win
        assert not set(tokens) & set(SEEN)


def test_an_ordinary_repetition_penalty_is_computed_as_before() -> None:
    """Only a penalty whose result leaves float32 takes the widened path: vLLM's float32 arithmetic
    (the same roundings) otherwise."""
    row = torch.tensor([2.0, -2.0, 1.0, 4.0, 0.3])
    want = row.clone()
    want[[0, 1, 4]] = torch.where(want[[0, 1, 4]] > 0, want[[0, 1, 4]] / 1.1, want[[0, 1, 4]] * 1.1)
    apply_repetition_penalty(row, [0, 1, 4], 1.1)
    assert torch.equal(row, want)


@pytest.mark.parametrize("path", [p for p in PATHS if p != "greedy"])
@pytest.mark.parametrize("temperature", [1e-5, 1e-3, 0.5])
def test_huge_finite_logits_at_a_cold_temperature_sample_their_top(path: str, temperature: float) -> None:
    """Logits near float32's limit divided by a temperature below 1 were inf (NaN probabilities)."""
    rows = torch.full((2, VOCAB), -3e38)
    rows[:, 5], rows[:, 9] = 3e38, 1e38
    sp = SamplingParams(**{"temperature": temperature, **PATHS[path], "logprobs": 2})
    result = Sampler().sample(rows, ["a", "b"], [sp, sp])
    assert result.errors == {} and result.tokens == {"a": 5, "b": 5}
    assert result.logprobs["a"].logprob == 0.0


@pytest.mark.parametrize("field, value", [("presence_penalty", math.nan), ("presence_penalty", math.inf),
                                          ("frequency_penalty", -math.inf), ("frequency_penalty", 1e-300),
                                          ("repetition_penalty", math.nan), ("repetition_penalty", 0.0),
                                          ("repetition_penalty", -1e-300), ("temperature", math.nan),
                                          ("temperature", 1e300), ("temperature", -1e-300)])
def test_the_request_refuses_penalties_and_temperatures_that_cannot_be_sampled(field: str, value: float) -> None:
    """At the HTTP edge (a 400): presence and frequency penalties are not supported (any value but
    0), a repetition penalty must be > 0 (vLLM's rule), a temperature in [0, 2]. The body parser has
    already refused NaN and Infinity (not JSON)."""
    with pytest.raises(ValidationError, match=field):
        CompletionRequest.model_validate({"prompt": "x", field: value})


@pytest.mark.parametrize("field, value", [("repetition_penalty", 1e-300), ("repetition_penalty", 1e300),
                                          ("temperature", 1e-300), ("temperature", 2.0)])
def test_the_request_accepts_what_vllm_accepts_and_the_sampler_samples_it(field: str, value: float) -> None:
    params = CompletionRequest.model_validate({"prompt": "x", field: value}).to_sampling_params(4, NO_DEFAULTS)
    result = Sampler().sample(seen_logits(1), ["a"], [params], [0], [SEEN])
    assert result.errors == {} and 0 <= result.tokens["a"] < VOCAB
