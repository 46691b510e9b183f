"""`--dtype auto`: which dtype an engine computes and keeps its KV cache in, and why.

`choose_auto_dtype` is the rule, a pure function of what the machine offers:
- CPU: bfloat16 where the CPU computes bf16 natively (the `avx512_bf16` or `amx_bf16` flag) and
  torch's oneDNN bf16 path is usable (the linear layers run on it: layers/linear.py); float32
  elsewhere, where bf16 would be emulated and slower than fp32.
- CUDA: as vLLM's "auto" (its `_resolve_auto_dtype`): the model config's `torch_dtype`, except
  that a float32 (or unstated) one becomes the GPU's preferred half type (bfloat16 where the GPU
  supports it, else float16), and bfloat16 on a GPU without it becomes float16.

`resolve_dtype` gathers those facts (/proc/cpuinfo, torch, the model folder's config.json) and
applies the rule; an explicit dtype passes through unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # native bf16 arithmetic (x86)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # float32 | bfloat16 | float16
    reason: str  # for the start-up log line


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The CPU feature flags in /proc/cpuinfo's text (x86 `flags`, Arm `Features`)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def read_cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """This machine's CPU flags; empty when the file cannot be read (not Linux)."""
    try:
        return parse_cpu_flags(Path(path).read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return frozenset()


def read_cpu_vendor(path: str = "/proc/cpuinfo") -> str:
    """This machine's CPU vendor (x86 `vendor_id`: GenuineIntel, AuthenticAMD, ...); "" when unknown."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "vendor_id":
            return value.strip()
    return ""


def choose_auto_dtype(device: str, *, cpu_flags: Iterable[str] = (), onednn_bf16: bool = False,
                      cuda_bf16: bool = False, config_dtype: str | None = None) -> DtypeChoice:
    """The dtype `auto` stands for on `device` ("cpu" or "cuda").

    cpu_flags: the CPU's feature flags; onednn_bf16: torch's oneDNN bf16 path is usable
    (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`); cuda_bf16: the GPU supports bf16;
    config_dtype: the model config's torch_dtype, None when it states none (a GGUF file)."""
    if device == "cuda":
        half = "bfloat16" if cuda_bf16 else "float16"
        if config_dtype in (None, "float32"):
            stated = "states no dtype" if config_dtype is None else "is float32"
            return DtypeChoice(half, f"CUDA: the model config {stated}, so the GPU's preferred half type (as vLLM)")
        if config_dtype == "bfloat16" and not cuda_bf16:
            return DtypeChoice("float16", "CUDA: the model config's bfloat16 is not supported by this GPU")
        return DtypeChoice(config_dtype, f"CUDA: the model config's torch_dtype {config_dtype} (as vLLM)")
    native = sorted(CPU_BF16_FLAGS.intersection(cpu_flags))
    if not native:
        return DtypeChoice("float32", "the CPU has no native bf16 arithmetic (no avx512_bf16 or amx_bf16 flag)")
    if not onednn_bf16:
        return DtypeChoice("float32", f"the CPU has {', '.join(native)} but torch's oneDNN bf16 path is not usable")
    return DtypeChoice("bfloat16", f"the CPU computes bf16 natively ({', '.join(native)}; oneDNN bf16 usable)")


def model_config_dtype(model: str) -> str | None:
    """The torch_dtype a Hugging Face model folder's config.json states (a name of DTYPE_NAMES),
    or None: a GGUF file, the default model, no or another value."""
    path = Path(model).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("torch_dtype", config.get("dtype")) if isinstance(config, dict) else None
    if not isinstance(value, str):
        return None
    value = {"float": "float32", "half": "float16", "bf16": "bfloat16"}.get(value, value)
    return value if value in DTYPE_NAMES else None


def resolve_dtype(requested: str, device: str, model: str) -> DtypeChoice:
    """`requested` unchanged, or what `auto` stands for on `device` (auto, cpu or cuda) for `model`."""
    if requested != AUTO:
        return DtypeChoice(requested, "asked for")
    import torch
    on_cuda = device == "cuda" or (device == AUTO and torch.cuda.is_available())
    if on_cuda:
        return choose_auto_dtype("cuda", cuda_bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
                                 config_dtype=model_config_dtype(model))
    return choose_auto_dtype("cpu", cpu_flags=read_cpu_flags(),
                             onednn_bf16=bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
