"""Serves one LLMEngine to asyncio code while the engine runs on its own thread.

The engine is not thread-safe and its step blocks for the length of a forward pass,
so exactly one thread, the engine thread, ever touches it. Everyone else talks to that
thread through a command queue (add, abort, call, stop) that it drains between steps,
and gets outputs back through per-request asyncio queues, filled with
`loop.call_soon_threadsafe` so the HTTP event loop never waits on the engine.

Life of a request: `add_request` enqueues the add and awaits its result, so bad
input (EngineRequestError) or overload (EngineOverloadedError) reaches the caller as
an exception before any output; once admitted, a RequestStream yields the request's
outputs up to the finished one. A consumer that stops early must call
`RequestStream.abort()` (`generate` does it for you) so the engine frees the blocks.

Failure: an exception from `step()` does not end the thread silently. Every in-flight
request gets a final output with FinishReason.ERROR, the engine is marked DEAD
(/health answers 503) and new requests are refused with EngineUnavailableError.

Drain (`begin_drain`, before an instance leaves): new requests are refused with
EngineDrainingError while admitted ones run on; those still unfinished `timeout_s` later end
with an error output (error_code DRAIN_TIMEOUT) and are aborted, so their blocks are freed.
Everything else goes on as before: calls (P's release_kv), KV reads of this engine's blocks
and the connector's messages. The engine is drained (`drained`, `wait_drained`) once it has
no pending work left: no request, no block held for a remote reader (every lease ended: read
done, released or expired), no connector message in flight. Then the owner shuts it down.

Load: after each round of its loop the engine thread publishes the engine's `EngineLoad`
(`load()`), so a reader never waits for a step.

Pace: the thread waits between steps as each step's answer asks (`EngineStep.next_step`, turned
into a wait by engine/pacing.py's Pacer); a command ends any wait at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvbridge.engine.outputs import DRAIN_TIMEOUT, RequestOutput
from kvbridge.engine.pacing import Pacer
from kvbridge.engine.request import FinishReason
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.tracing import RequestTrace

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

    from kvbridge.config import EngineConfig
    from kvbridge.engine.engine import EngineLoad, EngineMetrics, LLMEngine
    from kvbridge.kv_transfer.params import KVTransferParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineState(enum.Enum):
    RUNNING = "running"
    DRAINING = "draining"  # drain asked for: new requests are refused, admitted ones run on
    SHUTTING_DOWN = "shutting_down"  # shutdown asked for: new requests are refused
    DEAD = "dead"  # step() raised: in-flight requests were failed, new ones are refused
    STOPPED = "stopped"  # the engine thread has exited


class EngineUnavailableError(RuntimeError):
    """The engine is shutting down or dead; the API answers HTTP 503."""


class EngineDrainingError(EngineUnavailableError):
    """The engine is draining: it admits no new request (HTTP 503, code "draining")."""


@dataclass(frozen=True)
class _Sink:
    loop: asyncio.AbstractEventLoop
    stream: RequestStream


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: KVTransferParams | None
    continued: tuple[int, ...]  # LLMEngine.add_request's `continued`
    sink: _Sink
    future: concurrent.futures.Future[None]
    trace: RequestTrace | None = None
    share_prompt_with: str | None = None  # LLMEngine.add_request's


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any]


class _Stop:
    pass


@dataclass(frozen=True)
class _Drain:
    deadline: float  # time.monotonic(): requests still unfinished then end with DRAIN_TIMEOUT


class _Wake:
    """Step now: a transfer started that completes only while this engine polls."""


_WAKE = _Wake()
_Command = _Add | _Abort | _Call | _Stop | _Wake | _Drain


class RequestStream:
    """The outputs of one admitted request, in order; iteration ends after the finished one.

    Lives on the event loop that admitted it. `abort()` is safe at any time; after the
    finished output it does nothing.
    """

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False

    def _put(self, output: RequestOutput) -> None:
        self._queue.put_nowait(output)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self._queue.get()
        self.finished = output.finished
        return output

    def abort(self) -> None:
        if not self.finished:
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Owns an LLMEngine and its thread. Constructing one starts the thread.

    All methods may be called from any thread; the coroutine ones need a running loop.

    `from_config` builds the engine on the engine thread, so one thread runs all its torch ops:
    OpenMP keeps a worker team per thread that ran a parallel region, and with more team threads
    than cores they sleep between ops, and a decode step slows (benchmarks/README.md).
    """

    def __init__(self, engine: LLMEngine | None = None, *, build: Callable[[], LLMEngine] | None = None,
                 thread_name: str = "kvbridge-engine") -> None:
        """Give the engine, or `build` for the engine thread to make it (what it raises, this raises;
        after a KeyboardInterrupt here the thread shuts down what it builds)."""
        if (engine is None) == (build is None):
            raise TypeError("AsyncEngine needs an engine or a build function, not both")
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _state and _stop_posted
        self._state = EngineState.RUNNING
        self._stop_posted = False
        self.dead_reason: str | None = None
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._drain_deadline: float | None = None  # engine thread only: set by _Drain
        self._drained = threading.Event()
        self._load: EngineLoad | None = None  # the engine thread's latest snapshot (one reference: atomic)
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._abandoned = False  # the constructor gave up waiting for `build` (Ctrl-C)
        if engine is not None:
            self._adopt(engine)
            self._built.set()
        self._thread = threading.Thread(target=self._build_and_run, args=(build,), name=thread_name, daemon=True)
        self._thread.start()
        try:
            self._built.wait()
        except BaseException:
            self._abandoned = True
            raise
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error

    def _adopt(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.role: str = engine.role
        self.kv_events = engine.kv_events  # where its KV events go (None: not published); fixed
        self._load = engine.load()
        engine.set_wakeup(lambda: self._commands.put(_WAKE))

    def _build_and_run(self, build: Callable[[], LLMEngine] | None) -> None:
        if build is not None:
            try:
                engine = build()
            except BaseException as exc:  # the constructor raises it
                self._build_error = exc
                self._built.set()
                return
            self._adopt(engine)
            self._built.set()
            if self._abandoned:
                engine.shutdown()
                return
        self._run()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        from kvbridge.engine.engine import LLMEngine  # heavy: torch and the model
        return cls(build=lambda: LLMEngine.from_config(config))

    # ------------------------------------------------------------ public API

    def engine_collectors(self) -> list[Collector]:
        """The engine's own Prometheus collectors (thread-safe objects, fixed at construction)."""
        return self._engine.prometheus_collectors()

    @property
    def has_kv_connector(self) -> bool:
        return self._engine.has_kv_connector  # fixed at construction: safe to read anywhere

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def is_healthy(self) -> bool:
        """Running, and able to admit requests (not draining, stopping or dead)."""
        return self._state is EngineState.RUNNING and self.is_alive

    @property
    def is_alive(self) -> bool:
        """The engine thread runs and the engine has not failed (it may be draining)."""
        return (self._state in (EngineState.RUNNING, EngineState.DRAINING) and self._thread.is_alive()
                and self._engine.failure() is None)

    @property
    def is_draining(self) -> bool:
        return self._state is EngineState.DRAINING

    @property
    def drained(self) -> bool:
        """The drain has finished: no request, lease or connector message is left."""
        return self._drained.is_set()

    def wait_drained(self, timeout_s: float | None = None) -> bool:
        """Block until drained (True) or `timeout_s` passed (False)."""
        return self._drained.wait(timeout_s)

    def load(self) -> EngineLoad:
        """The engine's load as of its thread's latest round (never waits for a step)."""
        load = self._load
        assert load is not None  # set when the engine was adopted
        return load

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                          params: SamplingParams,
                          kv_transfer_params: KVTransferParams | None = None,
                          continued: Sequence[int] = (), trace: RequestTrace | None = None,
                          share_prompt_with: str | None = None) -> RequestStream:
        """Admit a request (`continued`, `share_prompt_with`: see LLMEngine.add_request). Raises what
        `LLMEngine.add_request` raises (EngineRequestError, EngineOverloadedError) or
        EngineUnavailableError; on return the engine owns it.
        Cancelled while waiting: the request is aborted (or never added)."""
        stream = RequestStream(request_id, self)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        sink = _Sink(asyncio.get_running_loop(), stream)
        self._submit(_Add(request_id, list(prompt_token_ids), params, kv_transfer_params,
                          tuple(continued), sink, future, trace, share_prompt_with))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may already have happened
            raise
        return stream

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams,
                       kv_transfer_params: KVTransferParams | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Admit a request and yield its outputs; the request is aborted if the consumer
        stops early (close or cancellation). Admission errors raise at the first step."""
        stream = await self.add_request(request_id, prompt_token_ids, params, kv_transfer_params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request; safe for unknown or finished ids. Its final output (ABORT)
        still reaches its stream."""
        self._submit(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self.call_threadsafe(fn))

    def call_threadsafe(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Like `call`, for threads without a loop. Once the engine thread has exited, fn
        runs on the caller's thread (nobody else owns the engine any more); while it is
        stopping, the future fails with EngineUnavailableError."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if not self._stop_posted:
                self._commands.put(_Call(fn, future))
                return future
        if self._thread.is_alive():
            future.set_exception(EngineUnavailableError("the engine is stopping"))
        else:
            _run_call(_Call(fn, future), self._engine)
        return future

    async def get_metrics(self) -> EngineMetrics:
        return await self.call(lambda engine: engine.metrics())

    async def notify_kv_transfer_rejected(self, request_id: str,
                                          kv_transfer_params: KVTransferParams) -> None:
        """Tell the prefill instance to free the blocks it holds for a request this server
        rejected before admission. Never raises: a failure is logged and the lease on P
        frees the blocks later."""
        try:
            await self.call(lambda engine: engine.notify_kv_transfer_rejected(
                request_id, kv_transfer_params))
        except Exception:
            logger.warning("request %s: could not notify the prefill instance of the "
                           "rejection; its lease will free the blocks", request_id,
                           exc_info=True)

    def begin_drain(self, timeout_s: float) -> bool:
        """Refuse new requests (EngineDrainingError), let admitted ones run for up to `timeout_s`,
        then fail and abort those left; `drained` once no work is left. Does not wait. True if
        this call started the drain; False if it was already draining, stopping or dead."""
        if timeout_s < 0:
            raise ValueError("timeout_s must be >= 0")
        with self._lock:
            if self._state is not EngineState.RUNNING or self._stop_posted:
                return False
            self._state = EngineState.DRAINING
            self._commands.put(_Drain(time.monotonic() + timeout_s))
        load = self.load()
        logger.info("draining: new requests are refused; admitted ones have %.1f s to finish (%d running, %d "
                    "waiting, %d leases held)", timeout_s, load.running, load.waiting, load.leases_held)
        return True

    def begin_shutdown(self) -> None:
        """Refuse new requests and ask the engine thread to stop; does not wait. In-flight
        requests finish with FinishReason.ERROR."""
        with self._lock:
            if self._stop_posted:
                return
            if self._state in (EngineState.RUNNING, EngineState.DRAINING):
                self._state = EngineState.SHUTTING_DOWN
            self._stop_posted = True
            self._commands.put(_Stop())

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """begin_shutdown(), then wait for the engine thread (it shuts the engine down)."""
        self.begin_shutdown()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.1f s", timeout_s)

    # ------------------------------------------------------------ caller side

    def _submit(self, command: _Command) -> None:
        with self._lock:
            if isinstance(command, _Add) and self._state is EngineState.DRAINING:
                raise EngineDrainingError("the server is draining: it takes no new requests")
            if isinstance(command, _Add) and self._state is not EngineState.RUNNING:
                raise EngineUnavailableError(self._unavailable_message())
            if not self._stop_posted:
                self._commands.put(command)
                return
        if isinstance(command, _Add):  # stop posted by a failed engine, state already DEAD
            raise EngineUnavailableError(self._unavailable_message())

    def _unavailable_message(self) -> str:
        if self._state is EngineState.DEAD:
            return f"the engine failed and cannot serve requests: {self.dead_reason}"
        return "the server is shutting down"

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        pacer = Pacer()
        try:
            while True:
                self._check_failure()
                if self._drain_deadline is not None:  # before an idle wait: the last step may have ended the drain
                    self._advance_drain()
                busy = self._state is not EngineState.DEAD and self._has_work()
                commands = self._take_commands(pacer.wait_s(busy))
                self._check_failure()  # before admitting anything the engine can no longer serve
                for command in commands:
                    if isinstance(command, _Stop):
                        return
                    self._apply(command)
                if self._drain_deadline is not None:  # a drain just asked for, or its deadline passed
                    self._advance_drain()
                if self._state is EngineState.DEAD or not self._has_work():
                    self._publish_load()
                    continue
                try:
                    step = self._engine.step()
                except Exception as exc:  # a bug or a broken device: fail loudly, not silently
                    self._die(exc)
                    continue
                self._dispatch(step.outputs)
                self._publish_load()
                pacer.after(step.next_step)
        finally:
            self._stop()

    def _publish_load(self) -> None:
        try:
            self._load = self._engine.load()
        except Exception:  # a snapshot must never stop the loop; the last one stays
            logger.exception("reading the engine's load failed")

    def _advance_drain(self) -> None:
        """Draining: past the deadline, fail and abort the requests still in flight; once no work
        is left, the engine is drained (set once, logged with how P's leases ended)."""
        assert self._drain_deadline is not None
        if self._state is EngineState.DEAD:  # the server shuts down as for any failed engine
            return
        if self._sinks and time.monotonic() >= self._drain_deadline:
            in_flight = list(self._sinks)
            logger.warning("drain timeout: ending %d unfinished requests with an error", len(in_flight))
            self._fail_all("the server drained before this request completed (drain timeout)", DRAIN_TIMEOUT)
            self._abort_in_engine(in_flight)
        if not self._drained.is_set() and not self._sinks and not self._has_work():
            outcomes = " ".join(f"{k}={v}" for k, v in self._engine.lease_outcomes().items())
            logger.info("drained: no request, lease or KV message is left; kv_blocks_used=%d; leases ended "
                        "since start: %s", self._engine.load().kv_blocks_used, outcomes or "none")
            self._drained.set()

    def _check_failure(self) -> None:
        """A failure found outside a step (e.g. a TP rank process died while idle) kills the engine."""
        if self._state is not EngineState.DEAD:
            failure = self._engine.failure()
            if failure is not None:
                self._die(RuntimeError(failure))

    def _has_work(self) -> bool:
        # has_pending_work, not has_unfinished_requests: a prefill instance must keep
        # stepping while it holds finished requests' blocks for remote readers (leases).
        try:
            return self._engine.has_pending_work()
        except Exception as exc:
            self._die(exc)
            return False

    def _take_commands(self, wait: float) -> list[_Command]:
        """The commands queued now, after waiting up to `wait` seconds for the first one."""
        commands: list[_Command] = []
        if wait > 0:
            if self._drain_deadline is not None and self._sinks:  # wake up for the drain's deadline
                wait = max(0.0, min(wait, self._drain_deadline - time.monotonic()))
            try:
                commands.append(self._commands.get(timeout=wait))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Add):
            self._apply_add(command)
        elif isinstance(command, _Abort):
            if self._state is not EngineState.DEAD:
                try:
                    self._engine.abort_request(command.request_id)
                except Exception:
                    logger.exception("request %s: abort failed", command.request_id)
        elif isinstance(command, _Call):
            _run_call(command, self._engine)
        elif isinstance(command, _Drain):
            self._drain_deadline = command.deadline
            self._engine.stop_retaining()  # a draining instance serves no conversation's next turn
        # _Wake: nothing to apply; taking it off the queue ended the wait, so the loop steps now

    def _apply_add(self, add: _Add) -> None:
        if not add.future.set_running_or_notify_cancel():
            # The caller gave up before the engine saw it: never add it. It was rejected
            # before admission, so a prefill instance holding its KV must hear of it.
            kv = add.kv_transfer_params
            if kv is not None and kv.do_remote_prefill and self.has_kv_connector:
                _run_call(_Call(lambda e: e.notify_kv_transfer_rejected(add.request_id, kv),
                                concurrent.futures.Future()), self._engine)
            return
        if self._state is EngineState.DEAD:
            add.future.set_exception(EngineUnavailableError(self._unavailable_message()))
            return
        try:
            self._engine.add_request(add.request_id, add.prompt_token_ids, add.params,
                                     add.kv_transfer_params, add.continued, add.trace, add.share_prompt_with)
        except Exception as exc:
            add.future.set_exception(exc)
            return
        self._sinks[add.request_id] = add.sink
        add.future.set_result(None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if output.finished:
                del self._sinks[output.request_id]
            by_loop.setdefault(sink.loop, []).append((sink.stream, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody will read these, free them
                self._abort_in_engine([s.request_id for s, out in items if not out.finished])

    def _abort_in_engine(self, request_ids: list[str]) -> None:
        """Abort requests in the engine, so it frees their blocks and the connector tells
        prefill instances it will not read theirs. Best effort: the engine may be broken."""
        for request_id in request_ids:
            try:
                self._engine.abort_request(request_id)
            except Exception:
                logger.exception("request %s: abort failed", request_id)

    def _fail_all(self, message: str, error_code: str | None = None) -> None:
        failures = [RequestOutput(request_id=rid, new_token_ids=[], new_text="", finished=True,
                                  finish_reason=FinishReason.ERROR, error=message, error_code=error_code)
                    for rid in self._sinks]
        self._dispatch(failures)
        self._sinks.clear()

    def _die(self, exc: BaseException) -> None:
        logger.exception("engine step failed; failing %d in-flight requests and refusing "
                         "new ones", len(self._sinks), exc_info=exc)
        with self._lock:
            self._state = EngineState.DEAD
            self.dead_reason = f"{type(exc).__name__}: {exc}"
        in_flight = list(self._sinks)
        self._fail_all(f"the engine failed while serving this request ({self.dead_reason})")
        self._abort_in_engine(in_flight)

    def _stop(self) -> None:
        in_flight = list(self._sinks)
        if in_flight:
            self._fail_all("the server is shutting down; the request did not complete")
            self._abort_in_engine(in_flight)
            try:
                self._engine.step()  # lets the aborts take effect (the connector's notices)
            except Exception:
                logger.exception("engine step after aborting in-flight requests failed")
        try:
            self._engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")
        with self._lock:
            self._state = EngineState.STOPPED
            self._stop_posted = True
        # Anything queued after the stop: fail it so no caller waits forever.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, (_Add, _Call)) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(EngineUnavailableError("the engine has stopped"))


def _run_call(call: _Call, engine: LLMEngine) -> None:
    if not call.future.set_running_or_notify_cancel():
        return
    try:
        call.future.set_result(call.fn(engine))
    except Exception as exc:
        call.future.set_exception(exc)


def _deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in items:
        stream._put(output)
