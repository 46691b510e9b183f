"""The KV tier below the pool (engine/kv_tier.py, engine/tier_file.py): the index's slots, LRU,
bounded store queue, pinned loads and events; one rank's file: stores, verified loads, a flipped
byte, a truncated file; and the scheduler's use of both over a real block pool (no model: the
ranks' part is a TierFile over a KV tensor this test writes). The real model end to end:
tests/integration/test_kv_tier_engine.py."""

from __future__ import annotations

import os

import pytest
import torch

from kvbridge.config import SchedulerConfig
from kvbridge.engine.block_pool import BlockPool
from kvbridge.engine.kv_cache_manager import KVCacheGroupSpec, KVCacheManager
from kvbridge.engine.kv_event_queue import KVEventQueue
from kvbridge.engine.kv_tier import MEDIUM_DISK, KVTierIndex, TierCollector, TierLoad, TierReport, TierStore, TierWork
from kvbridge.engine.request import FinishReason, Request, RequestStatus
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.scheduler import Scheduler
from kvbridge.engine.scheduler_output import ModelRunnerOutput
from kvbridge.engine.tier_file import TierFile
from kvbridge.kv_events.events import BlockRemoved, BlockStored
from kvbridge.kv_events.hashing import model_root, to_external
from kvbridge.shape.kv_groups import KVCacheKind

BS = 4


def key(i: int) -> tuple[int, bytes]:
    return (0, i.to_bytes(32, "big"))


# ---- the index -----------------------------------------------------------------------------
def test_evictions_take_free_slots_then_the_least_recently_used_entry_and_say_so_in_events():
    q = KVEventQueue()
    t = KVTierIndex(2, BS, q)
    t.evicted(7, key(1))
    t.evicted(8, key(2))
    assert t.take_work() == TierWork((TierStore(7, 0), TierStore(8, 1)))
    t.evicted(9, key(1))  # already held: the copy there stays good, key(1) becomes most recent
    assert t.take_work() is None
    t.evicted(3, key(3))  # full: key(2), the least recently used, goes
    assert t.take_work() == TierWork((TierStore(3, 1),))
    assert key(2) not in t and key(1) in t and key(3) in t and t.counters.evictions == 1
    ev = q.drain()
    assert [type(e) for e in ev] == [BlockStored, BlockStored, BlockRemoved, BlockStored]
    assert all(e.medium == MEDIUM_DISK for e in ev)
    assert ev[0].block_hashes == [to_external(key(1)[1])] and ev[0].token_ids == [] and ev[0].block_size == BS
    assert ev[2].block_hashes == [to_external(key(2)[1])]


def test_a_steps_store_queue_is_bounded_and_the_rest_is_counted_not_stored():
    t = KVTierIndex(8, BS, max_stores_per_step=2)
    for i in range(5):
        t.evicted(i, key(i))
    work = t.take_work()
    assert work is not None and len(work.stores) == 2 and t.counters.store_drops == 3
    assert len(t) == 2
    t.evicted(9, key(9))  # the next step has room again
    assert t.take_work() == TierWork((TierStore(9, 2),))


def test_lookup_counts_leading_entries_and_a_running_load_makes_others_wait():
    t = KVTierIndex(8, BS)
    for i in range(3):
        t.evicted(i, key(i))
    t.take_work()
    assert t.lookup([key(0), key(1), key(5), key(2)]) == (2, False)
    assert t.lookup([key(5), key(0)]) == (0, False)
    t.begin_load("a", [key(0), key(1)], [10, 11])
    assert t.lookup([key(0), key(1), key(2)]) == (3, True)
    assert t.take_work() == TierWork((), (TierLoad("a", (0, 1), (10, 11)),))
    assert t.finish(TierReport(loaded={"a": 2})) == {"a": 2}
    assert t.lookup([key(0), key(1), key(2)]) == (3, False) and t.counters.loaded_blocks == 2


def test_a_pinned_entry_is_never_the_slot_a_store_takes():
    t = KVTierIndex(2, BS)
    t.evicted(0, key(0))
    t.evicted(1, key(1))
    t.take_work()
    t.begin_load("a", [key(0), key(1)], [5, 6])
    t.evicted(2, key(2))  # every slot is read this step: not stored
    assert key(2) not in t and t.counters.store_drops == 1
    t.take_work()
    t.finish(TierReport(loaded={"a": 2}))
    t.evicted(2, key(2))
    assert key(2) in t


