"""Drive one P/D request's life step by step and inject an event at any phase boundary.

A P engine and a D engine in this process, on a small synthetic model, connected by the fake
transfer backend (its real protocol: reads copy bytes only when they complete) and the real
side channel over loopback. What the test controls:
- D's side-channel messages (handshake fetches, check_read, heartbeats) pass through a gate
  that can hold them on the thread that sends them, or drop them as a lost message;
- D's reads stay in progress while the fake agent's `hold_reads` is set;
- the leases' and heartbeats' clock is a manual one.
D may be a TP 2 decode (`d_tp=2`): its two ranks' transfer agents read into their own caches
(each its KV heads, as a TP 2 rank's), stepped as a TP engine steps them (commands before the
forward pass, reports after), so a read can be done on one rank and not the other; the forward
pass runs on one whole-model runner, into whose cache each rank's blocks are copied as its read
completes (TwoRanks).

`explore(world_factory, phase, event)` runs the request's happy path until `phase`, injects
`event`, lets everything run to the end (gates open, holds lifted) and returns the
invariants that were broken (an empty list when none):
- no engine raised;
- every block is back in its pool on P (when P is alive) and on D, and P holds no lease;
- no lease expired unless the event made it expire (D "vanished" from P's view);
- a request's outputs end with exactly one finished output, and after an abort at most one
  more output comes, the finished ABORT one;
- every request not aborted answers exactly the colocated engine's greedy tokens.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig, LoadFailurePolicy, SchedulerConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import LoadedModel
from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.request import FinishReason, RequestStatus
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.fake import FakeBackend, FakeFabric, FaultConfig
from kvbridge.engine.models import kv_cache_shape
from kvbridge.engine.tp import rank_shard
from kvbridge.kv_transfer.connector.factory import build_connectors
from kvbridge.kv_transfer.connector.rank_agent import RankAgent
from kvbridge.kv_transfer.control import MSG_CHECK_READ, MSG_HEARTBEAT, MSG_READ_DONE, MSG_RELEASE
from kvbridge.kv_transfer.handshake import HandshakeTimeout
from kvbridge.kv_transfer.params import parse_kv_transfer_params
from kvbridge.kv_transfer.side_channel_frames import MSG_GET_METADATA

LEASE_S = 30.0
WAIT_S = 20.0  # the longest any one wait for a step's effect may take (a bug, not a slow machine)
_ids = itertools.count()


class Phase(enum.Enum):
    QUEUED_ON_P = "queued on P"
    PREFILLING = "prefilling (between chunks)"
    P_FINISHED = "finished on P, lease held"
    D_ADMITTED = "admitted on D"
    HANDSHAKE = "handshake in flight"
    CHECKING = "check_read in flight"
    READ_POSTED = "read posted"
    READ_PARTIAL = "read done on one rank, not the other (TP 2)"
    READ_DONE = "read done, not yet computed on"
    FIRST_DECODE = "first decode step done"
    STREAMING = "streaming"
    D_FINISHED = "finished on D"
    RELEASED = "released on P"


D_PHASES = tuple(Phase)[tuple(Phase).index(Phase.D_ADMITTED):]


class Event(enum.Enum):
    ABORT_D = "client abort on D"
    ABORT_P = "client abort on P (the proxy's release once P answered)"
    READ_REFUSED = "P refuses the read (lease already ended)"
    READ_FAILED = "D's read fails"
    P_GONE = "P gone"
    LEASE_EXPIRY = "lease expiry (then P needs the blocks)"
    HEARTBEAT_LOST = "heartbeats lost until the lease expires"
    SAME_PROMPT = "a second request with the same prompt"


def applies(event: Event, phase: Phase) -> bool:
    """Whether the event can happen at that phase (the grid holds only these pairs)."""
    if event is Event.ABORT_P:
        return phase in (Phase.QUEUED_ON_P, Phase.PREFILLING, Phase.P_FINISHED)
    if event is Event.ABORT_D:
        return phase in D_PHASES
    if event is Event.READ_REFUSED:  # P ends the lease before D's check_read is answered
        return phase in (Phase.P_FINISHED, Phase.D_ADMITTED, Phase.HANDSHAKE, Phase.CHECKING)
    if event in (Event.P_GONE, Event.LEASE_EXPIRY, Event.HEARTBEAT_LOST):
        return phase not in (Phase.QUEUED_ON_P, Phase.PREFILLING)
    return True


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
        self.gate = SideChannelGate(self.d.connectors[1]._side_client)
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
        for out in self.p.step():
            track = by_p.get(out.request_id)
            if track is not None:
                track.p_outputs.append(out)
                if out.finished and out.kv_transfer_params is not None:
                    track.params = out.kv_transfer_params
                    if track.filler:
                        track.released = True
                        self.p.release_kv(parse_kv_transfer_params(track.params))

    def step_d(self) -> None:
        _, by_d = self._by_id()
        for out in self.d.step():
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
        return sum(len(recv.reads) for recv in self.d.connectors[1]._recvs.values())

    def p_agent(self) -> FakeBackend:
        return self.p.connectors[1].local_agent.backend

    def d_agents(self) -> list[FakeBackend]:
        """The transfer agents D reads with: its own, or its two ranks'."""
        if self.ranks is not None:
            return [a.backend for a in self.ranks.agents]
        return [self.d.connectors[1].local_agent.backend]

    def hold_reads(self, held: bool, ranks: slice = slice(None)) -> None:
        """Reads on these D agents stay in progress (True) or may complete (other faults stay)."""
        for agent in self.d_agents()[ranks]:
            agent.set_faults(dataclasses.replace(agent.faults, hold_reads=held))

    def rank_read_settled(self, rank: int) -> bool:
        return any(r.local_rank == rank and r.result is not None
                   for recv in self.d.connectors[1]._recvs.values() for r in recv.reads.values())

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
        return bool(self.d.connectors[1]._side_requests) or self.gate.is_waiting("read_done")

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
        worker = engine.connectors[1]
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
        worker._handshakes.close()  # register_ranks makes D's handshakes anew, for the two ranks
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


