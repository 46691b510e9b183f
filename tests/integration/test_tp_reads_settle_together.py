"""A D of TP 3 reading from a P of TP 1 (SmolLM2: 3 KV heads, one per D rank): the worker
connector's control plane with three in-process RankAgents on the fake fabric, stepped as a
TP 3 engine steps them (commands before the ranks run, their reports after), against a real
P engine and its real side channel.

- Every D rank ends up with exactly its heads of P's blocks; P frees on the one read-done.
- Seed 000's race: a read that fails while another is still in flight fails the request only
  after that other read has settled; only then are the handles released; P is told to free.

MLA (issue 9, seed 003): a prefill engine of TP 1, 2 or 4 whose ranks each hold the whole latent
(one replicated KV "head"), built from the real producer half of the worker connector (its
side channel, control server and lease table) and in-process RankAgents (real NIXL or tcp
agents, or the fake fabric's for injected faults); D of TP 1 or 2.
- Each D rank reads one copy of the latent from one P rank (the plan's), D's request id is not
  P's, and the one read-done, keyed by P's request id, ends P's lease for every rank.
- The read from the chosen P rank fails: the request fails after every read settled (the
  scheduler then applies the load-failure policy to its invalid blocks), P is released at once
  for every rank (not left to the lease), and the next request reads cleanly.
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig
from kvbridge.engine.kv_connector_factory import compatibility_of
from kvbridge.engine.loader import load_model
from kvbridge.engine.models import kv_cache_shape
from kvbridge.kv_transfer.backends import create_backend
from kvbridge.kv_transfer.backends.fake import FakeFabric, FaultConfig
from kvbridge.kv_transfer.connector.metadata import ConnectorMetadata, RecvSpec, RemoteEngine
from kvbridge.kv_transfer.connector.rank_agent import RankAgent, RankReport
from kvbridge.kv_transfer.connector.worker_side import KVBridgeWorkerConnector
from kvbridge.kv_transfer.failure import FailureHandler, FailureKind
from kvbridge.kv_transfer.side_channel.handshake import CompatibilityInfo
from kvbridge.kv_transfer.lease import LeaseTable, content_digest
from kvbridge.kv_transfer.side_channel.server import SideChannelServer
from kvbridge.kv_transfer.stats import KVTransferStats
from kvbridge.kv_transfer.read_plan.tp_mapping import RankKV, plan_request_reads, request_salt
from kvbridge.shape.model_config import MLAConfig, ModelArchConfig, ModelFamily
from kvbridge.shape.tp_split import rank_shard
from tests.integration.pd_harness import make_engine, prefill, settle

TP = 3
BLOCK_SIZE, NUM_BLOCKS = 16, 32
WAIT_S = 30.0


@pytest.fixture(scope="module")
def loaded():
    return load_model("SmolLM2-135M-Instruct")


class DecodeRanks:
    """D's control plane and its TP ranks' agents in one process (no model: only KV moves):
    rank r registers `caches[r]`, holding KV heads `kv_heads[r]`."""

    def __init__(self, fabric: FakeFabric, faults: list[FaultConfig], compat: CompatibilityInfo,
                 caches: list[torch.Tensor], kv_heads: list[range], engine_id: str = "d-tp3",
                 backend: str = "fake") -> None:
        kv = KVTransferConfig(role=KVRole.CONSUMER, backend=backend, engine_id=engine_id, handshake_timeout_s=10.0)
        self.tp = len(caches)
        self.stats = KVTransferStats()
        self.conn = KVBridgeWorkerConnector(kv, engine_id, None, compat, LeaseTable(30.0), FailureHandler(self.stats),
                                            self.stats, None, True)
        self.agents = [RankAgent(new_agent(backend, f"{engine_id}-tp{r}", fabric, faults[r]), serves_reads=False)
                       for r in range(self.tp)]
        self.caches = caches
        self.conn.register_ranks([a.register(c, BLOCK_SIZE, r, self.tp, h)
                                  for r, (a, c, h) in enumerate(zip(self.agents, caches, kv_heads))])
        self.log: list[tuple[int, str]] = []  # (step, event) in order
        self.reads: list[tuple[int, int, int]] = []  # every read started: (D rank, P rank, bytes)

    @classmethod
    def smollm2(cls, loaded, fabric: FakeFabric, faults: list[FaultConfig]) -> "DecodeRanks":
        arch = loaded.arch
        config = EngineConfig(cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS), tensor_parallel_size=TP)
        shards = [rank_shard(arch.num_heads, arch.num_kv_heads, TP, r) for r in range(TP)]
        caches = [torch.zeros(kv_cache_shape(arch, NUM_BLOCKS, BLOCK_SIZE, s.num_kv_heads)) for s in shards]
        d = cls(fabric, faults, compatibility_of(config, arch, loaded.name), caches, [s.kv_heads for s in shards])
        d.shards = shards
        return d

    def step(self, n: int, metadata: ConnectorMetadata | None = None):
        commands = self.conn.start_load_kv(metadata) or [None] * self.tp  # None: no rank has anything to do
        for rank, (agent, cmds) in enumerate(zip(self.agents, commands)):
            self.log += [(n, f"rank {rank} releases")] * (len(cmds.release) if cmds is not None else 0)
            self.reads += [(rank, int(op.peer.rsplit("/tp", 1)[1]), sum(ln for _, ln in op.local))
                           for op in (cmds.reads if cmds is not None else ())]
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


def new_agent(backend: str, name: str, fabric: FakeFabric, faults: FaultConfig | None = None):
    """A rank's transfer agent: the fake one (fault knobs), or a real tcp / NIXL agent (UCX on lo)."""
    if backend == "fake":
        return fabric.create_agent(name, faults)
    assert faults is None or faults == FaultConfig(), "faults are injected on the fake backend only"
    if backend == "nixl":
        pytest.importorskip("nixl._api")
    return create_backend(backend, f"{name}-{uuid.uuid4().hex[:8]}")  # NIXL agents in one process: distinct names


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
    d = DecodeRanks.smollm2(loaded, fabric, [FaultConfig()] * TP)
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
        assert p.metrics().num_held_for_remote == 0 and p.connectors.worker.stats.expired_leases == 0
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
    d = DecodeRanks.smollm2(loaded, fabric, [fault, FaultConfig(), slow])
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
        assert p.metrics().num_held_for_remote == 0 and p.connectors.worker.stats.expired_leases == 0
        assert p.connectors.worker.stats.early_releases == 1  # P granted the read: D told it to free at once
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


