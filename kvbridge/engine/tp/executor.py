"""Tensor parallelism: the model runs on N rank processes; the engine process only schedules.

The engine process (global rank 0 of a gloo process group of N + 1) spawns N rank
processes with `torch.multiprocessing` (spawn). Rank process i (global rank i + 1, TP
rank i) loads the model, keeps its shard of the weights and of the KV cache (its KV
heads; `shape/tp_split.py`) and sums partial layer outputs with `all_reduce` over a group of
the N ranks (gloo on CPU, NCCL on CUDA). Each engine step is ONE broadcast of the step's
inputs (the scheduler output, which carries the connector metadata) and ONE gather of the
ranks' outputs over the default gloo group (`channel.StepChannel`: a fixed-size frame
each way, so a step is two collectives, not the four of torch's object collectives); TP
rank 0 samples.

Each rank computes on its own CPUs (`--cpu-bind`, engine/tp/cpu_bind.py; on CPU at TP > 1 by
default), and a step that starts reads on two or more ranks begins with a barrier of the ranks
(ModelRunner.sync_ranks), so their copies run side by side (docs/internals.md).

With a KV connector each rank also owns a transfer agent (rank_agent.RankAgent) and
registers its KV shard with it at start-up (the registrations come back with the ready
gather); the step's broadcast carries each rank's transfer commands and the gather
brings back each rank's transfer report, so KV transfer adds no round of its own.

Failure: a rank that raises logs its traceback and exits; its peers' collectives then fail
at once (gloo sees the closed connection) and they exit too, so the engine's gather raises
and the engine fails cleanly (EngineState.DEAD). A watchdog thread notices a rank process
that died between steps (`failure()` is then set, so /health fails at once) and kills the
ranks of a step that runs past `tp_step_timeout_s`, so no wait is unbounded. `shutdown()`
stops the ranks and reaps every one of them (killing stragglers).

Profiling: every step's times are kept (the last `_PROFILE_STEPS`): the engine process's
wall time of the round, and each rank's `runner.execute` time and time inside `all_reduce`,
all host-side `time.perf_counter` (on CUDA, NCCL returns before the reduction is done, so
the split is only meaningful for gloo on CPU). `step_profile()` returns them;
`reset_step_profile()` starts afresh.

One executor per process at a time: torch.distributed has one default group per process.

Sockets: the ranks are this host's processes, so their rendezvous (a TCPStore in the engine
process) and gloo's pair connections listen on loopback only, whatever address the server binds.
torch's TCPStore binds the wildcard address (`*:PORT`) whatever host it is given, so the engine
process binds the store's socket itself and hands it over (`master_listen_fd`); gloo binds the
address this host's name resolves to unless GLOO_SOCKET_IFNAME names an interface, so groups are
created with it set to loopback's.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import logging
import os
import signal
import socket
import statistics
import threading
import time
import traceback
from dataclasses import dataclass
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvbridge.config import EngineConfig
from kvbridge.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvbridge.engine.tp.cpu_bind import rank_cpus
from kvbridge.engine.tp.channel import StepChannel
from kvbridge.shape.cpu_lists import CpuBindError, format_cpus
from kvbridge.shape.tp_split import rank_shard

if TYPE_CHECKING:
    from kvbridge.kv_transfer.connector.rank_agent import RankSetup

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"  # the ranks' rendezvous and gloo pairs (module docstring: sockets)
_HOST_INTERFACE = "lo"
# Ranks wait for the next step inside a gloo broadcast: an idle engine pings them well
# before this collective timeout passes.
_COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)
_PING_AFTER_IDLE_S = 600.0
_START_TIMEOUT_S = 600.0  # spawning, importing torch and loading the weights, per rank
_JOIN_TIMEOUT_S = 10.0
_WATCH_INTERVAL_S = 0.5
_PROFILE_STEPS = 10_000  # step timings kept for step_profile(); older ones are dropped


class TPExecutorError(RuntimeError):
    """A rank process failed, died or timed out; the engine cannot step any more."""


@dataclass(frozen=True)
class _Step:
    sched: SchedulerOutput


@dataclass(frozen=True)
class _Ping:
    pass


@dataclass(frozen=True)
class _Stop:
    pass


_Command = _Step | _Ping | _Stop
_active = threading.Lock()  # held by the one live executor of this process


@dataclass(frozen=True)
class _RankReply:
    """A rank's answer to a step: TP rank 0's output (None elsewhere) and its own timings."""

    output: ModelRunnerOutput | None
    kv_report: Any  # the rank's rank_agent.RankReport, or None without a KV connector
    tier_report: Any  # the rank's kv_tier.TierReport for the step's tier work, or None
    execute_s: float  # runner.execute, all_reduce included
    all_reduce_s: float  # inside dist.all_reduce, waiting for the slowest peer included
    all_reduce_calls: int


@dataclass(frozen=True)
class TPStepTiming:
    """One step's times in seconds. Rank tuples are in TP rank order."""

    wall_s: float  # the engine process's round: broadcast, the ranks' execute, gather
    execute_s: tuple[float, ...]  # each rank's runner.execute, all_reduce included
    all_reduce_s: tuple[float, ...]  # each rank's time inside all_reduce (transport and waiting for peers)
    all_reduce_calls: int  # all_reduce calls per rank this step (2 per layer for a Llama)

    @property
    def compute_s(self) -> tuple[float, ...]:
        """Each rank's execute time outside all_reduce."""
        return tuple(e - r for e, r in zip(self.execute_s, self.all_reduce_s))

    @property
    def overhead_s(self) -> float:
        """What the round adds to the slowest rank's execute: pickling, the broadcast of the
        scheduler output, the gather of the outputs, and the ranks' skew in starting."""
        return self.wall_s - max(self.execute_s)