def happy_path(world: World, track: Track, pausing: Callable[[], bool]) -> Iterator[Phase]:
    """The request's life, one phase at a time. While `pausing()`, each phase is held at its
    boundary (the gate holds the message that would end it); once it turns False the same
    path runs freely. Stops early when the request ends before D finishes it."""
    w = world
    if not track.on_p:
        w.add_to_p(track)
    yield Phase.QUEUED_ON_P
    w.step_p()
    if not track.p_done:
        yield Phase.PREFILLING
    w.until(lambda: track.p_done, "P finishes the prefill", w.step_p)
    if track.abandoned or track.params is None:
        return
    yield Phase.P_FINISHED
    if track.abandoned:
        return
    if not track.on_d:
        w.add_to_d(track)
    yield Phase.D_ADMITTED
    if pausing():
        w.gate.hold("handshake")
        w.step_d()
        w.until(lambda: w.gate.is_waiting("handshake") or w.d_request(track) is None
                or w.d_request(track).status is not RequestStatus.WAITING_FOR_REMOTE_KVS, "D sends the handshake")
        if w.gate.is_waiting("handshake"):
            yield Phase.HANDSHAKE
    if pausing():
        w.gate.hold("check")
        w.gate.open("handshake")
        w.until(lambda: w.gate.is_waiting("check") or _past_remote_wait(w, track), "D sends check_read")
        if w.gate.is_waiting("check"):
            yield Phase.CHECKING
    if pausing():
        w.hold_reads(True)
        w.gate.open("check")
        w.until(lambda: w.d_live_reads() > 0 or _past_remote_wait(w, track), "D posts its read")
        if w.d_live_reads() > 0:
            yield Phase.READ_POSTED
    if pausing() and w.ranks is not None and w.d_live_reads() > 0:
        w.hold_reads(False, slice(0, 1))
        w.until(lambda: w.rank_read_settled(0) or _past_remote_wait(w, track), "D rank 0's read completes")
        if not _past_remote_wait(w, track):
            yield Phase.READ_PARTIAL
    w.lift_read_hold()
    w.until(lambda: _past_remote_wait(w, track), "D's load settles")
    if track.abandoned or track.d_done:
        return
    yield Phase.READ_DONE
    w.until(lambda: bool(_tokens(track.d_outputs)) or track.d_done, "D's first decode step")
    if track.d_done:
        return
    yield Phase.FIRST_DECODE
    n = len(_tokens(track.d_outputs))
    w.until(lambda: len(_tokens(track.d_outputs)) > n or track.d_done, "D streams on")
    if not track.d_done:
        yield Phase.STREAMING
    w.until(lambda: track.d_done, "D finishes")
    yield Phase.D_FINISHED
    if w.p_alive:
        w.until(lambda: track.p_id not in w.p.scheduler.sending, "P frees the blocks on D's read-done")
    yield Phase.RELEASED


