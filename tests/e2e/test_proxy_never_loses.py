"""The proxy never loses a request, with real processes behind it: two prefill and two decode
`kvbridge serve` instances of a tiny random-weight Llama (NIXL), one real `kvbridge proxy`
in front of all four, the openai client.

- A P killed with SIGKILL while requests are in flight: every request answers 200 with the
  colocated engine's text (retried on the other P);
- a D killed with SIGKILL while it computes a request, before its first byte: the request is
  retried on the other D with the same kv_transfer_params and answers the colocated text;
- both P dead: requests are answered by the surviving D alone, and counted;
- the killed D flaps back (restarted on its address): the breaker its failure opened is
  probed after the cool-down and closes on the probe's success.
Afterwards every block is free on every instance still alive.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvbridge.config import KVRole
from kvbridge.engine.loader import load_model
from kvbridge.engine.loader.synthetic import TINY_4_KV_HEADS, write_synthetic_folder
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.launcher.cluster import DEFAULT_CLI, free_ports, http_url, proxy_command
from tests.e2e.processes import metric
from tests.fleet import SMOLLM2, FleetSpec, Member, Reference, assert_settled, complete

INSTANCES = {"p_a": Member(KVRole.PRODUCER, 1), "p_b": Member(KVRole.PRODUCER, 1), "d_a": Member(KVRole.CONSUMER, 1),
             "d_b": Member(KVRole.CONSUMER, 1)}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-never-loses")
    write_synthetic_folder(folder, load_model(SMOLLM2).tokenizer, **TINY_4_KV_HEADS)
    return str(folder)


def wait_for(what: str, condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def circuit(proxy: str, url: str) -> str:
    """The breaker state of upstream `url` in the proxy's /health report."""
    report = httpx.get(proxy + "/health", timeout=10, trust_env=False).json()
    return next(u["circuit"] for kind in ("prefill", "decode") for u in report[kind] if u["url"] == url)


def test_killed_prefill_and_decode_processes_lose_no_request(model, fleets):
    want = Reference(model)
    served = Path(model).name
    fleet = fleets.own(FleetSpec.of(model, "nixl", INSTANCES))
    try:
        port = free_ports(1)[0]
        argv = proxy_command(DEFAULT_CLI, [fleet.urls["p_a"], fleet.urls["p_b"]],
                             [fleet.urls["d_a"], fleet.urls["d_b"]], host="127.0.0.1", port=port)
        # One failure opens a breaker, probed after 2 s: the flapping D below closes it again.
        argv += ["--breaker-failures", "1", "--breaker-cooldown", "2", "--health-interval", "0.5"]
        fleet.spawn("proxy", argv, http_url("127.0.0.1", port))
        proxy = fleet.urls["proxy"]
        prompts = [f"Request {i}: tell me about the sea and the sky." for i in range(16)]
        # 1. P a dies while requests stream through the proxy: all answer, as one engine would.
        with ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(complete, proxy, served, p) for p in prompts]
            wait_for("p_a never finished a request",
                     lambda: metric(fleet.urls["p_a"], "kvbridge_prompt_tokens_total") > 0)
            os.kill(fleet.child("p_a").pid, signal.SIGKILL)
            assert [a.result() for a in answers] == [want(p) for p in prompts]
        # 2. A D dies while it computes a long answer, before its first byte: retried on the other D.
        long_prompt, long_tokens = "Request long: count the waves on the shore.", 200
        tok = want.loaded.tokenizer
        long_want = tok.decode(want.engine.generate([tok.encode(long_prompt)],
                                                    SamplingParams(max_tokens=long_tokens, temperature=0))[0])
        client = OpenAI(base_url=proxy + "/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(lambda: client.completions.create(
                model=served, prompt=long_prompt, max_tokens=long_tokens, temperature=0).choices[0].text)
            deadline, busy = time.monotonic() + 60, None
            while busy is None:
                busy = next((d for d in ("d_a", "d_b")
                             if metric(fleet.urls[d], "kvbridge_num_requests_running") > 0), None)
                assert time.monotonic() < deadline, "no decode instance ran the long request"
            os.kill(fleet.child(busy).pid, signal.SIGKILL)
            assert answer.result() == long_want
        assert metric(proxy, "kvbridge_proxy_retries_total", kind="decode", reason="protocol") >= 1
        assert circuit(proxy, fleet.urls[busy]) == "open"
        alive_d = "d_b" if busy == "d_a" else "d_a"
        # 3. Both P dead: D serves alone, counted.
        os.kill(fleet.child("p_b").pid, signal.SIGKILL)
        assert complete(proxy, served, "Request last: hello") == want("Request last: hello")
        assert metric(proxy, "kvbridge_proxy_decode_only_fallback_total") >= 1
        # 4. The killed D comes back on its address: after the cool-down one request probes it and
        # its success closes the breaker (each check sends a request: they are what probes it).
        killed = fleet.forget(busy)
        fleet.spawn(busy, killed.argv, fleet.urls[busy])

        def probed_and_closed() -> bool:
            assert complete(proxy, served, "Request flap: hello") == want("Request flap: hello")
            return circuit(proxy, fleet.urls[busy]) == "closed"
        wait_for("the restarted decode instance's breaker never closed", probed_and_closed)
        assert_settled(fleet, [alive_d, busy])
    finally:
        fleet.stop()
