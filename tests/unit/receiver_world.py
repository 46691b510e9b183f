"""The world of D's receive state machine under test (tests/unit/test_kv_receiver.py), in this
process and on the test's thread only: no model, no process, no socket, no sleep.

- D: the real worker connector (`KVBridgeWorkerConnector`, consumer) whose `KVReceiver` gets a
  `ReceiverDeps` of this world's: the loopback side-channel client, two `ManualExecutor`s (the
  handshakes' and the control messages') that run a submitted call only when the test says, and
  the world's `ManualClock`. Its ranks are real `RankAgent`s over `FakeBackend`s, stepped as a TP
  engine steps them (commands before the forward pass, reports after: `ReceiverWorld.step`), with
  the same clock for their read timeout.
- P (`PrefillEnd`): the real P end of the protocol: its `ControlServer` (over a real
  `LeaseTable` on the same clock, every rank's real handshake payload) on a `SideChannelServer`
  that is never started, and its ranks' KV in tensors registered with their own FakeBackend agents.
- Between them only the transport is fake (`SideChannelNet`): D's client encodes each request as
  a real frame, P's server answers it with its own dispatch (handlers, refusals), and the reply is
  classified as the socket client classifies it. The test can make a kind of message fail as the
  network would (`fail`: a timeout, a refused connection), and every message that reached a P is
  logged (`delivered`), so a test counts what P heard.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from kvbridge.config import KVRole, KVTransferConfig
from kvbridge.kv_transfer.backends.base import TransferBackend
from kvbridge.kv_transfer.backends.corrupting import CorruptingBackend
from kvbridge.kv_transfer.backends.fake import FakeFabric, FaultConfig
from kvbridge.kv_transfer.connector.base import KVConnectorOutput
from kvbridge.kv_transfer.connector.metadata import ConnectorMetadata, RecvSpec, ReleaseSpec, RemoteEngine
from kvbridge.kv_transfer.connector.rank_agent import RankAgent
from kvbridge.kv_transfer.connector.receiving import ReceiverDeps
from kvbridge.kv_transfer.connector.worker_side import KVBridgeWorkerConnector
from kvbridge.kv_transfer.side_channel.control import (MSG_CHECK_READ, MSG_HEARTBEAT, MSG_READ_DONE, MSG_RELEASE, ControlServer,
                                                       LeaseKey, RankDigester, parse_lease_key)
from kvbridge.kv_transfer.failure import FailureHandler, FailureKind
from kvbridge.kv_transfer.side_channel.handshake import (CompatibilityInfo, HandshakeDecodeError, HandshakeError,
                                                         HandshakeMetadata, HandshakePeerError, HandshakeRefused, HandshakeTimeout,
                                                         encode_payload)
from kvbridge.kv_transfer.lease import LeaseTable, content_digest
from kvbridge.kv_transfer.side_channel.server import DEFAULT_MAX_REQUEST_BYTES, SideChannelServer
from kvbridge.kv_transfer.side_channel.client import DEFAULT_MAX_REPLY_BYTES, HandshakeClient
from kvbridge.kv_transfer.side_channel.frames import (MSG_GET_METADATA, REPLY_ERROR, REPLY_OK, decode_frame,
                                                      encode_frame)
from kvbridge.kv_transfer.stats import KVTransferStats

HOST = "127.0.0.1"
P_PORT = 7100  # never bound: SideChannelNet routes by (host, port)
LEASE_S = 30.0
TRANSFER_TIMEOUT_S = 10.0
HANDSHAKE_TIMEOUT_S = 5.0
# A tiny model's KV: [blocks, heads of the rank, layers, K/V, tokens, dim], float32 (block = 32 floats per head).
HEADS, LAYERS, BLOCK_SIZE, HEAD_DIM, NUM_BLOCKS = 4, 1, 4, 2, 8
COMPAT = CompatibilityInfo(model="tiny-test", dtype="float32", num_kv_heads=HEADS, head_size=HEAD_DIM,
                           num_layers=LAYERS, cache_dtype="float32")
PROMPT = list(range(1, 10))  # 9 tokens: 3 blocks of 4
MAX_STEPS = 50  # the most steps any wait for an effect takes (more is a bug, not a slow machine)

_KINDS = {MSG_GET_METADATA: "handshake", MSG_CHECK_READ: "check", MSG_HEARTBEAT: "heartbeat",
          MSG_READ_DONE: "read_done", MSG_RELEASE: "release"}


class ManualClock:
    """time.monotonic that moves only when the test says."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class _Call:
    fn: Callable
    args: tuple
    kwargs: dict
    future: Future