def _past_remote_wait(w: World, track: Track) -> bool:
    """D's request no longer waits for remote KV (loaded, recomputing, or ended)."""
    req = w.d_request(track)
    return req is None or req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


# ---- events ------------------------------------------------------------------------------
def inject(world: World, track: Track, event: Event, phase: Phase) -> Track | None:
    """Inject `event` now; returns a second request it started, if any."""
    w = world
    w.faulted = w.faulted or event not in (Event.ABORT_D, Event.ABORT_P, Event.SAME_PROMPT)
    if event is Event.ABORT_D:
        track.d_aborted_at = len(track.d_outputs)
        w.d.abort_request(track.d_id)
    elif event is Event.ABORT_P:
        if track.p_done:  # P answered, the client is gone before any D got it: the proxy releases
            track.released = True
            w.p.release_kv(parse_kv_transfer_params(track.params))
        else:
            track.p_aborted_at = len(track.p_outputs)
            w.p.abort_request(track.p_id)
    elif event is Event.READ_REFUSED:
        if w.p_alive and track.params is not None:  # P ended the lease (another reader's release)
            w.p.release_kv(parse_kv_transfer_params(track.params))
    elif event is Event.READ_FAILED:  # at TP 2 on the last rank only: the other's read completes
        agent = w.d_agents()[-1]
        agent.set_faults(FaultConfig(hold_reads=agent.faults.hold_reads, error_state=True, raise_on_check_state=True))
    elif event is Event.P_GONE:
        w.kill_p()
    elif event is Event.LEASE_EXPIRY:
        w.expiry_expected = True
        w.clock.advance(LEASE_S + 1)
        _reuse_p_blocks(w)
    elif event is Event.HEARTBEAT_LOST:
        w.expiry_expected = True
        w.gate.drop("heartbeat")
        for _ in range(8):  # more than a lease, in heartbeat periods: D (still alive) keeps trying
            w.clock.advance(LEASE_S / 6)
            w.step_both()
        _reuse_p_blocks(w)
    elif event is Event.SAME_PROMPT:
        second = w.new_track(track.prompt, track.continued)
        return second
    return None


def _reuse_p_blocks(w: World) -> None:
    """Another prompt arrives at P, whose pool is small: it takes whatever blocks expired leases
    freed (and waits for blocks a granted read still holds). Its client leaves once P answers."""
    w.step_p()  # the step that sees the expiry frees the blocks
    filler = w.new_track(w.case.filler, False)
    filler.filler = True
    w.add_to_p(filler)
    for _ in range(len(w.case.filler)):  # as far as P's blocks let it
        w.step_p()


def _arrive(w: World, second: Track) -> None:
    """The second request reaches P, and D once P answered, while the first is where it was
    held; each engine takes it as far as its blocks allow (P's pool is small)."""
    w.add_to_p(second)
    for _ in range(len(second.prompt)):
        if second.p_done:
            break
        w.step_p()
    if second.params is not None:
        w.add_to_d(second)


