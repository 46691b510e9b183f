"""Chaos through the proxy: seeded random transfer faults and swapped kv_transfer_params in
front of D; no crash, every request correct or a clean error, every block free at the end."""

import pytest

from kvbridge.chaos import run_chaos


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_chaos_every_request_correct_or_clean_error(policy):
    report = run_chaos(num_requests=24, concurrency=8, fault_rate=0.15, seed=11, policy=policy, max_tokens=4,
                       swap_rate=0.5, swap_window_s=2.0)
    print(report.table())
    assert report.outcomes["bad"] == 0, report.bad_examples
    assert report.blocks_free and report.servers_alive
    assert sum(report.failures_by_class.values()) > 0  # faults really fired
    assert report.swapped > 0 and report.content_mismatches > 0  # swapped params reached P's check
    if policy == "recompute":
        assert report.outcomes["correct"] == 24
    else:
        assert report.outcomes["clean_error"] > 0
