"""The connector's view of an engine request: what its scheduler half reads of a request (and,
at P, the one thing it changes), so kv_transfer needs nothing from the engine above it.
engine/request.py's `Request` is one."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvbridge.kv_transfer.params import KVTransferParams
from kvbridge.tracing import RequestTrace

# The finish reasons (values of the engine's FinishReason, a str enum) after which P's blocks hold
# a prompt's KV worth reading: anything else (abort, error) frees them at once.
FINISHED_WITH_OUTPUT = ("stop", "length")


@runtime_checkable
class ConnectorRequest(Protocol):
    request_id: str
    # P drops the last prompt token of a Mamba model's request for remote decode (N-1 prefill).
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    kv_transfer_params: KVTransferParams | None
    # The request's trace (None: not traced): P's lease and D's load record their spans under it.
    trace: RequestTrace | None
    # Prompt tokens found in this instance's prefix cache at its first schedule (-1 until then).
    num_cached_tokens: int

    @property
    def num_reused_tokens(self) -> int:
        """Prompt tokens computed for this request nowhere in the fleet (found here, or read)."""
        ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def finish_reason(self) -> str | None:
        """Why it finished (one of the engine's FinishReason values), None while it runs."""
        ...
