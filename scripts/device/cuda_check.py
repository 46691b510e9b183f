"""The CUDA path end to end, on a machine with one GPU (scripts/device/prepare.sh here, then
scripts/device/run.sh there; the figures of the last run are in benchmarks/README.md "CUDA").

Stages (each bounded, each reports as data; a failing stage does not stop the next):
  env      torch/CUDA/NIXL versions and NIXL's plugins
  models   random-weight folders (SmolLM2's tokenizer): llama (SmolLM2 shapes, 4 KV heads),
           deepseek_v2 (MLA+MoE), qwen2 sliding window, bamba (Mamba2)
  engine   in-process greedy, CPU fp32 vs CUDA fp32 (16 tokens, 6 prompts), CUDA batch vs alone,
           CUDA bf16 vs CUDA fp32 agreement, every block free afterwards
  up       `kvbridge up` on CUDA with NIXL (KV registered as VRAM): completions (streamed and
           not) through the proxy against the in-process CUDA text, D's transfer bytes, blocks
  mixed    P on CUDA, D on CPU, NIXL: what happens (expected: a refused or failed read, never
           wrong text)
  tp       --tensor-parallel-size 2 on one GPU: a clear failure or a hang?
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import httpx

DEVICE = os.environ.get("CHECK_DEVICE", "cuda")
OUT = Path(os.environ.get("OUT", "/tmp/out"))
WORK = Path("/tmp/cuda_check")
RESULTS: dict[str, object] = {}
LOGS = OUT / "proc_logs.txt"
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
             "What is 12 times 12?", "Who wrote Hamlet?", "Explain gravity in one sentence."]


def say(stage: str, **data) -> None:
    RESULTS.setdefault(stage, {}).update(data)
    print(f"[{time.strftime('%H:%M:%S')}] {stage}: {json.dumps(data, default=str)[:1500]}", flush=True)


def stage(fn):
    def run(*a, **k):
        t0 = time.monotonic()
        try:
            return fn(*a, **k)
        except Exception as e:  # a stage's failure is a finding
            say(fn.__name__, error=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-3000:])
        finally:
            say(fn.__name__, seconds=round(time.monotonic() - t0, 1))
    return run


def tokenizer():
    from kvbridge.engine.tokenizer import Tokenizer
    return Tokenizer.from_json(gzip.decompress(Path(".devkit/smollm2_tokenizer.json.gz").read_bytes()).decode())


@stage
def env():
    import torch
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, available=torch.cuda.is_available())
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), count=torch.cuda.device_count())
    try:
        from nixl._api import nixl_agent, nixl_agent_config
        agent = nixl_agent("probe", nixl_agent_config(backends=[]))
        info["nixl_plugins"] = agent.get_plugin_list()
        info["ucx_mem_types"] = agent.get_plugin_mem_types("UCX")
    except Exception as e:
        info["nixl_error"] = f"{type(e).__name__}: {e}"
    say("env", **info)


@stage
def models() -> dict[str, Path]:
    from kvbridge.engine.loader.synthetic import (SMOLLM2_SHAPED_4_KV_HEADS, TINY_BAMBA, TINY_DEEPSEEK_V2_MOE,
                                                  TINY_QWEN2_SLIDING, write_synthetic_folder)
    tok = tokenizer()
    specs = {"llama": ("llama", dict(SMOLLM2_SHAPED_4_KV_HEADS, num_hidden_layers=8, initializer_range=0.2)),
             "deepseek_v2": ("deepseek_v2", TINY_DEEPSEEK_V2_MOE), "qwen2_sliding": ("qwen2", TINY_QWEN2_SLIDING),
             "bamba": ("bamba", TINY_BAMBA)}
    out = {}
    for name, (arch, geometry) in specs.items():
        out[name] = write_synthetic_folder(WORK / name, tok, architecture=arch, **geometry)
    say("models", built=sorted(out))
    return out


def prompts(tok) -> list[list[int]]:
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


def engine(folder: Path, device: str, dtype: str = "float32"):
    from kvbridge.config import CacheConfig, EngineConfig
    from kvbridge.engine.engine import LLMEngine
    from kvbridge.engine.loader import load_model
    loaded = load_model(str(folder))
    return LLMEngine(EngineConfig(model=loaded.source, dtype=dtype, device=device,
                                  cache=CacheConfig(block_size=16, num_blocks=256, enable_prefix_caching=False)),
                     loaded), loaded


@stage
def engine_check(folders: dict[str, Path]) -> dict[str, list[list[int]]]:
    import torch
    from kvbridge.engine.sampling_params import SamplingParams
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    reference = {}
    for name, folder in folders.items():
        e_gpu, loaded = engine(folder, DEVICE)
        ps = prompts(loaded.tokenizer)
        t0 = time.monotonic()
        alone = [e_gpu.generate([p], greedy)[0] for p in ps]
        t_alone = time.monotonic() - t0
        batch = e_gpu.generate(ps, greedy)
        m = e_gpu.metrics()
        kv_device = str(getattr(getattr(e_gpu.runner, "kv_cache", None), "device", "?"))
        e_cpu, _ = engine(folder, "cpu")
        cpu = [e_cpu.generate([p], greedy)[0] for p in ps]
        e_bf, _ = engine(folder, DEVICE, "bfloat16")
        bf = [e_bf.generate([p], greedy)[0] for p in ps]
        bf_batch = e_bf.generate(ps, greedy)
        e_bf_cpu, _ = engine(folder, "cpu", "bfloat16")
        bf_cpu = [e_bf_cpu.generate([p], greedy)[0] for p in ps]

        def agree(xs, ys):
            return [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(xs, ys)]
        prefix = agree(bf, alone)
        say("engine_check", **{name: dict(
            cpu_equals_gpu=[a == c for a, c in zip(alone, cpu)], batch_equals_alone=batch == alone,
            bf16_prefix_agreeing_with_fp32=prefix, bf16_gpu_vs_cpu_prefix=agree(bf, bf_cpu),
            bf16_batch_equals_alone=bf_batch == bf, blocks_free=m.num_free_blocks == m.num_total_blocks,
            kv_device=kv_device, alone_s=round(t_alone, 2))})
        reference[name] = alone
        reference[name + "/bf16"] = bf
        del e_gpu, e_cpu, e_bf, e_bf_cpu
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return reference


def wait_ready(proc: subprocess.Popen, out: Path, line: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while line not in (text := out.read_text(errors="replace")):
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready in {timeout_s}s")
        time.sleep(0.5)
    return text


def wait_health(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy in {timeout_s}s")


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def start(name: str, argv: list[str]) -> tuple[subprocess.Popen, Path, Path]:
    out, err = WORK / f"{name}.out", WORK / f"{name}.err"
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([sys.executable, "-m", "kvbridge.cli", *argv], stdout=o, stderr=e,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    return proc, out, err


def stop(procs: list[tuple[subprocess.Popen, Path, Path]], label: str) -> None:
    for proc, _, _ in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, out, err in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        with open(LOGS, "a") as f:
            f.write(f"\n===== {label} {out.name} rc={proc.returncode}\n{out.read_text(errors='replace')[-4000:]}"
                    f"\n----- stderr\n{err.read_text(errors='replace')[-8000:]}\n")


def ask(url: str, model: str, prompt: list[int], stream: bool) -> str:
    body = dict(model=model, prompt=prompt, max_tokens=16, temperature=0.0, stream=stream)
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error']}")
                text += event["choices"][0]["text"]
    return text


def compare(url: str, folder: Path, reference: list[list[int]]) -> dict:
    tok = tokenizer()
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    ps = prompts(tok)
    want = [tok.decode(r) for r in reference]
    got, errors = [], []
    for i, p in enumerate(ps):
        try:
            got.append(ask(url, model, p, stream=i % 2 == 1))
        except Exception as e:
            got.append(None)
            errors.append(f"{type(e).__name__}: {e}"[:300])
    return dict(equal=[g == w for g, w in zip(got, want)], errors=errors,
                sample=(got[0], want[0]))


def blocks(urls: list[str]) -> dict:
    return {u: (metric(u, "kvbridge_kv_cache_free_blocks"), metric(u, "kvbridge_kv_cache_total_blocks"))
            for u in urls}


@stage
def up(folder: Path, reference: list[list[int]], dtype: str = "float32"):
    port = 18000 if dtype == "float32" else 18100
    procs = [start(f"up-{dtype}", ["up", str(folder), "--port", str(port), "--device", DEVICE, "--dtype", dtype,
                                   "--kv-backend", "nixl", "--num-blocks", "512", "--max-model-len", "2048"])]
    try:
        text = wait_ready(procs[0][0], procs[0][1], "Ctrl-C stops everything.", 180)
        prefill = re.search(r"prefill: (\S+)", text).group(1)
        decode = re.search(r"decode: +(\S+)", text).group(1)
        url = f"http://127.0.0.1:{port}"
        result = compare(url, folder, reference)
        result.update(d_transfer_bytes=metric(decode, "kvbridge_kv_transfer_bytes_total"),
                      p_early_releases=metric(prefill, "kvbridge_kv_early_releases_total"),
                      blocks_free_total=blocks([prefill, decode]))
        say(f"up_{dtype}", **result)
    finally:
        stop(procs, f"up-{dtype}")


@stage
def mixed(folder: Path, reference: list[list[int]], p_device: str = DEVICE, d_device: str = "cpu"):
    """P and D on different memory: NIXL moves VRAM -> DRAM or DRAM -> VRAM (or refuses)."""
    base = 18200 if p_device == DEVICE else 18250
    ports = dict(p=base, d=base + 1, proxy=base + 2, p_side=base + 3, d_side=base + 4)
    common = [str(folder), "--kv-backend", "nixl", "--num-blocks", "256", "--max-model-len", "2048",
              "--dtype", "float32"]  # as the reference; auto would differ between the GPU and the CPU
    p = start("mixed-p", ["serve", *common, "--device", p_device, "--port", str(ports["p"]), "--kv-role", "producer",
                          "--kv-side-channel-port", str(ports["p_side"]), "--kv-engine-id", "mixed-p"])
    d = start("mixed-d", ["serve", *common, "--device", d_device, "--port", str(ports["d"]), "--kv-role", "consumer",
                          "--kv-side-channel-port", str(ports["d_side"]), "--kv-engine-id", "mixed-d"])
    procs = [p, d]
    try:
        pu, du = f"http://127.0.0.1:{ports['p']}", f"http://127.0.0.1:{ports['d']}"
        wait_health(pu, p[0], 180)
        wait_health(du, d[0], 180)
        procs.append(start("mixed-proxy", ["proxy", "--prefill", pu, "--decode", du, "--port", str(ports["proxy"])]))
        wait_health(f"http://127.0.0.1:{ports['proxy']}", procs[-1][0], 60)
        result = compare(f"http://127.0.0.1:{ports['proxy']}", folder, reference)
        result.update(d_transfer_bytes=metric(du, "kvbridge_kv_transfer_bytes_total"),
                      d_metrics_kv=[line for line in httpx.get(f"{du}/metrics").text.splitlines()
                                    if line.startswith("kvbridge_kv_") and "_bucket" not in line and not line.endswith(" 0.0")][:30],
                      blocks_free_total=blocks([pu, du]))
        say(f"mixed_p_{p_device}_d_{d_device}", **result)
    finally:
        stop(procs, f"mixed {p_device}->{d_device}")


@stage
def tp(folder: Path):
    port = 18300
    proc = start("tp2", ["serve", str(folder), "--tensor-parallel-size", "2", "--device", DEVICE, "--port", str(port),
                         "--num-blocks", "256", "--max-model-len", "2048", "--dtype", "float32"])
    try:
        t0 = time.monotonic()
        try:
            wait_health(f"http://127.0.0.1:{port}", proc[0], 150)
            say("tp", healthy_after_s=round(time.monotonic() - t0, 1))
            tok = tokenizer()
            model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
            say("tp", answer=ask(f"http://127.0.0.1:{port}", model, prompts(tok)[0], stream=False))
        except Exception as e:
            say("tp", outcome=f"{type(e).__name__}: {e}", after_s=round(time.monotonic() - t0, 1),
                stderr_tail=proc[2].read_text(errors="replace")[-1500:])
    finally:
        stop([proc], "tp2")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    only = set(sys.argv[1:])
    env()
    folders = models() or {}
    reference = engine_check(folders) or {}
    if "llama" in folders and "llama" in reference:
        if not only or "up" in only:
            up(folders["llama"], reference["llama"])
            up(folders["llama"], reference["llama/bf16"], "bfloat16")
        if not only or "mixed" in only:
            mixed(folders["llama"], reference["llama"])
            mixed(folders["llama"], reference["llama"], "cpu", DEVICE)
    if "llama" in folders and (not only or "tp" in only):
        tp(folders["llama"])
    (OUT / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))


if __name__ == "__main__":
    main()
