"""`--kv-events-config`: vLLM's KVEventsConfig, field for field, parsed from its JSON.

Fields, meanings and defaults are vLLM 0.33.0's (`vllm/config/kv_events.py`) but one: the
default `endpoint` is `tcp://127.0.0.1:*`, loopback on a port the OS picks, where vLLM's is
`tcp://*:5557`, every interface. The bind rule is vLLM's: an endpoint that contains `*` (or
`::`, or is ipc:// or inproc://) is bound, any other is connected to (the subscriber then
binds). So events leave the machine only where the operator writes an address that says so.
`replay_endpoint` is always bound (vLLM's rule too); None means no replay.

kvbridge has no data-parallel ranks, so vLLM's per-rank port offset does not apply.
"""

from __future__ import annotations

from typing import Literal

import pydantic

DEFAULT_ENDPOINT = "tcp://127.0.0.1:*"


class KVEventsConfig(pydantic.BaseModel):
    """Unknown fields are errors (a misspelled field would otherwise be silently ignored)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" when enabled, else "null"
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = pydantic.Field(default=10_000, ge=1)  # batches kept for replay
    hwm: int = pydantic.Field(default=100_000, ge=0)  # PUB send high-water mark, messages (0: none)
    max_queue_size: int = pydantic.Field(default=100_000, ge=1)  # batches waiting for the thread
    topic: str = ""

    @pydantic.field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_address(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{value!r} is not a ZMQ endpoint (tcp://, ipc:// or inproc://)")
        return value

    @pydantic.model_validator(mode="after")
    def _resolve_publisher(self) -> KVEventsConfig:
        if self.publisher is None:  # vLLM's __post_init__
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        return self

    @property
    def publishes(self) -> bool:
        """Whether events go out at all (vLLM's EventPublisherFactory: enabled and not null)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The config from `--kv-events-config`'s JSON. Raises ValueError naming every bad field
    (a flag parser can show it as is)."""
    try:
        return KVEventsConfig.model_validate_json(text)
    except pydantic.ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '(json)'}: {err['msg']}"
                             for err in e.errors())
        raise ValueError(f"--kv-events-config: {problems}") from None


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, an IPv6 any-address, ipc:// and inproc://; connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
