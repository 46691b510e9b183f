"""Continuous-batching scheduler: token budget, chunked prefill, preemption by recompute.

It holds no tensors. Each step: running requests first (decodes and unfinished
prefill chunks, preempting the newest running request when blocks run out),
then waiting requests in arrival order while the token budget, the sequence
limit and the block pool allow. A request whose prompt KV comes from a remote
prefill waits in WAITING_FOR_REMOTE_KVS, taking blocks but no compute, until
the connector reports its load settled.

It notes when each request reaches a phase (RequestTimes, monotonic: always) and, for a traced
request only (`request.trace is not None`, one test per scheduled request), the wall-clock times
its spans are made from (tracing/request_trace.py): a traced request's chunk is listed when it is
scheduled and its span recorded when the step's results come back.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kvbridge.config import SchedulerConfig
from kvbridge.engine.block_pool import KVBlock
from kvbridge.engine.kv_cache_manager import KVCacheManager
from kvbridge.engine.kv_tier import KVTierIndex, TierReport
from kvbridge.engine.request import FinishReason, Request, RequestStatus
from kvbridge.engine.retention import Retentions
from kvbridge.engine.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from kvbridge.kv_transfer.connector.base import KVConnectorOutput, SchedulerConnector
from kvbridge.kv_transfer.params import KV_LOAD_FAILED, BlockIds, KVTransferParams
from kvbridge.tracing import RequestTrace

logger = logging.getLogger(__name__)

# The most of the block pool that held prefixes (hold_prefix: blocks pinned for another instance's
# read, until its lease ends) and retained answers (engine/retention.py) may pin together; a hold
# beyond it ends retentions first, then holds nothing.
MAX_HELD_FRACTION = 0.25


class TierHit(Enum):
    """What a waiting request's prefix in the KV tier (engine/kv_tier.py) means for it this step."""

    NONE = "none"  # no tier blocks past the pool's hit (or recomputing them is faster): compute
    WAIT = "wait"  # another request's load reads its blocks this step: they will be in the pool
    PARKED = "parked"  # its load runs this step; it computes the rest from the next one
    NO_ROOM = "no_room"  # no free blocks to load into


@dataclass(frozen=True)
class TracedChunk:
    """A traced request's work in this step: `num_tokens` from `start_ns` (wall clock, scheduled)."""

    request: Request
    start_ns: int
    num_tokens: int