# ---- MLA: one latent per token, replicated on every rank ---------------------------------------

MLA_ARCH = ModelArchConfig(ModelFamily.DEEPSEEK_V2, vocab_size=64, hidden_size=64, intermediate_size=128,
                           num_layers=2, num_heads=4, num_kv_heads=4, head_dim=24,
                           mla=MLAConfig(kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                                         qk_rope_head_dim=8, v_head_dim=16))
MLA_COMPAT = compatibility_of(EngineConfig(), MLA_ARCH, "tiny-deepseek-v2")
# An MLA rank's cache: [blocks, 1 (the latent, one "head"), layers, 1 (no separate V), block_size, 32 + 8].
MLA_SHAPE = (NUM_BLOCKS, MLA_ARCH.cache_kv_heads, MLA_ARCH.num_layers, MLA_ARCH.cache_entries, BLOCK_SIZE,
             MLA_ARCH.cache_head_size)
MLA_BLOCK_BYTES = 4 * MLA_SHAPE[1] * MLA_SHAPE[2] * MLA_SHAPE[3] * MLA_SHAPE[4] * MLA_SHAPE[5]
D_RID, P_RID = "decode-req-AAAA", "prefill-req-BBBB"  # seed 003's ids: D's and P's differ
LATENT = torch.randn(MLA_SHAPE, generator=torch.Generator().manual_seed(3))  # the prompt's latent KV


class MLAPrefillRanks:
    """A prefill engine's KV side without its model: the real producer half of the worker
    connector (side channel, control server, leases) and one RankAgent per rank, each rank
    holding the same latent, as an MLA engine's ranks do."""

    def __init__(self, fabric: FakeFabric, tp: int, backend: str = "fake") -> None:
        self.kv = KVTransferConfig(role=KVRole.PRODUCER, backend=backend, engine_id="p-mla", lease_seconds=30.0)
        self.stats = KVTransferStats()
        self.leases = LeaseTable(30.0, stats=self.stats)
        self.stats.held_blocks = self.leases.held_blocks
        self.side_channel = SideChannelServer({}, "127.0.0.1", 0).start()
        self.conn = KVBridgeWorkerConnector(self.kv, "p-mla", None, MLA_COMPAT, self.leases,
                                            FailureHandler(self.stats), self.stats, self.side_channel, True)
        self.agents = [RankAgent(new_agent(backend, f"p-mla-tp{r}", fabric), serves_reads=True) for r in range(tp)]
        self.caches = [LATENT.clone() for _ in range(tp)]  # replicated: every rank holds all of it
        self.conn.register_ranks([a.register(c, BLOCK_SIZE, r, tp, range(0, 1))
                                  for r, (a, c) in enumerate(zip(self.agents, self.caches))])
        self.freed: list[str] = []  # request ids whose blocks P's engine would free, in order

    def grant(self, request_id: str, block_ids: list[int], prompt: list[int]) -> dict:
        """A finished prefill: hold `block_ids` for a reader; the kv_transfer_params P answers with."""
        generation = self.leases.new_generation()
        self.leases.grant(request_id, (block_ids,), generation, content_digest(prompt))
        return {"remote_engine_id": "p-mla", "remote_host": "127.0.0.1", "remote_port": self.side_channel.port,
                "remote_request_id": request_id, "lease_generation": generation, "remote_block_ids": block_ids}

    def step(self) -> None:
        for agent in self.agents:
            agent.apply(None)
            assert agent.poll().backend_error is None
        self.freed += sorted(self.conn.get_finished().finished_sending)

    def settle(self) -> None:
        """Step until the lease of every granted request has ended (D's notice arrived)."""
        deadline = time.monotonic() + WAIT_S
        while len(self.leases):
            assert time.monotonic() < deadline, "P's lease never ended"
            self.step()
        self.step()

    def close(self) -> None:
        self.conn.shutdown()
        for agent in self.agents:
            agent.shutdown()


