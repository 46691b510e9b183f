"""P/D KV transfer efficiency: one request's KV read through the real connector, divided
by a raw backend READ of the same number of bytes as one buffer, measured interleaved.

Set-up (per backend, nixl and tcp): a prefill server P and a decode server D, real
`kvbridge serve` processes started with the commands LocalCluster uses (fp32, block
size 16, 2 torch threads each: only one of them computes at a time). P keeps prefix
caching, so repeating a prompt costs it one block of prefill; D runs with
--no-prefix-caching, so every request makes D read the whole prompt's KV from P. A
request is the proxy's protocol without the proxy: P answers `max_tokens=1` with
`kv_transfer_params`, then D gets the prompt plus those params.

What is timed:
* P/D: the connector's own READ duration (`KVTransferStats.record_transfer`, read
  from D's /metrics as the change of `kvbridge_kv_transfer_duration_seconds_sum`
  over the request, with the bytes and descriptor counters). The interval starts on
  D's engine thread just before the two descriptor lists are prepared
  (`prep_descs` x2, after the block runs are computed and P's check_read reply is
  in) and ends at the first engine-step poll (`check_state`) that sees DONE. It
  excludes the handshake, the check_read round trip and releasing the handle.
* raw: `raw_transfer.RawPair(backend, capacity).read_gbps(nbytes, reps=3)` with the
  same byte count as one descriptor: a target process (polling get_new_notifs every
  1 ms while measured) and a reader agent, started once per backend before the servers
  and kept for the whole run; per repetition one untimed read, then the median of 3
  reads, each timed from `read()` to a DONE poll (descriptors prepared before).
* raw@descs (diagnostic): the same, with as many equal descriptors as the request's
  read used (or the nearest count below that divides the bytes evenly), remote ones
  in reverse order so that none merge.

Each (backend, TP pairing) gets its own P and D servers, started after the previous
pair's have stopped. Per pair: a warm-up request per size (P's prefill, handshake, UCX
wire-up), not counted; raw reads; the repetitions (P/D per prompt size); raw reads again.
Figures are medians; ratio = median P/D GB/s / median raw GB/s.

    UCX_NET_DEVICES=lo python benchmarks/pd_transfer.py --reps 5 --json /tmp/pd_transfer.json

Hetero-TP (a random-weight SmolLM2-shaped model with 4 KV heads, which TP 2 splits):

    python benchmarks/pd_transfer.py --synthetic --pairings 1:1 2:1 1:2 --backends nixl --reps 5 --kv-cache-gb 1

MLA (a random-weight DeepSeek-V2-shaped model, SYNTHETIC_MLA: DeepSeek-V2's 576-value latent per
token and layer, replicated on every TP rank; each D rank reads one whole copy from one P rank, so
a request moves D TP x one copy, which the table's "copies" column checks):

    python benchmarks/pd_transfer.py --synthetic-mla --pairings 1:1 2:1 1:2 --backends nixl --reps 5

Across hosts (issue 12): P in one network namespace, D and the raw reader in another, on a
bridge; KV crosses the veth pair over UCX's tcp transport (UCX_TLS=tcp: between namespaces of
one machine UCX would otherwise use shared memory), the raw target runs in P's namespace:

    python benchmarks/pd_transfer.py --netns --reps 5

KV bytes per token of published configs (MLA vs the Llama family), arithmetic only:

    python benchmarks/pd_transfer.py --kv-bytes-table
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # every NIXL process stays on loopback
os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent start at INFO

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # raw_transfer, also under `kvbridge bench`
from raw_transfer import RawPair  # noqa: E402

from kvbridge.launcher import cluster  # noqa: E402

READY_TIMEOUT_S = 300.0
BLOCK_SIZE = 16  # the servers' (kvbridge serve's default)
REQUEST_TIMEOUT_S = 600.0  # an 8k-token prefill on a busy 2-core machine
NETNS_ENV = "KVBRIDGE_BENCH_NETNS"  # --netns: set in the run inside D's namespace (NetnsHosts as JSON)
RAW_READS = 3  # timed raw reads per repetition (their median), after RawPair.read_gbps's warm-up read
METRICS = {"kvbridge_kv_transfer_duration_seconds": "sum", "kvbridge_kv_transfer_bytes": "total",
           "kvbridge_kv_transfer_descriptors": "total", "kvbridge_kv_transfers": "total"}

# --synthetic-mla: a DeepSeek-V2 (MLA + MoE) with DeepSeek-V2's real latent, kv_lora_rank 512 +
# qk_rope_head_dim 64 = 576 values per token and layer (V2, V2-Lite and V3 all cache this), on
# 16 layers: 36 MiB of fp32 latent per 1k tokens, 281 MiB for 8k. Everything the cache does not
# see is small, so that an 8k-token prefill takes about a minute on 2 cores (attention over the
# 576-wide latent dominates it, hence only 2 heads, which TP 2 splits): hidden 256, 4 routed
# experts of 128 + 1 shared, no q LoRA. Vocabulary: the tokenizer's (SmolLM2's).
SYNTHETIC_MLA = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=16,
                     num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512, q_lora_rank=None,
                     qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=4,
                     n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, topk_method="greedy",
                     max_position_embeddings=8192, rope_theta=10000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True)

# --kv-bytes-table: the architecture fields of published config.json files (no weights), read
# by kvbridge's own arch_from_config. (label, total / active parameters, config).
PUBLISHED_CONFIGS = [
    ("DeepSeek-V2-Lite", "15.7B / 2.4B", {  # deepseek-ai/DeepSeek-V2-Lite
        "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
        "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "topk_method": "greedy",
        "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}}),
    ("Llama-2-7B (MHA)", "6.7B", {  # meta-llama/Llama-2-7b-hf: 32 KV heads (no GQA)
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 4096}),
    # Llama-3.1's rope_scaling ("llama3") is left out: kvbridge's loader refuses it, and it does not
    # change the cache's size.
    ("Llama-3.1-8B", "8.0B", {  # meta-llama/Llama-3.1-8B
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 500000.0}),
    ("Qwen2.5-7B", "7.6B", {  # Qwen/Qwen2.5-7B
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 131072, "rope_theta": 1000000.0, "use_sliding_window": False}),
    ("Qwen2.5-14B", "14.7B", {  # Qwen/Qwen2.5-14B: about V2-Lite's total size
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 13824,
        "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 1000000.0, "use_sliding_window": False}),
    ("DeepSeek-V2", "236B / 21B", {  # deepseek-ai/DeepSeek-V2
        "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 5120,
        "intermediate_size": 12288, "num_hidden_layers": 60, "num_attention_heads": 128, "num_key_value_heads": 128,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 160, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "moe_intermediate_size": 1536, "first_k_dense_replace": 1, "topk_method": "group_limited_greedy",
        "n_group": 8, "topk_group": 3, "routed_scaling_factor": 16.0, "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}}),
    ("Llama-3.1-70B", "70.6B", {  # meta-llama/Llama-3.1-70B
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 500000.0}),
]
BF16_BYTES = 2


@dataclass(frozen=True)
class Sample:
    backend: str
    tokens: int
    rep: int
    nbytes: int
    descs: int
    pd_s: float  # the connector's READ duration

    @property
    def pd_gbps(self) -> float:
        return self.nbytes / self.pd_s / 1e9


@dataclass(frozen=True)
class RawSample:
    backend: str
    tokens: int
    when: str  # "before" / "after" the P/D repetitions, or "rep N" when interleaved
    raw_gbps: float  # median of RAW_READS reads
    raw_descs_gbps: float | None  # raw with about the request's descriptor count (None: one descriptor)


@dataclass(frozen=True)
class NetnsHosts:
    """--netns: P's namespace and both hosts' addresses and interfaces (this process runs in D's)."""

    p_netns: str
    p_addr: str
    p_veth: str
    d_addr: str
    d_veth: str

    @classmethod
    def from_env(cls) -> NetnsHosts | None:
        raw = os.environ.get(NETNS_ENV)
        return cls(**json.loads(raw)) if raw else None

    def p_prefix(self) -> list[str]:
        """Runs a command in P's namespace, with UCX on P's interface."""
        return ["ip", "netns", "exec", self.p_netns, "env", f"UCX_NET_DEVICES={self.p_veth}"]


def run_in_namespaces(argv: list[str]) -> int:
    """--netns: make P's and D's namespaces on a bridge (tests/netns.py), run this benchmark again
    inside D's (its raw reader and D then read across the veth pair), remove them afterwards."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.netns import NetnsLan

    with NetnsLan(("p", "d")) as lan:
        p, d = lan["p"], lan["d"]
        hosts = NetnsHosts(p.netns, p.addr, p.veth, d.addr, d.veth)
        # UCX_TLS=tcp: between namespaces of ONE machine UCX would copy through shared memory
        # (cross-memory attach) and no byte would cross the link; separate hosts have no such path.
        env = {**os.environ, NETNS_ENV: json.dumps(asdict(hosts)), "UCX_TLS": "tcp", "UCX_NET_DEVICES": d.veth}
        before = d.rx_bytes()
        rc = subprocess.run(d.argv([sys.executable, os.path.abspath(__file__), *argv]), env=env).returncode
        print(f"bytes D's veth received during the run: {d.rx_bytes() - before:,}")
        return rc


class PDPair:
    """One P and one D `kvbridge serve` process for one backend; stop() ends both by pid."""

    def __init__(self, backend: str, model: str, log_dir: Path, num_threads: int, kv_cache_gb: float,
                 prefill_tp: int = 1, decode_tp: int = 1, netns: NetnsHosts | None = None) -> None:
        self.backend, self.model = backend, model
        self.served = Path(model).name if Path(model).is_dir() else model  # the name `serve` gives a folder
        self.label = backend if (prefill_tp, decode_tp) == (1, 1) else f"{backend} P{prefill_tp}>D{decode_tp}"
        specs = cluster.plan_instances(1, 1, prefill_tp=prefill_tp, decode_tp=decode_tp)
        env = cluster.child_env(os.environ, loopback_only=netns is None, num_threads=num_threads)
        # fp32, as copy_bytes counts (the default --dtype auto is bf16 on a CPU with native bf16)
        common = ["--kv-cache-memory-gb", str(kv_cache_gb), "--log-level", "warning", "--dtype", "float32"]
        extra = {"prefill": common, "decode": [*common, "--no-prefix-caching"]}
        hosts = {"prefill": "127.0.0.1", "decode": "127.0.0.1"}
        prefix: dict[str, list[str]] = {"prefill": [], "decode": []}
        if netns is not None:  # each serve derives UCX_NET_DEVICES from its --host
            env.pop("UCX_NET_DEVICES", None)
            hosts = {"prefill": netns.p_addr, "decode": netns.d_addr}
            prefix["prefill"] = ["ip", "netns", "exec", netns.p_netns]
            extra["decode"] += ["--kv-trusted-hosts", netns.p_addr]
        self.children: list[cluster.ChildProcess] = []
        self.urls: dict[str, str] = {}
        for spec in specs:
            kind = spec.name.split("-")[0]
            argv = cluster.serve_command(cluster.DEFAULT_CLI, model, spec, host=hosts[kind], kv_backend=backend,
                                         num_threads=num_threads, extra_args=extra[kind])
            self.children.append(cluster.spawn_child(f"{self.label.replace(' ', '-')}-{spec.name}",
                                                     [*prefix[kind], *argv], env, log_dir))
            self.urls[kind] = cluster.http_url(hosts[kind], spec.port)
        self.http = httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False)

    def wait_healthy(self, deadline: float) -> None:
        pending = dict(zip(self.urls.values(), self.children))
        while pending:
            for url, child in list(pending.items()):
                if not child.alive():
                    raise RuntimeError(f"{child.name} exited during start-up:\n{child.tail()}")
                try:
                    if self.http.get(url + "/health", timeout=2).status_code == 200:
                        del pending[url]
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"not healthy in time: {', '.join(c.name for c in pending.values())}")
            time.sleep(0.2)

    def d_counters(self) -> dict[str, float]:
        text = self.http.get(self.urls["decode"] + "/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for name, suffix in METRICS.items():
                    if sample.name == f"{name}_{suffix}":
                        out[name] = sample.value
        return out

    def request(self, prompt: list[int]) -> tuple[float, int, int]:
        """One P/D request; returns D's (READ seconds, bytes, descriptors) for it."""
        body = {"model": self.served, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        r = self.http.post(self.urls["prefill"] + "/v1/completions",
                           json={**body, "kv_transfer_params": {"do_remote_decode": True}})
        r.raise_for_status()
        params = r.json()["kv_transfer_params"]
        before = self.d_counters()
        r = self.http.post(self.urls["decode"] + "/v1/completions", json={**body, "kv_transfer_params": params})
        r.raise_for_status()
        after = self.d_counters()
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in METRICS}
        if delta["kvbridge_kv_transfers"] != 1:
            raise RuntimeError(f"D completed {delta['kvbridge_kv_transfers']:.0f} reads for one request "
                               f"(a prefix-cache hit, or a failed load?)")
        return (delta["kvbridge_kv_transfer_duration_seconds"], int(delta["kvbridge_kv_transfer_bytes"]),
                int(delta["kvbridge_kv_transfer_descriptors"]))

    def stop(self) -> None:
        self.http.close()
        cluster.stop_children(list(reversed(self.children)), grace_s=10.0)


def make_prompt(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(tokens)]


def near_divisor(nbytes: int, n: int) -> int:
    """The largest descriptor count <= n that splits nbytes evenly (RawPair.read_gbps needs equal sizes)."""
    return next(d for d in range(n, 0, -1) if nbytes % d == 0)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(samples: list[Sample], raws: list[RawSample],
              expect: dict[tuple[str, int], tuple[int, int]] | None = None) -> list[dict]:
    """Medians per (label, tokens). `expect`: (label, tokens) -> (bytes of one KV copy, copies a
    request should move); `copies` is then the bytes per request over one copy, `bytes_ok` whether
    every repetition moved exactly the expected copies."""
    rows = []
    for backend, tokens in dict.fromkeys((s.backend, s.tokens) for s in samples):
        group = [s for s in samples if (s.backend, s.tokens) == (backend, tokens)]
        raw_group = [r for r in raws if (r.backend, r.tokens) == (backend, tokens)]
        pd, raw = median([s.pd_gbps for s in group]), median([r.raw_gbps for r in raw_group])
        at_descs = [r.raw_descs_gbps for r in raw_group if r.raw_descs_gbps is not None]
        check = {}
        if expect is not None and (backend, tokens) in expect:
            one, copies = expect[backend, tokens]
            check = {"copy_bytes": one, "expected_copies": copies, "copies": group[0].nbytes / one,
                     "bytes_ok": all(s.nbytes == one * copies for s in group)}
        rows.append({"backend": backend, "tokens": tokens, "reps": len(group), "raw_samples": len(raw_group),
                     "bytes": group[0].nbytes, "bytes_min": min(s.nbytes for s in group),
                     "bytes_max": max(s.nbytes for s in group), **check, "MiB": group[0].nbytes / 2**20,
                     "descs": median([s.descs for s in group]), "descs_min": min(s.descs for s in group),
                     "descs_max": max(s.descs for s in group), "pd_ms": median([s.pd_s * 1e3 for s in group]),
                     "pd_gbps": pd, "raw_gbps": raw, "raw_descs_gbps": median(at_descs) if at_descs else None,
                     "ratio": pd / raw})
    return rows


def print_table(rows: list[dict]) -> None:
    """`copies`: bytes per request / one copy of the prompt's KV, and "ok" when every repetition
    moved exactly the expected copies (D TP for MLA, 1 otherwise)."""
    head = (f"{'backend':<11} {'tokens':>6} {'MiB':>6} {'copies':>9} {'descs (min-max)':>16} {'P/D ms':>7} "
            f"{'P/D GB/s':>9} {'raw GB/s':>9} {'raw@descs':>9} {'ratio':>6}")
    print(head)
    for r in rows:
        descs = f"{r['descs']:.0f} ({r['descs_min']}-{r['descs_max']})"
        at = f"{r['raw_descs_gbps']:.2f}" if r["raw_descs_gbps"] is not None else "-"
        copies = f"{r['copies']:.2f} {'ok' if r['bytes_ok'] else 'NO'}" if "copies" in r else "-"
        print(f"{r['backend']:<11} {r['tokens']:>6} {r['MiB']:>6.1f} {copies:>9} {descs:>16} {r['pd_ms']:>7.2f} "
              f"{r['pd_gbps']:>9.2f} {r['raw_gbps']:>9.2f} {at:>9} {r['ratio']:>6.2f}")


def copy_bytes(arch, tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """One copy of a prompt's KV cache (fp32, every block the prompt touches): the whole KV of a
    Llama-family model (its TP ranks hold disjoint heads), one rank's latent of an MLA model."""
    import torch

    from kvbridge.engine.model_runner import kv_bytes_per_block

    return kv_bytes_per_block(arch, block_size, torch.float32) * -(-tokens // block_size)


def copies_read(arch, decode_tp: int) -> int:
    """Copies of the KV a request moves: every D rank reads the whole replicated MLA latent (from one
    P rank); a Llama-family model's D ranks read disjoint heads, one copy in all."""
    return decode_tp if arch.use_mla else 1


def kv_bytes_table() -> list[dict]:
    """KV bytes per token (bf16) of PUBLISHED_CONFIGS, each architecture as kvbridge's loader reads it;
    `vs_mla` is the ratio to the MLA model listed above it."""
    from kvbridge.engine.loader.safetensors import arch_from_config

    rows, mla_row = [], None
    for label, params, config in PUBLISHED_CONFIGS:
        arch = arch_from_config(config)
        values = arch.cache_entries * arch.cache_kv_heads * arch.cache_head_size  # per token and layer
        per_token = values * arch.num_layers * BF16_BYTES
        assert per_token * 4 == arch.kv_bytes_per_token * BF16_BYTES  # ModelArchConfig's own figure, in fp32
        if arch.use_mla:
            what = f"MLA latent {arch.mla.kv_lora_rank}+{arch.mla.qk_rope_head_dim}"
        else:
            what = (f"{'MHA' if arch.num_kv_heads == arch.num_heads else 'GQA'} "
                    f"{arch.num_kv_heads} KV heads x {arch.head_dim}, K+V")
        row = {"model": label, "params": params, "cache": what, "layers": arch.num_layers,
               "values_per_layer": values, "bytes_per_token": per_token,
               "mib_per_8k_tokens": per_token * 8192 / 2**20}
        if arch.use_mla:
            mla_row = row
            # what the same heads would cache as per-head K (nope + rope) and V, without the latent
            row["mha_equivalent_bytes_per_token"] = (arch.num_heads * (arch.mla.qk_head_dim + arch.mla.v_head_dim)
                                                     * arch.num_layers * BF16_BYTES)
        row["vs_mla"] = per_token / mla_row["bytes_per_token"] if mla_row else None
        row["vs_model"] = mla_row["model"] if mla_row else None
        rows.append(row)
    return rows


def print_kv_bytes_table(rows: list[dict]) -> None:
    print("KV cache bytes per token, bf16, from published config.json architecture fields (arch_from_config)")
    print(f"{'model':<17} {'params (active)':>15} {'cached per token and layer':<30} {'layers':>6} "
          f"{'values':>6} {'B/token':>8} {'KiB/token':>9} {'MiB/8k tok':>10} {'x MLA above':>11}")
    for r in rows:
        ratio = f"{r['vs_mla']:.2f}" if r["vs_mla"] is not None else "-"
        print(f"{r['model']:<17} {r['params']:>15} {r['cache']:<30} {r['layers']:>6} {r['values_per_layer']:>6} "
              f"{r['bytes_per_token']:>8} {r['bytes_per_token'] / 1024:>9.1f} {r['mib_per_8k_tokens']:>10.1f} "
              f"{ratio:>11}")
    for r in rows:
        if "mha_equivalent_bytes_per_token" in r:
            eq = r["mha_equivalent_bytes_per_token"]
            print(f"({r['model']}'s heads caching per-head K and V instead of the latent: {eq} B/token, "
                  f"{eq / r['bytes_per_token']:.1f}x its latent)")


def raw_sample(raw_pair: RawPair, backend: str, tokens: int, when: str, nbytes: int, descs: int,
               args: argparse.Namespace) -> RawSample:
    raw = raw_pair.read_gbps(nbytes, reps=RAW_READS)
    at_descs = (raw_pair.read_gbps(nbytes, reps=RAW_READS, num_descs=near_divisor(nbytes, descs))
                if descs > 1 and not args.no_desc_baseline else None)
    return RawSample(backend, tokens, when, raw, at_descs)


def run(args: argparse.Namespace, pairs: dict[str, PDPair],
        raw_pairs: dict[str, RawPair]) -> tuple[list[Sample], list[RawSample]]:
    prompts = {n: make_prompt(n, seed=n) for n in args.tokens}
    steps = len(args.tokens) * len(pairs) * (args.reps + 1)
    samples: list[Sample] = []
    raws: list[RawSample] = []
    shape: dict[tuple[str, int], tuple[int, int]] = {}  # (backend, tokens) -> (bytes, descriptors) read

    def bracket(when: str) -> None:
        for (label, n), (nbytes, descs) in shape.items():
            seen = [x.descs for x in samples if (x.backend, x.tokens) == (label, n)]
            descs = round(median(seen)) if seen else 1  # raw@descs: after the repetitions only
            raws.append(raw_sample(raw_pairs[pairs[label].backend], label, n, when, nbytes, descs, args))

    with tqdm(total=steps, desc="pd_transfer", unit="read", file=sys.stderr) as bar:
        for backend, pair in pairs.items():  # warm-up: P's prefill, handshake, wire-up
            for n in args.tokens:
                bar.set_postfix_str(f"warm-up {backend} {n} tokens")
                shape[backend, n] = pair.request(prompts[n])[1:]
                bar.update()
        if not args.interleaved:
            bar.set_postfix_str("raw reads before")
            bracket("before")
        for rep in range(args.reps):
            for n in args.tokens:
                for backend, pair in pairs.items():
                    bar.set_postfix_str(f"rep {rep + 1} {backend} {n} tokens")
                    seconds, nbytes, descs = pair.request(prompts[n])
                    samples.append(Sample(backend, n, rep, nbytes, descs, seconds))
                    if args.interleaved:
                        raws.append(raw_sample(raw_pairs[pair.backend], backend, n, f"rep {rep + 1}", nbytes, descs,
                                               args))
                    bar.update()
        if not args.interleaved:
            bar.set_postfix_str("raw reads after")
            bracket("after")
    return samples, raws


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--pairings", nargs="+", default=["1:1"], metavar="P:D",
                    help="prefill:decode tensor parallel sizes, e.g. 1:1 2:1 1:2 (default: %(default)s)")
    ap.add_argument("--synthetic", action="store_true",
                    help="serve a random-weight SmolLM2-shaped model with 8 heads and 4 KV heads instead of "
                         "--model (SmolLM2's 3 KV heads do not split over TP 2)")
    ap.add_argument("--synthetic-mla", action="store_true",
                    help="serve a random-weight DeepSeek-V2-shaped MLA model (SYNTHETIC_MLA: DeepSeek-V2's "
                         "576-value latent, 16 layers) instead of --model")
    ap.add_argument("--kv-bytes-table", action="store_true",
                    help="print KV bytes per token of published MLA and Llama-family configs (arithmetic, "
                         "no servers) and exit")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8000], help="prompt lengths")
    ap.add_argument("--backends", nargs="+", default=["nixl", "tcp"], choices=["nixl", "tcp"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="1k-token prompts only, 3 repetitions")
    ap.add_argument("--no-desc-baseline", action="store_true", help="skip the raw@descs diagnostic")
    ap.add_argument("--interleaved", action="store_true",
                    help="raw reads after every P/D request instead of before and after all of them")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per engine")
    ap.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache per engine (8k tokens: 0.37 GB)")
    ap.add_argument("--json", type=Path, default=None, help="write samples and summary here")
    ap.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temp dir)")
    ap.add_argument("--netns", action="store_true",
                    help="P and D (and the raw pair) on two hosts: network namespaces on a bridge, the KV "
                         "crossing a veth pair over UCX's tcp transport (needs root and iproute2)")
    args = ap.parse_args()
    if args.netns and NetnsHosts.from_env() is None:
        return run_in_namespaces(sys.argv[1:])
    if args.kv_bytes_table:
        print_kv_bytes_table(kv_bytes_table())
        return 0
    if args.synthetic and args.synthetic_mla:
        ap.error("--synthetic and --synthetic-mla exclude each other")
    if args.quick:
        args.tokens, args.reps = [1024], min(args.reps, 3)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvbridge-pd-transfer-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    from kvbridge.engine.loader import load_model
    from kvbridge.engine.loader.synthetic import SMOLLM2_SHAPED_4_KV_HEADS, write_synthetic_folder
    if args.synthetic:
        args.model = str(write_synthetic_folder(log_dir / "synthetic-4-kv-heads", load_model(args.model).tokenizer,
                                                **SMOLLM2_SHAPED_4_KV_HEADS))
    if args.synthetic_mla:
        args.model = str(write_synthetic_folder(log_dir / "synthetic-mla", load_model(args.model).tokenizer,
                                                architecture="deepseek_v2", **SYNTHETIC_MLA))
    tp_pairs = [tuple(int(x) for x in p.split(":")) for p in args.pairings]
    arch = load_model(args.model).arch
    expect: dict[tuple[str, int], tuple[int, int]] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the servers
    with contextlib.ExitStack() as raw_stack:
        # The raw pairs (one per backend, kept for the whole run) allocate their buffers
        # before the servers start: allocated after them, P/D reads ran ~40% slower from
        # then on (RawPair in raw_transfer.py; figures in benchmarks/README.md).
        # The largest request's read: an MLA request moves one latent copy per D rank.
        capacity = copy_bytes(arch, max(args.tokens)) * max(copies_read(arch, d) for _, d in tp_pairs)
        netns = NetnsHosts.from_env()
        raw_pairs = {b: raw_stack.enter_context(
            RawPair(b, capacity, netns.p_prefix(), netns.p_addr) if netns else RawPair(b, capacity))
            for b in args.backends}
        samples, raws = [], []
        for backend in args.backends:
            for p_tp, d_tp in tp_pairs:
                # One pair of servers at a time: idle TP engines' processes still take a share of
                # the two cores (a TP 1 pair measured 0.54 beside two TP 2 pairs, 1.03 alone).
                pair = PDPair(backend, args.model, log_dir, args.threads, args.kv_cache_gb, p_tp, d_tp, netns)
                expect.update({(pair.label, n): (copy_bytes(arch, n), copies_read(arch, d_tp)) for n in args.tokens})
                try:
                    pair.wait_healthy(time.monotonic() + READY_TIMEOUT_S)
                    got, got_raw = run(args, {pair.label: pair}, raw_pairs)
                finally:
                    pair.stop()
                samples += got
                raws += got_raw
    rows = summarize(samples, raws, expect)
    raw_when = "after each P/D request" if args.interleaved else "before and after the P/D repetitions"
    print(f"\nKV transfer efficiency, medians of {args.reps} P/D repetitions, raw reads {raw_when} "
          f"(P/D: connector READ on D; raw: one descriptor; raw@descs: the request's descriptor count)")
    cache = (f"MLA latent {arch.mla.kv_lora_rank}+{arch.mla.qk_rope_head_dim} on every rank" if arch.use_mla
             else f"{arch.num_kv_heads} KV heads x {arch.head_dim}, K+V")
    print(f"model {Path(args.model).name}: {arch.num_layers} layers, {cache}, "
          f"{copy_bytes(arch, BLOCK_SIZE) // BLOCK_SIZE} B/token fp32 (one copy); copies = bytes per request / "
          f"one copy, ok = {'D TP' if arch.use_mla else '1'} every repetition")
    print_table(rows)
    kv_table = None
    if arch.use_mla:
        kv_table = kv_bytes_table()
        print()
        print_kv_bytes_table(kv_table)
    if not all(r.get("bytes_ok", True) for r in rows):
        print("WARNING: some requests moved other than the expected copies of the KV (see copies)")
    if args.json is not None:
        args.json.write_text(json.dumps({"config": {k: str(v) if isinstance(v, Path) else v
                                                    for k, v in vars(args).items()},
                                         "summary": rows, "samples": [asdict(s) for s in samples],
                                         "raw_samples": [asdict(r) for r in raws],
                                         "kv_bytes_table": kv_table}, indent=2))
        print(f"wrote {args.json}")
    print(f"server logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
