"""The whole engine per CPU-kernel build (KVBRIDGE_CPU_ISA), and per source tree: what isa_paths.py
measures op by op, as a user sees it.

Each configuration (tree x ISA x dtype) runs in a process of its own (the build is chosen once per
process), one after another and round by round (`--reps`), so that the machine's drift falls on
every configuration alike: `LLMEngine` on SmolLM2-135M-Instruct, 2 torch threads, no prefix cache;
TTFT of a 1024-token prompt (median of 3) and the median step of 16 sequences decoding together
(128-token prompts). `--trees` compares checkouts of kvbridge (a PYTHONPATH each; their kernels
build into folders of their own), e.g. the tree before a kernel change against this one.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/isa_engine.py --isas avx2 avx512 --reps 2
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/isa_engine.py --trees /tmp/old . --isas avx2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(dtype: str) -> dict:
    """One configuration, in this process (KVBRIDGE_CPU_ISA and PYTHONPATH set by the parent)."""
    import torch

    from kvbridge.config import CacheConfig, EngineConfig
    from kvbridge.engine.engine import LLMEngine
    from kvbridge.engine.layers import cpu_kernels
    from kvbridge.engine.loader import load_model
    from kvbridge.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model="SmolLM2-135M-Instruct", dtype=dtype, num_threads=2,
                                    cache=CacheConfig(num_blocks=512, enable_prefix_caching=False)),
                       load_model("SmolLM2-135M-Instruct"))
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(100, 20000, (n,), generator=g).tolist()

    engine.generate([tokens(64)], SamplingParams(max_tokens=2))  # warm
    ttft = []
    for _ in range(3):
        start = time.perf_counter()
        engine.generate([tokens(1024)], SamplingParams(max_tokens=1))
        ttft.append(time.perf_counter() - start)
    for i in range(16):
        engine.add_request(f"d{i}", tokens(128), SamplingParams(max_tokens=40, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        running = engine.scheduler.running
        if len(running) == 16 and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running):
            steps.append(took)
    engine.shutdown()
    return {"isa": cpu_kernels.active_isa(), "ttft_1k_s": statistics.median(ttft),
            "decode16_step_s": statistics.median(steps[2:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isas", nargs="+", default=["avx2", "avx512"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--trees", nargs="+", default=["."], help="kvbridge checkouts to compare (default: this one)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: measure this dtype, print JSON
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure(a.one)))
        return
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"CPU: {cpu}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}")
    rows: dict[tuple[str, str, str], list[dict]] = {}
    for _ in range(a.reps):
        for dtype in a.dtypes:
            for tree in a.trees:
                for isa in a.isas:
                    env = {**os.environ, "KVBRIDGE_CPU_ISA": isa, "PYTHONPATH": str(Path(tree).resolve()),
                           "OMP_WAIT_POLICY": "PASSIVE"}
                    out = subprocess.run([sys.executable, __file__, "--one", dtype], env=env, capture_output=True,
                                         text=True, check=True, timeout=900)
                    rows.setdefault((tree, isa, dtype), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| tree | ISA | dtype | TTFT 1k (s) | decode step, 16 sequences (ms) |")
    print("|---|---|---|---|---|")
    for (tree, isa, dtype), runs in rows.items():
        ttft = statistics.median(r["ttft_1k_s"] for r in runs)
        step = statistics.median(r["decode16_step_s"] for r in runs) * 1e3
        print(f"| {tree} | {isa} | {dtype} | {ttft:.2f} | {step:.1f} |")


if __name__ == "__main__":
    main()
