"""Prefix-affinity routing: requests sharing a prompt prefix go to the same instance while it is
not overloaded; least-outstanding otherwise (routing.PrefixAffinityPolicy, proxy.prompt_text)."""

from __future__ import annotations

import pytest

from kvbridge.proxy.bodies import prompt_text
from kvbridge.proxy.routing import PrefixAffinityPolicy, Upstream, make_policy
from tests.unit.proxy_cluster import COMPLETION, pd_cluster

SYSTEM = "You are a helpful assistant for a shipping company. " * 8  # ~400 characters


def upstreams(n: int) -> list[Upstream]:
    return [Upstream(f"http://u{i}", i, healthy=True) for i in range(n)]


def test_requests_sharing_a_long_prefix_stick_to_one_instance_and_others_spread():
    policy, us = PrefixAffinityPolicy(), upstreams(3)
    first = policy.choose(us, SYSTEM + "Where is my parcel?")
    first.outstanding += 1  # in flight
    assert all(policy.choose(us, SYSTEM + q) is first for q in ("Track 123.", "Change my address.", "Refund?"))
    other = policy.choose(us, "A different system prompt entirely. " * 8 + "Hello")
    assert other is not first  # no known prefix: the least-loaded instance


def test_the_load_guard_moves_a_hot_prefix_off_an_overloaded_instance():
    policy, us = PrefixAffinityPolicy(imbalance=2), upstreams(2)
    hot = policy.choose(us, SYSTEM + "q0")
    hot.outstanding = 3  # 3 more in flight than the idle one: above the imbalance of 2
    moved = policy.choose(us, SYSTEM + "q1")
    assert moved is not hot
    assert policy.choose(us, SYSTEM + "q2") is moved  # the prefix now points at the new instance
    hot.outstanding = 0


def test_a_short_shared_part_gives_no_affinity_and_the_table_is_bounded():
    policy = PrefixAffinityPolicy(block_chars=64, max_entries=10)
    assert policy.prefix_keys("x" * 63) == [] and len(policy.prefix_keys("x" * 640)) == 10
    assert policy.prefix_keys("a" * 128)[0] == policy.prefix_keys("a" * 64 + "b" * 64)[0]
    assert policy.prefix_keys("a" * 128)[1] != policy.prefix_keys("a" * 64 + "b" * 64)[1]
    us = upstreams(2)
    for i in range(50):
        policy.choose(us, f"{i:04d}" * 100)
    assert len(policy._owner) == 10
    with pytest.raises(ValueError):
        PrefixAffinityPolicy(block_chars=0)
    assert isinstance(make_policy("prefix"), PrefixAffinityPolicy)


def test_an_instance_that_left_the_candidates_is_not_chosen():
    policy, us = PrefixAffinityPolicy(), upstreams(2)
    first = policy.choose(us, SYSTEM + "a")
    rest = [u for u in us if u is not first]
    assert policy.choose(rest, SYSTEM + "b") is rest[0]


@pytest.mark.parametrize("body, text", [
    ({"prompt": "hello"}, "hello"),
    ({"prompt": [1, 2, 3]}, "1,2,3"),
    ({"prompt": ["first", "second"]}, "first"),
    ({"prompt": [[7, 8], [9]]}, "7,8"),
    ({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}]},
     "system: S\nuser: U\n"),
    ({"messages": "not a list"}, ""),
    ({}, ""),
])
def test_prompt_text_of_completions_and_chats(body, text):
    assert prompt_text(body) == text


async def test_the_proxy_sends_a_shared_system_prompt_to_one_prefill_instance():
    async with pd_cluster(num_prefill=3, prefill_policy="prefix") as pd:
        for q in ("Where is my parcel?", "Track 123.", "Refund?", "Change my address."):
            body = {**COMPLETION, "prompt": SYSTEM + q}
            assert (await pd.http.post("/v1/completions", json=body)).status_code == 200
        assert sorted(len(p.received) for p in pd.prefill) == [0, 0, 4]
