"""One request's routing plan from the fleet view: a kv cost per P and per D (the kv_aware
policy picks the lowest), and the P/D decision of `--pd-mode` with its reason.

Modes: `always` (every request through P, reason `forced`; the default), `never` (D alone,
`forced`), `auto` (kv_cost.decide_auto: the measured cost of D prefilling what it lacks
against P's queue, P's prefill and the KV transfer; `cached` when D holds the whole prompt;
`no_measured_rate` until the instances report rates; a D that has not pulled yet takes the other
Ds' median pull rate), and for comparison `static` (Dynamo's
rule) and `threshold` (llm-d's). Each decision is taken against the D and the P the kv_aware
policy would pick (the cheapest); until a D has measured its own prefill rate, P's stands in
(one model: a D of a P/D fleet prefills little by itself). Each prompt of a list is planned on its own
(proxy.py). A request the view cannot predict (events off everywhere and no tokens, a malformed body)
goes through P with reason `no_prediction` in the deciding modes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from fastapi.responses import Response
from prometheus_client import Histogram

from kvbridge.proxy.fleet_view import FleetView, Prediction
from kvbridge.proxy.kv_cost import PdMode, Decision, Load, cheapest, cost, decide_auto, decide_static, decide_threshold
from kvbridge.proxy.routing import KvCosts, UpstreamPool

DEFAULT_BLOCK_SIZE = 16  # an instance without events: its cost counts blocks of this size
IDLE = Load(waiting=0, waiting_prefill_tokens=0, running=0, kv_blocks_total=0, kv_blocks_free=0,
            prefill_tokens_per_s=None, decode_step_s=None, kv_pull_bytes_per_s=None, kv_bytes_per_token=0)


class FleetFacts(Protocol):
    """What `plan` reads of the fleet view (FleetView; a table in unit tests)."""

    def load(self, url: str) -> Load | None: ...

    def block_size(self, url: str) -> int | None: ...


@dataclass(frozen=True)
class RoutePlan:
    decision: Decision
    prediction: Prediction | None = None
    prefill_costs: KvCosts | None = None
    decode_costs: KvCosts | None = None

    def predicted_cached(self, url: str) -> int | None:
        """The prompt tokens predicted not computed on `url` (its prefix cache and KV tier: what its
        answer's cached_tokens counts), or None without a prediction of it."""
        if self.prediction is None or url not in self.prediction.cached:
            return None
        return self.prediction.served(url)


FORCED_PD = RoutePlan(Decision("prefill_decode", "forced"))


def costs(view: FleetFacts, prediction: Prediction, urls: list[str]) -> KvCosts:
    """kv_cost.cost per URL, from its predicted overlap and its last reported load (an instance
    that has not reported one counts as idle); each request in flight there adds this one's
    prompt blocks (what a concurrent request holds and costs, as far as the router can tell)."""
    out = {}
    blocks = DEFAULT_BLOCK_SIZE
    for url in urls:
        blocks = view.block_size(url) or DEFAULT_BLOCK_SIZE
        out[url] = cost(prediction.prompt_tokens, prediction.served(url) // blocks, view.load(url) or IDLE, blocks)
    return KvCosts(out, float(math.ceil(prediction.prompt_tokens / blocks)))


def plan(view: FleetFacts, prediction: Prediction | None, prefill: list[str], decode: list[str],
         mode: PdMode, outstanding: Mapping[str, int] | None = None, reuse: bool = False) -> RoutePlan:
    """The plan of one request over the healthy `prefill` and `decode` URLs (module docstring);
    `outstanding`: the requests this proxy has in flight on each; `reuse`: the longest prefix any
    instance holds is read, not computed, on either path (proxy/kv_reuse.py)."""
    outstanding = outstanding or {}
    if mode == "always" and prediction is None:
        return FORCED_PD
    if prediction is None or not decode:
        return RoutePlan(Decision("decode_only", "forced") if mode == "never"
                         else Decision("prefill_decode", "forced" if mode == "always" else "no_prediction"))
    d_costs, p_costs = costs(view, prediction, decode), costs(view, prediction, prefill)
    d = decode[cheapest([d_costs.by_url[u] + d_costs.per_outstanding * outstanding.get(u, 0) for u in decode])]
    cached_d, n = prediction.served(d), prediction.prompt_tokens
    if mode in ("always", "never"):
        decision = Decision("prefill_decode" if mode == "always" else "decode_only", "forced")
    elif mode == "static":
        decision = decide_static(n, cached_d)
    elif mode == "threshold":
        decision = decide_threshold(n, cached_d)
    elif not prefill:
        decision = Decision("decode_only", "no_prefill_healthy")
    else:
        p = prefill[cheapest([p_costs.by_url[u] + p_costs.per_outstanding * outstanding.get(u, 0)
                              for u in prefill])]
        d_load, p_load = view.load(d), view.load(p)
        if d_load is None or p_load is None:
            decision = Decision("prefill_decode", "no_measured_rate")
        else:  # a D of a P/D fleet rarely prefills much: P's rate (same model) stands in until it has its own;
            # a D that has not pulled yet borrows the other Ds' pull rate (the same fabric), their median;
            # the requests this proxy has in flight there count as running even before D reports them
            d_load = dataclasses.replace(d_load, running=max(d_load.running, outstanding.get(d, 0)),
                                         prefill_tokens_per_s=d_load.prefill_tokens_per_s or p_load.prefill_tokens_per_s,
                                         kv_pull_bytes_per_s=d_load.kv_pull_bytes_per_s or fleet_pull_rate(view, decode))
            held = max(prediction.cached.values(), default=0) if reuse else 0
            decision = decide_auto(n, cached_d, prediction.served(p), d_load, p_load, held=held)
    return RoutePlan(decision, prediction, p_costs, d_costs)


def fleet_pull_rate(view: FleetFacts, decode: list[str]) -> float | None:
    """The median KV pull rate the decode instances `decode` measured, or None when none has."""
    rates = sorted(r for u in decode if (load := view.load(u)) is not None and (r := load.kv_pull_bytes_per_s))
    return rates[len(rates) // 2] if rates else None


async def plan_for(view: FleetView, client: httpx.AsyncClient, prefill: UpstreamPool | None, decode: UpstreamPool,
                   route: str, body: dict[str, Any], headers: dict[str, str], timeout: httpx.Timeout,
                   mode: PdMode, reuse: bool = False) -> RoutePlan:
    """`plan` for one request: its token ids asked of a healthy instance (a D first), predicted on
    every healthy one."""
    decode_urls = [u.url for u in decode.healthy()]
    prefill_urls = [u.url for u in prefill.healthy()] if prefill is not None else []
    asked = decode_urls or prefill_urls
    tokens = await view.token_ids(client, asked[0], route, body, headers, timeout) if asked else None
    prediction = None if tokens is None else view.predict(tokens, prefill_urls + decode_urls)
    in_flight = {u.url: u.outstanding for pool in (prefill, decode) if pool is not None for u in pool.healthy()}
    return plan(view, prediction, prefill_urls, decode_urls, mode, in_flight, reuse)


def reported_cached(answer: bytes) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` of a whole answer, or None when it has none."""
    try:
        value = json.loads(answer)["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (ValueError, KeyError, TypeError):
        return None
    return value if type(value) is int else None


def observe_cached(histogram: Histogram, plan: RoutePlan, url: str, answer: Response) -> None:
    """The cached prompt tokens `plan` predicted for `url` minus those its whole answer reports."""
    predicted = plan.predicted_cached(url)
    actual = reported_cached(bytes(answer.body)) if predicted is not None else None
    if actual is not None and predicted is not None:
        histogram.observe(predicted - actual)


def cached_observer(histogram: Histogram, plan: RoutePlan, url: str) -> Callable[[bytes], None] | None:
    """For a streamed answer: what observes the predicted minus the reported cached tokens once its
    usage event passes (the client asked for usage), or None when nothing was predicted for `url`."""
    predicted = plan.predicted_cached(url)
    if predicted is None:
        return None

    def observe(usage_event: bytes) -> None:
        actual = reported_cached(usage_event)
        if actual is not None:
            histogram.observe(predicted - actual)
    return observe