def test_a_failed_block_leaves_the_tier_and_the_load_keeps_the_blocks_before_it():
    q = KVEventQueue()
    t = KVTierIndex(4, BS, q)
    for i in range(3):
        t.evicted(i, key(i))
    t.take_work()
    q.drain()
    t.begin_load("a", [key(0), key(1), key(2)], [4, 5, 6])
    t.take_work()
    assert t.finish(TierReport(loaded={"a": 1}, bad_slots={1})) == {"a": 1}
    assert key(0) in t and key(1) not in t and key(2) in t and t.counters.failed_blocks == 1
    assert [type(e) for e in q.drain()] == [BlockRemoved]
    assert t.finish(None) == {}  # nothing loading: nothing to say


def test_a_load_nobody_reported_uses_nothing_and_drops_nothing():
    t = KVTierIndex(4, BS)
    t.evicted(0, key(0))
    t.take_work()
    t.begin_load("a", [key(0)], [3])
    assert t.finish(None) == {"a": 0} and key(0) in t


def test_ranks_reports_merge_to_what_every_rank_loaded():
    a = TierReport({"x": 3, "y": 2}, {4}, 300, 0.1, 0.01)
    b = TierReport({"x": 1, "y": 2}, {7}, 300, 0.3, 0.02)
    assert a.merge(b) == TierReport({"x": 1, "y": 2}, {4, 7}, 300, 0.3, 0.02)


@pytest.mark.parametrize("bad", [dict(num_slots=0), dict(num_slots=1, max_stores_per_step=0)])
def test_the_index_refuses_no_room(bad):
    with pytest.raises(ValueError):
        KVTierIndex(block_size=BS, **bad)


def test_begin_load_refuses_mismatched_or_repeated_loads():
    t = KVTierIndex(4, BS)
    t.evicted(0, key(0))
    with pytest.raises(ValueError):
        t.begin_load("a", [key(0)], [1, 2])
    t.begin_load("a", [key(0)], [1])
    with pytest.raises(ValueError):
        t.begin_load("a", [key(0)], [1])


def test_the_collector_exports_counters_and_fill():
    t = KVTierIndex(4, BS)
    t.evicted(0, key(0))
    names = {m.name: m.samples[0].value for m in TierCollector(t).collect()}
    assert names["kvbridge_kv_tier_stores"] == 1 and names["kvbridge_kv_tier_blocks"] == 1
    assert names["kvbridge_kv_tier_capacity_blocks"] == 4


# ---- one rank's file -----------------------------------------------------------------------
@pytest.fixture(params=[torch.float32, torch.bfloat16])
def pages(request) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 96, generator=g).to(request.param)


def test_a_stored_page_loads_back_byte_equal_into_another_block(pages, tmp_path):
    f = TierFile(pages, 4, str(tmp_path))
    assert os.listdir(tmp_path) == []  # unlinked once open: nothing outlives the process
    want = pages[2].clone()
    r = f.run(TierWork((TierStore(2, 3),)))
    pages[2].zero_()
    r = f.run(TierWork((), (TierLoad("a", (3,), (5,)),)))
    assert r.loaded == {"a": 1} and not r.bad_slots and r.load_bytes == f.page_bytes
    assert torch.equal(pages[5].view(torch.uint8), want.view(torch.uint8))
    f.close()


def test_stores_run_before_loads_in_one_step(pages, tmp_path):
    """A block handed to a new owner this step is stored before a load of the same step writes
    anything: here the load's target is the very block being stored."""
    f = TierFile(pages, 4, str(tmp_path))
    want = pages[1].clone()
    f.run(TierWork((TierStore(0, 0),)))
    r = f.run(TierWork((TierStore(1, 1),), (TierLoad("a", (0,), (1,)),)))
    assert r.loaded == {"a": 1}
    pages[1].zero_()
    assert f.run(TierWork((), (TierLoad("b", (1,), (1,)),))).loaded == {"b": 1}
    assert torch.equal(pages[1].view(torch.uint8), want.view(torch.uint8))
    f.close()


def test_a_flipped_byte_fails_that_block_and_the_load_stops_there(pages, tmp_path):
    f = TierFile(pages, 4, str(tmp_path))
    f.run(TierWork((TierStore(0, 0), TierStore(1, 1), TierStore(2, 2))))
    off = 1 * f.page_bytes + 7
    byte = os.pread(f.fd, 1, off)
    os.pwrite(f.fd, bytes([byte[0] ^ 0x10]), off)
    r = f.run(TierWork((), (TierLoad("a", (0, 1, 2), (5, 6, 7)),)))
    assert r.loaded == {"a": 1} and r.bad_slots == {1}
    f.close()


