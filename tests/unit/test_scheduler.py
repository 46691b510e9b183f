"""Scheduler: token budget, chunked prefill, preemption by recompute, aborts. No model:
the runner's output is synthesised (token 7 each time)."""

from kvbridge.config import SchedulerConfig
from kvbridge.engine.block_pool import BlockPool
from kvbridge.engine.kv_cache_manager import KVCacheGroupSpec, KVCacheManager
from kvbridge.engine.request import FinishReason, Request, RequestStatus
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.scheduler import Scheduler
from kvbridge.engine.scheduler_output import ModelRunnerOutput
from kvbridge.shape.kv_groups import KVCacheKind


def make(num_blocks=16, block_size=4, budget=64, max_seqs=8, max_len=1000):
    kvm = KVCacheManager(BlockPool(num_blocks), [KVCacheGroupSpec(KVCacheKind.FULL_ATTENTION, block_size, (0,))])
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kvm, max_len)


def add(s, rid, n_prompt, max_tokens=3):
    r = Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0))
    s.add_request(r)
    return r


def run_step(s):
    out = s.schedule()
    sampled = {x.request_id: 7 for x in out.scheduled if x.sample}
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return out


def test_batches_prefill_and_decode_under_the_token_budget():
    s = make(budget=10)
    add(s, "a", 6)
    add(s, "b", 6)
    out = run_step(s)
    assert [(x.request_id, len(x.token_ids)) for x in out.scheduled] == [("a", 6), ("b", 4)]
    out = run_step(s)  # a decodes (1 token), b finishes its prompt chunk (2 tokens)
    assert [(x.request_id, len(x.token_ids), x.sample) for x in out.scheduled] == [("a", 1, True), ("b", 2, True)]


def test_request_finishes_at_max_tokens_and_frees_its_blocks():
    s = make()
    r = add(s, "a", 5, max_tokens=3)
    while s.has_unfinished():
        run_step(s)
    assert r.finish_reason is FinishReason.LENGTH and r.output_token_ids == [7, 7, 7]
    assert s.kvm.num_free_blocks == 16


def test_preemption_by_recompute_when_blocks_run_out():
    s = make(num_blocks=4, block_size=4, budget=64)
    a = add(s, "a", 7, max_tokens=6)
    b = add(s, "b", 7, max_tokens=6)
    while s.has_unfinished():
        run_step(s)
    assert s.num_preemptions >= 1
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6
    assert s.kvm.num_free_blocks == 4


def test_abort_waiting_and_running_requests_frees_blocks():
    s = make(budget=6)
    add(s, "a", 6)
    add(s, "b", 6)
    run_step(s)  # a running, b waiting
    assert s.finish_request("a", FinishReason.ABORT).status is RequestStatus.FINISHED
    assert s.finish_request("b", FinishReason.ABORT) is not None
    assert s.finish_request("b", FinishReason.ABORT) is None  # already finished: no-op
    assert not s.has_unfinished() and s.kvm.num_free_blocks == 16
    assert s.schedule().finished_req_ids == {"a", "b"}


def test_max_num_seqs_limits_running_requests():
    s = make(max_seqs=2)
    for i in range(3):
        add(s, f"r{i}", 2)
    out = s.schedule()
    assert len(out.scheduled) == 2
    for rid in ("r0", "r1", "r2"):
        s.finish_request(rid, FinishReason.ABORT)
