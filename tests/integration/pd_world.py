"""The world of one P/D exploration run: a P and a D engine in this process, the fake transfer
backend between them (its real protocol: reads copy bytes only when they complete; `hold_reads`
keeps them in progress until the test lifts it), the real side channel over loopback with a gate
in D's client (SideChannelGate: holds or drops messages by kind), a manual clock for the leases
and heartbeats, and every output each engine produced, per request (Track).

D may be a TP 2 decode (ModelCase.d_tp = 2): its two ranks' transfer agents read into their own
caches (each its KV heads, as a TP 2 rank's), stepped as a TP engine steps them (commands before
the forward pass, reports after), so a read can be done on one rank and not the other; the
forward pass runs on one whole-model runner, into whose cache each rank's blocks are copied as
its read completes (TwoRanks).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig, LoadFailurePolicy, SchedulerConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.kv_connector_factory import build_connectors
from kvbridge.engine.loader import LoadedModel
from kvbridge.engine.models import kv_cache_shape
from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.fake import FakeBackend, FakeFabric
from kvbridge.kv_transfer.connector.rank_agent import RankAgent
from kvbridge.kv_transfer.side_channel.control import MSG_CHECK_READ, MSG_HEARTBEAT, MSG_READ_DONE, MSG_RELEASE
from kvbridge.kv_transfer.side_channel.handshake import HandshakeTimeout
from kvbridge.kv_transfer.params import parse_kv_transfer_params, to_wire
from kvbridge.kv_transfer.side_channel.frames import MSG_GET_METADATA
from kvbridge.shape.tp_split import rank_shard

LEASE_S = 30.0
WAIT_S = 20.0  # the longest any one wait for a step's effect may take (a bug, not a slow machine)
_ids = itertools.count()
class ManualClock:
    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


_KINDS = {MSG_GET_METADATA: "handshake", MSG_CHECK_READ: "check", MSG_HEARTBEAT: "heartbeat",
          MSG_READ_DONE: "read_done", MSG_RELEASE: "release"}


class SideChannelGate:
    """Sits in D's side-channel client (its `request`, which every message goes through):
    messages of a held kind wait on their sending thread until the kind is opened; a dropped
    kind fails as a message lost on the wire does (HandshakeTimeout, without the wait)."""

    def __init__(self, client) -> None:
        self._send = client.request
        client.request = self.request
        self._cv = threading.Condition()
        self._held: set[str] = set()
        self._dropped: set[str] = set()
        self.waiting: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()

    def request(self, host: str, port: int, msg_type: str, body: bytes, timeout: float) -> bytes:
        kind = _KINDS.get(msg_type, msg_type)
        with self._cv:
            if kind in self._dropped:
                raise HandshakeTimeout(f"side channel {host}:{port} did not answer (message dropped by the test)")
            self.waiting[kind] += 1
            self._cv.notify_all()
            self._cv.wait_for(lambda: kind not in self._held, timeout=2 * WAIT_S)
            self.waiting[kind] -= 1
            self.sent[kind] += 1
        return self._send(host, port, msg_type, body, timeout)

    def hold(self, *kinds: str) -> None:
        with self._cv:
            self._held.update(kinds)

    def drop(self, *kinds: str) -> None:
        with self._cv:
            self._dropped.update(kinds)

    def open_all(self) -> None:
        with self._cv:
            self._held.clear()
            self._dropped.clear()
            self._cv.notify_all()

    def open(self, kind: str) -> None:
        with self._cv:
            self._held.discard(kind)
            self._cv.notify_all()

    def is_waiting(self, kind: str) -> bool:
        with self._cv:
            return self.waiting[kind] > 0


@dataclass
class Track:
    """One request through P and D, and everything each engine said of it."""

    prompt: list[int]
    p_id: str
    d_id: str
    continued: bool
    p_outputs: list[RequestOutput] = field(default_factory=list)
    d_outputs: list[RequestOutput] = field(default_factory=list)
    p_aborted_at: int | None = None  # how many outputs P had emitted when the client went away
    d_aborted_at: int | None = None
    released: bool = False  # the proxy released P's blocks (no D got the request)
    params: dict | None = None
    filler: bool = False  # P only; its client leaves once P answers (the proxy releases)
    on_p: bool = False  # added to P
    on_d: bool = False  # added to D

    def __repr__(self) -> str:
        return f"Track({self.p_id}/{self.d_id}{', continued' if self.continued else ''})"

    @property
    def p_done(self) -> bool:
        return bool(self.p_outputs) and self.p_outputs[-1].finished

    @property
    def d_done(self) -> bool:
        return bool(self.d_outputs) and self.d_outputs[-1].finished

    @property
    def abandoned(self) -> bool:
        """The client went away: no answer is owed."""
        return self.p_aborted_at is not None or self.d_aborted_at is not None or self.released


@dataclass(frozen=True)
class ModelCase:
    """A model and how its engines are built: the grid's rows."""

    name: str
    model: LoadedModel
    block_size: int
    want: Callable[[list[int]], list[int]]  # the colocated engine's greedy output for a prompt
    prompt: list[int]  # long enough for several prefill chunks on P
    filler: list[int]  # another prompt (P reuses freed blocks for it)
    continued_ok: bool = True  # D may continue from P's first token (not with Mamba layers)
    p_num_blocks: int = 4  # P's pool: the prompt's blocks and one more, so the filler reuses freed ones
    d_tp: int = 1  # D's tensor parallel size (2: TwoRanks)


