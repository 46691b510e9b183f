"""The engine: one model instance and its step loop (schedule -> run -> postprocess).

Not thread-safe: one thread owns an LLMEngine (the instance server runs it on a
background thread: server/async_engine.py). It knows nothing of HTTP.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.registry import Collector

from kvbridge.config import EngineConfig, KVRole
from kvbridge.engine.block_pool import BlockPool
from kvbridge.engine.kv_cache_manager import KVCacheGroupSpec, KVCacheManager
from kvbridge.engine.kv_event_queue import KVEventQueue
from kvbridge.engine.load_rates import LoadRateMeter
from kvbridge.engine.kv_connector_factory import build_connectors
from kvbridge.engine.loader import LoadedModel, load_model
from kvbridge.engine.kv_tier import KVTierIndex, TierCollector
from kvbridge.engine.model_runner import (ModelRunner, configure_torch_threads, kv_bytes_per_block, resolve_device,
                                          tier_slots)
from kvbridge.engine.models import check_arch_tp_split
from kvbridge.engine.output_processor import OutputProcessor
from kvbridge.engine.outputs import REQUEST_OUTPUT_FAILED, RequestOutput
from kvbridge.engine.pacing import NextStep, Pacer, next_step
from kvbridge.engine.request import FinishReason, Request
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.engine.scheduler import Scheduler
from kvbridge.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvbridge.engine.tp.executor import TPExecutor
from kvbridge.kv_events.events import KVEventBatch
from kvbridge.kv_events.hashing import model_root
from kvbridge.kv_events.publisher import EventPublisher, NullEventPublisher, make_publisher
from kvbridge.kv_transfer.connector.base import KVConnectors, SchedulerConnector, WorkerConnector, WorkerStatus
from kvbridge.kv_transfer.params import MAX_GENERATED_TOKENS, KVTransferParams
from kvbridge.shape.dtypes import DTYPES
from kvbridge.shape.kv_cache_layout import logical_block_size
from kvbridge.shape.kv_groups import KVCacheKind, layer_groups
from kvbridge.engine.structured import Grammars, StructuredOutputError, accept as accept_token
from kvbridge.tracing import RequestTrace

logger = logging.getLogger(__name__)


class EngineRequestError(ValueError):
    """The request cannot be served as asked (client error, HTTP 400); `param`: the field at fault, if known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class DuplicateRequestIdError(EngineRequestError):
    """The request id is in use: by a live request, or by a finished one whose blocks are
    still held for a remote reader (its lease must keep them until it ends)."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting (HTTP 503)."""


@dataclass(frozen=True)
class EngineStep:
    """What one `LLMEngine.step()` did: the outputs of the requests that made progress or finished
    (those finished between steps first), and how soon the next step is due (engine/pacing.py)."""

    outputs: list[RequestOutput]
    next_step: NextStep


@dataclass(frozen=True)
class HeldPrefix:
    """What `LLMEngine.hold_prefix` held: the params a reader loads the prefix with (None: nothing
    held) and how many prompt tokens' KV that is."""

    kv_transfer_params: KVTransferParams | None
    num_tokens: int
    can_hold: bool = True  # False: this engine never holds prefixes (it serves no reads, or its model's
    # prefixes cannot be read elsewhere: a sliding window, a Mamba state)


@dataclass(frozen=True)
class EngineMetrics:
    num_running: int
    num_waiting: int
    num_held_for_remote: int  # finished requests whose blocks wait for a remote reader
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