class ManualExecutor(Executor):
    """An executor that runs a submitted call only when the test says (`run_all`), on the test's
    thread: what is submitted and not run yet is a call in flight, for as long as the test wants.
    Like ThreadPoolExecutor, it refuses work after `shutdown` (RuntimeError) and cancels what is
    queued when told to."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: deque[_Call] = deque()
        self._shut = False
        self.ran = 0

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._shut:
            raise RuntimeError(f"cannot schedule new futures after shutdown ({self.name})")
        future: Future = Future()
        self._queue.append(_Call(fn, args, kwargs, future))
        return future

    @property
    def pending(self) -> int:
        return len(self._queue)

    def run_all(self) -> int:
        """Run every queued call, and those they queue, in order; how many ran."""
        ran = 0
        while self._queue:
            call = self._queue.popleft()
            if not call.future.set_running_or_notify_cancel():
                continue
            ran += 1
            assert ran < 1000, f"{self.name}: calls keep queueing calls"
            try:
                result = call.fn(*call.args, **call.kwargs)
            except BaseException as exc:  # the future carries it, as a pool thread's would
                call.future.set_exception(exc)
            else:
                call.future.set_result(result)
        self.ran += ran
        return ran

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shut = True
        if cancel_futures:
            while self._queue:
                self._queue.popleft().future.cancel()


@dataclass(frozen=True)
class Delivered:
    """A message that reached a P's side channel (its handler ran)."""

    kind: str  # handshake | check | read_done | release | heartbeat
    port: int
    body: bytes
    reply: str  # ok | error

    @property
    def key(self) -> LeaseKey:
        """A read-done's or release's lease key, as P parsed it."""
        return parse_lease_key(self.body)


class SideChannelNet:
    """The loopback network between D's side-channel client and the P ends in this process."""

    def __init__(self) -> None:
        self.servers: dict[tuple[str, int], SideChannelServer] = {}
        self.delivered: list[Delivered] = []
        self.attempts: Counter[str] = Counter()  # messages D sent, by kind, delivered or not
        self._faults: dict[str, type[HandshakeError]] = {}

    def fail(self, kind: str, error: type[HandshakeTimeout] | type[HandshakeRefused]) -> None:
        """Messages of `kind` fail as the network fails them (not delivered) until `heal`."""
        self._faults[kind] = error

    def heal(self, kind: str) -> None:
        self._faults.pop(kind, None)

    def notices(self, request_id: str, port: int = P_PORT) -> list[str]:
        """The read-done and release messages for P's `request_id` that reached the P at `port`."""
        return [d.kind for d in self.delivered
                if d.port == port and d.kind in ("read_done", "release") and d.key.request_id == request_id]

    def count(self, kind: str, port: int = P_PORT) -> int:
        return sum(1 for d in self.delivered if d.kind == kind and d.port == port)

    def request(self, host: str, port: int, msg_type: str, body: bytes, timeout: float) -> bytes:
        """HandshakeClient.request without the socket: the same frames, errors and messages."""
        kind = _KINDS.get(msg_type, msg_type)
        where = f"side channel {host}:{port}"
        self.attempts[kind] += 1
        fault = self._faults.get(kind)
        if fault is HandshakeTimeout:
            raise HandshakeTimeout(f"{where} did not answer within {timeout}s")
        if fault is not None:
            raise fault(f"cannot connect to {where}: [Errno 111] Connection refused")
        server = self.servers.get((host, port))
        if server is None:
            raise HandshakeRefused(f"cannot connect to {where}: [Errno 111] Connection refused")
        frame = decode_frame(encode_frame(msg_type, body), DEFAULT_MAX_REQUEST_BYTES)
        reply = decode_frame(server._dispatch(frame), DEFAULT_MAX_REPLY_BYTES)  # the server's own answer
        self.delivered.append(Delivered(kind, port, frame.body, reply.msg_type))
        if reply.msg_type == REPLY_OK:
            return reply.body
        if reply.msg_type == REPLY_ERROR:
            raise HandshakePeerError(f"{where} answered: {reply.body[:500].decode('utf-8', 'replace')}")
        raise HandshakeDecodeError(f"{where} sent reply type {reply.msg_type!r}")


