"""`kvbridge up --ray` as a user runs it: a real subprocess that starts an embedded Ray bound to
127.0.0.1, deploys the application (router, one prefill and one decode replica) and serves; Ctrl-C
(SIGINT) removes the application, stops Ray and leaves no process behind; between the two,
`kvbridge ray scale` adds a decode replica to the running application without restarting the
others. About 2-3 minutes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest
from openai import OpenAI

from kvbridge.launcher.cluster import DEFAULT_CLI
from tests.e2e.processes import alive, children, gone
from tests.ray.cluster import ENGINE_ARGS, MODEL

pytestmark = pytest.mark.timeout(600)


class Output:
    """A process's stdout lines, read on a thread; wait for the line matching a pattern."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.closed = False
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        found: list[re.Match] = []

        def seen() -> bool:
            found[:] = [m for m in (re.search(pattern, line) for line in self.lines) if m][:1]
            return bool(found) or self.closed
        with self.cond:
            self.cond.wait_for(seen, timeout_s)
            assert found, f"no line matching {pattern!r}; output:\n{''.join(self.lines[-40:])}"
            return found[0]


def test_up_ray_serves_and_ctrl_c_leaves_no_process(no_shared_ray):
    """`no_shared_ray` (conftest.py): the session's shared Ray cluster is not up beside this one."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}  # `up` sets it
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([*DEFAULT_CLI, "up", "--ray", "--port", "0", "--num-threads", "1",
                             "--routing-policy", "kv_aware", *ENGINE_ARGS],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    out = Output(proc.stdout)
    try:
        ready = out.wait_for(r"router (http://127\.0\.0\.1:\d+) .*Ray at (127\.0\.0\.1:\d+)", 400)
        url, address = ready.group(1), ready.group(2)
        answer = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120).completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
        assert answer.choices[0].text and answer.usage.completion_tokens == 8
        health = httpx.get(url + "/health", timeout=10, trust_env=False).json()
        assert [len(health["prefill"]), len(health["decode"])] == [1, 1]
        # The replicas publish KV events and the router follows them (kv_aware): the prompt's blocks,
        # cached on P (it computed them) and on D (it read them), are in the router's fleet index.
        replicas = [health[r][0]["url"] for r in ("prefill", "decode")]
        first = complete(url, LONG, 24)
        held = (first["usage"]["prompt_tokens"] + 24 - 1) // 16  # D's full blocks of prompt and answer
        fleet_has(url, lambda v: all(v.get(u, {}).get("status") == "live" and v[u]["blocks"].get("0", 0) >= 2
                                     for u in replicas) and v[replicas[1]]["blocks"]["0"] >= held,
                  "P's and D's blocks of the prompt (and D's of the answer) in the router's index")
        # KV reuse on Ray (`up`'s default): the next turn's P reads the history from the D that answered
        second = complete(url, LONG + first["choices"][0]["text"] + " Which one mattered most?", 8)
        assert second["reused"] >= 16 * held - 16, second  # the history's blocks, at most the last retokenised
        # `kvbridge ray scale` on the running application: one more decode replica, no restart.
        before = ray_cli("status", address)
        assert [len(before["pools"][r]["router"]) for r in ("prefill", "decode")] == [1, 1]
        first = {u["url"] for r in ("prefill", "decode") for u in before["pools"][r]["router"]}
        ray_cli("scale", address, "--decode-replicas", "2")
        after = ray_cli("status", address)
        assert len(after["pools"]["decode"]["router"]) == 2
        assert first <= {u["url"] for r in ("prefill", "decode") for u in after["pools"][r]["router"]}
        fleet_has(url, lambda v: len([u for u in v.values() if u["status"] == "live"]) == 3,
                  "the new decode replica's events followed too")
        started = children(proc.pid)  # Ray's processes, the replicas and their engines
        engines = [pid for pid in started if b"kvbridge.cli\x00serve" in _cmdline(pid)]
        assert len(engines) == 3, "a prefill and two decode engines run under `up --ray`"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(300) == 0  # 37-41 s here (it hung when started with SIGINT ignored: stop_signals.py)
        out.wait_for(r"removing the application", 5)
        assert gone(started, 60) == [], "processes left behind"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not alive(proc.pid)


LONG = ("The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
        "Constantinople. Summarise its three most important turning points, with a date for each:")


def complete(url: str, prompt: str, max_tokens: int) -> dict:
    """A greedy completion's body, with the tokens the router had read from a holder (`reused`)."""
    r = httpx.post(url + "/v1/completions", timeout=120, trust_env=False, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return {**r.json(), "reused": int(r.headers.get("x-kvbridge-kv-reused-tokens", "0"))}


def fleet_has(url: str, done, what: str, timeout_s: float = 60.0) -> None:
    """Until the router's fleet view (GET /kvbridge/fleet: instances by URL) satisfies `done`."""
    deadline = time.monotonic() + timeout_s
    while not done(view := httpx.get(url + "/kvbridge/fleet", timeout=10, trust_env=False).json()["instances"]):
        assert time.monotonic() < deadline, f"{what}: {view}"
        time.sleep(0.2)


def ray_cli(command: str, address: str, *args: str) -> dict:
    """`kvbridge ray COMMAND --ray-address ADDRESS ARGS` as a user runs it: its JSON answer."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    done = subprocess.run([*DEFAULT_CLI, "ray", command, "--ray-address", address, *args], capture_output=True,
                          text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
