"""Drive one P/D request's life step by step and inject an event at any phase boundary.

The world (pd_world.py): a P and a D engine in this process on a small synthetic model, the fake
transfer backend between them, the real side channel with a gate in D's client, a manual lease
clock, and D at TP 1 or 2. happy_path walks one request through its phases, holding each at its
boundary (the gate holds the message that would end it, or the reads stay in progress).

`explore(case, phase, event, continued)` runs the request's happy path until `phase`, injects
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

import enum
import traceback
from collections.abc import Callable, Iterator

from kvbridge.engine.outputs import RequestOutput
from kvbridge.engine.request import FinishReason, RequestStatus
from kvbridge.kv_transfer.backends.fake import FaultConfig
from kvbridge.kv_transfer.params import parse_kv_transfer_params
from tests.integration.pd_world import LEASE_S, ModelCase, Track, World

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
        if len(w.p.connectors.worker.leases):
            problems.append(f"P: {len(w.p.connectors.worker.leases)} leases still held")
        expired = w.p.connectors.worker.stats.expired_leases
        if expired and not w.expiry_expected:
            problems.append(f"P: {expired} leases expired although D said read-done or release")
    recomputed = w.d.connectors.worker.stats.recomputed_requests
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