SAMPLING = SamplingParams(max_tokens=4, temperature=0)
P_CHUNK = 16  # P's token budget per step: the prompt takes several chunks


def build_engine(case: ModelCase, role: KVRole, fabric: FakeFabric, clock: ManualClock, num_blocks: int,
                 max_num_batched_tokens: int = 2048) -> LLMEngine:
    engine_id = f"{role.value}-{next(_ids)}"
    kv = KVTransferConfig(role=role, backend="fake", engine_id=engine_id, lease_seconds=LEASE_S,
                          load_failure_policy=LoadFailurePolicy.RECOMPUTE, handshake_timeout_s=WAIT_S / 2,
                          transfer_timeout_s=LEASE_S * 10)
    config = EngineConfig(model=case.model.source, kv_transfer=kv, num_threads=1,
                          cache=CacheConfig(block_size=case.block_size, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens))
    agent = fabric.create_agent(engine_id)
    return LLMEngine(config, case.model, build_connectors(config, case.model.arch, case.model.name, agent, clock))


class World:
    """P, D, the fabric, the gate and the clock of one exploration run."""

    def __init__(self, case: ModelCase, d_num_blocks: int = 24) -> None:
        self.case = case
        self.fabric = FakeFabric()
        self.clock = ManualClock()
        self.p = build_engine(case, KVRole.PRODUCER, self.fabric, self.clock, case.p_num_blocks, P_CHUNK)
        self.d = build_engine(case, KVRole.CONSUMER, self.fabric, self.clock, d_num_blocks)
        self.ranks = TwoRanks.install(self.d, self.fabric) if case.d_tp == 2 else None
        self.gate = SideChannelGate(self.d.connectors.worker.receiving._side_client)
        self.p_alive = True
        self.tracks: list[Track] = []
        self.errors: list[str] = []
        self.expiry_expected = False
        self.faulted = False  # an event made a transfer fail (D may recompute)

    # ---- the two engines' steps, recorded ------------------------------------------------
    def _by_id(self) -> tuple[dict[str, Track], dict[str, Track]]:
        return {t.p_id: t for t in self.tracks}, {t.d_id: t for t in self.tracks}

    def step_p(self) -> None:
        if not self.p_alive:
            return
        by_p, _ = self._by_id()
        for out in self.p.step().outputs:
            track = by_p.get(out.request_id)
            if track is not None:
                track.p_outputs.append(out)
                if out.finished and out.kv_transfer_params is not None:
                    track.params = to_wire(out.kv_transfer_params)  # as P's HTTP answer carries them
                    if track.filler:
                        track.released = True
                        self.p.release_kv(parse_kv_transfer_params(track.params))

    def step_d(self) -> None:
        _, by_d = self._by_id()
        for out in self.d.step().outputs:
            track = by_d.get(out.request_id)
            if track is not None:
                track.d_outputs.append(out)

    def step_both(self) -> None:
        self.step_d()
        self.step_p()

    def until(self, done: Callable[[], bool], what: str, step: Callable[[], None] | None = None) -> None:
        """Step until `done`; a bounded wait (the engines' own loop), never a sleep."""
        step = step or self.step_both
        deadline = time.monotonic() + WAIT_S
        while not done() and time.monotonic() < deadline:
            step()
        if not done():
            raise AssertionError(f"gave up waiting for: {what}")

    # ---- a request ------------------------------------------------------------------
    def new_track(self, prompt: list[int], continued: bool) -> Track:
        n = next(_ids)
        track = Track(prompt, f"p{n}", f"d{n}", continued)
        self.tracks.append(track)
        return track

    def add_to_p(self, track: Track) -> None:
        track.on_p = True
        self.p.add_request(track.p_id, track.prompt, SamplingParams(max_tokens=1, temperature=0),
                           parse_kv_transfer_params({"do_remote_decode": True}))

    def add_to_d(self, track: Track) -> None:
        track.on_d = True
        params = dict(track.params or {})
        generated = params.pop("generated_token_ids", [])
        continued = generated[:1] if track.continued else []
        self.d.add_request(track.d_id, track.prompt, SAMPLING, parse_kv_transfer_params(params), continued)

    def d_request(self, track: Track):
        return self.d.scheduler.requests.get(track.d_id)

    def d_live_reads(self) -> int:
        return sum(len(recv.reads) for recv in self.d.connectors.worker.receiving._recvs.values())

    def p_agent(self) -> FakeBackend:
        return self.p.connectors.worker.local_agent.backend

    def d_agents(self) -> list[FakeBackend]:
        """The transfer agents D reads with: its own, or its two ranks'."""
        if self.ranks is not None:
            return [a.backend for a in self.ranks.agents]
        return [self.d.connectors.worker.local_agent.backend]

    def hold_reads(self, held: bool, ranks: slice = slice(None)) -> None:
        """Reads on these D agents stay in progress (True) or may complete (other faults stay)."""
        for agent in self.d_agents()[ranks]:
            agent.set_faults(dataclasses.replace(agent.faults, hold_reads=held))

    def rank_read_settled(self, rank: int) -> bool:
        return any(r.local_rank == rank and r.result is not None
                   for recv in self.d.connectors.worker.receiving._recvs.values() for r in recv.reads.values())

    # ---- finishing ------------------------------------------------------------------
    def settle(self) -> None:
        """Open every gate, lift the holds, and step until nothing is left to do."""
        self.gate.open_all()
        self.lift_read_hold()
        engines = [self.d] + ([self.p] if self.p_alive else [])
        self.until(lambda: not any(e.has_pending_work() for e in engines) and not self._side_requests_pending(),
                   "both engines idle")

    def lift_read_hold(self) -> None:
        self.hold_reads(False)

    def _side_requests_pending(self) -> bool:
        return bool(self.d.connectors.worker.receiving._side_requests) or self.gate.is_waiting("read_done")

    def shutdown(self) -> None:
        self.gate.open_all()
        self.d.shutdown()
        if self.ranks is not None:
            self.ranks.shutdown()
        if self.p_alive:
            self.p.shutdown()

    def kill_p(self) -> None:
        """P's process dies: its agent stops serving reads and its side channel is gone."""
        self.fabric.kill(self.p_agent().agent_name)
        self.p.shutdown()
        self.p_alive = False


