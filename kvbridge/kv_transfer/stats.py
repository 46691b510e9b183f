"""Counters and histograms of the KV connector, exported to Prometheus.

One KVTransferStats per engine, written by the connector halves (engine thread and
the side-channel / handshake threads, hence the lock) and read by a Prometheus
collector that a server registers on its own registry.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

PREFIX = "kvbridge_kv_"
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# A whole load or a handshake: sub-millisecond on loopback (a cached peer, a small prompt), tens
# of ms for an 8k-token read, seconds over a slow network, up to the 30 s read timeout.
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A lease: from a read right after the grant (ms) to the 30 s default lease, renewed by heartbeats
# while D waits (a queue on D), or held for a read's two timeouts.
LEASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Bytes one request reads: 64 KiB (a few blocks of a small model) to 4 GiB, in powers of 4.
BYTES_BUCKETS = tuple(float(1 << n) for n in range(16, 34, 2))


@dataclass
class _Histogram:
    buckets: tuple[float, ...] = DURATION_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[i] += 1
        self.total += value

    def prometheus(self, name: str, doc: str) -> HistogramMetricFamily:
        cum, acc = [], 0
        for b, c in zip((*map(str, self.buckets), "+Inf"), self.counts):
            acc += c
            cum.append((b, acc))
        return HistogramMetricFamily(name, doc, buckets=cum, sum_value=self.total)


class _LabelledHistogram:
    """One histogram per value of a single label (an outcome)."""

    def __init__(self, label: str, buckets: tuple[float, ...]) -> None:
        self.label = label
        self.buckets = buckets
        self.by_value: dict[str, _Histogram] = {}

    def observe(self, value: str, x: float) -> None:
        h = self.by_value.get(value)
        if h is None:
            h = self.by_value[value] = _Histogram(self.buckets)
        h.observe(x)

    def prometheus(self, name: str, doc: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=[self.label])
        for value, h in sorted(self.by_value.items()):
            cum, acc = [], 0
            for b, c in zip((*map(str, h.buckets), "+Inf"), h.counts):
                acc += c
                cum.append((b, acc))
            family.add_metric([value], cum, sum_value=h.total)
        return family


class KVTransferStats(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.transfers = 0
        self.bytes = 0
        self.descriptors = 0
        self.failed_transfers: Counter[str] = Counter()  # by failure class
        self.failed_notifications = 0
        self.expired_leases = 0
        self.handshakes = 0
        self.handshake_failures: Counter[str] = Counter()
        self.recomputed_requests = 0
        self.held_prefixes = 0  # leases on held prefixes granted (hold_prefix)
        self.holds_ended_under_pressure = 0  # held prefixes ended unread: the pool needed their blocks
        self.retentions = 0  # finished answers whose blocks were retained (--kv-retention-seconds)
        self.retentions_renewed = 0  # retentions a request or a hold used (renewed)
        self.early_releases = 0  # P freed on a release notification (no read)
        self.refused_reads = 0  # P refused a read for a stale or foreign lease
        self.content_mismatches = 0  # P refused a read: its blocks hold another prompt's KV
        self.kv_content_mismatches = 0  # P: a reader's read failed its digests (digest.py)
        self.unverified_reads = 0  # D: reads whose P rank sent no digest (KV not in host memory)
        self._transfer_s = _Histogram()
        self._handshake_s = _Histogram()
        self._load_s = _LabelledHistogram("outcome", LOAD_BUCKETS)  # D: park -> settled, per request
        self._read_bytes = _Histogram(BYTES_BUCKETS)  # D: bytes of a request's completed load
        self._handshake_wait_s = _LabelledHistogram("outcome", LOAD_BUCKETS)  # D: a request's handshake wait
        self._lease_held_s = _LabelledHistogram("outcome", LEASE_BUCKETS)  # P: grant -> end
        self.held_blocks: Callable[[], int] = lambda: 0  # P: blocks held for remote decode now
        self.retained_blocks: Callable[[], int] = lambda: 0  # blocks retained for conversations' next turns now

    def record_transfer(self, seconds: float, nbytes: int, ndescs: int) -> None:
        with self._lock:
            self.transfers += 1
            self.bytes += nbytes
            self.descriptors += ndescs
            self._transfer_s.observe(seconds)

    def record_failure(self, kind: str) -> None:
        with self._lock:
            self.failed_transfers[kind] += 1

    def record_handshake(self, seconds: float, failure: str | None) -> None:
        with self._lock:
            if failure is None:
                self.handshakes += 1
                self._handshake_s.observe(seconds)
            else:
                self.handshake_failures[failure] += 1

    def record_load(self, seconds: float, outcome: str, nbytes: int | None = None) -> None:
        """D: a request's remote load settled (outcome "ok" or a FailureKind value) after
        `seconds` in WAITING_FOR_REMOTE_KVS; `nbytes`: what it read, for a completed load."""
        with self._lock:
            self._load_s.observe(outcome, seconds)
            if nbytes is not None:
                self._read_bytes.observe(nbytes)

    def record_handshake_wait(self, seconds: float, outcome: str) -> None:
        """D: a request waited `seconds` for the handshakes with P's ranks (outcome "ok" or the
        handshake failure kind)."""
        with self._lock:
            self._handshake_wait_s.observe(outcome, seconds)

    def record_lease(self, seconds: float, outcome: str) -> None:
        """P: a lease ended after `seconds` (read_done, release, expired, content_mismatch, shutdown)."""
        with self._lock:
            self._lease_held_s.observe(outcome, seconds)

    def lease_outcomes(self) -> dict[str, int]:
        """P: how many leases ended by each outcome (read_done, release, expired, ...) so far."""
        with self._lock:
            return {outcome: sum(h.counts) for outcome, h in sorted(self._lease_held_s.by_value.items())}

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def collect(self) -> Iterator[Metric]:
        """prometheus_client custom-collector protocol."""
        with self._lock:
            yield CounterMetricFamily(PREFIX + "transfers", "KV reads completed", value=self.transfers)
            yield CounterMetricFamily(PREFIX + "transfer_bytes", "bytes of KV read", value=self.bytes)
            yield CounterMetricFamily(PREFIX + "transfer_descriptors", "descriptors in KV reads",
                                      value=self.descriptors)
            yield self._transfer_s.prometheus(PREFIX + "transfer_duration_seconds", "KV read duration")
            failed = CounterMetricFamily(PREFIX + "failed_transfers", "failed KV loads by class", labels=["kind"])
            for kind, n in sorted(self.failed_transfers.items()):
                failed.add_metric([kind], n)
            yield failed
            yield CounterMetricFamily(PREFIX + "failed_notifications", "notifications that could not be sent",
                                      value=self.failed_notifications)
            yield CounterMetricFamily(PREFIX + "expired_leases", "P leases that expired before a read",
                                      value=self.expired_leases)
            yield CounterMetricFamily(PREFIX + "early_releases", "P blocks freed by a release notification",
                                      value=self.early_releases)
            yield CounterMetricFamily(PREFIX + "refused_reads", "reads P refused (stale or foreign lease)",
                                      value=self.refused_reads)
            yield CounterMetricFamily(PREFIX + "content_mismatches",
                                      "reads P refused because its blocks hold another prompt's KV "
                                      "(swapped or replayed kv_transfer_params)", value=self.content_mismatches)
            yield CounterMetricFamily(PREFIX + "kv_content_mismatches",
                                      "P: leases ended because the reader's bytes failed their digests",
                                      value=self.kv_content_mismatches)
            yield CounterMetricFamily(PREFIX + "unverified_reads",
                                      "D: reads not verified (their P rank could not digest its KV)",
                                      value=self.unverified_reads)
            yield CounterMetricFamily(PREFIX + "recomputed_requests", "D requests recomputed after a failed load",
                                      value=self.recomputed_requests)
            yield CounterMetricFamily(PREFIX + "held_prefixes", "leases granted on a cached prefix held for a "
                                      "reader (POST /kvbridge/kv_hold)", value=self.held_prefixes)
            yield CounterMetricFamily(PREFIX + "holds_ended_under_pressure", "held prefixes whose lease ended "
                                      "before any read: the pool needed their blocks",
                                      value=self.holds_ended_under_pressure)
            yield CounterMetricFamily(PREFIX + "retentions", "finished answers whose blocks were retained for "
                                      "the conversation's next turn (--kv-retention-seconds)", value=self.retentions)
            yield CounterMetricFamily(PREFIX + "retentions_renewed", "retentions renewed because a request or a "
                                      "hold used their blocks", value=self.retentions_renewed)
            yield CounterMetricFamily(PREFIX + "handshakes", "successful handshakes", value=self.handshakes)
            hs_failed = CounterMetricFamily(PREFIX + "handshake_failures", "failed handshakes", labels=["kind"])
            for kind, n in sorted(self.handshake_failures.items()):
                hs_failed.add_metric([kind], n)
            yield hs_failed
            yield self._handshake_s.prometheus(PREFIX + "handshake_duration_seconds", "handshake latency")
            yield self._load_s.prometheus(PREFIX + "load_seconds", "D: a request's remote KV load, from parking in "
                                          "WAITING_FOR_REMOTE_KVS to settled (handshake wait, lease check and "
                                          "reads), by outcome (ok or the failure kind)")
            yield self._read_bytes.prometheus(PREFIX + "read_bytes", "D: bytes of KV one request read from P")
            yield self._handshake_wait_s.prometheus(PREFIX + "handshake_seconds",
                                                    "D: how long a request waited for the handshakes with its "
                                                    "prefill engine's ranks, by outcome")
            yield self._lease_held_s.prometheus(PREFIX + "lease_held_seconds",
                                                "P: how long a lease held its blocks, grant to end, by outcome "
                                                "(read_done, release, expired, content_mismatch, shutdown)")
        yield GaugeMetricFamily(PREFIX + "held_blocks", "P blocks held for remote decode", value=self.held_blocks())
        yield GaugeMetricFamily(PREFIX + "retained_blocks", "blocks retained for conversations' next turns",
                                value=self.retained_blocks())