def mla_decode(fabric: FakeFabric, tp: int, faults: list[FaultConfig] | None = None,
               backend: str = "fake") -> DecodeRanks:
    return DecodeRanks(fabric, faults or [FaultConfig()] * tp, MLA_COMPAT, [torch.zeros(MLA_SHAPE) for _ in range(tp)],
                       [range(0, 1)] * tp, engine_id=f"d-mla-tp{tp}", backend=backend)


def mla_spec(params: dict, prompt: list[int], local_ids: list[int], request_id: str = D_RID) -> RecvSpec:
    remote = RemoteEngine(params["remote_engine_id"], params["remote_host"], int(params["remote_port"]))
    return RecvSpec(request_id, remote, params["remote_request_id"], params["lease_generation"], (local_ids,),
                    (list(params["remote_block_ids"]),), content_digest(prompt))


def chosen_p_ranks(d_tp: int, p_tp: int, p_request_id: str) -> list[int]:
    """The P rank each D rank reads the latent from (one each), as the plan picks them."""
    plan = plan_request_reads([RankKV(r, range(0, 1), MLA_BLOCK_BYTES) for r in range(d_tp)],
                              [RankKV(r, range(0, 1), MLA_BLOCK_BYTES) for r in range(p_tp)],
                              request_salt(p_request_id), p_request_id, 0)
    return [rp.remote_ranks[0] for rp in plan.ranks]


MLA_PROMPT = list(range(1, 3 * BLOCK_SIZE + 5))  # four blocks, the last one partial
P_BLOCKS, D_BLOCKS = [7, 3, 12, 20], [30, 2, 9, 10]


@pytest.mark.parametrize("backend", ["fake", "tcp", "nixl"])
@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (2, 2), (4, 1), (1, 2)], ids=lambda v: str(v))
def test_mla_each_d_rank_reads_one_copy_of_the_latent_and_one_read_done_frees_every_p_rank(p_tp, d_tp, backend):
    fabric = FakeFabric()
    p, d = MLAPrefillRanks(fabric, p_tp, backend), mla_decode(fabric, d_tp, backend=backend)
    try:
        params = p.grant(P_RID, P_BLOCKS, MLA_PROMPT)
        out = run(p, d, mla_spec(params, MLA_PROMPT, D_BLOCKS))
        assert out.finished_recving == {D_RID} and not out.failed_recving
        # Each D rank read the latent once, from the one P rank the plan chose for it.
        chosen = chosen_p_ranks(d_tp, p_tp, P_RID)
        assert sorted(d.reads) == sorted((r, chosen[r], len(P_BLOCKS) * MLA_BLOCK_BYTES) for r in range(d_tp))
        assert d.stats.bytes == d_tp * len(P_BLOCKS) * MLA_BLOCK_BYTES  # one copy per D rank, not P TP copies
        for cache in d.caches:
            assert torch.equal(cache[D_BLOCKS], LATENT[P_BLOCKS])
            assert not cache[[b for b in range(NUM_BLOCKS) if b not in D_BLOCKS]].any()
        # P: the read-done named P's request id, so the lease ended for every rank, read or not.
        p.settle()
        assert p.freed == [P_RID] and D_RID not in p.freed
        assert p.stats.held_blocks() == 0 and p.stats.expired_leases == 0 and p.stats.early_releases == 0
        assert all(a.num_live_reads == 0 for a in d.agents)
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("fault", [FaultConfig(error_state=True), FaultConfig(fail_read_setup=True)],
                         ids=["error_state", "fail_read_setup"])
