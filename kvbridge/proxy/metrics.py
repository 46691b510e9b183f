"""The proxy's Prometheus metrics (GET /metrics on the proxy)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ProxyMetrics:
    """Prometheus metrics in a registry of the app's own (several apps may share a process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvbridge_proxy_requests", "Client requests by route and status",
                                ["route", "status"], registry=r)
        self.upstream_errors = Counter("kvbridge_proxy_upstream_errors",
                                       "Failed upstream calls by kind and reason", ["kind", "reason"], registry=r)
        self.kv_releases = Counter("kvbridge_proxy_kv_releases",
                                   "Release calls sent to P by outcome", ["outcome"], registry=r)
        self.prefill_seconds = Histogram("kvbridge_proxy_prefill_seconds", "Time for P to answer", registry=r)
        self.retries = Counter("kvbridge_proxy_retries", "Upstream attempts retried on another instance, by kind "
                               "and the failure that caused the retry", ["kind", "reason"], registry=r)
        self.decode_only_fallback = Counter("kvbridge_proxy_decode_only_fallback",
                                            "Requests served by a decode instance alone because no prefill "
                                            "instance could prefill them", registry=r)
        self.first_token = Counter("kvbridge_proxy_first_token_from_prefill",
                                   "Streamed requests whose first token came straight from prefill, by whether "
                                   "decode continued them or prefill's token finished them", ["outcome"],
                                   registry=r)
        for outcome in ("continued", "finished_at_prefill"):
            self.first_token.labels(outcome)  # exported at 0 from the start
        self.pd_path = Counter("kvbridge_proxy_pd_path", "Requests by the path that served them (prefill_decode, "
                               "decode_only) and why", ["path", "reason"], registry=r)
        # Predicted minus reported: 0 when the fleet index is exact; whole answers of a P leg and
        # of D alone (a streamed D answer is passed through unread).
        self.cached_prediction_error = Histogram(
            "kvbridge_proxy_cached_tokens_prediction_error", "Prompt tokens the router predicted an instance "
            "held minus the cached_tokens its answer reported", registry=r,
            buckets=(-1024, -256, -64, -16, -1, 0, 1, 16, 64, 256, 1024, float("inf")))
        self.kv_holds = Counter("kvbridge_proxy_kv_holds", "Held prefixes asked of the instance holding the most "
                                "of a prompt (KV reuse), by outcome: held, none (nothing held this time), "
                                "cannot_hold (the instance never holds)", ["outcome"], registry=r)
        for outcome in ("held", "none", "cannot_hold"):
            self.kv_holds.labels(outcome)
        self.circuit = Gauge("kvbridge_proxy_circuit_state", "Circuit breaker per upstream: 0 closed, 1 half-open, "
                             "2 open", ["kind", "url"], registry=r)
        # Gauges are set from the pools at scrape time (PDProxy.refresh_gauges).
        self.healthy = Gauge("kvbridge_proxy_healthy_instances", "Healthy instances by kind", ["kind"], registry=r)
        self.outstanding = Gauge("kvbridge_proxy_outstanding_requests", "In-flight upstream requests by kind",
                                 ["kind"], registry=r)
