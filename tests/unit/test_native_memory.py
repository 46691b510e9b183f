"""Issue 33: an engine's native memory must not grow with every new prompt length.

oneDNN (kvbridge's prepacked fp32 and bf16 linears) compiles one primitive per
matmul shape and caches it: without a bound, every new row count (a step's token count) kept
about 0.5 MB per linear weight for over a thousand shapes. The check runs in a fresh process
(the caches' capacity is read at the process's first primitive) set up as an engine process is
(`configure_torch_threads`), feeds a linear hundreds of row counts it has not seen, and measures
glibc's bytes in use (mallinfo2), which counts the caches' live entries and no heap holes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvbridge.engine.setup import native_memory
from kvbridge.engine.setup.native_memory import HeapTrimmer

SCRIPT = r"""
import ctypes, json, sys
import torch
from kvbridge.engine.model_runner import configure_torch_threads

configure_torch_threads(1)  # as the engine and every TP rank do before building a model
from kvbridge.engine.layers.linear import Linear


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
dtype = getattr(torch, sys.argv[1])
warm, measured = int(sys.argv[2]), int(sys.argv[3])
layers = []
for n_in, n_out in ((256, 384), (384, 256)):
    layer = Linear(n_in, n_out, False, dtype, torch.device("cpu"))
    torch.nn.init.normal_(layer.weight)
    layer.prepack()  # oneDNN's blocked layout, in fp32 and bf16
    layers.append(layer)


def run(rows):
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, 256, dtype=dtype)
            layers[1](layers[0](x))


run(range(1, warm + 1))  # fills the caches up to their bound (if they have one)
before = libc.mallinfo2().uordblks
run(range(warm + 1, warm + measured + 1))  # row counts never seen before
print(json.dumps({"growth_mb": (libc.mallinfo2().uordblks - before) / 2**20}))
"""

WARM_SHAPES = 600  # fills the bounded caches (the bf16 path has more than one, each to its own bound)
NEW_SHAPES = 300


def native_growth_mb(dtype: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in native_memory.CACHE_ENV}
    done = subprocess.run([sys.executable, "-c", SCRIPT, dtype, str(WARM_SHAPES), str(NEW_SHAPES)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["growth_mb"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_new_row_counts_do_not_grow_native_memory(dtype):
    # Unbounded (before the fix): 600 primitives of this size kept, 100-200 MB here. Bounded: the
    # entries evicted free what the new ones take.
    growth = native_growth_mb(dtype)
    assert growth < 16, f"{NEW_SHAPES} new row counts kept {growth:.0f} MB of native memory"


def test_an_engine_process_bounds_onednn_caches_unless_told_otherwise(monkeypatch):
    for name in native_memory.CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    native_memory.bound_onednn_caches()
    assert all(os.environ[n] == str(native_memory.PRIMITIVE_CACHE_CAPACITY) for n in native_memory.CACHE_ENV)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    native_memory.bound_onednn_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"  # the operator's value wins


def test_heap_trimmer_trims_at_most_once_an_interval(monkeypatch):
    calls = []
    monkeypatch.setattr(native_memory, "_malloc_trim", lambda pad: calls.append(pad) or 1)
    now = [100.0]
    trimmer = HeapTrimmer(interval_s=10.0, clock=lambda: now[0])
    assert not trimmer.maybe_trim()
    now[0] += 9.9
    assert not trimmer.maybe_trim()
    now[0] += 0.2
    assert trimmer.maybe_trim() and calls == [0]
    assert not trimmer.maybe_trim()
    off = HeapTrimmer(interval_s=0.0, clock=lambda: now[0])
    now[0] += 1000
    assert not off.maybe_trim() and calls == [0]


def test_trim_interval_from_the_environment(monkeypatch):
    monkeypatch.setenv(native_memory.TRIM_ENV, "0")
    assert native_memory.trim_interval_s() == 0
    monkeypatch.setenv(native_memory.TRIM_ENV, "2.5")
    assert native_memory.trim_interval_s() == 2.5
    monkeypatch.setenv(native_memory.TRIM_ENV, "soon")
    assert native_memory.trim_interval_s() == native_memory.TRIM_INTERVAL_S
