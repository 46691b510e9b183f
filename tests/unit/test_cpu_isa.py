"""KVBRIDGE_CPU_ISA (layers/cpu_kernels.py): which build of the CPU kernels the engine runs, from
the CPU's flags (injected here as other CPUs' flag lines) and the variable; asking for an ISA the
CPU lacks is an error at start-up, naming what is missing; each ISA is a build of its own, and the
avx2 build holds no AVX-512 instruction (so it runs on an AVX2-only CPU such as AMD Zen 2/3)."""

from __future__ import annotations

import logging
import shutil
import subprocess

import pytest

from kvbridge.engine.layers import cpu_kernels
from tests.unit import cpu_isa

# Flag lines of other CPUs (/proc/cpuinfo's, trimmed to what matters here).
ZEN3 = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx f16c fma bmi1 bmi2 avx2 movbe abm sha_ni vaes".split())
CASCADE_LAKE = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}
SAPPHIRE_RAPIDS = CASCADE_LAKE | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
ARM = frozenset("fp asimd bf16 sve".split())


@pytest.mark.parametrize("flags,best", [(ZEN3, "avx2"), (CASCADE_LAKE, "avx512"), (SAPPHIRE_RAPIDS, "amx"),
                                        (ARM, "native")])
def test_auto_takes_the_best_isa_the_cpu_runs(flags: frozenset[str], best: str) -> None:
    isa, why = cpu_kernels.choose_isa("auto", flags)
    assert isa == best and why.startswith("auto")
    assert cpu_kernels.choose_isa("", flags)[0] == best


@pytest.mark.parametrize("flags,asked", [(SAPPHIRE_RAPIDS, "avx2"), (SAPPHIRE_RAPIDS, "avx512"), (CASCADE_LAKE, "avx2"),
                                         (ZEN3, "avx2"), (SAPPHIRE_RAPIDS, " AMX ")])
def test_an_isa_the_cpu_runs_is_taken_when_asked(flags: frozenset[str], asked: str) -> None:
    isa, why = cpu_kernels.choose_isa(asked, flags)
    assert isa == asked.strip().lower() and why == f"KVBRIDGE_CPU_ISA={isa}"


@pytest.mark.parametrize("flags,asked,missing", [(ZEN3, "avx512", "avx512f"), (ZEN3, "amx", "amx_tile"),
                                                 (CASCADE_LAKE, "amx", "amx_bf16"), (ARM, "avx2", "avx2")])
def test_an_isa_the_cpu_lacks_is_a_clear_error(flags: frozenset[str], asked: str, missing: str) -> None:
    with pytest.raises(cpu_kernels.CpuIsaError, match=f"KVBRIDGE_CPU_ISA={asked} .*lacks.*{missing}"):
        cpu_kernels.choose_isa(asked, flags)


def test_an_unknown_isa_is_a_clear_error() -> None:
    with pytest.raises(cpu_kernels.CpuIsaError, match="none of auto, avx2, avx512, amx"):
        cpu_kernels.choose_isa("avx3", SAPPHIRE_RAPIDS)


def _fresh_start(monkeypatch: pytest.MonkeyPatch, flags: frozenset[str] | None, asked: str) -> None:
    """available() as at an engine's start: undecided, on a CPU with these flags (None: this one's)."""
    monkeypatch.setattr(cpu_kernels, "_available", None)
    monkeypatch.setattr(cpu_kernels, "_active", None)
    if flags is not None:
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    monkeypatch.setenv("KVBRIDGE_CPU_ISA", asked)
    monkeypatch.delenv("KVBRIDGE_CPU_KERNELS", raising=False)


def test_the_engine_start_fails_on_an_isa_the_cpu_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a fallback and not a crash inside a kernel: available() (the engine's start-up) raises."""
    _fresh_start(monkeypatch, ZEN3, "avx512")
    with pytest.raises(cpu_kernels.CpuIsaError, match="no avx512"):
        cpu_kernels.available()
    with pytest.raises(cpu_kernels.CpuIsaError, match="cannot run the avx512 build"):
        cpu_kernels.load("avx512")


@pytest.mark.parametrize("isa", cpu_isa.PARAMS)
def test_the_engine_runs_the_isa_asked_for_and_says_so_once(isa: str, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    _fresh_start(monkeypatch, None, isa)
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        assert cpu_kernels.available() and cpu_kernels.available()
    said = [r.getMessage() for r in caplog.records if "kvbridge CPU kernels: the" in r.getMessage()]
    assert said == [f"kvbridge CPU kernels: the {isa} build (KVBRIDGE_CPU_ISA={isa})"]
    assert cpu_kernels.active_isa() == isa and cpu_kernels.ops() is cpu_kernels.ops(isa)


def test_each_isa_builds_in_its_own_folder() -> None:
    folders = {cpu_kernels.build_dir(isa) for isa in cpu_kernels.ISA_FLAGS}
    assert len(folders) == len(cpu_kernels.ISA_FLAGS)
    assert cpu_kernels.build_dir() == cpu_kernels.build_dir(cpu_kernels.choose_isa()[0])


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the build with")
@pytest.mark.parametrize("isa,zmm", [pytest.param("avx2", False, marks=cpu_isa.PARAMS[0].marks),
                                     pytest.param("avx512", True, marks=cpu_isa.PARAMS[1].marks)])
def test_the_avx2_build_has_no_avx512_instruction(isa: str, zmm: bool) -> None:
    """The avx2 build runs on a CPU without AVX-512: not one zmm register in its code (the avx512
    build, read the same way, has them: the check can fail)."""
    cpu_kernels.load(isa)
    library = cpu_kernels.build_dir(isa) / f"kvbridge_cpu_kernels_{isa}.so"
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                          check=True, timeout=120).stdout
    assert ("%zmm" in code) == zmm
    assert "vfmadd" in code and "%ymm" in code  # FMA on 8 lanes: vector code, not scalar