def test_a_truncated_file_or_a_slot_never_written_fails_the_read(pages, tmp_path):
    f = TierFile(pages, 4, str(tmp_path))
    f.run(TierWork((TierStore(0, 0), TierStore(1, 1))))
    os.ftruncate(f.fd, f.page_bytes + 10)  # slot 1 is cut short
    r = f.run(TierWork((), (TierLoad("a", (0, 1), (5, 6)), TierLoad("b", (3,), (7,)))))
    assert r.loaded == {"a": 1, "b": 0} and r.bad_slots == {1, 3}
    f.close()


def test_the_file_refuses_gpu_pages_and_no_slots(tmp_path):
    with pytest.raises(ValueError):
        TierFile(torch.zeros(2, 4), 0, str(tmp_path))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CPU"):
            TierFile(torch.zeros(2, 4, device="cuda"), 1, str(tmp_path))


# ---- the scheduler over a real pool and a real file ------------------------------------------
class Ranks:
    """The ranks' side of the tier: a KV tensor whose page `b` this test fills with block b's
    token ids (what a forward would write), and the tier file over it."""

    def __init__(self, num_blocks: int, tmp_path, slots: int = 16) -> None:
        self.pages = torch.zeros(num_blocks, BS)
        self.file = TierFile(self.pages, slots, str(tmp_path))

    def step(self, sched, scheduler: Scheduler) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        if sched.kv_tier is not None:
            out.kv_tier_report = self.file.run(sched.kv_tier)
        for s in sched.scheduled:  # "compute": write each token into its slot of its block
            for i, t in enumerate(s.token_ids):
                pos = s.start_pos + i
                self.pages[s.block_ids[0][pos // BS], pos % BS] = float(t)
            if s.sample:
                out.sampled_token_ids[s.request_id] = 1
        return out


def _scheduler(num_blocks: int, slots: int = 16, prefer=None):
    q = KVEventQueue()
    pool = BlockPool(num_blocks)
    kvm = KVCacheManager(pool, [KVCacheGroupSpec(KVCacheKind.FULL_ATTENTION, BS, (0,))], model_root("tier-test"), q)
    tier = KVTierIndex(slots, BS, q)
    pool.on_evicted = tier.evicted
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64), kvm, 1024, None, tier, prefer), q


def _run(s: Scheduler, ranks: Ranks, reqs: list[Request]) -> list[int]:
    """Run requests to their first token; returns the prompt tokens each step computed."""
    for r in reqs:
        s.add_request(r)
    computed = []
    while any(not r.status.is_finished for r in reqs):
        sched = s.schedule()
        computed.append(sum(len(x.token_ids) for x in sched.scheduled))
        s.update_from_output(sched, ranks.step(sched, s))
    return computed


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True), frozenset())


def test_an_evicted_prefix_is_loaded_back_not_recomputed_and_its_kv_is_the_computed_kv(tmp_path):
    s, q = _scheduler(num_blocks=6)
    ranks = Ranks(6, tmp_path)
    a = list(range(100, 117))  # 4 full blocks + 1
    _run(s, ranks, [_req("a", a)])
    # b's 5 blocks: the one never used, then a's freed tail first: its last (partial) block and its
    # full blocks 3, 2, 1 go to the tier; block 0 stays cached in the pool
    _run(s, ranks, [_req("b", list(range(200, 217)))])
    assert s.tier.counters.stores == 3
    c = _req("c", a + [7, 8, 9])
    computed = _run(s, ranks, [c])
    assert computed[0] == 0 and sum(computed) == len(c.prompt_token_ids) - 16  # the load step computes nothing
    assert c.num_cached_tokens == 16 and s.tier.counters.loaded_blocks == 3
    assert "c" not in s.requests  # finished and freed
    # the loaded blocks (b's pages before) are cached in the pool and hold the tokens a computed
    for i in range(4):
        blk = s.kvm.pool.get_cached_block((0, c.block_hashes[i]))
        assert blk is not None and ranks.pages[blk.block_id].tolist() == [float(t) for t in a[i * BS:(i + 1) * BS]]
    assert s.kvm.num_free_blocks == 6  # every block back in the pool