class LoopbackClient(HandshakeClient):
    """D's side-channel client over SideChannelNet (`fetch` is the real one: it calls `request`)."""

    def __init__(self, net: SideChannelNet) -> None:
        super().__init__()
        self.net = net

    def request(self, host: str, port: int, msg_type: str, body: bytes, timeout: float) -> bytes:
        return self.net.request(host, port, msg_type, body, timeout)


def rank_heads(tp_size: int, tp_rank: int) -> range:
    per = HEADS // tp_size
    return range(tp_rank * per, (tp_rank + 1) * per)


def kv_cache(tp_size: int, fill: float | None = None) -> torch.Tensor:
    """One rank's KV cache; `fill` None: each element its own value (global head and block in it)."""
    shape = (NUM_BLOCKS, HEADS // tp_size, LAYERS, 2, BLOCK_SIZE, HEAD_DIM)
    if fill is not None:
        return torch.full(shape, fill, dtype=torch.float32)
    return torch.arange(float(torch.Size(shape).numel()), dtype=torch.float32).reshape(shape) + 1.0


class PrefillEnd:
    """An in-memory P at (HOST, port): its real ControlServer, LeaseTable and rank payloads on an
    unstarted SideChannelServer (module docstring). `restart` brings it back as a new incarnation
    (new agents, no leases) at the same address."""

    _incarnations = itertools.count()

    def __init__(self, net: SideChannelNet, fabric: FakeFabric, clock: ManualClock, *, tp: int = 1,
                 engine_id: str = "prefill-0", port: int = P_PORT, compat: CompatibilityInfo = COMPAT,
                 backend: str = "fake", block_size: int = BLOCK_SIZE, digests: bool = True) -> None:
        """`digests`: P answers digests of what D reads (False: as a P whose KV it cannot hash)."""
        self.digests = digests
        self.net, self.fabric, self.clock = net, fabric, clock
        self.tp, self.engine_id, self.port = tp, engine_id, port
        self.compat, self.backend, self.block_size = compat, backend, block_size
        self.start()

    def start(self) -> None:
        n = next(self._incarnations)
        self.stats = KVTransferStats()
        self.leases = LeaseTable(LEASE_S, clock=self.clock, stats=self.stats, engine_id=self.engine_id)
        self.server = SideChannelServer({}, HOST, self.port)
        self.control = ControlServer(self.server, self.leases)
        self.agents = [RankAgent(self.fabric.create_agent(f"{self.engine_id}-{n}-rank{r}"), serves_reads=True)
                       for r in range(self.tp)]
        self.caches = [kv_cache(self.tp) for _ in range(self.tp)]
        self.registrations = tuple(agent.register(cache, self.block_size, r, self.tp, rank_heads(self.tp, r))
                                   for r, (agent, cache) in enumerate(zip(self.agents, self.caches)))
        self.control.publish_ranks(self.engine_id, self.backend, self.compat,
                                   [(r.agent_metadata, r.layout) for r in self.registrations])
        if self.digests:  # every rank's KV is in this process's memory: P digests what D reads
            self.control.digesters = {r.layout.tp_rank: RankDigester.of(r.layout) for r in self.registrations}
        self.net.servers[(HOST, self.port)] = self.server

    def restart(self) -> None:
        """P's process died (its agents with it) and a new one serves the same address."""
        for agent in self.agents:
            self.fabric.kill(agent.backend.agent_name)
        self.server.close()
        self.start()

    def serve(self, tp_rank: int, payload: bytes) -> None:
        """Serve these bytes as `tp_rank`'s handshake payload instead."""
        self.server.set_payload(tp_rank, payload)

    def payload(self, tp_rank: int, *, engine_id: str | None = None, backend: str | None = None,
                compat: CompatibilityInfo | None = None, **layout: object) -> bytes:
        """`tp_rank`'s real payload, with these layout fields (and engine id, backend, compat) changed."""
        reg = self.registrations[tp_rank]
        meta = HandshakeMetadata(engine_id or self.engine_id, backend or self.backend, reg.agent_metadata,
                                 dataclasses.replace(reg.layout, **layout))
        return encode_payload(meta, compat or self.compat)

    def grant(self, request_id: str, blocks: list[int], prompt: list[int] = PROMPT) -> int:
        """P finished `request_id`: a lease on `blocks` for the KV of `prompt`; its generation."""
        generation = self.leases.new_generation()
        self.leases.grant(request_id, (list(blocks),), generation, content_digest(prompt))
        return generation

    def step(self) -> set[str]:
        """P's engine step, as far as leases go: the requests whose blocks it frees now."""
        return self.leases.finished_sending()

    @property
    def remote(self) -> RemoteEngine:
        return RemoteEngine(self.engine_id, HOST, self.port)


@dataclass
class Outputs:
    """Everything D's connector reported across steps."""

    finished: Counter[str] = field(default_factory=Counter)  # times each request was reported settled
    failed: dict[str, FailureKind] = field(default_factory=dict)
    causes: dict[str, str] = field(default_factory=dict)
    invalid_block_ids: set[int] = field(default_factory=set)

    def add(self, out: KVConnectorOutput) -> None:
        self.finished.update(out.finished_recving)
        self.failed.update(out.failure_kinds)
        self.causes.update(out.failure_causes)
        self.invalid_block_ids |= out.invalid_block_ids


class ReceiverWorld:
    """D (TP `d_tp`) and one in-memory P (TP `p_tp`); see the module docstring."""

    def __init__(self, *, d_tp: int = 1, p_tp: int = 1, d_faults: dict[int, FaultConfig] | None = None,
                 prefix_caching: bool = True, kv_verify: bool = True,
                 corrupt: tuple[float, tuple[str, ...]] | None = None, p_digests: bool = True) -> None:
        """`kv_verify`: D checks reads against P's digests; `corrupt`: (rate, kinds) of a
        CorruptingBackend around each D rank's agent; `p_digests`: P answers digests."""
        self.clock = ManualClock()
        self.fabric = FakeFabric()
        self.net = SideChannelNet()
        self.handshakes = ManualExecutor("handshakes")
        self.control = ManualExecutor("control")
        self.config = KVTransferConfig(role=KVRole.CONSUMER, backend="fake", engine_id="decode-0",
                                       handshake_timeout_s=HANDSHAKE_TIMEOUT_S, transfer_timeout_s=TRANSFER_TIMEOUT_S,
                                       lease_seconds=LEASE_S, kv_verify=kv_verify)
        self.stats = KVTransferStats()
        self.failures = FailureHandler(self.stats, clock=self.clock)
        deps = ReceiverDeps(LoopbackClient(self.net), self.control, self.handshakes, self.clock, self.clock)
        self.connector = KVBridgeWorkerConnector(
            self.config, "decode-0", None, COMPAT, LeaseTable(LEASE_S, clock=self.clock), self.failures, self.stats,
            None, prefix_caching, receiver_deps=deps)
        self.receiver = self.connector.receiving
        faults = d_faults or {}
        backends: list[TransferBackend] = [self.fabric.create_agent(f"decode-0-rank{r}", faults.get(r))
                                           for r in range(d_tp)]
        if corrupt is not None:
            backends = [CorruptingBackend(b, corrupt[0], corrupt[1], seed=r) for r, b in enumerate(backends)]
        self.agents = [RankAgent(b, False, TRANSFER_TIMEOUT_S, clock=self.clock) for b in backends]
        self.caches = [kv_cache(d_tp, fill=0.0) for _ in range(d_tp)]
        self.d_tp = d_tp
        self.connector.register_ranks([agent.register(cache, BLOCK_SIZE, r, d_tp, rank_heads(d_tp, r))
                                       for r, (agent, cache) in enumerate(zip(self.agents, self.caches))])
        self.p = PrefillEnd(self.net, self.fabric, self.clock, tp=p_tp, digests=p_digests)
        self.out = Outputs()
        self._meta = ConnectorMetadata()

    # ---- what D's scheduler half would put in the step's metadata ------------------------
    def recv(self, request_id: str, local: Sequence[int] = (0, 1, 2), remote: Sequence[int] = (5, 6, 7), *,
             p: PrefillEnd | None = None, p_request_id: str | None = None, generation: int | None = None,
             prompt: list[int] = PROMPT, engine_id: str | None = None) -> RecvSpec:
        """P grants `p_request_id` (default: "p-" + request_id) a lease on `remote`, and D's next
        step receives it into `local` (pass `generation` to skip the grant)."""
        p = p or self.p
        p_rid = p_request_id or f"p-{request_id}"
        if generation is None:
            generation = p.grant(p_rid, list(remote), prompt)
        remote_engine = RemoteEngine(p.engine_id if engine_id is None else engine_id, HOST, p.port)
        spec = RecvSpec(request_id, remote_engine, p_rid, generation, (list(local),), (list(remote),),
                        content_digest(prompt))
        self._meta.reqs_to_recv.append(spec)
        return spec

    def release(self, request_id: str, p_request_id: str, generation: int) -> None:
        """D ended a request without reading (abort before allocation, full hit): tell P."""
        self._meta.reqs_to_release.append(ReleaseSpec(request_id, self.p.remote, p_request_id, generation))

    def heartbeat(self, p_request_id: str, generation: int) -> None:
        self._meta.heartbeats.setdefault(self.p.remote, []).append((p_request_id, generation))

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> KVConnectorOutput:
        """One engine step of D: the connector before the ranks run, each rank's commands and
        poll (as a TP engine's ranks), the connector after. The control pools do not run."""
        meta, self._meta = self._meta, ConnectorMetadata()
        commands = self.connector.start_load_kv(meta)
        for rank, agent in enumerate(self.agents):
            agent.apply(commands[rank] if commands is not None else None)
        reports = [agent.poll() for agent in self.agents]
        out = self.connector.get_finished(reports)
        self.out.add(out)
        return out

    def run(self) -> None:
        """Everything the side channel has in flight reaches P and comes back."""
        self.handshakes.run_all()
        self.control.run_all()

    def to_check(self) -> None:
        """Step the requests taken so far to their check_read, on the wire (queued, not run)."""
        self.step()
        self.handshakes.run_all()
        self.step()

    def to_read(self) -> None:
        """Step the requests taken so far through P's grant to their reads, handed to the ranks."""
        self.to_check()
        self.control.run_all()
        self.step()

    def settle(self) -> Outputs:
        """Step and run the side channel until no load is left (bounded); then one more step and
        run, so the handles' releases ride to the ranks and the notices reach P."""
        for _ in range(MAX_STEPS):
            self.step()
            self.run()
            if not self.receiver.has_loads():
                break
        else:
            raise AssertionError("the loads did not settle")
        self.step()
        self.run()
        return self.out

    def live_reads(self) -> list[int]:
        """Each of D's ranks' read handles not yet released."""
        return [agent.num_live_reads for agent in self.agents]

    def d_blocks(self, rank: int, blocks: list[int]) -> torch.Tensor:
        return self.caches[rank][blocks]

    def p_heads(self, blocks: list[int], heads: range, p: PrefillEnd | None = None) -> torch.Tensor:
        """P's KV of `blocks` for the global `heads`, gathered over its ranks."""
        p = p or self.p
        per = HEADS // p.tp
        parts = [p.caches[h // per][blocks, h % per] for h in heads]
        return torch.stack(parts, dim=1)

    def shutdown(self) -> None:
        self.connector.shutdown()
        self.p.server.close()