@dataclass(frozen=True)
class TPStepProfile:
    """The step timings since the last reset (at most the last `_PROFILE_STEPS`), oldest first,
    and their medians over the steps (0.0 with no steps; per rank for the rank tuples)."""

    steps: tuple[TPStepTiming, ...]

    @property
    def wall_s(self) -> float:
        return _median([s.wall_s for s in self.steps])

    @property
    def overhead_s(self) -> float:
        return _median([s.overhead_s for s in self.steps])

    @property
    def execute_s(self) -> tuple[float, ...]:
        return self._per_rank([s.execute_s for s in self.steps])

    @property
    def compute_s(self) -> tuple[float, ...]:
        return self._per_rank([s.compute_s for s in self.steps])

    @property
    def all_reduce_s(self) -> tuple[float, ...]:
        return self._per_rank([s.all_reduce_s for s in self.steps])

    @staticmethod
    def _per_rank(rows: list[tuple[float, ...]]) -> tuple[float, ...]:
        return tuple(_median(list(column)) for column in zip(*rows))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


class _ReduceClock:
    """A rank's time inside all_reduce during the current step."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0


class TPExecutor:
    """`execute(sched)` like a ModelRunner's, over `config.tensor_parallel_size` rank processes."""

    def __init__(self, config: EngineConfig, num_blocks: int,
                 rank_setup: RankSetup | None = None) -> None:
        """`rank_setup` (the worker connector's, without a local agent): each rank creates a transfer
        agent and registers its KV shard with it; `registrations` then lists them, rank order."""
        self.tp_size = config.tensor_parallel_size
        self.step_timeout_s = config.tp_step_timeout_s
        self._ranks_backend = ranks_backend(config.device)
        if self._ranks_backend == "nccl" and self.tp_size > torch.cuda.device_count():
            # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and only at the first
            # collective: the engine would start, then die on its first request.
            raise TPExecutorError(f"tensor parallel size {self.tp_size} needs one GPU per rank; torch sees "
                                  f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES, or --device cpu)")
        try:  # each rank's CPUs (--cpu-bind), checked before anything starts
            self.rank_cpus: tuple[frozenset[int], ...] | None = rank_cpus(
                config.cpu_bind, self.tp_size, os.sched_getaffinity(0), self._ranks_backend == "gloo")
        except CpuBindError as exc:
            raise TPExecutorError(f"--cpu-bind {config.cpu_bind}: {exc}") from None
        if not _active.acquire(blocking=False):
            raise TPExecutorError("another tensor-parallel engine runs in this process "
                                  "(torch.distributed has one default group per process)")
        self._lock = threading.Lock()  # one collective round at a time (engine thread, watchdog's ping)
        self._failure: str | None = None
        self._step_deadline: float | None = None
        self._last_round = time.monotonic()
        self._stopping = threading.Event()
        self._procs: list[Any] = []
        self._channel: StepChannel | None = None
        self.registrations: list[Any] = []  # each rank's rank_agent.RankRegistration (with a rank_setup)
        self._timings: collections.deque[TPStepTiming] = collections.deque(maxlen=_PROFILE_STEPS)
        self._timings_lock = threading.Lock()  # step_profile() may be called from another thread
        try:
            self._start(config, num_blocks, rank_setup)
        except BaseException:
            self._reap()
            _active.release()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="kvbridge-tp-watchdog", daemon=True)
        self._watchdog.start()

    # ---- the engine thread's calls ---------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        started = time.perf_counter()
        replies = self._round(_Step(sched), self.step_timeout_s)[1:]
        wall = time.perf_counter() - started
        if not all(isinstance(r, _RankReply) for r in replies):
            raise TPExecutorError(f"a rank answered {[type(r).__name__ for r in replies]}")
        result = replies[0].output  # TP rank 0 samples; every rank runs the same step
        if not isinstance(result, ModelRunnerOutput):
            raise TPExecutorError(f"TP rank 0 answered {type(result).__name__}")
        result.kv_rank_reports = [r.kv_report for r in replies if r.kv_report is not None]
        tier = [r.tier_report for r in replies if r.tier_report is not None]
        if tier:  # a block loaded only where every rank loaded its shard
            result.kv_tier_report = functools.reduce(lambda a, b: a.merge(b), tier)
        timing = TPStepTiming(wall, tuple(r.execute_s for r in replies), tuple(r.all_reduce_s for r in replies),
                              replies[0].all_reduce_calls)
        with self._timings_lock:
            self._timings.append(timing)
        return result

    def step_profile(self) -> TPStepProfile:
        """The steps' timings since the last `reset_step_profile()` (the last `_PROFILE_STEPS`)."""
        with self._timings_lock:
            return TPStepProfile(tuple(self._timings))

    def reset_step_profile(self) -> None:
        with self._timings_lock:
            self._timings.clear()

    def failure(self) -> str | None:
        """Why the ranks cannot serve any more (a rank died, a step timed out), or None."""
        return self._failure

    def shutdown(self) -> None:
        """Stop the ranks and reap them all; kills any that do not exit in time. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._failure is None:
            try:
                with self._lock:
                    assert self._channel is not None
                    self._channel.broadcast(_Stop())
            except Exception:  # a rank is gone: reaping below kills the rest
                logger.debug("stopping the TP ranks failed", exc_info=True)
        self._reap()
        try:
            dist.destroy_process_group()
        except Exception:
            logger.debug("destroying the process group failed", exc_info=True)
        _active.release()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- internals ---------------------------------------------------------------
    def _start(self, config: EngineConfig, num_blocks: int, rank_setup: RankSetup | None) -> None:
        world = self.tp_size + 1
        listener = _loopback_listener()
        # torch.distributed imports TCPStore from its C module without re-exporting it by name
        store = dist.TCPStore(_HOST, listener.getsockname()[1], world, is_master=True,  # type: ignore[attr-defined]
                              timeout=datetime.timedelta(seconds=_START_TIMEOUT_S), wait_for_workers=False,
                              master_listen_fd=listener.detach())  # the store owns (and closes) it
        ctx = mp.get_context("spawn")
        for rank in range(self.tp_size):
            cpus = self.rank_cpus[rank] if self.rank_cpus is not None else None
            proc = ctx.Process(target=_rank_main, args=(config, num_blocks, rank, store.port, rank_setup, cpus),
                               name=f"kvbridge-tp-rank-{rank}", daemon=True)
            proc.start()
            self._procs.append(proc)
        with _gloo_on_loopback():
            dist.init_process_group("gloo", store=store, rank=0, world_size=world, timeout=_COLLECTIVE_TIMEOUT)
            # Every process takes part in creating the ranks' groups, in the same order as the ranks
            # (this one is not in them: the backend of its call does not matter).
            dist.new_group(ranks=list(range(1, world)))
            if self._ranks_backend != "gloo":  # the ranks' host-side barrier group (model_runner.sync_ranks)
                dist.new_group(ranks=list(range(1, world)), backend="gloo")
        ready: list[Any] = [None] * world
        dist.gather_object(None, ready, dst=0)
        errors = [f"rank {i}: {msg}" for i, (msg, _) in enumerate(ready[1:]) if msg is not None]
        if errors:
            raise TPExecutorError("tensor-parallel ranks failed to start: " + "; ".join(errors))
        self._channel = StepChannel(0, world)
        self.registrations = [reg for _, reg in ready[1:] if reg is not None]
        logger.info("tensor parallel: %d rank processes (pids %s), CPUs %s", self.tp_size, self.pids,
                    " | ".join(format_cpus(c) for c in self.rank_cpus) if self.rank_cpus is not None else "not bound")

    def _round(self, command: _Command, timeout_s: float) -> list[Any]:
        if self._failure is not None:
            raise TPExecutorError(self._failure)
        with self._lock:
            self._step_deadline = time.monotonic() + timeout_s
            try:
                assert self._channel is not None
                self._channel.broadcast(command)
                outputs = self._channel.gather()
                assert outputs is not None  # the engine process is rank 0: it receives every rank's reply
            except Exception as exc:
                self._fail(self._explain(exc))
                raise TPExecutorError(self._failure) from exc
            finally:
                self._step_deadline = None
                self._last_round = time.monotonic()
        return outputs

    def _explain(self, exc: Exception) -> str:
        for proc in self._procs:
            proc.join(timeout=1.0)  # a peer that lost its connection exits at once
        dead = [f"rank {i} (pid {p.pid}) exited with code {p.exitcode}"
                for i, p in enumerate(self._procs) if p.exitcode is not None]
        return ("; ".join(dead) if dead else f"a collective with the ranks failed: {exc}") + \
            " (see the rank's log above)"

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
            logger.error("tensor-parallel engine failed: %s", reason)

    def _watch(self) -> None:
        while not self._stopping.wait(_WATCH_INTERVAL_S):
            deadline = self._step_deadline
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"a step ran past {self.step_timeout_s:.0f} s; the rank processes were killed")
                self._kill()  # the engine's collective then raises
                return
            dead = [(i, p) for i, p in enumerate(self._procs) if not p.is_alive()]
            if dead and not self._stopping.is_set():
                self._fail("; ".join(f"rank {i} (pid {p.pid}) exited with code {p.exitcode}" for i, p in dead))
                self._kill()  # its peers would wait for it in the next collective
                return
            if (self._failure is None and deadline is None
                    and time.monotonic() - self._last_round > _PING_AFTER_IDLE_S):
                try:
                    self._round(_Ping(), self.step_timeout_s)
                except TPExecutorError:
                    return

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()

    def _reap(self) -> None:
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for proc in self._procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0.0))
        for proc in self._procs:
            if proc.is_alive():
                logger.warning("TP rank process %s did not exit; killing it", proc.pid)
                proc.kill()
                proc.join(timeout=_JOIN_TIMEOUT_S)


# ---- the rank process ------------------------------------------------------------------

def ranks_backend(device: str) -> str:
    """The ranks' collective backend: NCCL when they run on CUDA, else gloo."""
    return "nccl" if device in ("cuda", "auto") and torch.cuda.is_available() else "gloo"


