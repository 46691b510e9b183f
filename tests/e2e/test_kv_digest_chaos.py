"""kvbridge chaos with corrupted transfers (--corrupt-rate): every read delivered wrong fails its
load (by the KV digest; a shift off P's region fails at setup, before any byte), every answer is the
colocated engine's, every block is free afterwards."""

from __future__ import annotations

from kvbridge.chaos import run_chaos


def test_chaos_with_corrupted_reads_answers_correctly():
    report = run_chaos(num_requests=16, concurrency=4, fault_rate=0.0, seed=5, policy="recompute", max_tokens=4,
                       swap_rate=0.0, corrupt_rate=0.4)
    assert report.ok, report.bad_examples
    assert report.outcomes["correct"] == 16 and report.outcomes["bad"] == 0
    assert report.corrupted_reads > 0 and 0 < report.digest_caught <= report.corrupted_reads
    # at most one failed load per corrupted read: a "corruption" can deliver the right bytes anyway (a
    # truncated tail, or another request's blocks, already holding the same prompt's KV), and then
    # nothing is wrong to catch; what matters is above: every answer correct
    assert 0 < sum(report.failures_by_class.values()) <= report.corrupted_reads, report.failures_by_class