def test_concurrent_requests_on_one_tier_prefix_cause_one_load(tmp_path):
    s, _ = _scheduler(num_blocks=48, slots=64)
    ranks = Ranks(48, tmp_path, slots=64)
    a = list(range(100, 117))
    _run(s, ranks, [_req("a", a)])
    for i in range(10):  # 50 fresh blocks: every block of a is evicted into the tier
        _run(s, ranks, [_req(f"x{i}", list(range(300 + 20 * i, 317 + 20 * i)))])
    assert s.tier.lookup([(0, h) for h in _hashes(s, a)]) == (4, False)  # evicted into the tier
    reqs = [_req(f"c{i}", a + [i, i, i]) for i in range(32)]
    _run(s, ranks, reqs)
    assert s.tier.counters.loads == 1 and s.tier.counters.loaded_blocks == 4
    assert all(r.num_cached_tokens == 16 for r in reqs)
    assert s.kvm.num_free_blocks == 48


def test_a_corrupt_tier_block_is_recomputed_from_there(tmp_path):
    s, _ = _scheduler(num_blocks=6)
    ranks = Ranks(6, tmp_path)
    a = list(range(100, 117))
    _run(s, ranks, [_req("a", a)])
    _run(s, ranks, [_req("b", list(range(200, 217)))])
    f = ranks.file
    slot = s.tier._entries[(0, _hashes(s, a)[2])]  # the third block's entry
    os.pwrite(f.fd, b"\xff\xff", slot * f.page_bytes)
    c = _req("c", a + [1])
    computed = _run(s, ranks, [c])
    assert computed[0] == 0 and sum(computed) == len(c.prompt_token_ids) - 8  # blocks 0-1 loaded, from 2 on computed
    assert s.tier.counters.failed_blocks == 1 and s.kvm.num_free_blocks == 6
    assert c.num_cached_tokens == 8 and (0, _hashes(s, a)[2]) not in s.tier


def test_a_load_predicted_slower_than_computing_is_not_used(tmp_path):
    s, _ = _scheduler(num_blocks=6, prefer=lambda tokens: False)
    ranks = Ranks(6, tmp_path)
    a = list(range(100, 117))
    _run(s, ranks, [_req("a", a)])
    _run(s, ranks, [_req("b", list(range(200, 217)))])
    c = _req("c", a + [1])
    assert sum(_run(s, ranks, [c])) == len(c.prompt_token_ids) - BS  # all but the pool's block 0 computed
    assert s.tier.counters.skipped_slower == 1 and s.tier.counters.loads == 0


def test_a_request_parked_for_a_load_is_never_between_steps(tmp_path):
    """The load runs in the step that parks the request and its report comes back with that step:
    an abort between steps finds it queued or running, never half-loaded."""
    s, _ = _scheduler(num_blocks=6)
    ranks = Ranks(6, tmp_path)
    a = list(range(100, 117))
    _run(s, ranks, [_req("a", a)])
    _run(s, ranks, [_req("b", list(range(200, 217)))])
    s.add_request(c := _req("c", a + [1]))
    sched = s.schedule()
    assert s.tier_loading == {"c": c} and not sched.scheduled
    s.update_from_output(sched, ranks.step(sched, s))
    assert s.tier_loading == {} and c.status is RequestStatus.WAITING and s.waiting[0] is c
    s.finish_request("c", FinishReason.ABORT)
    assert s.kvm.num_free_blocks == 6


def _hashes(s: Scheduler, prompt: list[int]) -> list[bytes]:
    return s.kvm.block_hashes(_req("h", prompt))


# ---- the options ----------------------------------------------------------------------------
def test_serve_takes_vllms_offloading_size_in_gib_and_a_directory_and_up_forwards_both(tmp_path):
    from kvbridge import cli
    a = cli.build_parser().parse_args(["serve", "--kv-offloading-size", "1.5", "--kv-tier-dir", str(tmp_path)])
    cache = cli.engine_config_from_args(a).cache
    assert cache.kv_offloading_bytes == 3 << 29 and cache.kv_tier_dir == str(tmp_path)
    assert cli.engine_config_from_args(cli.build_parser().parse_args(["serve"])).cache.kv_offloading_bytes == 0
    up = cli.build_parser().parse_args(["up", "--kv-offloading-size", "2", "--kv-tier-dir", str(tmp_path)])
    forwarded = cli.forwarded_serve_args(up)
    assert forwarded[forwarded.index("--kv-offloading-size") + 1] == "2.0"
    assert forwarded[forwarded.index("--kv-tier-dir") + 1] == str(tmp_path)


def test_a_negative_size_is_refused(capsys):
    from kvbridge import cli
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--kv-offloading-size", "-1"])
    assert "kv-offloading-size" in capsys.readouterr().err