@dataclass(frozen=True)
class FirstStep:
    """A traced request's step that produced its first token (or D's first decode step): its span
    ends once the step's output is made (LLMEngine.step)."""

    trace: RequestTrace
    name: str
    start_ns: int
    num_tokens: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int,
                 connector: SchedulerConnector | None = None, tier: KVTierIndex | None = None,
                 prefer_tier_load: Callable[[int], bool] | None = None) -> None:
        """`tier`: the KV tier below the pool (None: none); `prefer_tier_load(tokens)`: whether loading
        that many tokens' KV from it is predicted faster than computing them (None: always)."""
        self.config = config
        self.kvm = kv_cache_manager
        self.max_model_len = max_model_len
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote_waiting: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS
        self.sending: dict[str, Request] = {}  # finished, blocks held for a remote reader
        self.held_prefixes: dict[str, int] = {}  # hold id -> blocks it pins (hold_prefix), until its lease ends
        # finished answers' blocks kept for their conversation's next turn (--kv-retention-seconds)
        self.retentions = Retentions(kv_cache_manager, connector) if connector is not None else None
        self.tier = tier
        self.prefer_tier_load = prefer_tier_load
        self.tier_loading: dict[str, Request] = {}  # loading from the tier this step (within one step only)
        self._asked_connector: set[str] = set()
        self._finished_since_step: set[str] = set()
        self.num_preemptions = 0
        self._traced: list[TracedChunk] = []  # traced requests' chunks in the step being run
        self.first_steps: list[FirstStep] = []  # the engine records them once the step's outputs are made

    # ---- admission -----------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.remote_waiting)

    def can_admit(self) -> bool:
        return len(self.waiting) < self.config.max_waiting

    def add_request(self, request: Request) -> None:
        if request.trace is not None:
            request.trace.arrival_ns = time.time_ns()
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.connector is not None:
            self.connector.on_new_request(request)

    def holds(self, request_id: str) -> bool:
        """Any state for this id: queued, running, waiting for remote KV, finished but still
        settling a read, or finished with its blocks held for a remote reader (a lease)."""
        return (request_id in self.requests or request_id in self.sending
                or (self.retentions is not None and request_id in self.retentions))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.remote_waiting)

    def has_pending_work(self) -> bool:
        """Anything a step could advance: requests, or blocks held for remote readers."""
        return self.has_unfinished() or bool(self.sending)

    # ---- finishing -----------------------------------------------------
    def finish_request(self, request_id: str, reason: FinishReason, error: str | None = None,
                       stop_reason: str | int | None = None) -> Request | None:
        """Finish a live request from outside the step (abort, stop string). Returns it, or
        None if it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.status.is_finished:
            return None
        if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            # A read may still be writing into its blocks: free them only once it settles.
            req.finish(reason, stop_reason, error)
            return req
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish(reason, stop_reason, error)
        self._free_request(req)
        return req

    def _free_request(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self._asked_connector.discard(req.request_id)
        self._finished_since_step.add(req.request_id)
        delay = False
        if self.connector is not None:
            delay, params = self.connector.request_finished(req, self.kvm.get_block_ids(req.request_id))
            req.kv_transfer_params_out = params
        if delay:
            self.sending[req.request_id] = req
        else:
            if self.retentions is not None:
                self.retentions.retain(req, self._hold_room())
            self.kvm.free(req.request_id)

    def _hold_room(self) -> int:
        """Blocks retentions may pin: MAX_HELD_FRACTION of the pool less what held prefixes pin."""
        return int(MAX_HELD_FRACTION * self.kvm.pool.num_usable_blocks) - sum(self.held_prefixes.values())

    def end_retentions(self, for_good: bool = False) -> None:
        """End every retention now (a prefix-cache reset; `for_good`: a drain, nothing retained from
        now on): their blocks are freed."""
        if self.retentions is not None:
            self.retentions.close() if for_good else self.retentions.end_all()

    # ---- scheduling ----------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            block_ids = self._allocate(req, num_new)
            while block_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                block_ids = self.kvm.allocate_slots(req, num_new)
            if block_ids is None:
                break
            scheduled.append(self._scheduled(req, num_new, block_ids))
            budget -= num_new
            i += 1

        if not preempted:
            budget = self._schedule_waiting(budget, scheduled)

        meta = self.connector.build_connector_meta() if self.connector is not None else None
        finished, self._finished_since_step = self._finished_since_step, set()
        tier = self.tier.take_work() if self.tier is not None else None
        return SchedulerOutput(scheduled, finished, meta, kv_tier=tier)

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._leader_computing(req):  # its prompt's blocks will be cached in a step or two
                skipped.append(self.waiting.popleft())
                continue
            hits: tuple[list[KVBlock], ...] = tuple([] for _ in self.kvm.groups)
            num_local = 0
            fresh = self.kvm.num_allocated_tokens(req.request_id) == 0
            if fresh:
                hits, num_local = self.kvm.get_computed_blocks(req)
                if num_local and self.retentions is not None:
                    self.retentions.touch(hits)  # a retained history used: its conversation is live
            if fresh and self.connector is not None and self._wants_remote_kv(req):
                n_ext, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
                if n_ext is None:
                    skipped.append(self.waiting.popleft())
                    self._asked_connector.discard(req.request_id)
                    continue
                if n_ext > 0 and load_async:
                    block_ids = self._allocate(req, n_ext, hits)
                    if block_ids is None:
                        self._asked_connector.discard(req.request_id)
                        break
                    self.waiting.popleft()
                    req.num_computed_tokens = num_local
                    req.num_cached_tokens = num_local
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    req.parked_at = time.monotonic()
                    self.remote_waiting[req.request_id] = req
                    if req.trace is not None:
                        req.trace.parked(time.time_ns(), sum(len(g) for g in block_ids), n_ext)
                    self.connector.update_state_after_alloc(req, block_ids, num_local, n_ext)
                    continue
            if fresh and self.tier is not None:
                hit = self._tier_load(req, hits, num_local)
                if hit is TierHit.WAIT:
                    skipped.append(self.waiting.popleft())
                    continue
                if hit is TierHit.PARKED:
                    continue
                if hit is TierHit.NO_ROOM:
                    break
            num_new = req.num_tokens - req.num_computed_tokens - num_local
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            block_ids = self._allocate(req, num_new, hits if fresh else None)
            if block_ids is None:
                break
            self.waiting.popleft()
            if fresh:
                req.num_computed_tokens = num_local
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_local
            if fresh and self.connector is not None and req.request_id in self._asked_connector:
                self.connector.update_state_after_alloc(req, block_ids, num_local, 0)
            req.status = RequestStatus.RUNNING
            if not req.times.scheduled:
                req.times.scheduled = time.monotonic()
            self.running.append(req)
            scheduled.append(self._scheduled(req, num_new, block_ids))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _allocate(self, req: Request, num_new: int,
                  hits: tuple[list[KVBlock], ...] | None = None) -> BlockIds | None:
        """kvm.allocate_slots, ending held prefixes nobody reads yet while blocks are short: a hold
        (another instance's wish to read a prefix) never makes a request of this instance wait or be
        preempted."""
        block_ids = self.kvm.allocate_slots(req, num_new, hits)
        while block_ids is None and self._end_a_hold():
            block_ids = self.kvm.allocate_slots(req, num_new, hits)
        return block_ids

    def _end_a_hold(self) -> bool:
        """End the oldest held prefix whose lease no reader was granted a read of, and free its blocks
        (they stay in the prefix cache until evicted). False when no hold can end."""
        if self.connector is None:
            return False
        if self.retentions is not None and self.retentions.end_oldest():  # before a reader's hold
            return True
        for hold_id in list(self.held_prefixes):
            if self.connector.end_hold(hold_id):
                del self.held_prefixes[hold_id]
                self.sending.pop(hold_id, None)
                self.kvm.free(hold_id)
                return True
        return False

    def _tier_load(self, req: Request, hits: tuple[list[KVBlock], ...], num_local: int) -> TierHit:
        """Load the blocks of `req`'s prompt that follow its pool hit from the KV tier, when it holds
        them and that is predicted faster than computing them: blocks for them now, the load in this
        step's tier work, the request parked until the step's report (`_apply_tier_report`)."""
        assert self.tier is not None
        keys = self.kvm.tier_keys(req, num_local)
        n, busy = self.tier.lookup(keys)
        if n == 0:
            return TierHit.NONE
        if busy:
            return TierHit.WAIT
        bs = self.kvm.block_size
        if self.prefer_tier_load is not None and not self.prefer_tier_load(n * bs):
            self.tier.counters.skipped_slower += 1
            return TierHit.NONE
        block_ids = self._allocate(req, n * bs, hits)
        if block_ids is None:
            return TierHit.NO_ROOM
        self.waiting.popleft()
        req.num_computed_tokens = num_local
        first = num_local // bs
        self.tier.begin_load(req.request_id, keys[:n], block_ids[0][first:first + n])
        self.tier_loading[req.request_id] = req
        if self.connector is not None and req.request_id in self._asked_connector:
            self.connector.update_state_after_alloc(req, block_ids, num_local, 0)
        return TierHit.PARKED

    def _apply_tier_report(self, report: TierReport | None) -> None:
        """The step's tier loads settled: each parked request goes back to the head of the queue with
        the blocks that loaded and verified as computed (and in the prefix cache, for its siblings);
        from a block that failed on, it computes."""
        assert self.tier is not None
        for rid, n in self.tier.finish(report).items():
            req = self.tier_loading.pop(rid)
            req.num_computed_tokens += n * self.kvm.block_size
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.num_computed_tokens
            self.kvm.cache_blocks(req, req.num_computed_tokens)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    def hold_prefix(self, req: Request) -> tuple[KVTransferParams | None, int]:
        """Hold the longest cached prefix of `req`'s prompt (whole blocks, at least one token short of
        it) for a remote reader: reference its blocks under `req`'s id and have the connector lease
        them; they are freed when the lease ends (read done, released, expired), like a finished
        prefill's. Returns the reader's params and the tokens held, or (None, 0): nothing cached,
        this engine serves no reads, or the holds would pin more than MAX_HELD_FRACTION of the pool
        (a client asking for holds must not keep the pool from evicting)."""
        if self.connector is None or self.holds(req.request_id):
            return None, 0
        hits, n = self.kvm.get_computed_blocks(req, count=False)
        pinned = sum(len(g) for g in hits)
        if n and self.retentions is not None:
            self.retentions.touch(hits)  # a reader wants the history: its conversation is live
            while self.retentions.pinned + pinned > self._hold_room() and self.retentions.end_oldest():
                pass
        if n == 0 or sum(self.held_prefixes.values()) + pinned > MAX_HELD_FRACTION * self.kvm.pool.num_usable_blocks:
            return None, 0
        block_ids = self.kvm.allocate_slots(req, 0, hits)
        if block_ids is None:
            return None, 0
        params = self.connector.hold_prefix(req.request_id, req.prompt_token_ids, n, block_ids)
        if params is None:
            self.kvm.free(req.request_id)
            return None, 0
        self.sending[req.request_id] = req
        self.held_prefixes[req.request_id] = pinned
        return params, n

    def _leader_computing(self, req: Request) -> bool:
        """Whether `req` waits for its prefix leader (a sibling with its prompt, Request.prefix_leader),
        still live and short of its prompt's last token. A leader that finished or left lets it go."""
        if req.prefix_leader is None:
            return False
        leader = self.requests.get(req.prefix_leader)
        if leader is None or leader.status.is_finished or leader.num_computed_tokens >= leader.num_prompt_tokens - 1:
            req.prefix_leader = None
            return False
        return True

    def _wants_remote_kv(self, req: Request) -> bool:
        if req.request_id in self._asked_connector:
            return False
        self._asked_connector.add(req.request_id)
        return True

    def _scheduled(self, req: Request, num_new: int, block_ids: BlockIds) -> ScheduledRequest:
        start = req.num_computed_tokens
        tokens = req.all_token_ids[start:start + num_new]
        sample = start + num_new == req.num_tokens
        penalised = sample and req.sampling_params.penalises_repetition
        if req.trace is not None:
            now = time.time_ns()
            if not req.trace.scheduled_ns:
                req.trace.first_scheduled(now)
            self._traced.append(TracedChunk(req, now, num_new))
        lp_row, lp_targets = req.prompt_logprob_targets(start, num_new)
        return ScheduledRequest(
            request_id=req.request_id, token_ids=tokens, start_pos=start, block_ids=block_ids,
            sample=sample, sampling_params=req.sampling_params, num_output_tokens=req.num_output_tokens,
            penalty_token_ids=tuple(req.all_token_ids) if penalised else (),
            prompt_logprob_row=lp_row, prompt_logprob_targets=lp_targets)

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: drop the blocks, start over from the prompt + output so far."""
        self.kvm.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted request %s", req.request_id)

    # ---- results -------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[Request]:
        """Advance requests by the step's results. Returns requests that produced a token or
        finished in this update (in that order)."""
        touched: list[Request] = []
        if self._traced:
            self._trace_step(out)
        now = time.monotonic()
        for s in sched.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished (aborted) during the step, or preempted
            req.num_computed_tokens += len(s.token_ids)
            self.kvm.cache_blocks(req, req.num_computed_tokens)
            if s.prompt_logprob_targets:
                req.prompt_logprobs.extend(out.prompt_logprobs.get(s.request_id, ()))
            if not s.sample:
                continue
            error = out.sampling_errors.get(s.request_id)
            if error is not None:  # this request alone fails; the batch goes on
                self.running.remove(req)
                req.finish(FinishReason.ERROR, error=error)
                self._free_request(req)
                touched.append(req)
                continue
            token = out.sampled_token_ids[s.request_id]
            req.output_token_ids.append(token)
            req.times.last_token = now
            if not req.times.first_token:
                req.times.first_token = now
            touched.append(req)
            self._check_stop(req, token)
        if out.kv_connector_output is not None:
            touched.extend(self._apply_connector_output(out.kv_connector_output))
        if sched.kv_tier is not None and self.tier is not None:
            self._apply_tier_report(out.kv_tier_report)
        return touched

    def _trace_step(self, out: ModelRunnerOutput) -> None:
        """The traced requests' chunks of the step whose results are `out`: their spans (before the
        step's tokens finish any request, so a finishing request's decode counts its last token)."""
        end = time.time_ns()
        traced, self._traced = self._traced, []
        for chunk in traced:
            req = chunk.request
            trace = req.trace
            assert trace is not None
            sampled = (req.status is RequestStatus.RUNNING and req.request_id in out.sampled_token_ids
                       and self.requests.get(req.request_id) is req)
            first = trace.step_ran(chunk.start_ns, end, chunk.num_tokens, sampled)
            if first is not None:
                self.first_steps.append(FirstStep(trace, first, chunk.start_ns, chunk.num_tokens))

    def _check_stop(self, req: Request, token: int) -> None:
        sp = req.sampling_params
        reason: FinishReason | None = None
        stop_reason: int | None = None
        if token in sp.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, token
        elif not sp.ignore_eos and token in req.eos_token_ids:
            reason = FinishReason.STOP
        elif req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.running.remove(req)
            req.finish(reason, stop_reason)
            self._free_request(req)

    def _apply_connector_output(self, out: KVConnectorOutput) -> list[Request]:
        assert self.connector is not None
        self.connector.update_connector_output(out)
        if out.invalid_block_ids:
            self.kvm.invalidate_blocks(out.invalid_block_ids)
        finished: list[Request] = []
        for rid in out.finished_recving:
            req = self.remote_waiting.pop(rid, None)
            if req is None:
                continue
            if req.status.is_finished:
                # Aborted while its read was in flight: its final output went out with the
                # abort; now that nothing writes into its blocks any more, free them.
                self._free_request(req)
                continue
            if rid in out.failed_recving:
                if not self._recover_failed_load(req, out):
                    finished.append(req)
                continue
            # The whole prompt is loaded; recompute its last token to get logits, or, for a
            # request that continues from tokens P sampled, compute those (the prompt's KV is
            # complete and the last known token is P's). A held prefix: compute the rest.
            params = req.kv_transfer_params
            if params is not None and params.remote_prefix_tokens is not None:
                req.num_computed_tokens = params.remote_prefix_tokens  # below the prompt (validated)
            else:
                req.num_computed_tokens = req.num_prompt_tokens - (0 if req.output_token_ids else 1)
            req.num_loaded_tokens = req.num_computed_tokens - max(req.num_cached_tokens, 0)
            self.kvm.cache_blocks(req, req.num_computed_tokens)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
            if req.trace is not None:
                req.trace.kv_loaded = True
        for rid in out.finished_sending:
            req = self.sending.pop(rid, None)
            self.held_prefixes.pop(rid, None)
            if req is not None:
                self.kvm.free(rid)
            elif self.retentions is not None:
                self.retentions.finished(rid)
        return finished

    def _recover_failed_load(self, req: Request, out: KVConnectorOutput) -> bool:
        """Apply the load-failure policy. Returns True if the request lives on (recompute)."""
        assert self.connector is not None
        cause = out.failure_causes.get(req.request_id, "KV transfer from the prefill instance failed")
        if self.connector.recompute_on_load_failure(req):
            if self.kvm.has_mamba:
                # A Mamba state holds the whole context or nothing: recompute from the start
                # (the first chunk ignores whatever its state block holds).
                req.num_computed_tokens = 0
            else:
                block_ids = self.kvm.get_block_ids(req.request_id)[0]
                bs = self.kvm.block_size
                first_bad = next((i for i, b in enumerate(block_ids) if b in out.invalid_block_ids),
                                 req.num_computed_tokens // bs)
                # Blocks before the first invalid one were loaded intact and are kept.
                req.num_computed_tokens = min(first_bad * bs, req.num_prompt_tokens - 1)
            req.num_loaded_tokens = max(req.num_computed_tokens - max(req.num_cached_tokens, 0), 0)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
            if req.trace is not None:
                kind = out.failure_kinds.get(req.request_id)
                req.trace.recompute_started(time.time_ns(), kind.value if kind is not None else "unknown",
                                            req.num_tokens - req.num_computed_tokens, req.num_computed_tokens)
            logger.warning("request %s: %s; recomputing locally from token %d",
                           req.request_id, cause, req.num_computed_tokens)
            return True
        req.finish(FinishReason.ERROR, error=f"{cause}. The request may be retried.", error_code=KV_LOAD_FAILED)
        self._free_request(req)
        return False
