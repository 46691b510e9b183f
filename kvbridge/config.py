"""Frozen configuration dataclasses, validated in __post_init__ (ValueError, never assert).

They build on each other: EngineConfig holds a CacheConfig, a SchedulerConfig and
an optional KVTransferConfig.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum

from kvbridge.kv_events.config import KVEventsConfig
from kvbridge.shape.cpu_lists import check_spec
from kvbridge.shape.hosts import is_unspecified


class KVRole(str, Enum):
    PRODUCER = "producer"  # a prefill instance: keeps finished requests' KV for remote decode
    CONSUMER = "consumer"  # a decode instance: reads KV from remote prefill instances
    BOTH = "both"


class LoadFailurePolicy(str, Enum):
    RECOMPUTE = "recompute"
    FAIL = "fail"
    AUTO = "auto"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    # The second tier below the pool (engine/kv_tier.py): bytes of local disk for evicted blocks, all
    # TP ranks together (vLLM's --kv-offloading-size, in bytes here); 0: no tier.
    kv_offloading_bytes: int = 0
    kv_tier_dir: str | None = None  # where the tier's files go (None: the system's temporary directory)

    def __post_init__(self) -> None:
        if self.kv_offloading_bytes < 0:
            raise ValueError(f"kv_offloading_bytes must be >= 0, got {self.kv_offloading_bytes}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_waiting: int = 1024  # beyond this, new requests are refused (HTTP 503)
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")


@dataclass(frozen=True)
class KVTransferConfig:
    role: KVRole
    backend: str = "nixl"  # nixl | tcp | fake
    engine_id: str = ""
    side_channel_host: str = "127.0.0.1"  # where P's side channel and the tcp backend listen
    # The address P names in kv_transfer_params (D connects to it); "": side_channel_host.
    # Required of a producer whose side_channel_host is 0.0.0.0 or ::, which no peer can connect to.
    advertise_host: str = ""
    side_channel_port: int = 0  # 0: chosen by the OS
    lease_seconds: float = 30.0
    # An answer's cached blocks (its conversation's history) are kept for the next turn this long from
    # their last use, within the held prefixes' share of the pool (kv_transfer/lease.py); 0: not kept
    retention_seconds: float = 0.0
    handshake_timeout_s: float = 5.0
    # A KV read still in progress this long after it started fails (policy applies); the peer's
    # transfer agent is dropped first so nothing lands later (rank_agent.py).
    transfer_timeout_s: float = 30.0
    load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE
    kv_verify: bool = True  # D checks every read against P's digests before decode (kv_transfer/digest.py)
    recompute_max_tokens: int = 2048  # for policy AUTO
    trusted_hosts: tuple[str, ...] = ()  # empty: only this host's addresses
    # The API key P and D share (--api-key): side-channel requests are authenticated with a key
    # derived from it (kv_transfer/side_channel/frames.py). None: the side channel accepts unauthenticated requests.
    side_channel_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in ("nixl", "tcp", "fake"):
            raise ValueError(f"unknown KV transfer backend {self.backend!r} (nixl, tcp or fake)")
        if self.lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        if self.retention_seconds < 0:
            raise ValueError("retention_seconds must be >= 0")
        if self.handshake_timeout_s <= 0:
            raise ValueError("handshake_timeout_s must be positive")
        if self.transfer_timeout_s <= 0:
            raise ValueError("transfer_timeout_s must be positive")
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port out of range: {self.side_channel_port}")
        if is_unspecified(self.advertise_host):
            raise ValueError(f"advertise host {self.advertise_host!r} is not an address a peer can connect to")
        if is_unspecified(self.side_channel_host) and not self.advertise_host and self.role is not KVRole.CONSUMER:
            raise ValueError(f"the KV side channel binds {self.side_channel_host}: give the address peers "
                             "reach this instance at (--kv-advertise-host)")
        if self.side_channel_key is not None and not self.side_channel_key:
            raise ValueError("side_channel_key must be a non-empty string or None")

    @property
    def public_host(self) -> str:
        """The address peers are told: in kv_transfer_params and in the tcp backend's metadata."""
        return self.advertise_host or self.side_channel_host

    def backend_options(self) -> dict[str, str]:
        """create_backend options of this instance's transfer agent(s): the tcp backend's server
        listens on the side channel's address and names the public one (NIXL's UCX follows
        UCX_NET_DEVICES, which `kvbridge serve` sets from the same address: kv_transfer/net.py)."""
        if self.backend == "tcp":
            return {"host": self.side_channel_host, "advertise_host": self.public_host}
        return {}


def default_num_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class EngineConfig:
    model: str = "SmolLM2-135M-Instruct"
    served_model_name: str | None = None
    # float32 | bfloat16 | float16. The library's default stays float32 (the same numbers on every
    # machine); the command line's default, --dtype auto, is resolved to one of these before an
    # EngineConfig is built (engine/setup/dtype_choice.py: bfloat16 on a CPU with native bf16 arithmetic).
    dtype: str = "float32"
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # None: the model's own limit
    seed: int = 0
    num_threads: int = field(default_factory=default_num_threads)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig | None = None
    # Rank processes the model is split over (tensor parallelism); 1 = in the engine process.
    tensor_parallel_size: int = 1
    # A step's rank processes must answer within this long, or they are killed and the engine fails.
    tp_step_timeout_s: float = 600.0
    # Which CPUs each rank computes on: auto, none or one list per rank ("0-3|4-7");
    # shape/cpu_lists.py reads it, engine/tp/cpu_bind.py applies it.
    cpu_bind: str = "auto"
    # The model's sampling defaults for requests that omit them: auto, vllm or a folder (engine/setup/generation_config.py).
    generation_config: str = "auto"
    # --kv-events-config: vLLM's KV events (kv_events/config.py); None: none published.
    kv_events: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.tp_step_timeout_s <= 0:
            raise ValueError("tp_step_timeout_s must be positive")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r} "
                             "(auto: resolve it first, kvbridge.engine.setup.dtype_choice.resolve_dtype)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        check_spec(self.cpu_bind, self.tensor_parallel_size)  # a CpuBindError is a ValueError with the reason