@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (2, 2), (4, 1)], ids=lambda v: str(v))
def test_mla_a_failed_read_from_the_chosen_p_rank_releases_every_p_rank_at_once(p_tp, d_tp, fault):
    fabric = FakeFabric()
    p = MLAPrefillRanks(fabric, p_tp)
    # D rank 0's read, from the P rank the plan chose for it, fails; D rank 1's (if any) is slow.
    d = mla_decode(fabric, d_tp, [fault] + [FaultConfig(delay_polls=4)] * (d_tp - 1))
    try:
        params = p.grant(P_RID, P_BLOCKS, MLA_PROMPT)
        out = run(p, d, mla_spec(params, MLA_PROMPT, D_BLOCKS))
        # D: the request failed (after every read settled) with all its blocks invalid: the
        # scheduler's load-failure policy recomputes them or fails the request.
        assert out.failed_recving == {D_RID} and out.invalid_block_ids == set(D_BLOCKS)
        chosen = chosen_p_ranks(d_tp, p_tp, P_RID)
        assert f"D rank 0 from P rank {chosen[0]}; 1 of {d_tp} reads failed" in out.failure_causes[D_RID]
        kind = FailureKind.TRANSFER_STATE if fault.error_state else FailureKind.TRANSFER_SETUP
        assert dict(d.stats.failed_transfers) == {kind.value: 1} and d.stats.transfers == 0
        events = [e for _, e in d.log]
        if d_tp == 2:  # seed 000: the failure waits for the other rank's read
            assert events.index("rank 1 done") < events.index(f"failed {D_RID}")
        # P: D's one release, keyed by P's request id, freed every rank's copy at once.
        p.settle()
        assert p.freed == [P_RID]
        assert p.stats.early_releases == 1 and p.stats.expired_leases == 0 and p.stats.held_blocks() == 0
        assert all(a.num_live_reads == 0 for a in d.agents)
        # Both engines live on: with the fault gone the next request reads cleanly and frees P.
        d.agents[0].backend.set_faults(FaultConfig())
        params = p.grant("prefill-req-CCCC", P_BLOCKS, MLA_PROMPT)
        out = run(p, d, mla_spec(params, MLA_PROMPT, D_BLOCKS, request_id="decode-req-DDDD"))
        assert out.finished_recving == {"decode-req-DDDD"} and not out.failed_recving
        assert all(torch.equal(c[D_BLOCKS], LATENT[P_BLOCKS]) for c in d.caches)
        p.settle()
        assert p.freed == [P_RID, "prefill-req-CCCC"] and p.stats.expired_leases == 0 and p.stats.early_releases == 1
    finally:
        d.close()
        p.close()


def test_mla_d_asks_p_to_watch_a_read_from_a_p_rank_it_has_not_read_from_yet():
    """The first read between a D rank's agent and a P rank's completes only once P's agent has
    progressed (UCX wire-up), so D's check_read asks P to step promptly ("connect") for it. D
    TP 1 reads the replicated latent from the one P rank the plan picks per request: a request
    whose pick is a P rank D has already read from is not watched, one whose pick is new is."""
    fabric = FakeFabric()
    p, d = MLAPrefillRanks(fabric, 2), mla_decode(fabric, 1)
    asked: list[bool] = []
    check_read = p.leases.check_read

    def recording_check_read(*args, watch: bool = True, **kwargs):
        asked.append(watch)
        return check_read(*args, watch=watch, **kwargs)
    p.leases.check_read = recording_check_read
    by_rank: dict[int, list[str]] = {0: [], 1: []}  # P request ids whose plan picks P rank 0 / 1
    for n in range(64):
        rid = f"prefill-req-{n}"
        by_rank[chosen_p_ranks(1, 2, rid)[0]].append(rid)
    first = chosen_p_ranks(1, 2, "prefill-req-0")[0]
    order = [by_rank[first][0], by_rank[first][1], by_rank[1 - first][0], by_rank[1 - first][1], by_rank[first][2]]
    try:
        for n, p_rid in enumerate(order):
            params = p.grant(p_rid, P_BLOCKS, MLA_PROMPT)
            out = run(p, d, mla_spec(params, MLA_PROMPT, D_BLOCKS, request_id=f"d-req-{n}"))
            assert out.finished_recving == {f"d-req-{n}"} and not out.failed_recving
            p.settle()
        assert [r for _, r, _ in d.reads] == [first, first, 1 - first, 1 - first, first]
        assert asked == [True, False, True, False, False]
        assert p.stats.held_blocks() == 0 and p.stats.expired_leases == 0
    finally:
        p.leases.check_read = check_read
        d.close()
        p.close()
