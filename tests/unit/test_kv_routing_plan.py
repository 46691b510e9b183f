"""One request's routing plan (kvbridge/proxy/kv_routing.py) from a table of fleet facts: the
kv_aware costs, the P/D decision of each --pd-mode and its reason; the kv_aware policy's pick;
what the router asks /tokenize; an instance's events contract; the reported cached tokens; and the
proxy in front of stand-in instances that lack the fleet contract or garble it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from kvbridge.proxy.fleet_view import EventsContract, Prediction, tokenize_question
from kvbridge.proxy.kv_cost import Load
from kvbridge.proxy.kv_routing import IDLE, plan, reported_cached
from kvbridge.proxy.routing import KvAwarePolicy, KvCosts, Upstream
from tests.unit.proxy_cluster import COMPLETION, pd_cluster

P, D1, D2 = "http://p", "http://d1", "http://d2"


def load(**changes: object) -> Load:
    base: dict[str, object] = dict(waiting=0, waiting_prefill_tokens=0, running=0, kv_blocks_total=100,
                                   kv_blocks_free=100, prefill_tokens_per_s=1000.0, decode_step_s=0.05,
                                   kv_pull_bytes_per_s=1e9, kv_bytes_per_token=1000)
    return Load(**{**base, **changes})  # type: ignore[arg-type]


@dataclass
class Facts:
    loads: dict[str, Load] = field(default_factory=dict)
    block_sizes: dict[str, int] = field(default_factory=dict)

    def load(self, url: str) -> Load | None:
        return self.loads.get(url)

    def block_size(self, url: str) -> int | None:
        return self.block_sizes.get(url)


ALL = Facts({P: load(), D1: load(), D2: load()}, {P: 16, D1: 16, D2: 16})


def test_without_a_prediction_the_modes_that_decide_go_through_p_and_say_why() -> None:
    assert plan(ALL, None, [P], [D1], "always").decision.reason == "forced"
    assert plan(ALL, None, [P], [D1], "never").decision.path == "decode_only"
    for mode in ("auto", "static", "threshold"):
        decided = plan(ALL, None, [P], [D1], mode).decision  # type: ignore[arg-type]
        assert (decided.path, decided.reason) == ("prefill_decode", "no_prediction")


def test_the_d_holding_the_prompt_is_the_cheapest_and_auto_serves_it_alone() -> None:
    prediction = Prediction(640, {P: 0, D1: 0, D2: 624})
    routed = plan(ALL, prediction, [P], [D1, D2], "auto")
    assert routed.decode_costs is not None
    assert min(routed.decode_costs.by_url, key=routed.decode_costs.by_url.__getitem__) == D2
    assert (routed.decision.path, routed.decision.reason) == ("decode_only", "cost")
    assert routed.predicted_cached(D2) == 624 and routed.predicted_cached("http://elsewhere") is None


def test_a_d_whose_kv_tier_holds_the_prompt_serves_it_alone_as_if_cached() -> None:
    """Busy Ds; the prefix cache of neither holds the prompt, D2's KV tier continues its cached 16
    tokens to 624: D2 is the cheapest and serves alone (it loads, not computes), and that is the
    prediction. Without the tier the same fleet sends the prompt through P."""
    busy = Facts({P: load(), D1: load(running=10, kv_blocks_free=40), D2: load(running=10, kv_blocks_free=40)},
                 {P: 16, D1: 16, D2: 16})
    prediction = Prediction(640, {P: 0, D1: 0, D2: 16}, (), {P: 0, D1: 0, D2: 624})
    routed = plan(busy, prediction, [P], [D1, D2], "auto")
    assert routed.decode_costs is not None
    assert min(routed.decode_costs.by_url, key=routed.decode_costs.by_url.__getitem__) == D2
    assert (routed.decision.path, routed.decision.reason) == ("decode_only", "cost")
    assert routed.predicted_cached(D2) == 624
    without_tier = plan(busy, Prediction(640, {P: 0, D1: 0, D2: 16}), [P], [D1, D2], "auto")
    assert without_tier.decision.path == "prefill_decode"


def test_a_busy_d_sends_a_long_uncached_prompt_through_p() -> None:
    busy = Facts({P: load(), D1: load(running=30, kv_blocks_free=40)}, {P: 16, D1: 16})
    decided = plan(busy, Prediction(2000, {P: 0, D1: 0}), [P], [D1], "auto").decision
    assert (decided.path, decided.reason) == ("prefill_decode", "cost")


def test_auto_waits_for_a_reported_load_and_borrows_p_s_rate_for_a_d_without_one() -> None:
    prediction = Prediction(640, {P: 0, D1: 0})
    assert plan(Facts({P: load()}), prediction, [P], [D1], "auto").decision.reason == "no_measured_rate"
    unmeasured_d = Facts({P: load(), D1: load(prefill_tokens_per_s=None)})
    assert plan(unmeasured_d, prediction, [P], [D1], "auto").decision.reason == "cost"
    assert plan(ALL, prediction, [], [D1], "auto").decision == plan(ALL, prediction, [], [D1], "auto").decision
    assert plan(ALL, prediction, [], [D1], "auto").decision.reason == "no_prefill_healthy"


def test_a_d_that_never_pulled_borrows_the_other_ds_pull_rate() -> None:
    prediction = Prediction(640, {P: 0, D1: 0, D2: 0})
    fresh = load(kv_pull_bytes_per_s=None, running=0)
    alone = Facts({P: load(), D1: fresh})
    assert plan(alone, prediction, [P], [D1], "auto").decision.reason == "no_measured_rate"  # nobody measured
    beside = Facts({P: load(), D1: fresh, D2: load(running=40, kv_blocks_free=10)})  # D2 busy: D1 is picked
    routed = plan(beside, prediction, [P], [D1, D2], "auto")
    assert routed.decode_costs is not None
    assert min(routed.decode_costs.by_url, key=routed.decode_costs.by_url.__getitem__) == D1
    assert routed.decision.reason == "cost"  # on D2's measured rate
    assert plan(beside, prediction, [P], [D1, D2], "auto") == routed  # a pure function of the facts


@pytest.mark.parametrize("mode, cached, path", [
    ("static", 0, "prefill_decode"), ("static", 400, "decode_only"),
    ("threshold", 0, "prefill_decode"), ("threshold", 900, "decode_only"),
    ("always", 1000, "prefill_decode"), ("never", 0, "decode_only"),
])
def test_the_named_rules_and_the_forced_modes(mode: str, cached: int, path: str) -> None:
    decided = plan(ALL, Prediction(1000, {P: 0, D1: cached}), [P], [D1], mode).decision  # type: ignore[arg-type]
    assert decided.path == path and decided.reason == {"always": "forced", "never": "forced"}.get(mode, mode)


def test_an_instance_without_events_or_load_is_costed_cold_and_idle() -> None:
    routed = plan(Facts(), Prediction(160, {P: 0, D1: 0}), [P], [D1], "always")
    assert (routed.decode_costs, routed.prefill_costs) == (KvCosts({D1: 10.0}, 10.0), KvCosts({P: 10.0}, 10.0))
    assert IDLE.kv_blocks_total == 0


def test_kv_aware_picks_the_lowest_cost_and_the_least_busy_without_costs() -> None:
    a, b = Upstream("http://a", 0, healthy=True, outstanding=3), Upstream("http://b", 1, healthy=True)
    policy = KvAwarePolicy()
    assert policy.choose([a, b], costs=KvCosts({"http://a": 1.0, "http://b": 5.0})) is a
    assert policy.choose([a, b], costs=KvCosts({"http://a": 2.0, "http://b": 2.0})) is b  # tie: fewer in flight
    assert policy.choose([a, b]) is b
    assert policy.choose([a, b], costs=KvCosts({"http://a": 5.0})) is a  # b unknown: last
    # a's 3 requests in flight, each worth this request's 2 blocks, outweigh its lower reported cost
    assert policy.choose([a, b], costs=KvCosts({"http://a": 1.0, "http://b": 5.0}, per_outstanding=2.0)) is b


def test_requests_in_flight_count_before_the_instances_report_them() -> None:
    prediction = Prediction(640, {P: 0, D1: 0, D2: 0})
    assert plan(ALL, prediction, [P], [D1, D2], "auto").decision.path == "decode_only"  # both idle
    busy = plan(ALL, prediction, [P], [D1, D2], "auto", outstanding={D1: 30, D2: 30})
    assert (busy.decision.path, busy.decision.reason) == ("prefill_decode", "cost")


def test_what_the_router_asks_tokenize() -> None:
    assert tokenize_question("/v1/completions", {"model": "m", "prompt": "hi"}) == {"model": "m", "prompt": "hi"}
    assert tokenize_question("/v1/completions", {"model": "m", "prompt": ["hi"]}) == {"model": "m", "prompt": "hi"}
    assert tokenize_question("/v1/completions", {"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert tokenize_question("/v1/completions", {"prompt": ["a", "b"]}) is None  # a prompt list: no prediction
    assert tokenize_question("/v1/completions", {"prompt": [[1], [2]]}) is None
    messages = [{"role": "user", "content": "hi"}]
    assert tokenize_question("/v1/chat/completions", {"model": "m", "messages": messages}) == {
        "model": "m", "messages": messages}
    assert tokenize_question("/v1/chat/completions", {"messages": "hi"}) is None


def test_an_events_contract_is_read_or_refused_clearly() -> None:
    good = {"enabled": True, "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": None, "topic": "kv",
            "block_size": 16, "hash_root": "00ff"}
    assert EventsContract.from_json(good) == EventsContract("tcp://127.0.0.1:5557", None, "kv", 16, b"\x00\xff")
    assert EventsContract.from_json({"enabled": False}) is None
    for bad in ({"endpoint": "ipc:///x"}, {"replay_endpoint": 5}, {"block_size": 0}, {"hash_root": None},
                {"hash_root": "zz"}, {"topic": 3}):
        with pytest.raises(ValueError):
            EventsContract.from_json({**good, **bad})


def test_the_cached_tokens_an_answer_reports() -> None:
    body = {"usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}
    assert reported_cached(json.dumps(body).encode()) == 32
    assert reported_cached(b'{"usage": {"prompt_tokens": 4}}') is None
    assert reported_cached(b"not json") is None


# ---- the proxy in front of instances that do not speak the fleet contract, or speak it wrong ----
KV_AWARE = dict(prefill_policy="kv_aware", decode_policy="kv_aware", pd_mode="auto", health_interval_s=0.05)
IDLE_LOAD = {"waiting": 0, "waiting_prefill_tokens": 0, "running": 0, "kv_blocks_total": 64, "kv_blocks_free": 64,
             "prefill_tokens_per_s": 1000.0, "decode_step_s": 0.02, "kv_pull_bytes_per_s": 1e9,
             "kv_bytes_per_token": 1000}


@pytest.mark.timeout(60)
async def test_instances_without_events_or_tokenize_are_served_through_p_without_a_prediction() -> None:
    """vLLM without events, or an older kvbridge: 404 on every fleet route; the router serves on."""
    async with pd_cluster(**KV_AWARE) as pd:
        for _ in range(3):
            r = await pd.http.post("/v1/completions", json=COMPLETION)
            assert r.status_code == 200
            assert (r.headers["x-kvbridge-pd-path"], r.headers["x-kvbridge-pd-reason"]) == (
                "prefill_decode", "no_prediction")
        fleet = (await pd.http.get("/kvbridge/fleet")).json()
        assert fleet == {"enabled": True, "pd_mode": "auto", "kv_reuse": False, "instances": {}}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("contract", [
    {"enabled": True, "endpoint": "ipc:///tmp/nowhere", "topic": "", "block_size": 16, "hash_root": "00"},
    {"enabled": True, "endpoint": "tcp://127.0.0.1:9", "topic": "", "block_size": "16", "hash_root": "00"},
    {"enabled": True},
    ["not", "a", "map"],
])
async def test_a_garbled_events_contract_is_routed_cold_and_the_router_serves_on(contract: object) -> None:
    async with pd_cluster(**KV_AWARE) as pd:
        for instance in pd.prefill + pd.decode:
            instance.kv_events = contract  # type: ignore[assignment]
            instance.load, instance.tokens = IDLE_LOAD, list(range(100, 164))
        await pd.wait_health("decode", 0, True)
        for _ in range(3):  # several health rounds: the contract is read again, refused again
            r = await pd.http.post("/v1/completions", json=COMPLETION)
            assert r.status_code == 200
            # cold everywhere, rates reported: an idle D prefilling 64 tokens beats P + the transfer
            assert (r.headers["x-kvbridge-pd-path"], r.headers["x-kvbridge-pd-reason"]) in (
                ("decode_only", "cost"), ("prefill_decode", "no_measured_rate"))  # before the first load poll
        assert (await pd.http.get("/kvbridge/fleet")).json()["instances"] == {}
        assert (await pd.http.get("/health")).status_code == 200


@pytest.mark.timeout(60)
async def test_each_prompt_of_a_list_is_planned_on_its_own() -> None:
    """--pd-mode never: a list's every prompt goes to D alone, as one prompt would; none reaches P."""
    async with pd_cluster(**{**KV_AWARE, "pd_mode": "never"}) as pd:
        for instance in pd.prefill + pd.decode:
            instance.tokens = list(range(100, 164))
        r = await pd.http.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b", "c"]},
                               headers={"X-Request-Id": "rid-n"})
        assert r.status_code == 200, r.text
        assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
        assert not pd.prefill[0].received
        assert sorted(x.headers["x-request-id"] for x in pd.decode[0].received) == ["rid-n-0", "rid-n-1", "rid-n-2"]
