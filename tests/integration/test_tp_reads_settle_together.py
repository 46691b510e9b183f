"""A D of TP 3 reading from a P of TP 1 (SmolLM2: 3 KV heads, one per D rank): the worker
connector's control plane with three in-process RankAgents on the fake fabric, stepped as a
TP 3 engine steps them (commands before the ranks run, their reports after), against a real
P engine and its real side channel.

- Every D rank ends up with exactly its heads of P's blocks; P frees on the one read-done.
- Seed 000's race: a read that fails while another is still in flight fails the request only
  after that other read has settled; only then are the handles released; P is told to free.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig
from kvbridge.engine.loader import load_model
from kvbridge.engine.models import kv_cache_shape
from kvbridge.engine.tp import rank_shard
from kvbridge.kv_transfer.backends.fake import FakeFabric, FaultConfig
from kvbridge.kv_transfer.connector.factory import compatibility_of
from kvbridge.kv_transfer.connector.metadata import ConnectorMetadata, RecvSpec, RemoteEngine
from kvbridge.kv_transfer.connector.rank_agent import RankAgent, RankReport
from kvbridge.kv_transfer.connector.worker_side import KVBridgeWorkerConnector
from kvbridge.kv_transfer.failure import FailureHandler
from kvbridge.kv_transfer.lease import LeaseTable, content_digest
from kvbridge.kv_transfer.stats import KVTransferStats
from tests.integration.pd_harness import make_engine, prefill, settle

TP = 3
BLOCK_SIZE, NUM_BLOCKS = 16, 32
WAIT_S = 30.0


@pytest.fixture(scope="module")
def loaded():
    return load_model("SmolLM2-135M-Instruct")


class DecodeRanks:
    """D's control plane and its TP ranks' agents in one process (no model: only KV moves)."""

    def __init__(self, loaded, fabric: FakeFabric, faults: list[FaultConfig]) -> None:
        arch = loaded.arch
        kv = KVTransferConfig(role=KVRole.CONSUMER, backend="fake", engine_id="d-tp3", handshake_timeout_s=10.0)
        config = EngineConfig(cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS), kv_transfer=kv,
                              tensor_parallel_size=TP)
        self.stats = KVTransferStats()
        self.conn = KVBridgeWorkerConnector(kv, "d-tp3", None, compatibility_of(config, arch, loaded.name),
                                            LeaseTable(30.0), FailureHandler(self.stats), self.stats, None, True)
        self.agents = [RankAgent(fabric.create_agent(f"d-tp3-tp{r}", faults[r]), serves_reads=False)
                       for r in range(TP)]
        self.shards = [rank_shard(arch.num_heads, arch.num_kv_heads, TP, r) for r in range(TP)]
        self.caches = [torch.zeros(kv_cache_shape(arch, NUM_BLOCKS, BLOCK_SIZE, s.num_kv_heads)) for s in self.shards]
        self.conn.register_ranks([a.register(c, BLOCK_SIZE, r, TP, s.kv_heads)
                                  for r, (a, c, s) in enumerate(zip(self.agents, self.caches, self.shards))])
        self.log: list[tuple[int, str]] = []  # (step, event) in order

    def step(self, n: int, metadata: ConnectorMetadata | None = None):
        commands = self.conn.start_load_kv(metadata) or [None] * TP  # None: no rank has anything to do
        for rank, (agent, cmds) in enumerate(zip(self.agents, commands)):
            self.log += [(n, f"rank {rank} releases")] * (len(cmds.release) if cmds is not None else 0)
            agent.apply(cmds)
        reports: list[RankReport] = [a.poll() for a in self.agents]
        for report in reports:
            self.log += [(n, f"rank {report.tp_rank} {'done' if r.ok else 'error'}") for r in report.settled]
        out = self.conn.get_finished(reports)
        self.log += [(n, f"failed {rid}") for rid in out.failed_recving]
        self.log += [(n, f"finished {rid}") for rid in out.finished_recving - out.failed_recving]
        return out

    def close(self) -> None:
        self.conn.shutdown()
        for agent in self.agents:
            agent.shutdown()


def recv_spec(p, prompt: list[int], params: dict, local_ids: list[int]) -> RecvSpec:
    remote = RemoteEngine(params["remote_engine_id"], params["remote_host"], int(params["remote_port"]))
    return RecvSpec("d-req", remote, params["remote_request_id"], params["lease_generation"], (local_ids,),
                    (list(params["remote_block_ids"]),), content_digest(prompt))


def run(p, d: DecodeRanks, spec: RecvSpec):
    """Step D (and P, which frees on read-done) until the request settles; returns D's output."""
    out, n = d.step(0, ConnectorMetadata(reqs_to_recv=[spec])), 0
    deadline = time.monotonic() + WAIT_S
    while spec.request_id not in out.finished_recving:
        assert time.monotonic() < deadline, f"the request never settled: {d.log}"
        n += 1
        p.step()
        out = d.step(n)
    for k in range(n + 1, n + 3):  # the settled reads' handles are released with the next commands
        d.step(k)
    return out


