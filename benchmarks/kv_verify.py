"""What KV verification costs (kvbridge/kv_transfer/digest.py): the digest's throughput per core,
its cost per MB and per 1k-token prompt of the default model's KV (fp32 and bf16), and D's TTFT
with --kv-verify on vs off in one run.

Digest: xxh3_64 over a KV-block-sized (and a whole-prompt-sized) buffer, hashed in place through a
memoryview of the tensor's storage, 1 thread; median of 15 calls.

TTFT: two in-process P/D pairs on the real default model (SmolLM2-135M-Instruct, fp32, 1 torch
thread each), one with verification on at both ends and one with it off, the fake transfer
backend (an in-process copy: the cheapest transfer, so the digests' share is the largest), the
real side channel on loopback. P keeps its prefix cache (it prefills each prompt once, then every
repetition hits it); D has none, so it reads the whole prompt's KV every time. The time measured is
D's: from add_request on D to its first token (the lease check with P's digests, the read, D's
verification and its first decode step), the part verification changes; P's prefill is the same
in both arms and left out. The arms alternate, the order rotating per repetition; medians; ratio =
on / off.

    python benchmarks/kv_verify.py --reps 9 --json /tmp/kv_verify.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from kvbridge.config import CacheConfig, EngineConfig, KVRole, KVTransferConfig  # noqa: E402
from kvbridge.engine.engine import LLMEngine  # noqa: E402
from kvbridge.engine.kv_connector_factory import build_connectors  # noqa: E402
from kvbridge.engine.loader import load_model  # noqa: E402
from kvbridge.engine.sampling_params import SamplingParams  # noqa: E402
from kvbridge.kv_transfer.backends.fake import FakeFabric  # noqa: E402
from kvbridge.kv_transfer.digest import digest_span  # noqa: E402
from kvbridge.kv_transfer.params import parse_kv_transfer_params, to_wire  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def digest_gbps(nbytes: int, dtype: torch.dtype, calls: int = 15) -> float:
    t = torch.randn(nbytes // torch.tensor([], dtype=dtype).element_size()).to(dtype)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        digest_span(t.data_ptr(), t.numel() * t.element_size())
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def engine(loaded, role: KVRole, fabric: FakeFabric, name: str, verify: bool, blocks: int) -> LLMEngine:
    kv = KVTransferConfig(role=role, backend="fake", engine_id=name, kv_verify=verify, lease_seconds=120.0,
                          transfer_timeout_s=60.0)
    config = EngineConfig(model=loaded.source, kv_transfer=kv, num_threads=1,
                          cache=CacheConfig(block_size=16, num_blocks=blocks,
                                            enable_prefix_caching=role is KVRole.PRODUCER))
    return LLMEngine(config, loaded, build_connectors(config, loaded.arch, loaded.name, fabric.create_agent(name)))


def prefill(p: LLMEngine, prompt: list[int], rid: str) -> dict:
    p.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0),
                  parse_kv_transfer_params({"do_remote_decode": True}))
    while True:
        for out in p.step().outputs:
            if out.request_id == rid and out.finished:
                return to_wire(out.kv_transfer_params)


def d_ttft(p: LLMEngine, d: LLMEngine, prompt: list[int], params: dict, rid: str) -> float:
    start = time.perf_counter()
    d.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0), parse_kv_transfer_params(params))
    first = None
    while True:
        outs = [o for o in d.step().outputs if o.request_id == rid]
        if first is None and any(o.new_token_ids for o in outs):
            first = time.perf_counter() - start
        p.step()
        if outs and outs[-1].finished:
            assert first is not None, "no token"
            return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(MODEL)
    arch = loaded.arch
    kv_bytes_per_token = {"fp32": 4, "bf16": 2}
    per_token = arch.num_layers * arch.cache_kv_heads * arch.cache_head_size * 2  # K and V elements per token
    result: dict = {"cpu": cpu_model(), "model": MODEL, "digest": {}, "ttft": {}}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        prompt_bytes = per_token * kv_bytes_per_token[name] * 1024
        block_bytes = per_token * kv_bytes_per_token[name] * 16
        gbps_block = digest_gbps(block_bytes, dtype)
        gbps_prompt = digest_gbps(prompt_bytes, dtype)
        result["digest"][name] = {"block_bytes": block_bytes, "gbps_block": gbps_block,
                                  "prompt_1k_bytes": prompt_bytes, "gbps_prompt_1k": gbps_prompt,
                                  "ms_per_mb": 1e3 * (1 << 20) / (gbps_prompt * 1e9),
                                  "ms_per_1k_prompt": 1e3 * prompt_bytes / (gbps_prompt * 1e9)}
        print(f"digest {name}: block {block_bytes} B {gbps_block:.1f} GB/s; 1k-token prompt {prompt_bytes / 1e6:.1f} MB "
              f"{gbps_prompt:.1f} GB/s = {result['digest'][name]['ms_per_1k_prompt']:.2f} ms on each of P and D")
    blocks = max(args.tokens) // 16 + 16
    arms = {}
    for verify in (True, False):
        fabric = FakeFabric()
        tag = "on" if verify else "off"
        arms[tag] = (engine(loaded, KVRole.PRODUCER, fabric, f"P-{tag}", verify, blocks),
                     engine(loaded, KVRole.CONSUMER, fabric, f"D-{tag}", verify, blocks))
    rng = random.Random(0)
    vocab = min(arch.vocab_size, 40000)
    try:
        for n in args.tokens:
            prompt = [rng.randrange(100, vocab) for _ in range(n)]
            times: dict[str, list[float]] = {"on": [], "off": []}
            for rep in range(args.reps + 1):  # the first is a warm-up
                order = ["on", "off"] if rep % 2 == 0 else ["off", "on"]
                for tag in order:
                    p, d = arms[tag]
                    params = prefill(p, prompt, f"p-{tag}-{n}-{rep}")
                    t = d_ttft(p, d, prompt, params, f"d-{tag}-{n}-{rep}")
                    if rep:
                        times[tag].append(t)
            on, off = statistics.median(times["on"]), statistics.median(times["off"])
            result["ttft"][str(n)] = {"on_ms": on * 1e3, "off_ms": off * 1e3, "ratio": on / off,
                                      "reps": args.reps}
            print(f"{n} tokens: D's TTFT verify on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, ratio {on / off:.3f} "
                  f"(medians of {args.reps})")
    finally:
        for p, d in arms.values():
            p.shutdown()
            d.shutdown()
    print(f"CPU: {result['cpu']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
