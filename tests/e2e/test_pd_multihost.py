"""P/D across hosts: prefill, decode and proxy each in a network namespace of its own, on one
bridge (tests/netns.py), with addresses that exist only inside them. The proxy fronts P and D by
those addresses; this test, in the root namespace, is a client on the same LAN (the bridge's
own address) and talks to the proxy with the official openai client.

Each `kvbridge serve` gets only --host (its namespace address): its side channel, its tcp
backend and NIXL's UCX device (UCX_NET_DEVICES is derived from the address, not set by the
test) follow it. UCX_TLS=tcp emulates separate machines: between namespaces of one machine UCX
would otherwise copy through shared memory (cross-memory attach) and no KV byte would cross the
link; the tests check that the KV bytes D read did cross D's veth. D trusts P's /30 only
(--kv-trusted-hosts CIDR).

Needs root and iproute2 (CI has both): it fails, never skips, without them. Namespaces, bridge
and processes are removed in the fixtures' finally blocks, also when a test fails.
"""

from __future__ import annotations

import ipaddress
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kvbridge.config import CacheConfig, EngineConfig
from kvbridge.engine.engine import LLMEngine
from kvbridge.engine.loader import load_model
from kvbridge.engine.sampling_params import SamplingParams
from kvbridge.launcher.cluster import ChildProcess, child_env, spawn_child, stop_children
from tests.fleet import LONG, MAX_TOKENS, SHORT
from tests.netns import Host, NetnsLan

MODEL = "SmolLM2-135M-Instruct"
PORT = 8000  # every host has its own port space
# P's lease: short, so the fault test sees it expire soon, yet far above a request's P-to-D gap.
LEASE_S, TRANSFER_TIMEOUT_S = 8.0, 3.0
WAIT_S = 60.0
# About 270 tokens: its KV read (46 KB a token) lasts about a second at the fault test's link rate.
FAULT_PROMPT = " ".join([LONG] * 6)
FETCH = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


@pytest.fixture(scope="module")
def lan():
    net = NetnsLan(("p", "d", "x"))
    try:
        yield net.start()
    finally:
        net.close()
        assert net.leftovers() == [], "namespaces or links left behind"


@pytest.fixture(scope="module")
def reference():
    loaded = load_model(MODEL)
    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks=160)), loaded)
    answers: dict[str, str] = {}

    def complete(prompt: str) -> str:
        if prompt not in answers:
            ids = loaded.tokenizer.encode(prompt)
            out = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
            answers[prompt] = loaded.tokenizer.decode(out)
        return answers[prompt]
    complete.tokenizer = loaded.tokenizer
    return complete


