"""A request inside the engine: its tokens, its state and why it finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbridge.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvbridge.engine.logprobs import TokenLogprob
    from kvbridge.kv_transfer.params import KVTransferParams
    from kvbridge.tracing import RequestTrace


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # blocks allocated, KV arriving from a remote prefill
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks taken back; will recompute from its prompt + output so far
    FINISHED = "finished"

    @property
    def is_finished(self) -> bool:
        return self is RequestStatus.FINISHED


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away or asked to abort
    ERROR = "error"  # the engine could not serve it (e.g. KV transfer failed under policy "fail")


@dataclass(slots=True)
class RequestTimes:
    """When a request reached each phase in the engine, in `time.monotonic()` seconds (0.0: not
    reached), like vLLM's RequestStateStats; always noted (a few floats per request). The
    finished RequestOutput carries them for the server's per-phase histograms."""

    arrival: float  # added to the engine
    scheduled: float = 0.0  # first scheduled to compute (D: after its remote KV settled)
    first_token: float = 0.0  # this engine sampled its first token
    last_token: float = 0.0  # this engine sampled its latest token

    @property
    def queue_s(self) -> float | None:
        """Arrival -> first scheduled (vLLM's queue time)."""
        return self.scheduled - self.arrival if self.scheduled else None

    @property
    def prefill_s(self) -> float | None:
        """First scheduled -> first token (vLLM's prefill time)."""
        return self.first_token - self.scheduled if self.first_token and self.scheduled else None

    @property
    def decode_s(self) -> float | None:
        """First token -> last token (vLLM's decode time)."""
        return self.last_token - self.first_token if self.first_token else None

    @property
    def inference_s(self) -> float | None:
        """First scheduled -> last token (vLLM's inference time: prefill + decode)."""
        return self.last_token - self.scheduled if self.last_token and self.scheduled else None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()  # EOS and other end-of-generation ids
    kv_transfer_params: "KVTransferParams | None" = None
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in this request's blocks
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until scheduled
    parked_at: float = 0.0  # time.monotonic() when it began WAITING_FOR_REMOTE_KVS (D's pull rate)
    num_loaded_tokens: int = 0  # prompt tokens whose KV was read from another instance (kept after a failed read)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_code: str | None = None  # machine-readable kind of `error` (kv_transfer.params.KV_LOAD_FAILED)
    # Set by the connector's scheduler half (P: where D reads this request's KV); carried to
    # the API on the finishing output, and written as JSON only there (params.to_wire).
    kv_transfer_params_out: "KVTransferParams | None" = None
    block_hashes: list[bytes] = field(default_factory=list)  # chained digests of full blocks (kv_events/hashing.py)
    trace: "RequestTrace | None" = None  # set when the request is traced (its spans' parent)
    # With sampling_params.prompt_logprobs: those computed so far, in prompt order (the first None);
    # kept across a preemption, whose recompute does not compute them again.
    prompt_logprobs: "list[TokenLogprob | None]" = field(default_factory=list)
    # A sibling with the same prompt (n > 1): this request waits until that one's prompt is computed,
    # then takes its full blocks from the prefix cache (LLMEngine.add_request's share_prompt_with).
    prefix_leader: str | None = None
    grammar: Any = None  # with sampling_params.structured: its xgrammar matcher (engine/structured.py)
    times: RequestTimes = field(init=False)

    def __post_init__(self) -> None:
        self.times = RequestTimes(self.arrival_time)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs.append(None)

    @property
    def num_reused_tokens(self) -> int:
        """Prompt tokens computed for this request nowhere in the fleet (OpenAI's `cached_tokens`): its
        local prefix hit; with KV read from a prefill instance, that instance's own prefix hit
        (`remote_cached_tokens`, 0 when it does not say), at most what this instance did not compute."""
        local = max(self.num_cached_tokens, 0)
        params = self.kv_transfer_params
        if params is None or not params.wants_remote_prefill:
            return local
        return min(params.remote_cached_tokens or 0, local + self.num_loaded_tokens)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    def prompt_logprob_targets(self, start: int, num_new: int) -> tuple[int, tuple[int, ...]]:
        """For a chunk computing positions [start, start + num_new): the first row of the chunk whose
        logits give a prompt logprob not yet computed, and the prompt tokens those rows predict
        (position p predicts prompt token p + 1). (0, ()) when the chunk gives none."""
        if not self.wants_prompt_logprobs:
            return 0, ()
        first = max(start, len(self.prompt_logprobs) - 1)
        end = min(start + num_new, self.num_prompt_tokens - 1)
        if first >= end:
            return 0, ()
        return first - start, tuple(self.prompt_token_ids[first + 1:end + 1])

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def keeps_whole_context(self) -> bool:
        """A P request whose KV a decode instance will read: every block of every KV cache group
        stays until the read (a sliding window drops none), so D receives the whole prompt's KV."""
        return self.kv_transfer_params is not None and self.kv_transfer_params.wants_remote_decode

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None,
               error: str | None = None, error_code: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.error_code = error_code
        if self.trace is not None:
            self.trace.finished(time.time_ns(), reason.value)