# ---- one run -----------------------------------------------------------------------------
def explore(case: ModelCase, phase: Phase, event: Event, continued: bool) -> list[str]:
    """One run: the happy path to `phase`, `event`, then to the end. The broken invariants."""
    world = World(case)
    track = world.new_track(case.prompt, continued)
    state = {"pausing": True}
    path = happy_path(world, track, lambda: state["pausing"])
    second: Track | None = None
    problems: list[str] = []
    try:
        reached = False
        for at in path:
            if at is phase:
                reached = True
                second = inject(world, track, event, phase)
                state["pausing"] = False
                if second is not None:
                    _arrive(world, second)
                world.gate.open_all()
                world.lift_read_hold()
                break
        if not reached:
            return [f"the path never reached phase {phase.value!r}"]
        for _ in path:  # the rest of the first request's life
            pass
        if second is not None:
            for _ in happy_path(world, second, lambda: False):
                pass
        world.settle()
        problems += check(world)
    except Exception:
        problems.append("raised:\n" + traceback.format_exc())
    finally:
        world.shutdown()
    return problems


def check(world: World) -> list[str]:
    w = world
    problems: list[str] = []
    for engine, name in ((w.p, "P"), (w.d, "D")):
        if name == "P" and not w.p_alive:
            continue
        m = engine.metrics()
        if m.num_free_blocks != m.num_total_blocks:
            problems.append(f"{name}: {m.num_total_blocks - m.num_free_blocks} blocks not back in the pool")
        if m.num_held_for_remote or m.num_running or m.num_waiting:
            problems.append(f"{name}: requests left: {m}")
    if w.p_alive:
        if len(w.p.connectors[1].leases):
            problems.append(f"P: {len(w.p.connectors[1].leases)} leases still held")
        expired = w.p.connectors[1].stats.expired_leases
        if expired and not w.expiry_expected:
            problems.append(f"P: {expired} leases expired although D said read-done or release")
    recomputed = w.d.connectors[1].stats.recomputed_requests
    if recomputed and not w.faulted:
        problems.append(f"D: {recomputed} requests recomputed although no transfer was faulted")
    for t in w.tracks:
        problems += [f"request {t.p_id}/{t.d_id}: {p}" for p in check_track(w, t)]
    return problems


def check_track(w: World, t: Track) -> list[str]:
    problems = _check_outputs(t.p_outputs, t.p_aborted_at, "P")
    problems += _check_outputs(t.d_outputs, t.d_aborted_at, "D")
    if t.abandoned or t.filler:
        return problems
    want = w.case.want(t.prompt)
    p_tokens = _tokens(t.p_outputs)
    if w.case.continued_ok and p_tokens != want[:1]:  # with Mamba layers P samples after N-1 tokens
        problems.append(f"P sampled {p_tokens}, the colocated engine {want[:1]}")
    if not t.d_done:
        return problems + ["D never finished the request"]
    last = t.d_outputs[-1]
    if last.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
        return problems + [f"D finished with {last.finish_reason} ({last.error})"]
    got = (p_tokens[:1] if t.continued else []) + _tokens(t.d_outputs)
    if got != want:
        problems.append(f"D answered {got}, the colocated engine {want}")
    return problems


def _check_outputs(outputs: list[RequestOutput], aborted_at: int | None, where: str) -> list[str]:
    problems = []
    finished = [i for i, o in enumerate(outputs) if o.finished]
    if len(finished) > 1 or (finished and finished[0] != len(outputs) - 1):
        problems.append(f"{where}: outputs after the finished one ({[o.finish_reason for o in outputs]})")
    if aborted_at is not None:
        after = outputs[aborted_at:]
        if len(after) > 1 or (after and not (after[0].finished and after[0].finish_reason is FinishReason.ABORT)):
            problems.append(f"{where}: output after the abort: {after}")
    return problems
