"""Builds the two connector halves of one engine and the parts they share: engine wiring, so it
lives with the engine; it reads the model's shape (shape/) and the engine's configuration and
gives kv_transfer's halves only what they need (block size, KV cache groups, element size)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import torch

from kvbridge.config import EngineConfig, KVRole
from kvbridge.kv_transfer.backends.base import TransferBackend
from kvbridge.kv_transfer.connector.scheduler_side import KVBridgeSchedulerConnector
from kvbridge.kv_transfer.connector.worker_side import KVBridgeWorkerConnector
from kvbridge.kv_transfer.failure import FailureHandler
from kvbridge.kv_transfer.side_channel.handshake import CompatibilityInfo
from kvbridge.kv_transfer.lease import LeaseTable
from kvbridge.kv_transfer.read_plan.request_reads import KVGroups
from kvbridge.kv_transfer.side_channel.server import SideChannelServer
from kvbridge.kv_transfer.stats import KVTransferStats
from kvbridge.shape.dtypes import DTYPES
from kvbridge.shape.kv_cache_layout import logical_block_size
from kvbridge.shape.kv_groups import layer_groups, slots_per_block
from kvbridge.shape.model_config import ModelArchConfig


def compatibility_of(config: EngineConfig, arch: ModelArchConfig, model_identity: str) -> CompatibilityInfo:
    """What a peer must share with this engine to exchange KV: described by what the KV cache
    holds (MLA: one latent "head" of kv_lora_rank + qk_rope_head_dim values, in one "mla" group;
    otherwise the model's K/V heads) and its KV cache groups in order, a sliding window's
    size included ("sliding_window:24"). A one-group non-MLA model's info, and so its hash,
    is the same as before MLA and sliding windows existed."""
    groups = tuple(g.kind.value if g.sliding_window is None else f"{g.kind.value}:{g.sliding_window}"
                   for g in layer_groups(arch))
    return CompatibilityInfo(model=model_identity, dtype=config.dtype, num_kv_heads=arch.cache_kv_heads,
                             head_size=arch.cache_head_size, num_layers=arch.num_layers, cache_dtype=config.dtype,
                             use_mla=arch.use_mla, kv_cache_groups=groups)


def kv_groups_of(config: EngineConfig, arch: ModelArchConfig) -> KVGroups:
    """The model's KV cache groups as D pairs blocks by them (request_reads.py)."""
    return KVGroups(tuple(g.kind.value for g in layer_groups(arch)), arch.mamba, slots_per_block(arch),
                    torch.tensor([], dtype=DTYPES[config.dtype]).element_size())


def build_connectors(config: EngineConfig, arch: ModelArchConfig, model_identity: str,
                     backend: TransferBackend | None = None, clock: Callable[[], float] = time.monotonic
                     ) -> tuple[KVBridgeSchedulerConnector, KVBridgeWorkerConnector]:
    """At TP 1 the engine process's transfer backend is created from the config unless one is
    passed in (tests pass a fake); at TP N there is none here: each rank process creates its own.
    `clock`: the leases' and the heartbeats' time (tests pass one they advance)."""
    kv = config.kv_transfer
    if kv is None:
        raise ValueError("no kv_transfer configuration")
    engine_id = kv.engine_id or f"kvbridge-{uuid.uuid4().hex[:12]}"
    stats = KVTransferStats()
    leases = LeaseTable(kv.lease_seconds, clock=clock, stats=stats, engine_id=engine_id)
    stats.held_blocks = leases.held_blocks
    stats.retained_blocks = leases.retained_blocks
    side_channel = None
    if kv.role in (KVRole.PRODUCER, KVRole.BOTH):
        side_channel = SideChannelServer({}, kv.side_channel_host, kv.side_channel_port,
                                         key=kv.side_channel_key).start()
    if config.tensor_parallel_size > 1:
        if backend is not None:
            raise ValueError("at tensor parallel size > 1 each rank process creates its own transfer backend")
    elif backend is None:
        from kvbridge.kv_transfer.backends import create_backend  # imports NIXL only when asked for
        backend = create_backend(kv.backend, agent_name=engine_id, **kv.backend_options())
    worker = KVBridgeWorkerConnector(
        kv, engine_id, backend, compatibility_of(config, arch, model_identity), leases, FailureHandler(stats),
        stats, side_channel, config.cache.enable_prefix_caching, kv_groups_of(config, arch))
    sc_addr = (lambda: (kv.public_host, side_channel.port)) if side_channel else (lambda: ("", 0))
    block_size = logical_block_size(arch, config.cache.block_size, config.tensor_parallel_size)
    scheduler = KVBridgeSchedulerConnector(kv, engine_id, block_size, leases, stats, sc_addr, clock,
                                           group_kinds=[g.kind.value for g in layer_groups(arch)],
                                           tp_size=config.tensor_parallel_size)
    return scheduler, worker
