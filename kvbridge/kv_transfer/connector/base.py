"""Contracts of the KV connector's two halves, as the engine sees them: everything `LLMEngine`
(kvbridge/engine/) calls on a connector is declared here, and it calls nothing else.

The scheduler half lives with the scheduler (no tensors, no I/O on the step
path beyond queue operations); the worker half lives with the model runner and
owns the transfer backend. Once per step the scheduler half builds one metadata
object for the worker half; once per step the worker half returns one
KVConnectorOutput to the scheduler half, and one WorkerStatus to the engine (how soon
it needs the next step). Failures travel as data in that output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client.registry import Collector

from kvbridge.kv_transfer.connector.metadata import ConnectorMetadata
from kvbridge.kv_transfer.connector.request_view import ConnectorRequest
from kvbridge.kv_transfer.failure import FailureKind
from kvbridge.kv_transfer.params import BlockIds

if TYPE_CHECKING:
    from kvbridge.kv_transfer.connector.rank_agent import RankCommands, RankRegistration, RankReport, RankSetup
    from kvbridge.kv_transfer.params import KVTransferParams

@dataclass
class KVConnectorOutput:
    """What the worker half reports after a step.

    finished_sending: P side, requests whose blocks may now be freed (all reads
        done, or lease expired).
    finished_recving: D side, requests whose loads settled — successfully or not.
    failed_recving: subset of finished_recving whose load failed (their blocks are
        listed in invalid_block_ids; they are never post-processed).
    invalid_block_ids: local block ids (any group) whose content was not loaded.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    failure_causes: dict[str, str] = field(default_factory=dict)  # request id -> human-readable cause
    failure_kinds: dict[str, FailureKind] = field(default_factory=dict)  # request id -> what failed

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


@dataclass(frozen=True)
class WorkerStatus:
    """The worker half's state as the engine reads it (`WorkerConnector.status`): what its
    transfers need of the step loop, and P's leases. The engine asks once per step and paces
    the next step by the answer (engine/pacing.py)."""

    rank_commands_waiting: bool = False  # commands wait to ride the next step to the ranks: step at once
    transfers_in_flight: bool = False  # loads on D, watched reads of held blocks on P: poll promptly
    has_work: bool = False  # loads, control messages or leases a step must advance: keep stepping
    leases_held: int = 0  # P: leases granted on finished requests' blocks and not ended yet
    lease_outcomes: Mapping[str, int] = field(default_factory=dict)  # P: leases ended so far, by outcome


