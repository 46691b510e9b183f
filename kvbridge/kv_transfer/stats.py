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

PREFIX = "kvbridge_kv_"
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class _Histogram:
    buckets: tuple[float, ...] = DURATION_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    total: float = 0.0

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


class KVTransferStats:
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
        self.early_releases = 0  # P freed on a release notification (no read)
        self.refused_reads = 0  # P refused a read for a stale or foreign lease
        self.content_mismatches = 0  # P refused a read: its blocks hold another prompt's KV
        self._transfer_s = _Histogram()
        self._handshake_s = _Histogram()
        self.held_blocks: Callable[[], int] = lambda: 0  # P: blocks held for remote decode now

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

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def collect(self) -> Iterator:
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
            yield CounterMetricFamily(PREFIX + "recomputed_requests", "D requests recomputed after a failed load",
                                      value=self.recomputed_requests)
            yield CounterMetricFamily(PREFIX + "handshakes", "successful handshakes", value=self.handshakes)
            hs_failed = CounterMetricFamily(PREFIX + "handshake_failures", "failed handshakes", labels=["kind"])
            for kind, n in sorted(self.handshake_failures.items()):
                hs_failed.add_metric([kind], n)
            yield hs_failed
            yield self._handshake_s.prometheus(PREFIX + "handshake_duration_seconds", "handshake latency")
        yield GaugeMetricFamily(PREFIX + "held_blocks", "P blocks held for remote decode", value=self.held_blocks())