class TwoRanks:
    """D's runner at TP 2 in this process: rank r's agent reads into its own cache (its KV heads,
    shaped as a TP 2 rank's), applying its commands before the forward pass and reporting after,
    as a rank process does; the forward pass runs on the whole-model runner, and a rank's read,
    once complete, is copied into that runner's cache (the heads the rank holds, the blocks the
    read wrote)."""

    def __init__(self, compute, agents: list[RankAgent], caches: list[torch.Tensor], heads: list[range]) -> None:
        self.compute, self.agents, self.caches, self.heads = compute, agents, caches, heads
        self._reads: dict[str, tuple[int, tuple]] = {}  # xfer id -> (rank, local descs)

    @classmethod
    def install(cls, engine: LLMEngine, fabric: FakeFabric) -> "TwoRanks":
        worker = engine.connectors.worker
        compute = engine.runner
        compute.agent = None  # the whole-model runner only computes
        arch, layout = compute.arch, compute.layout
        agents, caches, heads, regs = [], [], [], []
        for r in range(2):
            shard = rank_shard(arch.num_heads, arch.cache_kv_heads, 2, r)
            cache = torch.zeros(kv_cache_shape(arch, compute.kv_cache.shape[0], compute.kernel_block_size,
                                               shard.num_kv_heads), dtype=compute.kv_cache.dtype)
            agent = RankAgent(fabric.create_agent(f"{worker.engine_id}-tp{r}"), False, worker.config.transfer_timeout_s)
            regs.append(agent.register(cache, compute.kernel_block_size, r, 2, shard.kv_heads,
                                       blocks_per_logical=layout.blocks_per_logical))
            agents.append(agent)
            caches.append(cache)
            heads.append(shard.kv_heads)
        worker.receiving._handshakes.close()  # register_ranks makes D's handshakes anew, for the two ranks
        worker.register_ranks(regs)
        ranks = cls(compute, agents, caches, heads)
        engine.runner = ranks
        return ranks

    def execute(self, sched):
        commands = sched.kv_rank_commands or [None, None]
        for r, (agent, cmds) in enumerate(zip(self.agents, commands)):
            for op in (cmds.reads if cmds is not None else ()):
                self._reads[op.xfer_id] = (r, op.local)
            agent.apply(cmds)
        sched.kv_rank_commands = None
        out = self.compute.execute(sched)
        out.kv_rank_reports = [agent.poll() for agent in self.agents]
        for report in out.kv_rank_reports:
            for result in report.settled:
                rank, descs = self._reads.pop(result.xfer_id, (None, ()))
                if rank is not None and result.ok:
                    self._copy_in(rank, descs)
        return out

    def _copy_in(self, rank: int, descs) -> None:
        cache = self.caches[rank]
        base, block_bytes = cache.data_ptr(), cache[0].numel() * cache.element_size()
        blocks = {b for addr, n in descs for b in range((addr - base) // block_bytes,
                                                        (addr + n - 1 - base) // block_bytes + 1)}
        h = self.heads[rank]
        for b in blocks:
            self.compute.kv_cache[b, h.start:h.stop] = cache[b]

    def failure(self):
        return None

    def shutdown(self) -> None:
        for agent in self.agents:
            agent.shutdown()