def _loopback_listener() -> socket.socket:
    """A listening TCP socket on loopback and a free port, for the ranks' TCPStore."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((_HOST, 0))
        listener.listen(128)
    except BaseException:
        listener.close()
        raise
    return listener


@contextlib.contextmanager
def _gloo_on_loopback() -> Iterator[None]:
    """While it is open, the engine process's new gloo groups listen on loopback
    (GLOO_SOCKET_IFNAME; the value before is restored after)."""
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = _HOST_INTERFACE
    try:
        yield
    finally:
        if before is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = before


def _rank_main(config: EngineConfig, num_blocks: int, rank: int, store_port: int,
               rank_setup: RankSetup | None, cpus: frozenset[int] | None) -> None:
    """A rank process: join the group, build this rank's runner (and transfer agent), then serve
    steps until told to stop."""
    from kvbridge.engine.loader import load_model  # heavy imports after the fork-free spawn
    from kvbridge.engine.model_runner import ModelRunner, configure_torch_threads, tier_slots

    # Ctrl-C reaches the whole process group: the engine process stops the ranks itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tp = config.tensor_parallel_size
    world = tp + 1
    configure_torch_threads(max(1, config.num_threads // tp))
    os.environ["GLOO_SOCKET_IFNAME"] = _HOST_INTERFACE  # every gloo group of this rank listens on loopback
    store = dist.TCPStore(_HOST, store_port, world, is_master=False,  # type: ignore[attr-defined]  # (as above)
                          timeout=datetime.timedelta(seconds=_START_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank + 1, world_size=world, timeout=_COLLECTIVE_TIMEOUT)
    device = config.device
    backend = ranks_backend(device)
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank (TPExecutor checked there are enough)
        device = "cuda"
    group = dist.new_group(ranks=list(range(1, world)), backend=backend)
    # Host-side sync of the ranks (the reads of a step start together: model_runner.py), on gloo.
    cpu_group = group if backend == "gloo" else dist.new_group(ranks=list(range(1, world)), backend="gloo")
    if cpus is not None:
        # This thread, and the torch and transfer threads it starts from now on, run on the rank's
        # CPUs; gloo's threads, started above, do not (engine/tp/cpu_bind.py says why).
        os.sched_setaffinity(0, cpus)

    clock = _ReduceClock()

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        dist.all_reduce(t, group=group)
        clock.seconds += time.perf_counter() - started
        clock.calls += 1
        return t

    runner, agent, error = None, None, None
    try:
        kv = config.kv_transfer
        if rank_setup is not None and kv is not None:  # a rank setup exists only for an engine with a KV transfer config
            from kvbridge.kv_transfer.backends import create_backend
            from kvbridge.kv_transfer.connector.rank_agent import RankAgent
            transfer = create_backend(rank_setup.backend, agent_name=rank_setup.agent_name(rank), **kv.backend_options())
            agent = RankAgent(transfer, rank_setup.serves_reads, kv.transfer_timeout_s)
        loaded = load_model(config.model)
        shard = rank_shard(loaded.arch.num_heads, loaded.arch.cache_kv_heads, tp, rank)
        runner = ModelRunner(loaded.arch, loaded.weights, config.dtype, device, config.cache.block_size,
                             num_blocks, config.seed, agent, shard=shard, all_reduce=all_reduce, samples=rank == 0,
                             sync_ranks=lambda: dist.barrier(group=cpu_group),
                             tier_slots=tier_slots(config, loaded.arch), tier_dir=config.cache.kv_tier_dir)
        del loaded
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        logger.exception("TP rank %d failed to start", rank)
    dist.gather_object((error, agent.registration if agent is not None and runner is not None else None), dst=0)
    if runner is None:
        if agent is not None:
            agent.shutdown()
        return
    channel = StepChannel(rank + 1, world)
    while True:
        try:
            command = channel.broadcast()
        except Exception:  # the engine process is gone
            os._exit(1)
        if isinstance(command, _Stop):
            break
        result: _RankReply | None = None
        if isinstance(command, _Step):
            try:
                clock.seconds, clock.calls = 0.0, 0
                started = time.perf_counter()
                out = runner.execute(command.sched)
                report = out.kv_rank_reports[0] if out.kv_rank_reports else None
                out.kv_rank_reports = []  # sent once, as the reply's kv_report
                tier, out.kv_tier_report = out.kv_tier_report, None  # sent once, as the reply's tier_report
                result = _RankReply(out if rank == 0 else None, report, tier, time.perf_counter() - started,
                                    clock.seconds, clock.calls)
            except Exception:
                # Peers may be waiting in a collective this rank will never join: exit, so
                # theirs fail at once and the engine fails the step.
                traceback.print_exc()
                os._exit(1)
        try:
            channel.gather(result)
        except Exception:
            os._exit(1)
    if agent is not None:
        agent.shutdown()
    dist.destroy_process_group()
