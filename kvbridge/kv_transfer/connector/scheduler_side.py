"""The connector's scheduler half: decides what each request needs from or owes to a
remote engine, and tells the worker half once per step (ConnectorMetadata).

P (producer): a request with do_remote_decode that finishes normally keeps its blocks
(delay_free) under a lease; its response carries the kv_transfer_params D needs.
D (consumer): a request with do_remote_prefill waits in WAITING_FOR_REMOTE_KVS while
the worker half reads the blocks D lacks (those not already in D's prefix cache);
if it ends without reading (abort, rejection), P is told to release at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvbridge.config import KVTransferConfig
from kvbridge.engine.request import FinishReason, Request
from kvbridge.kv_transfer.connector.base import BlockIds, KVConnectorOutput, SchedulerConnector
from kvbridge.kv_transfer.connector.metadata import ConnectorMetadata, RecvSpec, ReleaseSpec, RemoteEngine, remote_of
from kvbridge.kv_transfer.failure import recompute_on_failure
from kvbridge.kv_transfer.handshake_manager import is_trusted_host
from kvbridge.kv_transfer.lease import LeaseTable, content_digest
from kvbridge.kv_transfer.params import KVTransferParams, KVTransferParamsError
from kvbridge.kv_transfer.stats import KVTransferStats

logger = logging.getLogger("kvbridge.kv_transfer")

HEARTBEATS_PER_LEASE = 6  # D renews waiting requests' leases this often per lease period


class KVBridgeSchedulerConnector(SchedulerConnector):
    def __init__(self, config: KVTransferConfig, engine_id: str, block_size: int, leases: LeaseTable,
                 stats: KVTransferStats, side_channel_addr: Callable[[], tuple[str, int]],
                 clock: Callable[[], float] = time.monotonic, num_groups: int = 1) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.num_groups = num_groups  # KV cache groups of the model: P lists block ids per group
        self.leases = leases
        self.stats = stats
        self._side_channel_addr = side_channel_addr
        self._clock = clock
        self._meta = ConnectorMetadata()
        self._lock = threading.Lock()  # guards _rejected: notify_rejected comes from the HTTP side
        self._rejected: list[ReleaseSpec] = []
        self._consumed: set[str] = set()  # D: requests whose remote KV was read or released
        self._waiting: dict[str, tuple[RemoteEngine, str, int]] = {}  # D: heartbeat targets
        self._last_heartbeat = clock()

    # ---- admission (D) ---------------------------------------------------
    def validate_request(self, num_prompt_tokens: int, params: KVTransferParams | None) -> None:
        """Raises KVTransferParamsError (HTTP 400) for a remote prefill D must not or cannot do."""
        if params is None or not params.wants_remote_prefill:
            return
        if not is_trusted_host(params.remote_host or "", self.config.trusted_hosts):
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_host {params.remote_host!r} is not a trusted prefill host")
        blocks = params.remote_block_ids or ()
        want = -(-num_prompt_tokens // self.block_size)
        if len(blocks) != self.num_groups or any(len(g) != want for g in blocks):
            groups = "one KV cache group" if self.num_groups == 1 else f"each of {self.num_groups} KV cache groups"
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_block_ids must list {want} block ids for a "
                f"{num_prompt_tokens}-token prompt in {groups}")

    def notify_rejected(self, request_id: str, params: KVTransferParams | None) -> None:
        """Thread-safe: D rejected a request before admission; P may free its blocks now."""
        if params is None or not params.wants_remote_prefill:
            return
        try:
            self.validate_request(len(params.remote_block_ids[0]) * self.block_size, params)
        except (KVTransferParamsError, TypeError, IndexError):
            return  # never contact an untrusted or malformed peer
        spec = ReleaseSpec(request_id, remote_of(params), params.remote_request_id or "",
                           params.lease_generation or 0)
        with self._lock:
            self._rejected.append(spec)

    def has_pending(self) -> bool:
        """Messages queued for the worker half (releases, reads): the engine must step."""
        with self._lock:
            rejected = bool(self._rejected)
        return rejected or bool(self._meta.reqs_to_recv or self._meta.reqs_to_release)

    # ---- SchedulerConnector -----------------------------------------------
    def on_new_request(self, request: Request) -> None:
        p = request.kv_transfer_params
        if p is not None and p.wants_remote_prefill:
            self._waiting[request.request_id] = (remote_of(p), p.remote_request_id or "", p.lease_generation or 0)

    def get_num_new_matched_tokens(self, request: Request, num_local_computed: int) -> tuple[int | None, bool]:
        p = request.kv_transfer_params
        if p is None or not p.wants_remote_prefill or request.request_id in self._consumed:
            return 0, False
        full_hit = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
        if num_local_computed > 0 and num_local_computed == full_hit:
            # D already holds every full block it can cache: it computes the short tail itself
            # and P only hears that it may free (update_state_after_alloc sends the release).
            return 0, False
        return request.num_prompt_tokens - num_local_computed, True

    def update_state_after_alloc(self, request: Request, block_ids: BlockIds, num_local_computed: int,
                                 num_external_tokens: int) -> None:
        p = request.kv_transfer_params
        if p is None or not p.wants_remote_prefill or request.request_id in self._consumed:
            return
        self._consumed.add(request.request_id)
        if num_external_tokens == 0:  # everything is local: P only needs to hear it may free
            self._release(request.request_id, p)
            return
        first_new = num_local_computed // self.block_size
        local = tuple(list(g[first_new:]) for g in block_ids)
        # D reads only what it lacks: the tail of P's blocks matching D's new blocks.
        remote = tuple(list(r[len(r) - len(loc):]) if loc else [] for loc, r in zip(local, p.remote_block_ids))
        self._meta.reqs_to_recv.append(RecvSpec(
            request.request_id, remote_of(p), p.remote_request_id or "", p.lease_generation or 0, local, remote,
            content_digest(request.prompt_token_ids)))

    def build_connector_meta(self) -> ConnectorMetadata:
        meta, self._meta = self._meta, ConnectorMetadata()
        with self._lock:
            meta.reqs_to_release.extend(self._rejected)
            self._rejected.clear()
        now = self._clock()
        if self._waiting and now - self._last_heartbeat >= self.config.lease_seconds / HEARTBEATS_PER_LEASE:
            self._last_heartbeat = now
            for remote, p_rid, gen in self._waiting.values():
                meta.heartbeats.setdefault(remote, []).append((p_rid, gen))
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving:
            self._waiting.pop(rid, None)

    def request_finished(self, request: Request, block_ids: BlockIds) -> tuple[bool, dict | None]:
        rid = request.request_id
        self._waiting.pop(rid, None)
        p = request.kv_transfer_params
        if p is not None and p.wants_remote_prefill and rid not in self._consumed:
            # Ended before its blocks were allocated (aborted in the queue): P frees now.
            self._release(rid, p)
        self._consumed.discard(rid)
        if p is None or not p.wants_remote_decode:
            return False, None
        if request.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH) or not block_ids[0]:
            return False, None
        if rid in self.leases:  # the engine refuses ids in use, so this is a bug: never orphan blocks
            logger.error("request %s finished while a lease on that id is held; freeing its blocks", rid)
            return False, None
        # Granted now, before the response carrying these params can reach any reader. The
        # blocks hold the prompt's KV: the lease binds them to its digest.
        generation = self.leases.new_generation()
        self.leases.grant(rid, block_ids, generation, content_digest(request.prompt_token_ids))
        host, port = self._side_channel_addr()
        return True, {
            "do_remote_decode": False, "do_remote_prefill": True,
            "remote_block_ids": list(block_ids[0]) if len(block_ids) == 1 else [list(g) for g in block_ids],
            "remote_engine_id": self.engine_id, "remote_request_id": rid,
            "remote_host": host, "remote_port": port, "tp_size": 1,
            "remote_num_tokens": request.num_prompt_tokens, "lease_generation": generation,
        }

    def recompute_on_load_failure(self, request: Request) -> bool:
        recompute = recompute_on_failure(self.config.load_failure_policy, self.config.recompute_max_tokens,
                                         request.num_prompt_tokens)
        if recompute:
            self.stats.incr("recomputed_requests")
        return recompute

    def _release(self, request_id: str, p: KVTransferParams) -> None:
        self._meta.reqs_to_release.append(
            ReleaseSpec(request_id, remote_of(p), p.remote_request_id or "", p.lease_generation or 0))