@dataclass(frozen=True)
class EngineLoad:
    """How busy this engine is, for a router or an autoscaler (GET /kvbridge/load). The engine
    thread makes one after each step; it is read from any thread without waiting for a step."""

    role: str  # "prefill" (kv role producer), "decode" (consumer) or "both" (kv both, or no KV transfer)
    running: int
    waiting: int  # queued, or waiting for their KV from a prefill instance
    queued_prompt_tokens: int  # prompt tokens of queued requests not computed yet
    oldest_arrival: float | None  # time.monotonic() at which the oldest waiting request arrived; None: none waits
    kv_blocks_total: int
    kv_blocks_used: int  # held by requests and leases; retained answers' blocks not counted (any request takes them)
    leases_held: int  # P: leases granted on finished requests' blocks and not ended yet
    # Measured rates (engine/load_rates.py), None until measured, and the KV one token takes.
    prefill_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    kv_pull_bytes_per_s: float | None = None
    kv_bytes_per_token: int = 0
    kv_blocks_retained: int = 0  # kept for conversations' next turns (--kv-retention-seconds)

    def oldest_wait_s(self, now: float) -> float:
        return max(0.0, now - self.oldest_arrival) if self.oldest_arrival is not None else 0.0


HOLD_PARAMS = SamplingParams(max_tokens=1)  # what a held prefix's prompt is checked against (the turn it serves)

_ROLES = {KVRole.PRODUCER: "prefill", KVRole.CONSUMER: "decode", KVRole.BOTH: "both"}


