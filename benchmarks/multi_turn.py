"""KV reuse across turns: per-turn TTFT and prefill tokens computed for multi-turn conversations,
kvbridge with reuse against kvbridge without, same run, same instances.

Set-up, all on 127.0.0.1: one LocalCluster of `--prefill` P and `--decode` D `kvbridge serve` (nixl,
fp32, 1 torch thread each, KV events on, every instance of role both, as `kvbridge up` starts them)
and two `kvbridge proxy` in front of the same instances, both with kv_aware P and D and every request
through P (--pd-mode always):
* reuse: --kv-reuse on (P reads the history from the D that answered the last turn);
* no_reuse: --kv-reuse off (P computes what its own prefix cache lacks: at least the last answer);
and a third arm through the no_reuse proxy:
* cold: the reuse arm's prompt of the same turn behind a word no other prompt starts with, so no
  instance holds any of it (the turn-1-equivalent recompute: what a P that lost the history computes).

Each of `--conversations` conversations per arm (its own random words) runs `--turns` turns: a user
message of ~`--user-tokens` tokens, answered in `--max-tokens` tokens (ignore_eos), the answer kept
in the history; turns run one request at a time, the arms interleaved per turn. Every request is a
streamed greedy chat completion; TTFT: from sending to the first chunk with text. Prefill tokens
computed: the sum of the P instances' vllm:request_prefill_kv_computed_tokens over the request (one
request at a time, so the delta is its own). New tokens of a turn: its prompt less the last turn's
prompt and answer (the user message and the chat template's tokens around it).

    python benchmarks/multi_turn.py --prefill 1 --decode 1 --json /tmp/multi_turn_1p1d.json
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402

from kvbridge.launcher import cluster  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fleet_proxies, also under `kvbridge bench`
from fleet_proxies import cpu_name, start_proxy  # noqa: E402

PROXIES = {
    "reuse": ["--kv-reuse", "on"],
    "no_reuse": ["--kv-reuse", "off"],
}
ROUTING = ["--prefill-policy", "kv_aware", "--decode-policy", "kv_aware", "--pd-mode", "always",
           "--health-interval", "0.5"]
WORDS = ("harbour ledger cargo invoice route vessel tariff customs pallet manifest carrier freight berth "
         "container crane depot schedule delay weather insurance claim parcel address refund river "
         "mountain season orchard lantern copper violet meadow").split()
COMPUTED = "vllm:request_prefill_kv_computed_tokens_sum"


def words(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens * 3 // 4)) + "."


@dataclass
class Sample:
    arm: str
    conversation: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    new_tokens: int
    computed_on_p: float
    cached_tokens: int
    reused_header: int


def computed(http: httpx.Client, urls: tuple[str, ...]) -> float:
    total = 0.0
    for url in urls:
        text = http.get(url + "/metrics", timeout=10).text
        total += sum(float(v) for v in re.findall(rf"^{re.escape(COMPUTED)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))
    return total


def stream(http: httpx.Client, url: str, model: str, messages: list[dict], max_tokens: int
           ) -> tuple[float, str, dict, int]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    first, text, usage = float("inf"), [], {}
    started = time.perf_counter()
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        reused = int(r.headers.get("x-kvbridge-kv-reused-tokens", "0"))
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if event.get("usage"):
                usage = event["usage"]
            delta = event["choices"][0]["delta"].get("content") if event.get("choices") else None
            if delta:
                if first == float("inf"):
                    first = time.perf_counter() - started
                text.append(delta)
    return first, "".join(text), usage, reused


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="kvbridge-multi-turn-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    fleet = cluster.LocalCluster(args.model, args.prefill, args.decode, port=0, kv_backend="nixl", num_threads=1,
                                 kv_reuse=True, proxy_args=[*ROUTING, "--kv-reuse", "on"],
                                 extra_serve_args=["--dtype", "float32", "--num-blocks", str(args.num_blocks),
                                                   "--max-model-len", str(args.max_model_len),
                                                   "--log-level", "warning"],
                                 log_dir=log_dir, ready_timeout_s=600)
    proxies: list[cluster.ChildProcess] = []
    http = httpx.Client(timeout=600, trust_env=False)
    samples: list[Sample] = []
    try:
        urls = fleet.start()
        proxy_urls = {"reuse": urls.proxy}  # up's own proxy, --kv-reuse on
        child, proxy_urls["no_reuse"] = start_proxy("proxy-no_reuse", urls, [*ROUTING, *PROXIES["no_reuse"]], log_dir,
                                                    http)
        proxies.append(child)
        rng = {arm: random.Random(f"{arm}-{args.seed}") for arm in ("reuse", "no_reuse")}
        histories = {arm: [[] for _ in range(args.conversations)] for arm in ("reuse", "no_reuse")}
        last_total = {arm: [0] * args.conversations for arm in ("reuse", "no_reuse")}
        stream(http, urls.proxy, args.model, [{"role": "user", "content": "warm up"}], 4)  # rates, handshakes
        for turn in range(args.turns):
            for conv in range(args.conversations):
                cold_messages = None
                for arm in ("reuse", "no_reuse"):
                    history = histories[arm][conv]
                    messages = [*history, {"role": "user", "content": words(rng[arm], args.user_tokens)}]
                    if arm == "reuse":  # the cold arm: this prompt behind a word no other prompt starts with
                        first = messages[0]["content"]
                        cold_messages = [{"role": "user", "content": f"Q{args.seed}x{turn}x{conv}. {first}"},
                                         *messages[1:]]
                    before = computed(http, urls.prefill)
                    ttft, answer, usage, reused = stream(http, proxy_urls[arm], args.model, messages, args.max_tokens)
                    on_p = computed(http, urls.prefill) - before
                    n = usage.get("prompt_tokens", 0)
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    samples.append(Sample(arm, conv, turn + 1, ttft, n, n - last_total[arm][conv], on_p, cached, reused))
                    last_total[arm][conv] = n + usage.get("completion_tokens", 0)
                    history[:] = [*messages, {"role": "assistant", "content": answer}]
                    time.sleep(0.3)  # the answering D's KV events reach the proxy before the next turn is routed
                assert cold_messages is not None
                before = computed(http, urls.prefill)
                ttft, _, usage, reused = stream(http, proxy_urls["no_reuse"], args.model, cold_messages, args.max_tokens)
                n = usage.get("prompt_tokens", 0)
                samples.append(Sample("cold", conv, turn + 1, ttft, n, n, computed(http, urls.prefill) - before,
                                      (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), reused))
            print(f"turn {turn + 1}/{args.turns} done", file=sys.stderr)
    finally:
        http.close()
        cluster.stop_children(proxies, 10.0)
        fleet.stop()
    cpu = cpu_name()
    print(f"\n{cpu}, {args.prefill}P{args.decode}D, {args.conversations} conversations x {args.turns} turns, "
          f"user ~{args.user_tokens} tokens, answers {args.max_tokens} tokens; medians over conversations")
    print(f"{'turn':>4} {'prompt':>7} | {'TTFT reuse':>10} {'no_reuse':>9} {'cold':>7} | "
          f"{'P computed reuse':>16} {'no_reuse':>9} {'cold':>7} | {'new':>5} {'held':>5}")
    table = []
    for turn in range(1, args.turns + 1):
        row = {}
        for arm in ("reuse", "no_reuse", "cold"):
            mine = [s for s in samples if s.arm == arm and s.turn == turn]
            row[arm] = {"ttft": statistics.median(s.ttft_s for s in mine),
                        "computed": statistics.median(s.computed_on_p for s in mine),
                        "prompt": statistics.median(s.prompt_tokens for s in mine),
                        "new": statistics.median(s.new_tokens for s in mine),
                        "held": statistics.median(s.reused_header for s in mine)}
        table.append(row)
        print(f"{turn:>4} {row['reuse']['prompt']:>7.0f} | {row['reuse']['ttft']:>10.3f} {row['no_reuse']['ttft']:>9.3f} "
              f"{row['cold']['ttft']:>7.3f} | {row['reuse']['computed']:>16.0f} {row['no_reuse']['computed']:>9.0f} "
              f"{row['cold']['computed']:>7.0f} | {row['reuse']['new']:>5.0f} {row['reuse']['held']:>5.0f}")
    last = table[-1]
    reuse = [s for s in samples if s.arm == "reuse"]
    later = [s for s in reuse if s.turn > 1]
    summary = {
        "last_turn_ttft_reuse_over_no_reuse": last["reuse"]["ttft"] / last["no_reuse"]["ttft"],
        "last_turn_ttft_reuse_over_cold": last["reuse"]["ttft"] / last["cold"]["ttft"],
        "computed_over_new_tokens_turns_2_on": sum(s.computed_on_p for s in later) / max(1, sum(s.new_tokens for s in later)),
        "computed_over_new_tokens_all": sum(s.computed_on_p for s in reuse) / max(1, sum(s.new_tokens for s in reuse)),
        "no_reuse_computed_over_new_tokens_turns_2_on": (
            sum(s.computed_on_p for s in samples if s.arm == "no_reuse" and s.turn > 1)
            / max(1, sum(s.new_tokens for s in samples if s.arm == "no_reuse" and s.turn > 1))),
    }
    print("last turn TTFT, reuse / no_reuse: {last_turn_ttft_reuse_over_no_reuse:.2f}; reuse / cold: "
          "{last_turn_ttft_reuse_over_cold:.2f}".format(**summary))
    print("P's prefill tokens computed / new tokens, turns 2+: reuse {computed_over_new_tokens_turns_2_on:.2f}, "
          "no_reuse {no_reuse_computed_over_new_tokens_turns_2_on:.2f}".format(**summary))
    if args.json is not None:
        args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu,
                                         "summary": summary, "table": table,
                                         "samples": [s.__dict__ for s in samples]}, indent=2))
    print(f"logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
