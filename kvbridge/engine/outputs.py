"""What the engine reports back per step for each request that made progress."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge.engine.logprobs import TokenLogprob
from kvbridge.engine.request import FinishReason, RequestTimes

__all__ = ["DRAIN_TIMEOUT", "REQUEST_OUTPUT_FAILED", "RequestOutput", "TokenLogprob"]

if TYPE_CHECKING:
    from kvbridge.kv_transfer.params import KVTransferParams


# RequestOutput.error_code of a request whose own output stage (detokenising, stop strings,
# building its output) raised: that request fails, the engine and the batch go on.
REQUEST_OUTPUT_FAILED = "request_output_failed"
# RequestOutput.error_code of a request still unfinished when its server's drain timed out
# (--drain-timeout-s): it ends with an error (HTTP 503, or a stream's error event), never truncated.
DRAIN_TIMEOUT = "drain_timeout"


@dataclass
class RequestOutput:
    """Incremental output of one request for one engine step.

    `new_token_ids` / `new_text` are deltas since the previous output of the same request.
    `finished` is set exactly once per request; then `finish_reason` is not None.
    `kv_transfer_params` is set only on the finishing output of a request whose
    connector returned parameters (P side: where D can read the KV); the HTTP edge writes
    it as JSON (params.to_wire).
    `error` is a human-readable cause when finish_reason is ERROR; `error_code` says what
    kind of failure it was where the API answers it differently (KV_LOAD_FAILED).
    `times` (finishing output only): when the request reached each phase in the engine.
    `prompt_logprobs`: see the field.
    `num_cached_tokens`: prompt tokens found in this instance's prefix cache; `num_loaded_tokens`:
    prompt tokens whose KV was read from another instance. This instance computed the rest of the prompt.
    `num_reused_tokens`: prompt tokens computed for this request nowhere in the fleet.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_loaded_tokens: int = 0
    num_reused_tokens: int = 0  # Request.num_reused_tokens: what the answer's usage calls cached_tokens
    logprobs: list[TokenLogprob] | None = None
    kv_transfer_params: "KVTransferParams | None" = None
    error: str | None = None
    stop_reason: str | int | None = None
    error_code: str | None = None
    times: RequestTimes | None = None
    # With SamplingParams.prompt_logprobs, on the request's first output only: one entry per prompt
    # token, None for the first (nothing precedes it), as vLLM's RequestOutput.prompt_logprobs.
    prompt_logprobs: "list[TokenLogprob | None] | None" = None