class SchedulerConnector(ABC):
    """Scheduler half. Every method is called on the engine thread, but `notify_rejected`
    (any thread)."""

    @abstractmethod
    def validate_request(self, num_prompt_tokens: int, params: KVTransferParams | None) -> None:
        """Called by LLMEngine.add_request before admission; changes nothing. Raises
        KVTransferParamsError (a ValueError: the client's error, HTTP 400) for a remote prefill
        this engine must not or cannot do. None params: nothing to check."""

    @abstractmethod
    def notify_rejected(self, request_id: str, params: KVTransferParams | None) -> None:
        """Thread-safe. D rejected a request with a remote prefill before admission: tell P (with
        the next step's metadata) that it may free the blocks it holds for it. No-op for params
        without a remote prefill, or naming an untrusted peer."""

    @abstractmethod
    def has_pending(self) -> bool:
        """Messages wait for the worker half (releases, reads): the engine must step."""

    @abstractmethod
    def on_new_request(self, request: ConnectorRequest) -> None:
        """Called when a request is added to the scheduler."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_local_computed: int) -> tuple[int | None, bool]:
        """Called for a WAITING request on its first schedule.

        Returns (n, load_async): n prompt tokens beyond the local prefix hit will
        arrive from a remote prefill; None means "ask again next step". With
        load_async the request waits in WAITING_FOR_REMOTE_KVS and takes no compute.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds,
                                 num_local_computed: int, num_external_tokens: int) -> None:
        """Called right after blocks were allocated for a request the connector asked about."""

    @abstractmethod
    def build_connector_meta(self) -> ConnectorMetadata:
        """Called at the end of every schedule(); returns this step's metadata for the
        worker half (what to receive, what to release, which leases to renew) and resets
        the per-step state."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Called with the worker half's output before the scheduler acts on it."""

    @abstractmethod
    def request_finished(self, request: ConnectorRequest, block_ids: BlockIds) -> tuple[bool, KVTransferParams | None]:
        """Called exactly once when a request finishes (any reason) or is aborted.

        Returns (delay_free, kv_transfer_params): with delay_free the scheduler keeps
        the blocks until the request id appears in finished_sending; the params (P: where
        D reads them) ride the request's finishing output, typed until the HTTP edge.
        """

    def can_hold_prefixes(self) -> bool:
        """Whether `hold_prefix` can ever hold anything here (this engine serves reads, and its
        model's prefixes can be read by another instance)."""
        return False

    def hold_prefix(self, hold_id: str, token_ids: Sequence[int], num_tokens: int,
                    block_ids: BlockIds) -> KVTransferParams | None:
        """Lease cached blocks holding the KV of `token_ids[:num_tokens]` (the scheduler referenced
        them under `hold_id` and frees them once `hold_id` appears in finished_sending) for a remote
        reader. Returns the params it reads them with, or None where this engine serves no reads
        (then the scheduler frees them at once)."""
        return None

    def end_hold(self, hold_id: str) -> bool:
        """The pool needs blocks: end the lease on held prefix `hold_id` now if no reader was granted
        a read of it yet. True if it ended (the caller frees its blocks at once; `hold_id` still
        appears in finished_sending later, which the caller then ignores)."""
        return False

    def retains(self) -> bool:
        """Whether finished answers' blocks are retained here for their conversation's next turn
        (--kv-retention-seconds, on an engine that can hold prefixes)."""
        return False

    def retain(self, retention_id: str, token_ids: Sequence[int], block_ids: BlockIds) -> bool:
        """Keep cached blocks holding the KV of `token_ids` (whole blocks; referenced by the scheduler
        under `retention_id`, freed once it appears in finished_sending) for the retention period. False:
        not retained (the scheduler frees them at once)."""
        return False

    def touch_retention(self, retention_id: str) -> bool:
        """A request or a hold used the retained blocks: renew. False if no such retention is live."""
        return False

    def end_retention(self, retention_id: str, outcome: str) -> bool:
        """End a retention now (outcome `superseded`, `pressure` or `release`). True if it ended (the
        caller frees its blocks at once and ignores its id in finished_sending later)."""
        return False

    def recompute_on_load_failure(self, request: ConnectorRequest) -> bool:
        """The load-failure policy: True to recompute the request's invalid blocks
        locally, False to finish it with an error."""
        return True

    def shutdown(self) -> None:
        """Releases threads and sockets; idempotent."""


class WorkerConnector(ABC):
    """Worker half: the control plane of the transfers, in the engine process, called on the
    engine thread once per step around the ranks' step. The bytes move in the ranks, each
    through its own RankAgent (rank_agent.py), driven by the commands this half returns and
    reporting back with the step's result."""

    @property
    @abstractmethod
    def rank_setup(self) -> RankSetup:
        """How the engine's ranks get their transfer agents, read once when the engine starts its
        runner: at TP 1 the engine process's own agent (`local_agent`), at TP N what each rank
        process builds its agent from (`local_agent` None)."""

    @abstractmethod
    def register_ranks(self, ranks: Sequence[RankRegistration]) -> None:
        """Every rank's transfer agent blob and KV layout, rank order, once at start."""

    @abstractmethod
    def start_load_kv(self, metadata: ConnectorMetadata | None) -> list[RankCommands] | None:
        """Before the ranks run: take this step's metadata (None: the step ran without a
        connector's schedule); return one RankCommands per rank, or None when no rank has
        anything to do."""

    def needs_rank_poll(self) -> bool:
        """After start_load_kv, when the step schedules nothing and carries no commands: must the
        ranks run anyway, to poll their transfer agents? (At TP N each such step is a round through
        N + 1 processes.)"""
        return True

    @abstractmethod
    def get_finished(self, reports: Sequence[RankReport] = ()) -> KVConnectorOutput:
        """After the ranks ran, with their reports: never raises, failures are reported as data."""

    @abstractmethod
    def status(self) -> WorkerStatus:
        """This half's state now (engine thread; cheap: LLMEngine.step asks once per step, and
        `load()` and the drain read it between steps)."""

    @abstractmethod
    def release(self, params: KVTransferParams) -> bool:
        """P: free the blocks held for a finished request now, named by the params this engine
        returned for it (the proxy found no decode instance to read them). Thread-safe and
        idempotent; False if no such lease is held or the params name another engine."""

    def collectors(self) -> Sequence[Collector]:
        """Prometheus collectors of this half's counters, for a server's /metrics registry."""
        return ()

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """Install a thread-safe callback that wakes the engine loop when a transfer starts."""

    def shutdown(self) -> None:
        """Releases transfers, registrations and threads; idempotent."""


class KVConnectors(NamedTuple):
    """One engine's two connector halves, by name (built together: engine/kv_connector_factory.py)."""

    scheduler: SchedulerConnector
    worker: WorkerConnector
