"""`--dtype auto` (engine/setup/dtype_choice.py): the rule as a pure function of the machine's facts
(a CPU without bf16 flags is simulated by the flag set given), the flags read from
/proc/cpuinfo's text, what `serve` builds and logs, and the dtype `up` hands every instance."""

from __future__ import annotations

import logging

import pytest
import torch

from kvbridge import cli
from kvbridge.config import EngineConfig
from kvbridge.engine.setup.dtype_choice import (choose_auto_dtype, model_config_dtype, parse_cpu_flags, read_cpu_flags,
                                                read_cpu_vendor, resolve_dtype)
from kvbridge.launcher import cluster

# This machine's flags line (Sapphire Rapids) and an older Xeon's (Cascade Lake: AVX-512, no bf16).
SPR_FLAGS = "fpu vme sse sse2 avx avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8"
CLX_FLAGS = "fpu vme sse sse2 avx avx2 avx512f avx512bw avx512_vnni"
CPUINFO = "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: {}\nbogomips\t: 4000\n\nprocessor\t: 1\nflags\t\t: {}\n"


def test_a_cpu_without_bf16_flags_gets_float32() -> None:
    for flags in (CLX_FLAGS, "", "neon asimd"):
        choice = choose_auto_dtype("cpu", cpu_flags=parse_cpu_flags(CPUINFO.format(flags, flags)), onednn_bf16=True)
        assert choice.dtype == "float32"
        assert "no native bf16" in choice.reason


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_a_cpu_with_native_bf16_gets_bfloat16(flag: str) -> None:
    choice = choose_auto_dtype("cpu", cpu_flags={"avx512f", flag}, onednn_bf16=True)
    assert choice.dtype == "bfloat16" and flag in choice.reason


def test_bf16_flags_without_a_usable_onednn_bf16_path_get_float32() -> None:
    choice = choose_auto_dtype("cpu", cpu_flags=parse_cpu_flags(CPUINFO.format(SPR_FLAGS, SPR_FLAGS)),
                               onednn_bf16=False)
    assert choice.dtype == "float32" and "oneDNN" in choice.reason


@pytest.mark.parametrize(("config_dtype", "cuda_bf16", "want"), [
    ("bfloat16", True, "bfloat16"),  # the model's own dtype
    ("float16", True, "float16"),
    ("float32", True, "bfloat16"),  # vLLM downcasts an fp32 model to the GPU's preferred half type
    (None, True, "bfloat16"),  # a GGUF file states none
    ("float32", False, "float16"),  # a GPU without bf16 (before Ampere)
    ("bfloat16", False, "float16"),
])
def test_cuda_follows_the_model_config_as_vllm(config_dtype: str | None, cuda_bf16: bool, want: str) -> None:
    assert choose_auto_dtype("cuda", cuda_bf16=cuda_bf16, config_dtype=config_dtype).dtype == want


def test_cpu_flags_are_read_from_every_flags_line() -> None:
    flags = parse_cpu_flags(CPUINFO.format(SPR_FLAGS, CLX_FLAGS))
    assert {"avx512_bf16", "amx_bf16", "amx_tile", "avx2"} <= flags and "bogomips" not in flags
    assert parse_cpu_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}
    assert read_cpu_flags("/nonexistent/cpuinfo") == frozenset()


def test_the_cpu_vendor_is_read_from_vendor_id(tmp_path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert read_cpu_vendor(str(info)) == "AuthenticAMD"
    info.write_text("Features\t: fp asimd\n")  # no vendor_id (Arm)
    assert read_cpu_vendor(str(info)) == ""
    assert read_cpu_vendor("/nonexistent/cpuinfo") == ""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_explicit_dtypes_are_unchanged(dtype: str) -> None:
    assert resolve_dtype(dtype, "cpu", "SmolLM2-135M-Instruct").dtype == dtype
    a = cli.build_parser().parse_args(["serve", "--dtype", dtype])
    assert cli.engine_config_from_args(a).dtype == dtype
    assert cli.dtype_line(a) == f"dtype {dtype} (--dtype {dtype})"


def this_machine() -> str:
    """What auto means here, from the real /proc/cpuinfo and torch."""
    native = bool({"avx512_bf16", "amx_bf16"} & read_cpu_flags()) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return "bfloat16" if native else "float32"


def test_serve_defaults_to_auto_resolved_for_this_machine() -> None:
    a = cli.build_parser().parse_args(["serve"])
    assert a.dtype == "auto"
    assert cli.engine_config_from_args(a).dtype == this_machine()
    assert cli.dtype_line(a).startswith(f"dtype {this_machine()} (--dtype auto: ")
    assert EngineConfig().dtype == "float32"  # the library's default stays fp32
    with pytest.raises(ValueError, match="resolve it first"):
        EngineConfig(dtype="auto")


def test_serve_logs_the_dtype_it_picked_and_why(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    seen = []
    monkeypatch.setattr("kvbridge.server.api_server.run_server", lambda config, *a, **k: seen.append(config) or 0)
    with caplog.at_level(logging.INFO, logger="kvbridge.cli"):
        assert cli.main(["serve", "--port", "0"]) == 0
    [config] = seen
    assert config.dtype == this_machine()
    assert f"dtype {this_machine()} (--dtype auto: " in caplog.text


def test_up_gives_every_instance_the_dtype_it_resolved(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[dict] = []
    monkeypatch.delenv("KVBRIDGE_API_KEY", raising=False)
    monkeypatch.setattr(cluster, "run_cluster", lambda **kwargs: calls.append(kwargs) or 0)
    assert cli.main(["up", "--num-threads", "1"]) == 0
    assert cli.main(["up", "--num-threads", "1", "--dtype", "float32"]) == 0
    assert cli.main(["up", "--num-threads", "1", "--", "--dtype", "bfloat16"]) == 0
    assert [c["extra_serve_args"] for c in calls] == [["--dtype", this_machine()], ["--dtype", "float32"],
                                                      ["--dtype", "bfloat16"]]
    assert f"every instance computes in dtype {this_machine()} (--dtype auto: " in capsys.readouterr().err


def test_model_config_dtype_reads_a_folders_torch_dtype(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert model_config_dtype(str(tmp_path)) == "bfloat16"
    (tmp_path / "config.json").write_text('{"dtype": "float32"}')
    assert model_config_dtype(str(tmp_path)) == "float32"
    (tmp_path / "config.json").write_text('{"torch_dtype": "int8"}')
    assert model_config_dtype(str(tmp_path)) is None
    assert model_config_dtype("SmolLM2-135M-Instruct") is None  # the packaged GGUF states none


def test_serve_on_an_avx2_only_cpu_picks_float32_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """An AMD Zen 3 (AVX2 + FMA, no AVX-512, no bf16 instruction), its flags injected: auto is float32,
    and the start-up log says it is for want of native bf16 arithmetic."""
    zen3 = parse_cpu_flags(CPUINFO.format(*["fpu sse sse2 ssse3 sse4_2 avx f16c fma bmi1 bmi2 avx2 sha_ni vaes"] * 2))
    monkeypatch.setattr("kvbridge.engine.setup.dtype_choice.read_cpu_flags", lambda path="/proc/cpuinfo": zen3)
    seen = []
    monkeypatch.setattr("kvbridge.server.api_server.run_server", lambda config, *a, **k: seen.append(config) or 0)
    with caplog.at_level(logging.INFO, logger="kvbridge.cli"):
        assert cli.main(["serve", "--port", "0"]) == 0
    assert [config.dtype for config in seen] == ["float32"]
    assert "dtype float32 (--dtype auto: the CPU has no native bf16 arithmetic" in caplog.text
