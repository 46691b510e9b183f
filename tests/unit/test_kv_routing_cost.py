"""kv_cost.py: the worker cost's choices and the P/D decision on tables of inputs."""

import pytest

from kvbridge.proxy.kv_cost import Decision, Load, cheapest, cost, decide_auto, decide_static, decide_threshold


def load(**kw: object) -> Load:
    base: dict[str, object] = dict(waiting=0, waiting_prefill_tokens=0, running=0, kv_blocks_total=100,
                                   kv_blocks_free=100, prefill_tokens_per_s=1000.0, decode_step_s=0.02,
                                   kv_pull_bytes_per_s=1e9, kv_bytes_per_token=1000)
    base.update(kw)
    return Load.from_json(base)


@pytest.mark.parametrize("candidates, winner", [
    # (overlap blocks, load) per candidate; a 64-token prompt, block size 16: 4 blocks
    ([(0, load()), (4, load())], 1),  # the one holding the prompt
    ([(2, load()), (2, load())], 0),  # equal: the first
    ([(4, load(kv_blocks_free=90)), (0, load())], 1),  # 10 blocks in use outweigh a 4-block hit
    ([(4, load(kv_blocks_free=97)), (0, load())], 0),  # 3 do not
    ([(4, load(waiting_prefill_tokens=160)), (0, load())], 1),  # 10 queued prefill blocks
    ([(5, load()), (0, load(kv_blocks_free=99))], 0),  # an overlap past the prompt counts as the prompt
])
def test_the_lowest_cost_wins(candidates: list[tuple[int, Load]], winner: int) -> None:
    assert cheapest([cost(64, overlap, ld, 16) for overlap, ld in candidates]) == winner


def test_the_cost_follows_the_formula() -> None:
    ld = load(waiting_prefill_tokens=17, kv_blocks_free=60)
    # prefill_load_scale * (max(5 - 2, 0) + ceil(17 / 16)) + (100 - 60)
    assert cost(65, 2, ld, 16, prefill_load_scale=2.0) == 2.0 * (3 + 2) + 40
    with pytest.raises(ValueError):
        cheapest([])


@pytest.mark.parametrize("field, value", [("waiting", -1), ("running", 1.5), ("kv_blocks_total", None),
                                          ("prefill_tokens_per_s", "fast"), ("kv_pull_bytes_per_s", float("nan")),
                                          ("kv_bytes_per_token", True)])
def test_a_malformed_load_is_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        load(**{field: value})


@pytest.mark.parametrize("prompt, cached_d, cached_p, d, p, expected", [
    (1000, 1000, 0, load(), load(), Decision("decode_only", "cached")),
    (1000, 0, 0, load(prefill_tokens_per_s=None), load(), Decision("prefill_decode", "no_measured_rate")),
    (1000, 0, 0, load(), load(kv_pull_bytes_per_s=None), Decision("decode_only", "cost")),  # D pulls, not P
    (1000, 0, 0, load(kv_pull_bytes_per_s=None), load(), Decision("prefill_decode", "no_measured_rate")),
    # D 1 s alone; P 1 s + transfer 1 s: D alone
    (1000, 0, 0, load(), load(), Decision("decode_only", "cost")),
    # D busy with 20 streams: 1 s * (1 + 0.1 * 20) = 3 s > 2 s
    (1000, 0, 0, load(running=20), load(), Decision("prefill_decode", "cost")),
    # P 10x faster, fast pull: 0.1 s + 0.01 s < 1 s
    (1000, 0, 0, load(kv_pull_bytes_per_s=1e8), load(prefill_tokens_per_s=10000.0),
     Decision("prefill_decode", "cost")),
    # ... unless P's queue holds 20000 tokens: 2.1 s
    (1000, 0, 0, load(kv_pull_bytes_per_s=1e8), load(prefill_tokens_per_s=10000.0, waiting_prefill_tokens=20000),
     Decision("decode_only", "cost")),
    # D holds 990 of 1000: 10 tokens locally beat anything
    (1000, 990, 0, load(running=20), load(prefill_tokens_per_s=10000.0), Decision("decode_only", "cost")),
])
def test_auto_picks_the_cheaper_path(prompt: int, cached_d: int, cached_p: int, d: Load, p: Load,
                                     expected: Decision) -> None:
    assert decide_auto(prompt, cached_d, cached_p, d, p) == expected


@pytest.mark.parametrize("held, expected", [
    # D busy (x3), P's queue 500 tokens: D alone 3 s against P's 1.5 s
    (0, Decision("prefill_decode", "cost")),
    # another instance holds 900 tokens: D alone computes 100 (0.3 s) after pulling 900 (~1 ms),
    # P 0.6 s (its queue, then the 100 after the held prefix)
    (900, Decision("decode_only", "cost")),
])
def test_auto_weighs_a_prefix_held_elsewhere_on_both_paths(held: int, expected: Decision) -> None:
    assert decide_auto(1000, 0, 0, load(running=20), load(waiting_prefill_tokens=500), held=held) == expected


@pytest.mark.parametrize("prompt, cached_d, path", [
    (1000, 0, "prefill_decode"),  # nothing cached: 1000 is not under 0.7 of 1000
    (1000, 400, "decode_only"),  # 600 < 2048 and < 700
    (10000, 7000, "prefill_decode"),  # 3000 >= 2048
    (100, 40, "decode_only"),
])
def test_the_static_rule(prompt: int, cached_d: int, path: str) -> None:
    assert decide_static(prompt, cached_d) == Decision(path, "static")  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt, cached_d, path", [(300, 0, "prefill_decode"), (300, 100, "decode_only"),
                                                     (256, 0, "prefill_decode"), (255, 0, "decode_only")])
def test_the_threshold_rule(prompt: int, cached_d: int, path: str) -> None:
    assert decide_threshold(prompt, cached_d) == Decision(path, "threshold")  # type: ignore[arg-type]