@pytest.fixture
def prompt(loaded):
    return loaded.tokenizer.encode("Tensor parallel decode reads every head from the one prefill rank. " * 3)


def test_each_d_rank_reads_exactly_its_heads_and_p_frees_on_the_one_read_done(loaded, prompt):
    fabric = FakeFabric()
    p = make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("p-tp1"), block_size=BLOCK_SIZE)
    d = DecodeRanks(loaded, fabric, [FaultConfig()] * TP)
    try:
        params = prefill(p, prompt)
        r_ids = list(params["remote_block_ids"])
        local_ids = [NUM_BLOCKS - 1 - i for i in range(len(r_ids))]  # anywhere in D's cache
        out = run(p, d, recv_spec(p, prompt, params, local_ids))
        assert not out.failed_recving
        p_kv = p.runner.kv_cache  # [blocks, 3 heads, layers, 2, block_size, head_dim]
        for shard, cache in zip(d.shards, d.caches):
            want = p_kv[r_ids][:, shard.kv_heads.start:shard.kv_heads.stop]
            assert torch.equal(cache[local_ids], want)
            others = [b for b in range(NUM_BLOCKS) if b not in local_ids]
            assert not cache[others].any()  # nothing else written
        settle(p)
        assert p.metrics().num_held_for_remote == 0 and p.connectors[1].stats.expired_leases == 0
        assert d.stats.transfers == 1 and all(a.num_live_reads == 0 for a in d.agents)
    finally:
        d.close()
        p.shutdown()


@pytest.mark.parametrize("fault", [FaultConfig(error_state=True), FaultConfig(fail_read_setup=True),
                                   FaultConfig(fail_add_remote_agent=True)])
def test_a_failed_read_fails_the_request_only_after_the_other_reads_settle(loaded, prompt, fault):
    fabric = FakeFabric()
    p = make_engine(loaded, KVRole.PRODUCER, fabric.create_agent("p-tp1"), block_size=BLOCK_SIZE)
    slow = FaultConfig(delay_polls=6)  # rank 2's read is still in flight for six polls after rank 0's failed
    d = DecodeRanks(loaded, fabric, [fault, FaultConfig(), slow])
    try:
        params = prefill(p, prompt)
        out = run(p, d, recv_spec(p, prompt, params, list(range(len(params["remote_block_ids"])))))
        assert out.failed_recving == {"d-req"}
        events = [e for _, e in d.log]
        steps = {e: n for n, e in reversed(d.log)}  # first step of each event
        assert {"rank 0 error", "rank 1 done", "rank 2 done", "failed d-req"} <= set(events)
        assert steps["rank 0 error"] < steps["rank 2 done"] <= steps["failed d-req"]  # seed 000's order
        assert events.index("rank 2 done") < events.index("failed d-req")
        releases = [n for n, e in d.log if e.endswith("releases")]
        assert len(releases) == 3 and min(releases) > steps["failed d-req"]  # handles kept until settled
        assert all(a.num_live_reads == 0 for a in d.agents)
        assert "D rank 0 from P rank 0; 1 of 3 reads failed" in out.failure_causes["d-req"]
        settle(p)
        assert p.metrics().num_held_for_remote == 0 and p.connectors[1].stats.expired_leases == 0
        assert p.connectors[1].stats.early_releases == 1  # P granted the read: D told it to free at once
        d.agents[0].backend.set_faults(FaultConfig())  # the fault clears: the next request reads cleanly
        d.agents[2].backend.set_faults(FaultConfig())
        params = prefill(p, prompt)
        out = run(p, d, recv_spec(p, prompt, params, list(range(len(params["remote_block_ids"])))))
        assert out.finished_recving == {"d-req"} and not out.failed_recving
        settle(p)
        assert p.metrics().num_held_for_remote == 0 and d.stats.transfers == 1
    finally:
        d.close()
        p.shutdown()