@dataclass(frozen=True)
class KVEventsInfo:
    """Where this engine publishes its KV events (GET /kvbridge/kv_events): the addresses bound
    (ports resolved), and what a subscriber needs to compute the same block hashes."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    block_size: int
    hash_root: str  # hex of kv_events.hashing.model_root(model_identity)
    data_parallel_rank: int = 0


def model_identity(name: str, arch: object, dtype: str) -> str:
    """What names this model's KV exactly, for the block hashes' root: the model's name, a digest
    of its architecture (every dimension) and the KV dtype. Instances of one model and dtype agree,
    in any process and after restarts; a different model or dtype never shares a block hash."""
    return f"{name}|{hashlib.sha256(repr(arch).encode()).hexdigest()[:16]}|{dtype}"


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel,
                 connectors: tuple[SchedulerConnector, WorkerConnector] | None = None) -> None:
        """`connectors`: the KV connector's (scheduler, worker) halves, or None (no P/D)."""
        configure_torch_threads(config.num_threads)
        kv = KVConnectors(*connectors) if connectors is not None else None
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.arch = loaded.arch
        self.model_name = config.served_model_name or loaded.name
        self.max_model_len = min(config.max_model_len or loaded.arch.max_position_embeddings,
                                 loaded.arch.max_position_embeddings)
        self._check_tp_split(kv)
        self.num_blocks = self._count_blocks()
        # Tokens per scheduler block: the configured size, or a multiple of it for a hybrid Mamba
        # model (shape/kv_cache_layout.py); the attention kernel keeps the configured size.
        self.block_size = logical_block_size(loaded.arch, config.cache.block_size, config.tensor_parallel_size)
        self._mamba_groups = sum(g.kind is KVCacheKind.MAMBA for g in layer_groups(loaded.arch))
        self.hash_root = model_root(model_identity(loaded.name, loaded.arch, config.dtype))
        # KV events: recorded only when published (the null publisher's path records nothing).
        events_config = config.kv_events
        self._events = KVEventQueue() if events_config is not None and events_config.publishes else None
        self.kv_cache_manager = self._make_kv_cache_manager()
        self._rates = LoadRateMeter()
        self.kv_tier = self._make_kv_tier()
        # The load-or-compute check reads the meter only (a method of the engine would make the
        # scheduler and the engine a reference cycle: the engine's memory then waits for the cyclic GC)
        self.kv_bytes_per_token = (kv_bytes_per_block(loaded.arch, config.cache.block_size, DTYPES[config.dtype],
                                                      config.tensor_parallel_size)
                                   * config.tensor_parallel_size // config.cache.block_size)
        rank_bytes_per_token = self.kv_bytes_per_token / config.tensor_parallel_size
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, self.max_model_len,
                                   kv.scheduler if kv is not None else None, self.kv_tier,
                                   functools.partial(self._rates.tier_load_faster, bytes_per_token=rank_bytes_per_token))
        self.runner = self._start_runner(loaded, kv.worker if kv is not None else None)
        self.connectors = kv
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammars = Grammars(self.tokenizer, loaded.arch.vocab_size)  # structured output's compiler
        eos = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        self._eos_ids = frozenset(eos | set(self.tokenizer.stop_token_ids))
        self._pending: list[RequestOutput] = []  # final outputs of requests finished between steps
        self._holds = 0  # prefixes held so far (hold_prefix): their ids
        self.role = _ROLES[config.kv_transfer.role] if config.kv_transfer is not None else "both"
        self.publisher: EventPublisher = NullEventPublisher()
        self.kv_events: KVEventsInfo | None = None
        if self._events is not None:  # last: nothing after it can fail and leave its sockets open
            try:
                self.publisher = make_publisher(events_config)
            except Exception as e:  # a taken port, an unusable address: what started goes again
                self.shutdown()
                raise ValueError(f"--kv-events-config: cannot publish KV events ({e})") from e
            ep = getattr(self.publisher, "endpoint", None)
            assert events_config is not None and isinstance(ep, str)
            self.kv_events = KVEventsInfo(ep, getattr(self.publisher, "replay_endpoint", None), events_config.topic,
                                          self.block_size, self.hash_root.hex())

    def _check_tp_split(self, kv: KVConnectors | None) -> None:
        """At TP N the model must split over the ranks, and each rank process creates its own
        transfer agent (so the connectors come without one). Raises ValueError."""
        tp = self.config.tensor_parallel_size
        if tp > 1:
            check_arch_tp_split(self.arch, tp)
            if kv is not None and kv.worker.rank_setup.local_agent is not None:
                raise ValueError("at tensor parallel size > 1 each rank process creates its own transfer agent: "
                                 "build the connectors without a backend")

    def _count_blocks(self) -> int:
        """The configured number of KV blocks, or as many as the configured memory holds."""
        cache = self.config.cache
        return cache.num_blocks or max(1, cache.kv_cache_memory_bytes // kv_bytes_per_block(
            self.arch, cache.block_size, DTYPES[self.config.dtype], self.config.tensor_parallel_size))

    def _make_kv_cache_manager(self) -> KVCacheManager:
        """One KV cache group per kind of layer (full, sliding window, Mamba) over one block pool."""
        groups = [KVCacheGroupSpec(g.kind, self.block_size, g.layer_ids, g.sliding_window)
                  for g in layer_groups(self.arch)]
        sliding = any(g.sliding_window is not None for g in groups)
        pool = BlockPool(self.num_blocks, self.config.cache.enable_prefix_caching, reserve_null=sliding)
        return KVCacheManager(pool, groups, self.hash_root, self._events)

    def _make_kv_tier(self) -> KVTierIndex | None:
        """The KV tier's index (engine/kv_tier.py), when configured: for a CPU engine with prefix
        caching whose model has one KV cache group of full attention or MLA. Raises ValueError."""
        slots = tier_slots(self.config, self.arch)
        if not self.config.cache.kv_offloading_bytes:
            return None
        groups = self.kv_cache_manager.groups
        if resolve_device(self.config.device).type != "cpu":
            raise ValueError("--kv-offloading-size: the KV tier is built for CPU engines only (a GPU's host-memory "
                             "tier is not)")
        if not self.config.cache.enable_prefix_caching:
            raise ValueError("--kv-offloading-size needs prefix caching (a tier keeps evicted cached prefixes)")
        if len(groups) != 1 or groups[0].kind not in (KVCacheKind.FULL_ATTENTION, KVCacheKind.MLA):
            raise ValueError(f"--kv-offloading-size: {self.model_name}'s KV cache groups "
                             f"({', '.join(g.kind.value for g in groups)}) are not one full-attention or MLA group; "
                             "the KV tier keeps only such prefixes")
        if slots < 1:
            raise ValueError("--kv-offloading-size is smaller than one KV block")
        tier = KVTierIndex(slots, self.block_size, self._events)
        self.kv_cache_manager.pool.on_evicted = tier.evicted
        return tier

    def _start_runner(self, loaded: LoadedModel, worker: WorkerConnector | None) -> ModelRunner | TPExecutor:
        """The model runner (TP 1), or the TP ranks, which load the weights and create their
        transfer agents themselves; the worker connector learns every rank's agent and layout."""
        config = self.config
        runner: ModelRunner | TPExecutor
        setup = worker.rank_setup if worker is not None else None
        if config.tensor_parallel_size > 1:
            runner = TPExecutor(config, self.num_blocks, setup)
            registrations = runner.registrations
        else:
            agent = setup.local_agent if setup is not None else None
            runner = ModelRunner(loaded.arch, loaded.weights, config.dtype, config.device, config.cache.block_size,
                                 self.num_blocks, config.seed, agent,
                                 tier_slots=self.kv_tier.num_slots if self.kv_tier is not None else 0,
                                 tier_dir=config.cache.kv_tier_dir)
            registrations = [agent.registration] if agent is not None else []
        if worker is not None:
            worker.register_ranks(registrations)
        return runner

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        loaded = load_model(config.model)
        connectors = None
        if config.kv_transfer is not None:
            connectors = build_connectors(config, loaded.arch, loaded.name)
        return cls(config, loaded, connectors)

    @property
    def has_kv_connector(self) -> bool:
        return self.connectors is not None

    # ---- requests ------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises EngineRequestError if the request cannot be served; changes nothing."""
        if not prompt_token_ids:
            raise EngineRequestError("the prompt is empty")
        vocab = self.arch.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise EngineRequestError(f"prompt token ids must be in [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise EngineRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(prompt_token_ids)} in the prompt, {params.max_tokens} for the completion). "
                f"Please reduce the length of the prompt or max_tokens.")
        needed = -(-total // self.block_size) + self._mamba_groups
        if needed > self.num_blocks:
            raise EngineRequestError(
                f"the request needs {needed} KV blocks but the cache has only {self.num_blocks}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer_params: KVTransferParams | None = None, continued: Sequence[int] = (),
                    trace: RequestTrace | None = None, share_prompt_with: str | None = None) -> None:
        """Admit a request; raises EngineRequestError (and subclasses) or EngineOverloadedError.
        `continued`: D only, with a remote prefill: the tokens P sampled after the prompt, already
        sent to the client (the proxy's first token straight from prefill). They are the
        request's first output tokens; D computes their KV after reading the prompt's.
        `share_prompt_with`: a request admitted before with the same prompt (a sibling of n > 1):
        this one is scheduled once that one's prompt is computed (or loaded), and takes its full
        blocks from the prefix cache; ignored where nothing can be shared (caching off, a Mamba
        state, a prompt shorter than a block, prompt logprobs wanted)."""
        if self.scheduler.holds(request_id):
            raise DuplicateRequestIdError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        if self.connectors is not None:
            try:
                self.connectors.scheduler.validate_request(len(prompt_token_ids), kv_transfer_params)
            except ValueError as exc:
                raise EngineRequestError(str(exc)) from None
        if params.prompt_logprobs is not None and kv_transfer_params is not None \
                and kv_transfer_params.wants_remote_prefill:
            raise EngineRequestError("prompt_logprobs cannot be served from KV computed by another instance: send "
                                     "the request to one that computes its prompt (the proxy serves it on P)")
        if not self.scheduler.can_admit():
            raise EngineOverloadedError("the server is overloaded: too many requests are waiting")
        if continued:
            self._validate_continued(continued, params, kv_transfer_params)
        grammar = None
        if params.structured is not None:
            try:
                grammar = self.grammars.matcher(params.structured, continued)
            except StructuredOutputError as exc:
                raise EngineRequestError(str(exc), exc.param) from None
        req = Request(request_id, list(prompt_token_ids), params, self._eos_ids, kv_transfer_params,
                      output_token_ids=list(continued), trace=trace, grammar=grammar)
        if share_prompt_with is not None and self.kv_cache_manager.can_share_prompt(req):
            req.prefix_leader = share_prompt_with
        self.output_processor.add(request_id, continued, params.stop)
        self.scheduler.add_request(req)

    def _validate_continued(self, generated: Sequence[int], params: SamplingParams,
                            kv_transfer_params: KVTransferParams | None) -> None:
        """A request that continues from a prefill instance's sampled tokens: it reads the
        prompt's KV from that prefill (not on a model with Mamba layers, whose prefill samples
        after N-1 tokens); the tokens are token ids and leave at least one token to generate."""
        if self.connectors is None or kv_transfer_params is None or not kv_transfer_params.wants_remote_prefill:
            raise EngineRequestError("continue_from_token_ids needs kv_transfer_params from a prefill instance")
        if self._mamba_groups:
            raise EngineRequestError("continue_from_token_ids cannot be continued on a model with Mamba layers "
                                     "(its prefill instance computes all but the last prompt token)")
        if len(generated) > MAX_GENERATED_TOKENS:
            raise EngineRequestError(f"continue_from_token_ids holds more than {MAX_GENERATED_TOKENS} tokens")
        vocab = self.arch.vocab_size
        if any(not 0 <= t < vocab for t in generated):
            raise EngineRequestError(f"continue_from_token_ids must be in [0, {vocab})")
        if len(generated) >= params.max_tokens:
            raise EngineRequestError(f"continue_from_token_ids holds {len(generated)} tokens: "
                                     f"max_tokens ({params.max_tokens}) leaves none to generate")

    def hold_prefix(self, prompt_token_ids: Sequence[int]) -> HeldPrefix:
        """Hold the longest prefix of `prompt_token_ids` that this engine's prefix cache has (whole
        blocks, at least one token short of the prompt: a conversation's history, the answers it
        generated included) for a remote reader, under a lease (Scheduler.hold_prefix). Raises
        EngineRequestError for token ids that are not a prompt this engine could serve (`validate`,
        for one token to generate); holds nothing where nothing is cached or this engine serves no reads."""
        ids = list(prompt_token_ids)
        self.validate(ids, HOLD_PARAMS)
        if self.connectors is None or not self.connectors.scheduler.can_hold_prefixes():
            return HeldPrefix(None, 0, can_hold=False)
        self._holds += 1
        req = Request(f"kvbridge-hold-{self._holds}-{time.monotonic_ns()}", ids, HOLD_PARAMS, self._eos_ids)
        params, tokens = self.scheduler.hold_prefix(req)
        return HeldPrefix(params, tokens)

    def abort_request(self, request_id: str) -> None:
        req = self.scheduler.finish_request(request_id, FinishReason.ABORT)
        if req is not None:
            self._pending.append(self.output_processor.make_output(req, None))

    def notify_kv_transfer_rejected(self, request_id: str, kv_transfer_params: KVTransferParams | None) -> None:
        """D side: a request with a remote prefill was rejected before admission; tell P to
        free the blocks it holds for it. No-op without a connector."""
        if self.connectors is None:
            return
        self.connectors.scheduler.notify_rejected(request_id, kv_transfer_params)

    def release_kv(self, kv_transfer_params: KVTransferParams | None) -> bool:
        """P side: free the blocks held for a finished request at once (the proxy found no
        decode instance to read them). Idempotent; False if nothing was held or the params
        name another engine."""
        if self.connectors is None or kv_transfer_params is None:
            return False
        return self.connectors.worker.release(kv_transfer_params)

    def prometheus_collectors(self) -> list[Collector]:
        """Collectors a server registers on its /metrics registry (the KV connector's, the KV tier's)."""
        out = list(self.connectors.worker.collectors()) if self.connectors is not None else []
        return out + ([TierCollector(self.kv_tier)] if self.kv_tier is not None else [])

    def worker_status(self) -> WorkerStatus:
        """The connector's worker half's status now (an empty one without a connector)."""
        return self.connectors.worker.status() if self.connectors is not None else WorkerStatus()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def has_pending_work(self) -> bool:
        """Requests, blocks held for remote readers (whose leases a step must advance), or
        connector messages in flight: the owner of the loop keeps stepping while True."""
        return (self.has_unfinished_requests() or self.scheduler.has_pending_work()
                or (self.connectors is not None
                    and (self.connectors.scheduler.has_pending() or self.connectors.worker.status().has_work)))

    # ---- the step ------------------------------------------------------
    def step(self) -> EngineStep:
        """One step: schedule -> run -> postprocess. Never sleeps: how soon the next step is due
        comes back with the outputs, for the loop's owner to wait (engine/pacing.py)."""
        sched = self._schedule()
        started = time.monotonic()
        result = self._run(sched)
        self._measure(sched, result, started)
        outputs = self._postprocess(sched, result)
        if self._events is not None and len(self._events):
            self.publisher.publish(KVEventBatch(ts=time.time(), events=self._events.drain()))
        if self.scheduler.first_steps:  # traced requests' first tokens: their outputs are made
            self._record_first_steps()
        worker = self.connectors.worker.status() if self.connectors is not None else None
        return EngineStep(outputs, next_step(bool(sched.scheduled or outputs), worker))

    def _measure(self, sched: SchedulerOutput, result: ModelRunnerOutput, started: float) -> None:
        """The step's rates (engine/load_rates.py): its compute (`started`: time.monotonic() when
        the ranks' step began), and D's loads that completed (parked -> loaded)."""
        s = self.scheduler
        now = time.monotonic()
        seconds = now - started
        if sched.scheduled:
            prefill = 0
            for chunk in sched.scheduled:
                req = s.requests.get(chunk.request_id)
                if req is not None:
                    prefill += max(0, min(chunk.start_pos + len(chunk.token_ids), req.num_prompt_tokens)
                                   - chunk.start_pos)
            total = sum(len(chunk.token_ids) for chunk in sched.scheduled)
            self._rates.record_step(seconds, prefill, total - prefill)
        tier = result.kv_tier_report
        if tier is not None:
            self._rates.record_tier_load(tier.load_s, tier.load_bytes)
        out = result.kv_connector_output
        if self.connectors is None or out is None:
            return
        for rid in out.finished_recving:  # still parked: the scheduler unparks them in _postprocess
            req = s.remote_waiting.get(rid)
            if req is not None and rid not in out.failed_recving:
                to_read = max(0, req.num_prompt_tokens - req.num_computed_tokens)
                self._rates.record_pull(now - req.parked_at, to_read * self.kv_bytes_per_token)

    def _record_first_steps(self) -> None:
        end = time.time_ns()
        steps, self.scheduler.first_steps = self.scheduler.first_steps, []
        for step in steps:
            step.trace.first_step(step.name, step.start_ns, end, step.num_tokens)

    def _schedule(self) -> SchedulerOutput:
        """What the ranks compute this step, with the worker connector's commands for them."""
        sched = self.scheduler.schedule()
        for s in sched.scheduled:  # structured output: the next token's allowed ids, for the sampling rank
            if s.sample and s.sampling_params.structured is not None:
                grammar = self.scheduler.requests[s.request_id].grammar
                sched.grammar_bitmasks[s.request_id] = self.grammars.bitmask(grammar)
        if self.connectors is not None:
            sched.kv_rank_commands = self.connectors.worker.start_load_kv(sched.kv_connector_metadata)
        return sched

    def _run(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """The ranks' step (when they have work), and the worker connector's reading of their reports."""
        result = self.runner.execute(sched) if self._ranks_have_work(sched) else ModelRunnerOutput()
        if self.connectors is not None:
            result.kv_connector_output = self.connectors.worker.get_finished(result.kv_rank_reports)
        return result

    def _postprocess(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """The scheduler takes the step's result; every request it touched gets its output."""
        touched = self.scheduler.update_from_output(sched, result)
        outputs, self._pending = self._pending, []
        for req in touched:
            if req.grammar is not None and req.request_id in result.sampled_token_ids:
                self._advance_grammar(req, result.sampled_token_ids[req.request_id])
            out = self._request_output(req, result)
            if out is not None:
                outputs.append(out)
        return outputs

    def _advance_grammar(self, req: Request, token: int) -> None:
        """A structured request's sampled token advances its matcher; a token the grammar refuses (the
        bitmask forbade it: a bug) fails the request, a complete grammar ends it (as vLLM)."""
        accepted, complete = accept_token(req.grammar, token)
        if req.status.is_finished:
            return
        if not accepted:
            logger.error("request %s: sampled token %d outside its grammar", req.request_id, token)
            self.scheduler.finish_request(req.request_id, FinishReason.ERROR,
                                          error="structured output: a token outside the grammar was sampled")
        elif complete:
            self.scheduler.finish_request(req.request_id, FinishReason.STOP)

    def _request_output(self, req: Request, result: ModelRunnerOutput) -> RequestOutput | None:
        """The request's output for this step: detokenise, apply stop strings, build it.
        A failure here is this request's alone (its bookkeeping is bad, not the engine's):
        the request finishes with an error output and the batch goes on. None for a
        request whose final output already went out (it has no stream any more)."""
        if not self.output_processor.has_stream(req.request_id):
            logger.error("request %s: a step touched it after its final output (status %s); no output",
                         req.request_id, req.status.name)
            return None
        try:
            self._apply_stop_string(req, self.output_processor.detokenize(req))
            lp = result.logprobs.get(req.request_id)
            return self.output_processor.make_output(req, [lp] if lp is not None else None)
        except Exception as exc:
            return self._fail_request(req, exc)

    def _apply_stop_string(self, req: Request, stop: str | None) -> None:
        """`stop`: the stop string this step's text completed, if any. It finishes a running
        request; and a request the same token finished by length ends at the stop string, so
        that is its reason (as vLLM checks stops before length; a prefill's one-token answer
        tells the proxy the request is over)."""
        if stop is None:
            return
        if not req.status.is_finished:
            self.scheduler.finish_request(req.request_id, FinishReason.STOP, stop_reason=stop)
        elif req.finish_reason is FinishReason.LENGTH:
            req.finish_reason = FinishReason.STOP

    def _fail_request(self, req: Request, exc: Exception) -> RequestOutput:
        """Finish one request whose output stage raised, with an error output (HTTP 500 or an
        error event); its blocks go back through the scheduler's ordinary finish path."""
        logger.error("request %s: building its output failed (status %s, %d prompt + %d output tokens); "
                     "failing this request only", req.request_id, req.status.name, req.num_prompt_tokens,
                     req.num_output_tokens, exc_info=exc)
        message = f"internal error while building this request's output: {type(exc).__name__}"
        if not req.status.is_finished:
            self.scheduler.finish_request(req.request_id, FinishReason.ERROR, error=message)
        self._release_own_lease(req)
        self.output_processor.discard(req.request_id)
        return RequestOutput(request_id=req.request_id, new_token_ids=[], new_text="", finished=True,
                             finish_reason=FinishReason.ERROR, num_prompt_tokens=req.num_prompt_tokens,
                             num_output_tokens=req.num_output_tokens, error=req.error or message,
                             error_code=REQUEST_OUTPUT_FAILED, times=req.times)

    def _release_own_lease(self, req: Request) -> None:
        """P side: a request that finished (and was granted a lease) but whose answer cannot be
        sent: no reader will ever learn of its blocks, so free them now, not at expiry."""
        if req.kv_transfer_params_out is not None:
            self.release_kv(req.kv_transfer_params_out)

    def _ranks_have_work(self, sched: SchedulerOutput) -> bool:
        """Tokens to compute, finished requests to forget, transfer commands, or transfers to poll:
        otherwise the step is the engine's alone (scheduling, leases, connector messages)."""
        return bool(sched.scheduled or sched.finished_req_ids or sched.kv_rank_commands or sched.kv_tier is not None
                    or (self.connectors is not None and self.connectors.worker.needs_rank_poll()))

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """``wake`` is called from another thread when a transfer starts that needs this engine
        to step promptly (a remote reader was granted a read). It must be cheap and thread-safe."""
        if self.connectors is not None:
            self.connectors.worker.set_wakeup(wake)

    def metrics(self) -> EngineMetrics:
        s, kvm = self.scheduler, self.kv_cache_manager
        return EngineMetrics(
            num_running=len(s.running), num_waiting=s.num_waiting, num_held_for_remote=len(s.sending),
            kv_cache_usage=kvm.usage, num_free_blocks=kvm.num_free_blocks, num_total_blocks=kvm.pool.num_usable_blocks,
            prefix_cache_queries=kvm.prefix_queries, prefix_cache_hits=kvm.prefix_hits,
            num_preemptions=s.num_preemptions)

    def load(self) -> EngineLoad:
        """This engine's load now: O(waiting requests)."""
        s, pool = self.scheduler, self.kv_cache_manager.pool
        waiting = [*s.waiting, *s.remote_waiting.values()]
        retained = s.retentions.pinned if s.retentions is not None else 0
        return EngineLoad(
            role=self.role, running=len(s.running), waiting=len(waiting),
            queued_prompt_tokens=sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in s.waiting),
            oldest_arrival=min((r.arrival_time for r in waiting), default=None),
            kv_blocks_total=pool.num_usable_blocks,
            kv_blocks_used=pool.num_usable_blocks - pool.num_free_blocks - retained, kv_blocks_retained=retained,
            leases_held=self.worker_status().leases_held, prefill_tokens_per_s=self._rates.rates.prefill_tokens_per_s,
            decode_step_s=self._rates.rates.decode_step_s, kv_pull_bytes_per_s=self._rates.rates.kv_pull_bytes_per_s,
            kv_bytes_per_token=self.kv_bytes_per_token)

    def lease_outcomes(self) -> Mapping[str, int]:
        """P: how many leases ended by each outcome since start (read_done, release, expired, ...)."""
        return self.worker_status().lease_outcomes

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline helper: run prompts to completion, return their output token ids in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, plist):
            self.add_request(rid, p, sp)
        result: dict[str, list[int]] = {rid: [] for rid in ids}
        pacer = Pacer()
        while self.has_unfinished_requests():
            step = self.step()
            for out in step.outputs:
                result[out.request_id].extend(out.new_token_ids)
            pacer.sleep_after(step.next_step)
        return [result[rid] for rid in ids]

    def failure(self) -> str | None:
        """Why this engine cannot step any more although no step raised yet (a TP rank process
        died between steps), or None. Cheap; safe from any thread."""
        return self.runner.failure() if isinstance(self.runner, TPExecutor) else None

    def stop_retaining(self) -> None:
        """A drain: this instance serves no conversation's next turn. Free every retained answer's
        blocks now (--kv-retention-seconds; they stay in the prefix cache until evicted) and retain
        no answer that finishes from now on."""
        self.scheduler.end_retentions(for_good=True)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (subscribers get AllBlocksCleared with the next step's events);
        retained answers end first (their blocks would be found by no one)."""
        self.scheduler.end_retentions()
        self.kv_cache_manager.reset_prefix_cache()
        if self.kv_tier is not None:
            self.kv_tier.clear()

    def shutdown(self) -> None:
        self.publisher.shutdown()
        if self.connectors is not None:
            for half in self.connectors:
                half.shutdown()
        if isinstance(self.runner, TPExecutor):
            self.runner.shutdown()
        elif (tier := getattr(self.runner, "tier", None)) is not None:  # the KV tier's file: its disk
            tier.close()  # space goes with the descriptor (a stand-in runner of a test may have no tier)
