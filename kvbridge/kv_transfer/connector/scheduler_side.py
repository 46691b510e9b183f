"""The connector's scheduler half: decides what each request needs from or owes to a
remote engine, and tells the worker half once per step (ConnectorMetadata).

P (producer): a request with do_remote_decode that finishes normally keeps its blocks
(delay_free) under a lease; its response carries the kv_transfer_params D needs.
D (consumer): a request with do_remote_prefill waits in WAITING_FOR_REMOTE_KVS while
the worker half reads the blocks D lacks (those not already in D's prefix cache);
if it ends without reading (abort, rejection), P is told to release at once.

Models with a Mamba KV cache group (N-1 prefill, as vLLM): D recomputes the prompt's last
token to get its logits, which for attention rewrites one token's KV but for a Mamba layer
would advance a state that already holds that token. So P computes the prompt but its last
token (`on_new_request` drops it from a do_remote_decode request: P's own one sampled token is
never used) and D loads the KV and states of those N-1 tokens, then computes token N from them.
A one-token prompt leaves P nothing to send: D computes it and P only hears it may free.

First token straight from prefill (attention models only): P's params name the tokens it
sampled (`generated_token_ids`) and its lease also accepts the digest of the prompt + those
tokens. A D request that continues from them (LLMEngine.add_request's `continued`) starts
with them as output tokens: D reads the prompt's KV, computes the generated tokens' KV
itself and samples the next token; it presents the digest of its whole sequence, so P
refuses any other continuation. A Mamba P never samples from the whole prompt (N-1
prefill), so it offers no tokens, and a Mamba D refuses to continue (engine.py).

A held prefix (any instance, `hold_prefix`): an instance that answered a conversation keeps its KV
in its prefix cache; asked to hold the longest cached prefix of a new prompt, it leases those blocks
exactly as P leases a finished prompt's and answers params with `remote_prefix_tokens`. The reader
(a P that then prefills the new tokens, or a D serving the turn itself) loads that prefix through
the same receive path, lease check and content digest (of the prefix's tokens), and computes the
rest. Models whose every KV cache group keeps every token only (no sliding window, no Mamba state).

A retained answer (`retain`, --kv-retention-seconds): where prefixes can be held, a finished answer's
cached blocks (prompt and answer) stay referenced under a retention lease (lease.py) so that other
traffic does not evict its conversation's history before the next turn; the scheduler renews it on use
and ends it under pressure, when the next turn's answer is retained, or at a drain.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from kvbridge.config import KVTransferConfig
from kvbridge.kv_transfer.connector.base import KVConnectorOutput, SchedulerConnector
from kvbridge.kv_transfer.connector.metadata import ConnectorMetadata, RecvSpec, ReleaseSpec, RemoteEngine, remote_of
from kvbridge.kv_transfer.connector.request_view import FINISHED_WITH_OUTPUT, ConnectorRequest
from kvbridge.kv_transfer.failure import recompute_on_failure
from kvbridge.kv_transfer.side_channel.handshake_manager import is_trusted_host
from kvbridge.kv_transfer.lease import LeaseOutcome, LeaseTable, content_digest
from kvbridge.kv_transfer.params import MAX_GENERATED_TOKENS, BlockIds, KVTransferParams, KVTransferParamsError
from kvbridge.kv_transfer.stats import KVTransferStats
from kvbridge.tracing import RequestTrace

logger = logging.getLogger("kvbridge.kv_transfer")

HEARTBEATS_PER_LEASE = 6  # D renews waiting requests' leases this often per lease period


class KVBridgeSchedulerConnector(SchedulerConnector):
    def __init__(self, config: KVTransferConfig, engine_id: str, block_size: int, leases: LeaseTable,
                 stats: KVTransferStats, side_channel_addr: Callable[[], tuple[str, int]],
                 clock: Callable[[], float] = time.monotonic,
                 group_kinds: Sequence[str] = ("full_attention",), tp_size: int = 1) -> None:
        """`tp_size`: this engine's tensor parallel size, which P's params announce (a vLLM
        decode instance plans its reads from it)."""
        self.config = config
        self.tp_size = tp_size
        self.engine_id = engine_id
        self.block_size = block_size  # tokens per logical block, this engine's
        self.group_kinds = tuple(group_kinds)  # KVCacheKind values: P lists block ids per group
        self.num_groups = len(self.group_kinds)
        self.has_mamba = "mamba" in self.group_kinds
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
        self._check_peer(params)
        blocks = params.remote_block_ids or ()
        if params.is_prefix_load:
            self._check_prefix(num_prompt_tokens, params)
        tokens = self.remote_tokens(num_prompt_tokens, params)
        if tokens == 0:  # nothing to read (a one-token prompt of a Mamba model): P only frees
            return
        bs = params.remote_block_size or self.block_size
        want = [1 if kind == "mamba" else -(-tokens // bs) for kind in self.group_kinds]
        if len(blocks) != self.num_groups or [len(g) for g in blocks] != want:
            groups = "one KV cache group" if self.num_groups == 1 else f"the {self.num_groups} KV cache groups"
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_block_ids must list {'/'.join(map(str, want))} block ids in {groups} "
                f"for the {tokens} prompt tokens a prefill engine computes of {num_prompt_tokens} "
                f"(blocks of {bs} tokens)")

    def _check_peer(self, params: KVTransferParams) -> None:
        if not is_trusted_host(params.remote_host or "", self.config.trusted_hosts):
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_host {params.remote_host!r} is not a trusted prefill host")
        if params.num_kv_groups != self.num_groups:
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_block_ids must list block ids for {self.num_groups} KV cache groups")

    def _check_prefix(self, num_prompt_tokens: int, params: KVTransferParams) -> None:
        assert params.remote_prefix_tokens is not None
        if not self.holds_prefixes:
            raise KVTransferParamsError(
                "kv_transfer_params.remote_prefix_tokens: a held prefix is read only by models whose KV cache "
                "groups keep every token (no sliding window, no Mamba state)")
        if (params.remote_block_size or self.block_size) != self.block_size:
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_block_size must be this engine's ({self.block_size}) to read a held prefix")
        n = params.remote_prefix_tokens
        if n % self.block_size or n >= num_prompt_tokens:
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_prefix_tokens ({n}) must be a multiple of the block size "
                f"({self.block_size}) below the prompt's {num_prompt_tokens} tokens")

    @property
    def holds_prefixes(self) -> bool:
        """Whether this model's prefixes can be held and read: every group keeps every token."""
        return all(kind in ("full_attention", "mla") for kind in self.group_kinds)

    def remote_tokens(self, num_prompt_tokens: int, params: KVTransferParams | None = None) -> int:
        """The prompt tokens whose KV the source holds and this engine reads: a held prefix's, or all
        (P computed the prompt), or all but the last (Mamba)."""
        if params is not None and params.is_prefix_load:
            assert params.remote_prefix_tokens is not None
            return params.remote_prefix_tokens
        return num_prompt_tokens - 1 if self.has_mamba else num_prompt_tokens

    def notify_rejected(self, request_id: str, params: KVTransferParams | None) -> None:
        """Thread-safe: D rejected a request before admission; P may free its blocks now."""
        if params is None or not params.wants_remote_prefill:
            return
        try:
            self._check_peer(params)
        except KVTransferParamsError:
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
    def on_new_request(self, request: ConnectorRequest) -> None:
        params = request.kv_transfer_params
        if params is not None and params.wants_remote_decode and self.has_mamba and request.num_prompt_tokens > 1:
            del request.prompt_token_ids[-1]  # N-1 prefill: D computes the last token (module doc)
        if params is not None and params.wants_remote_prefill:
            self._waiting[request.request_id] = (remote_of(params), params.remote_request_id or "",
                                                 params.lease_generation or 0)

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_local_computed: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params is None or not params.wants_remote_prefill or request.request_id in self._consumed:
            return 0, False
        full_hit = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
        if num_local_computed > 0 and num_local_computed == full_hit:
            # D already holds every full block it can cache: it computes the short tail itself
            # and P only hears that it may free (update_state_after_alloc sends the release).
            return 0, False
        tokens = self.remote_tokens(request.num_prompt_tokens, params)
        if tokens <= num_local_computed:
            return 0, False
        return tokens - num_local_computed, True

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds, num_local_computed: int,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params is None or not params.wants_remote_prefill or request.request_id in self._consumed:
            return
        self._consumed.add(request.request_id)
        if num_external_tokens == 0:  # everything is local: P only needs to hear it may free
            self._release(request.request_id, params, request.trace)
            return
        first_new = num_local_computed // self.block_size
        assert params.remote_block_ids is not None  # params with a remote prefill name P's blocks (params.py)
        # D reads only what it lacks: its new blocks, filled from the matching tail of P's
        # (the worker pairs them in kernel blocks once the handshake gave P's ratio:
        # block_mapping.apply_prefix_caching). A Mamba group's one state is always new.
        local = tuple(list(g if kind == "mamba" else g[first_new:]) for g, kind in zip(block_ids, self.group_kinds))
        remote = tuple(list(r) if loc else [] for loc, r in zip(local, params.remote_block_ids))
        tokens = self.remote_tokens(request.num_prompt_tokens, params)
        # the KV is bound to its tokens: the prompt's (+ the tokens P sampled, which D continues
        # from), or a held prefix's alone
        bound = request.prompt_token_ids[:tokens] + ([] if params.is_prefix_load else request.output_token_ids)
        self._meta.reqs_to_recv.append(RecvSpec(
            request.request_id, remote_of(params), params.remote_request_id or "", params.lease_generation or 0,
            local, remote, content_digest(bound), request.trace))

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

    def request_finished(self, request: ConnectorRequest, block_ids: BlockIds) -> tuple[bool, KVTransferParams | None]:
        rid = request.request_id
        self._waiting.pop(rid, None)
        params = request.kv_transfer_params
        if params is not None and params.wants_remote_prefill and rid not in self._consumed:
            # Ended before its blocks were allocated (aborted in the queue): P frees now.
            self._release(rid, params, request.trace)
        self._consumed.discard(rid)
        if params is None or not params.wants_remote_decode:
            return False, None
        if request.finish_reason not in FINISHED_WITH_OUTPUT or not block_ids[0]:
            return False, None
        if rid in self.leases:  # the engine refuses ids in use, so this is a bug: never orphan blocks
            logger.error("request %s finished while a lease on that id is held; freeing its blocks", rid)
            return False, None
        # Granted now, before the response carrying these params can reach any reader. The
        # blocks hold the prompt's KV: the lease binds them to its digest (and to the digest
        # of the prompt + P's sampled tokens, for a D that continues from them).
        generated = list(request.output_token_ids)
        if self.has_mamba or len(generated) > MAX_GENERATED_TOKENS:
            generated = []
        continued = content_digest(request.prompt_token_ids + generated) if generated else None
        generation = self.leases.new_generation()
        self.leases.grant(rid, block_ids, generation, content_digest(request.prompt_token_ids), continued,
                          request.trace)
        host, port = self._side_channel_addr()
        to_decode = KVTransferParams(
            do_remote_decode=False, do_remote_prefill=True, remote_block_ids=tuple(tuple(g) for g in block_ids),
            remote_engine_id=self.engine_id, remote_request_id=rid, remote_host=host, remote_port=port,
            tp_size=self.tp_size, remote_num_tokens=request.num_prompt_tokens, remote_block_size=self.block_size,
            lease_generation=generation, generated_token_ids=tuple(generated) if generated else None,
            remote_cached_tokens=request.num_reused_tokens)
        return True, to_decode

    def can_hold_prefixes(self) -> bool:
        return bool(self._side_channel_addr()[1]) and self.holds_prefixes

    def hold_prefix(self, hold_id: str, token_ids: Sequence[int], num_tokens: int,
                    block_ids: BlockIds) -> KVTransferParams | None:
        """Lease blocks of this engine's prefix cache holding the KV of `token_ids[:num_tokens]` (a
        whole number of blocks, referenced by the caller under `hold_id`) for a remote reader, as P
        leases a finished prompt's. Returns the params a reader loads them with, or None where this
        engine serves no reads (no side channel) or its model's prefixes cannot be held."""
        host, port = self._side_channel_addr()
        if not self.can_hold_prefixes() or num_tokens <= 0 or num_tokens % self.block_size:
            return None
        generation = self.leases.new_generation()
        self.leases.grant(hold_id, block_ids, generation, content_digest(list(token_ids[:num_tokens])), None, None)
        self.stats.incr("held_prefixes")
        return KVTransferParams(
            do_remote_prefill=True, remote_block_ids=tuple(tuple(g) for g in block_ids),
            remote_engine_id=self.engine_id, remote_request_id=hold_id, remote_host=host, remote_port=port,
            tp_size=self.tp_size, remote_num_tokens=num_tokens, remote_block_size=self.block_size,
            lease_generation=generation, remote_cached_tokens=num_tokens, remote_prefix_tokens=num_tokens)

    def end_hold(self, hold_id: str) -> bool:
        ended = self.leases.end_unread(hold_id)
        if ended:
            self.stats.incr("holds_ended_under_pressure")
        return ended

    def retains(self) -> bool:
        return self.config.retention_seconds > 0 and self.can_hold_prefixes()

    def retain(self, retention_id: str, token_ids: Sequence[int], block_ids: BlockIds) -> bool:
        if not self.retains() or not token_ids or len(token_ids) % self.block_size:
            return False
        self.leases.retain(retention_id, block_ids, content_digest(list(token_ids)), self.config.retention_seconds)
        self.stats.incr("retentions")
        return True

    def touch_retention(self, retention_id: str) -> bool:
        touched = self.leases.touch(retention_id)
        if touched:
            self.stats.incr("retentions_renewed")
        return touched

    def end_retention(self, retention_id: str, outcome: str) -> bool:
        return self.leases.end_retention(retention_id, LeaseOutcome(outcome))

    def recompute_on_load_failure(self, request: ConnectorRequest) -> bool:
        params = request.kv_transfer_params
        if params is not None and params.is_prefix_load:  # a held prefix only saves work: compute it
            self.stats.incr("recomputed_requests")
            return True
        recompute = recompute_on_failure(self.config.load_failure_policy, self.config.recompute_max_tokens,
                                         request.num_prompt_tokens)
        if recompute:
            self.stats.incr("recomputed_requests")
        return recompute

    def _release(self, request_id: str, params: KVTransferParams, trace: RequestTrace | None) -> None:
        self._meta.reqs_to_release.append(
            ReleaseSpec(request_id, remote_of(params), params.remote_request_id or "", params.lease_generation or 0,
                        trace))
