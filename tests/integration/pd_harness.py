"""In-process P and D engines on the real default model, connected by a transfer
backend (the fake one with fault knobs, or a real one) and the real side channel."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig, LoadFailurePolicy, SchedulerConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.kv_connector_factory import build_connectors
from kvbridge.engine.loader import LoadedModel
from kvbridge.engine.pacing import Pacer
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.kv_transfer.backends.base import TransferBackend
from kvbridge.kv_transfer.params import parse_kv_transfer_params, to_wire

_ids = itertools.count()


def make_engine(loaded: LoadedModel, role: KVRole | None, backend: TransferBackend | None = None,
                num_blocks: int = 96, block_size: int = 16, lease_s: float = 30.0,
                policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE, backend_name: str = "fake",
                handshake_timeout_s: float = 5.0, engine_id: str | None = None,
                max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None, tp: int = 1,
                prefix_caching: bool = True, transfer_timeout_s: float = 30.0, dtype: str = "float32",
                retention_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> LLMEngine:
    """`clock`: the connector's leases' and heartbeats' time (a test advances its own)."""
    kv = None
    if role is not None:
        kv = KVTransferConfig(role=role, backend=backend_name, engine_id=engine_id or f"{role.value}-{next(_ids)}",
                              lease_seconds=lease_s, retention_seconds=retention_s, load_failure_policy=policy,
                              handshake_timeout_s=handshake_timeout_s, transfer_timeout_s=transfer_timeout_s)
    scheduler = SchedulerConfig(**{k: v for k, v in (("max_num_seqs", max_num_seqs),
                                                     ("max_num_batched_tokens", max_num_batched_tokens))
                                   if v is not None})
    config = EngineConfig(model=loaded.source, tensor_parallel_size=tp, kv_transfer=kv, num_threads=2, dtype=dtype,
                          cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                            enable_prefix_caching=prefix_caching), scheduler=scheduler)
    connectors = build_connectors(config, loaded.arch, loaded.name, backend, clock) if kv is not None else None
    return LLMEngine(config, loaded, connectors)


def prefill(p: LLMEngine, prompt: list[int], request_id: str | None = None, timeout_s: float = 60.0) -> dict:
    """Run the P half of a request; returns the kv_transfer_params P answers with."""
    rid = request_id or f"p-{next(_ids)}"
    p.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0),
                  parse_kv_transfer_params({"do_remote_decode": True}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for out in p.step().outputs:
            if out.request_id == rid and out.finished:
                return to_wire(out.kv_transfer_params)  # as P's HTTP answer carries them
    raise TimeoutError("P did not finish the prefill")


def decode(d: LLMEngine, p: LLMEngine, prompt: list[int], params: dict, sp: SamplingParams,
           request_id: str | None = None, timeout_s: float = 60.0):
    """Run the D half while stepping P too (it must see notifications). Returns D's outputs."""
    rid = request_id or f"d-{next(_ids)}"
    d.add_request(rid, prompt, sp, parse_kv_transfer_params(params))
    outs = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        outs += [o for o in d.step().outputs if o.request_id == rid]
        p.step()
        if outs and outs[-1].finished:
            return outs
    raise TimeoutError("D did not finish")


def settle(*engines: LLMEngine, timeout_s: float = 10.0) -> None:
    """Step every engine until none has pending work (leases released, messages reaped)."""
    deadline = time.monotonic() + timeout_s
    pacers = [Pacer() for _ in engines]  # an idle engine waits as the serving loop's would, not spinning
    while any(e.has_pending_work() for e in engines) and time.monotonic() < deadline:
        time.sleep(min(pacer.after(e.step().next_step) for e, pacer in zip(engines, pacers)))


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]