class Deployment:
    """P, D and the proxy of one transfer backend, each running inside its own host."""

    def __init__(self, lan: NetnsLan, backend: str, log_dir: Path) -> None:
        self.lan, self.backend = lan, backend
        p, d, x = lan["p"], lan["d"], lan["x"]
        self.trusted = str(ipaddress.ip_network(f"{p.addr}/30", strict=False))
        env = child_env(os.environ, loopback_only=False, num_threads=1)
        env.pop("UCX_NET_DEVICES", None)  # serve derives it from --host
        env.update(UCX_TLS="tcp", UCX_MODULES="^ib")
        common = ["--kv-backend", backend, "--num-threads", "1", "--num-blocks", "160", "--max-model-len", "1536",
                  "--kv-lease-seconds", str(LEASE_S), "--port", str(PORT), "--dtype", "float32"]
        cli = [sys.executable, "-m", "kvbridge.cli"]
        self.children: list[ChildProcess] = []
        try:
            self._spawn(p, "prefill", [*cli, "serve", MODEL, "--host", p.addr, "--kv-role", "producer", *common],
                        env, log_dir)
            self._spawn(d, "decode", [*cli, "serve", MODEL, "--host", d.addr, "--kv-role", "consumer", *common,
                                      "--kv-trusted-hosts", self.trusted,
                                      "--kv-transfer-timeout", str(TRANSFER_TIMEOUT_S)], env, log_dir)
            self.wait_healthy([self.url(p), self.url(d)])
            self._spawn(x, "proxy", [*cli, "proxy", "--prefill", self.url(p), "--decode", self.url(d),
                                     "--host", x.addr, "--port", str(PORT)], env, log_dir)
            self.wait_healthy([self.url(x)])
        except BaseException:
            self.stop()
            raise

    def _spawn(self, host: Host, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.children.append(spawn_child(f"{name}-{self.backend}", host.argv(argv), env, log_dir))

    @staticmethod
    def url(host: Host) -> str:
        return f"http://{host.addr}:{PORT}"

    def wait_healthy(self, urls: list[str], timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        for url in urls:
            while True:
                dead = [c for c in self.children if not c.alive()]
                assert not dead, f"{dead[0].name} exited:\n{dead[0].tail(30)}"
                try:
                    if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"{url} not healthy in {timeout_s}s:\n" + "\n".join(
                    f"--- {c.name}:\n{c.tail(10)}" for c in self.children)
                time.sleep(0.2)

    def wait_proxy_admits_all(self, timeout_s: float = WAIT_S) -> None:
        """Until the proxy's /health reports every instance healthy with a closed circuit."""
        deadline = time.monotonic() + timeout_s
        while True:
            r = httpx.get(self.url(self.lan["x"]) + "/health", timeout=10, trust_env=False)
            ups = r.json().get("prefill", []) + r.json().get("decode", [])
            if r.status_code == 200 and all(u["healthy"] and u["circuit"] == "closed" for u in ups):
                return
            assert time.monotonic() < deadline, f"the proxy does not admit every instance: {r.text}"
            time.sleep(0.1)

    def metric(self, role: str, name: str, inside: bool = False, **labels: str) -> float:
        """The sum of `name`'s samples on P ("p") or D ("d") having `labels` (0 if none); `inside`:
        asked from inside the instance's own namespace (its link may be down)."""
        url = self.url(self.lan[role]) + "/metrics"
        if inside:
            text = subprocess.run(self.lan[role].argv([sys.executable, "-c", FETCH, url]), capture_output=True,
                                  text=True, timeout=30, check=True).stdout
        else:
            text = httpx.get(url, timeout=10, trust_env=False).text
        total = 0.0
        for line in text.splitlines():
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total

    def complete(self, prompt: str) -> str:
        client = OpenAI(base_url=self.url(self.lan["x"]) + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S,
                        http_client=httpx.Client(trust_env=False, timeout=WAIT_S))
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0).choices[0].text

    def assert_all_blocks_free(self, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            state = {r: (self.metric(r, "kvbridge_kv_cache_free_blocks"),
                         self.metric(r, "kvbridge_kv_cache_total_blocks")) for r in ("p", "d")}
            if all(free == total > 0 for free, total in state.values()):
                return
            assert time.monotonic() < deadline, f"KV blocks still allocated: {state}"
            time.sleep(0.1)

    def stop(self) -> None:
        stop_children(list(reversed(self.children)))


BOTH_BACKENDS = pytest.mark.parametrize("deployment", ["nixl", "tcp"], indirect=True)


@pytest.fixture(scope="module")
def deployment(request, lan, tmp_path_factory):
    dep = Deployment(lan, request.param, tmp_path_factory.mktemp(f"logs-{request.param}"))
    try:
        yield dep
        dep.assert_all_blocks_free()
    finally:
        dep.stop()


@BOTH_BACKENDS
def test_greedy_outputs_equal_colocated_and_the_kv_crosses_the_link(deployment, reference):
    d = deployment.lan["d"]
    before_bytes, before_rx = deployment.metric("d", "kvbridge_kv_transfer_bytes_total"), d.rx_bytes()
    assert deployment.complete(SHORT) == reference(SHORT)
    assert deployment.complete(LONG) == reference(LONG)
    moved = deployment.metric("d", "kvbridge_kv_transfer_bytes_total") - before_bytes
    assert moved >= 46_000 * len(reference.tokenizer.encode(LONG))  # every block of both prompts was read
    assert d.rx_bytes() - before_rx >= moved  # ... over D's link, not through shared memory
    if deployment.backend == "nixl":  # serve chose the interface of --host for UCX by itself
        logs = "".join(Path(c.log_path).read_text(errors="replace") for c in deployment.children)
        assert f"UCX_NET_DEVICES={deployment.lan['p'].veth} " in logs
        assert f"UCX_NET_DEVICES={d.veth} " in logs
    assert deployment.metric("p", "kvbridge_kv_expired_leases_total") == 0
    deployment.assert_all_blocks_free()


@BOTH_BACKENDS
def test_a_remote_host_outside_the_trusted_range_is_refused_before_any_connection(deployment, lan, reference):
    """A listener at an address D can reach but does not trust (the bridge's own, outside P's /30)
    sees no connection attempt: not at admission, not later (D has served another request since,
    so any release it queued for that host would have been sent)."""
    assert not ipaddress.ip_address(lan.gateway) in ipaddress.ip_network(deployment.trusted)
    with socket.create_server((lan.gateway, 0)) as listener:
        params = {"do_remote_prefill": True, "remote_engine_id": "rogue", "remote_request_id": "rogue-1",
                  "remote_host": lan.gateway, "remote_port": listener.getsockname()[1],
                  "remote_block_ids": [1, 2], "lease_generation": 1}
        r = httpx.post(deployment.url(lan["d"]) + "/v1/completions", timeout=WAIT_S, trust_env=False,
                       json={"model": MODEL, "prompt": LONG, "max_tokens": 2, "kv_transfer_params": params})
        assert r.status_code == 400, r.text
        body = r.json()["error"]
        assert "not a trusted prefill host" in body["message"] and body["type"] == "invalid_request_error"
        assert deployment.complete(SHORT) == reference(SHORT)
        assert select.select([listener], [], [], 0)[0] == [], "D connected to an untrusted host"
    deployment.assert_all_blocks_free()


@pytest.mark.parametrize("deployment", ["nixl"], indirect=True)  # once, with the default backend
def test_link_cut_mid_read_follows_the_policy_and_the_lease_frees_p(deployment, lan, reference):
    """The link between P and D goes down while D reads a long prompt's KV, then comes back.

    Mid-read, deterministically: P's link is rate-limited (tc tbf, 80 Mbit/s) so the ~12 MiB read
    would last about 1.2 s (under the 3 s transfer timeout: only the cut can fail it), and the link
    is cut when P's veth has sent 2 MiB more than before the request: only KV data is that large
    (P's HTTP answer and side-channel frames are a few KB), so the read
    is then in progress, which the counters confirm afterwards (no read completed, one timed out).
    D's read stalls, fails at --kv-transfer-timeout (3 s), and D recomputes (policy recompute): the
    answer is the colocated one. D's release cannot reach P, so P's lease (8 s) frees its blocks.
    With the link up again the next request is read from P as usual."""
    p = lan["p"]
    assert deployment.complete(SHORT) == reference(SHORT)  # handshake done: the fault hits the read
    want = reference(FAULT_PROMPT)
    reads, expired = (deployment.metric("d", "kvbridge_kv_transfers_total"),
                      deployment.metric("p", "kvbridge_kv_expired_leases_total"))
    timeouts = deployment.metric("d", "kvbridge_kv_failed_transfers_total", kind="transfer_timeout")
    p.shape(rate="80mbit")
    answer: dict[str, str | BaseException] = {}

    def ask() -> None:
        try:
            answer["text"] = deployment.complete(FAULT_PROMPT)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            answer["error"] = exc
    try:
        sent = p.tx_bytes()
        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        deadline = time.monotonic() + WAIT_S
        while p.tx_bytes() - sent < 2 << 20:
            assert asker.is_alive() and time.monotonic() < deadline, f"the read never started: {answer}"
            time.sleep(0.002)
        p.set_link(False)
        asker.join(WAIT_S)
        assert not asker.is_alive(), "the request hung"
        assert answer.get("text") == want, answer
        assert deployment.metric("d", "kvbridge_kv_failed_transfers_total", kind="transfer_timeout") == timeouts + 1
        assert deployment.metric("d", "kvbridge_kv_transfers_total") == reads
        # P is cut off from D's release: its lease frees the blocks (seen from inside P's host).
        deadline = time.monotonic() + LEASE_S + 10
        while deployment.metric("p", "kvbridge_kv_expired_leases_total", inside=True) == expired:
            assert time.monotonic() < deadline, "P's lease never expired"
            time.sleep(0.1)
        assert (deployment.metric("p", "kvbridge_kv_cache_free_blocks", inside=True)
                == deployment.metric("p", "kvbridge_kv_cache_total_blocks", inside=True))
    finally:
        p.set_link(True)
        p.unshape()
    deployment.wait_proxy_admits_all()  # its health checks marked P down while the link was
    after = "With the link back up: " + LONG  # shares no block with D's cache: its KV is read from P
    assert deployment.complete(after) == reference(after)
    assert deployment.metric("d", "kvbridge_kv_transfers_total") == reads + 1
    deployment.assert_all_blocks_free()
