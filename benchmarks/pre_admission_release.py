"""How fast P frees a request's blocks when D rejects the request before admission (seed 002).

In one process: a P and a D API server (real HTTP on loopback, tcp transfer backend),
driven by httpx. Each round: P prefills a request and holds its blocks under a 30 s lease;
D gets the request with P's kv_transfer_params plus a bad parameter (cycling through
max_tokens=0, an unknown model, a prompt longer than the context) and answers 400/404;
we measure from the moment the client has D's answer until P's engine reports no blocks
held for remote decode. Without the notification P would hold them until the lease
expires (30 s). Target: p99 under 50 ms.

    python benchmarks/pre_admission_release.py [--rounds 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import httpx  # noqa: E402
from tqdm import tqdm  # noqa: E402

from kvbridge.chaos import ThreadServer  # noqa: E402
from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig  # noqa: E402
from kvbridge.engine.engine import LLMEngine  # noqa: E402
from kvbridge.engine.kv_connector_factory import build_connectors  # noqa: E402
from kvbridge.engine.loader import load_model  # noqa: E402
from kvbridge.server.api_server import build_app  # noqa: E402
from kvbridge.server.async_engine import AsyncEngine  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
LEASE_S = 30.0


def engine(loaded, role: KVRole, engine_id: str) -> AsyncEngine:
    config = EngineConfig(cache=CacheConfig(num_blocks=128), max_model_len=1024, num_threads=1,
                          kv_transfer=KVTransferConfig(role=role, backend="tcp", engine_id=engine_id,
                                                       lease_seconds=LEASE_S))
    return AsyncEngine(LLMEngine(config, loaded, build_connectors(config, loaded.arch, loaded.name)))


def bad_body(i: int, params: dict) -> dict:
    base = {"model": MODEL, "prompt": "Tell me a story about a dragon.", "max_tokens": 8,
            "kv_transfer_params": params}
    kind = i % 3
    if kind == 0:
        return {**base, "max_tokens": 0}
    if kind == 1:
        return {**base, "model": "no-such-model"}
    return {**base, "max_tokens": 2000}  # prompt + max_tokens beyond the 1024-token context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    loaded = load_model(MODEL)
    p_eng, d_eng = engine(loaded, KVRole.PRODUCER, "P"), engine(loaded, KVRole.CONSUMER, "D")
    p_srv, d_srv = ThreadServer(build_app(p_eng)), ThreadServer(build_app(d_eng))
    held = lambda: p_eng.call_threadsafe(lambda e: e.metrics().num_held_for_remote).result(timeout=10)  # noqa: E731
    latencies_ms, statuses = [], []
    try:
        with httpx.Client(timeout=60) as client:
            for i in tqdm(range(a.rounds), desc="rejections"):
                r = client.post(p_srv.url + "/v1/completions", json={
                    "model": MODEL, "prompt": "Tell me a story about a dragon.", "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True}})
                params = r.json()["kv_transfer_params"]
                assert held() == 1
                r = client.post(d_srv.url + "/v1/completions", json=bad_body(i, params))
                answered = time.perf_counter()
                statuses.append(r.status_code)
                while held():
                    if time.perf_counter() - answered > LEASE_S:
                        raise RuntimeError("P never freed the blocks")
                latencies_ms.append(max(0.0, (time.perf_counter() - answered) * 1000))
    finally:
        p_srv.stop()
        d_srv.stop()
        p_eng.shutdown()
        d_eng.shutdown()
    lat = sorted(latencies_ms)
    p50, p99 = statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    result = {"rounds": a.rounds, "statuses": sorted(set(statuses)), "p50_ms": p50, "p99_ms": p99,
              "max_ms": lat[-1], "lease_s_without_notification": LEASE_S}
    print("\n| rounds | D statuses | P freed after D's answer: p50 | p99 | max | without the notification |")
    print(f"| {a.rounds} | {result['statuses']} | {p50:.1f} ms | {p99:.1f} ms | {lat[-1]:.1f} ms | "
          f"lease expiry ({LEASE_S:.0f} s) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
