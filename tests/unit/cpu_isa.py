"""The kernel tests' ISA parameter: each kernel test runs on every build (avx2, avx512, amx) this CPU
can execute, and skips, saying so, the ones it cannot. `use(isa, monkeypatch)` loads that build (one
build per ISA per cache folder, reused by every later test and session) and sends the engine's
kernel calls (`cpu_kernels.ops()`, the layers' call sites) to it for the test."""

from __future__ import annotations

import pytest

from kvbridge.engine.layers import cpu_kernels

RUNNABLE = cpu_kernels.runnable_isas()
PARAMS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in RUNNABLE, reason=f"this CPU cannot run {isa}"))
          for isa in cpu_kernels.ISAS]


def use(isa: str, monkeypatch: pytest.MonkeyPatch) -> str:
    assert cpu_kernels.available(), "kvbridge's CPU kernels did not build (see the warning logged)"
    cpu_kernels.load(isa)
    monkeypatch.setattr(cpu_kernels, "_active", isa)
    return isa
