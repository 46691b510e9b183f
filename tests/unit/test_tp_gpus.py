"""Tensor parallelism on CUDA takes one GPU per rank. With fewer GPUs than ranks the engine
refuses to start, with the reason, before any rank process exists: NCCL refuses two ranks on one
GPU only at the first collective, and on an H100 a TP 2 engine on one GPU started healthy and
died on its first request (HTTP 500, server shut down)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from kvbridge.config import EngineConfig
from kvbridge.engine.tp import executor as executor_module
from kvbridge.engine.tp.executor import TPExecutor, TPExecutorError


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(monkeypatch, device: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    started = []
    monkeypatch.setattr(TPExecutor, "_start", lambda self, *a: started.append(a))
    with pytest.raises(TPExecutorError, match="tensor parallel size 2 needs one GPU per rank; torch sees 1"):
        TPExecutor(EngineConfig(device=device, tensor_parallel_size=2), num_blocks=16)
    assert started == [] and multiprocessing.active_children() == []
    assert executor_module._active.acquire(blocking=False)  # the one-engine-per-process slot was not taken
    executor_module._active.release()


def test_as_many_gpus_as_ranks_passes_the_check(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    started = []
    monkeypatch.setattr(TPExecutor, "_start", lambda self, *a: started.append(a))
    executor = TPExecutor(EngineConfig(device="cuda", tensor_parallel_size=2, cpu_bind="none"), num_blocks=16)
    assert len(started) == 1
    executor.shutdown()  # no rank was started: stops the watchdog, frees the one-engine slot
    assert executor_module._active.acquire(blocking=False)
    executor_module._active.release()
