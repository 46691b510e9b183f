"""benchmarks/prefill_vs_vllm.py: its case grammar, the prompts both engines get, and kvbridge's
worker speaking the benchmark's line protocol with the real default model (vLLM's worker needs
vLLM's own virtualenv: the benchmark, not the suite, runs it)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import prefill_vs_vllm as bench  # noqa: E402


def test_cases_parse_and_bad_ones_are_refused():
    assert bench.parse_case("16x128") == (16, 128)
    assert bench.parse_case("1X1024") == (1, 1024)
    for bad in ("16", "x128", "16x", "0x128", "4x0", "ax2", "1x2x3"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_case(bad)


def test_both_workers_run_openmps_default_wait_policy_as_the_servers_do():
    args = bench.parse_args(["--threads", "2", "--kv-cache-gb", "0.5"])
    kvb, vllm = bench.worker_envs(args, {"OMP_WAIT_POLICY": "PASSIVE", "PATH": "/bin"})
    assert "OMP_WAIT_POLICY" not in kvb and "OMP_WAIT_POLICY" not in vllm
    assert kvb["PATH"] == vllm["PATH"] == "/bin"
    assert vllm["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and vllm["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert vllm["VLLM_CPU_KVCACHE_SPACE"] == "0.5" and vllm["OMP_NUM_THREADS"] == "2"


def test_both_engines_get_the_same_fresh_prompts():
    a, b = bench.prompts(7, 3, 5), bench.prompts(7, 3, 5)
    assert a == b and len(a) == 3 and all(len(p) == 5 for p in a)
    assert all(bench.VOCAB_RANGE[0] <= t < bench.VOCAB_RANGE[1] for p in a for t in p)
    assert bench.prompts(8, 3, 5) != a  # each repetition its own prompts: no prefix-cache help


def test_kvbridge_worker_answers_bursts_and_exits_when_its_input_closes(tmp_path):
    args = bench.parse_args(["--threads", "1", "--kv-cache-gb", "0.05", "--max-model-len", "512"])
    command = bench.worker_command(sys.executable, "kvbridge", args, Path("SmolLM2-135M-Instruct"))
    worker = bench.Worker("kvbridge", command, {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, tmp_path / "w.log")
    try:
        times = [worker.burst(3, 40, seed) for seed in (1, 2)]  # 3 prompts of 40 tokens, twice
        assert all(0 < t < 120 for t in times)
    finally:
        worker.stop()
    assert worker.proc.returncode == 0, (tmp_path / "w.log").read_text()[-2000:]
