"""kvbridge's own CPU kernels (csrc/*.cpp), compiled once per machine with torch's C++ extension
builder and loaded as torch custom ops (`torch.ops.kvbridge_<isa>.*`, `ops()`).

- `paged_decode_attention`: decode attention straight from the paged KV cache (no gather of
  each sequence's K/V into a temporary tensor every layer; see csrc/paged_decode.cpp);
- `prefill_attention`: causal attention of a prompt over its own new K/V, in 16 x 32 tiles
  (csrc/prefill_attention.cpp);
  decode also reads a bf16 cache (widened to fp32 as read, every sum fp32; `decode_applies`);
- `prefill_attention_bf16_`: the same for bf16 prompts, every fresh prompt of a step in one call,
  written into the step's output, on AMX where the CPU has it and AVX-512 BF16 dot products where it
  has only those (csrc/prefill_attention_bf16.cpp; `bf16_prefill_applies`); bf16 prompts on other
  CPUs go to torch's SDPA;
- `rms_norm`, `add_rms_norm_`, `rotary_`, `write_kv_`, `silu_and_mul`: one-pass versions of small
  per-layer ops (csrc/elementwise.cpp), fp32 or bf16 (fp32 arithmetic, rounded where torch's bf16
  ops round). Call sites ask `applies(...)` / `elementwise_applies(...)` and keep their torch path.

The build needs g++ and ninja (both on the machines kvbridge installs on; `scripts/install.sh`
builds it, so a server never compiles at start-up) and goes to `$KVBRIDGE_CACHE_DIR/cpu-kernels`.
Each instruction set is a build of its own (ISA_FLAGS: "avx2" AVX2 + FMA + F16C and no AVX-512,
"avx512" the CPU's own set without AMX, "amx" the CPU's own set; "native" -march=native on a CPU
that runs none of those), registered in its own op namespace (`torch.ops.kvbridge_<isa>`), so
several load into one process (tests, benchmarks) and `ops(isa)` reaches each. The CPU's flags and
the ISA are part of the build's identity, so another CPU gets its own build. The engine runs one:
`KVBRIDGE_CPU_ISA=avx2|avx512|amx|auto` (auto, the default: the best this CPU runs); asking for one
the CPU cannot run is an error at start-up (`CpuIsaError`). Where the build fails the engine logs
why once and attends with the gather + SDPA path (the path CUDA and fp16 caches always use).
`KVBRIDGE_CPU_KERNELS=0` turns the kernels off.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvbridge.engine.setup.cache_dir import default_cache_dir

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("paged_decode.cpp", "prefill_attention.cpp", "prefill_attention_bf16.cpp", "elementwise.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / name for name in ("vec_math.h", "vec_avx2.h", "vec_avx512.h")]  # in the build's identity
_lock = threading.Lock()
_available: bool | None = None  # decided once per process, by the first available()
_active: str | None = None  # the ISA whose build the engine's calls go to (set by available())
_loaded: set[str] = set()  # the ISAs whose builds are loaded in this process

# The compiler's flags of each ISA's build, and the /proc/cpuinfo flags a CPU needs to run it.
ISA_FLAGS: dict[str, list[str]] = {
    "avx2": ["-march=x86-64-v3", "-mtune=native"],  # AVX2, FMA, F16C, BMI1/2, no AVX-512
    "avx512": ["-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"],
    "amx": ["-march=native"],
    "native": ["-march=native"],  # a CPU that runs none of the above (not x86, or older than AVX2)
}
ISA_NEEDS: dict[str, frozenset[str]] = {
    "avx2": frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm",
                         "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
    "amx": frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm",
                      "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "amx_tile", "amx_bf16"}),
}
ISAS = ("avx2", "avx512", "amx")  # what KVBRIDGE_CPU_ISA may ask for, worst to best


class CpuIsaError(RuntimeError):
    """KVBRIDGE_CPU_ISA asks for an instruction set this CPU cannot run (or one that does not exist)."""


def cpu_flags() -> frozenset[str]:
    """This CPU's flags, as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        line = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())


def runnable_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The ISAs of ISAS this CPU (its flags) runs, worst to best."""
    have = cpu_flags() if flags is None else flags
    return [isa for isa in ISAS if ISA_NEEDS[isa] <= have]


def choose_isa(asked: str | None = None, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """The ISA whose build the engine runs, and why: KVBRIDGE_CPU_ISA's (or `asked`) where the CPU
    runs it, the best it runs for "auto" (the default), "native" where it runs none. Raises
    CpuIsaError for an ISA the CPU lacks or a name that is none."""
    wanted = (asked if asked is not None else os.environ.get("KVBRIDGE_CPU_ISA", "auto")).strip().lower() or "auto"
    here = runnable_isas(flags)
    if wanted == "auto":
        if not here:
            return "native", "auto: this CPU runs none of avx2, avx512, amx; built for -march=native"
        return here[-1], f"auto: the best of {', '.join(here)} this CPU runs"
    if wanted not in ISAS:
        raise CpuIsaError(f"KVBRIDGE_CPU_ISA={wanted!r} is none of auto, {', '.join(ISAS)}")
    if wanted not in here:
        have = cpu_flags() if flags is None else flags
        missing = sorted(ISA_NEEDS[wanted] - have)
        raise CpuIsaError(f"KVBRIDGE_CPU_ISA={wanted} asks for an instruction set this CPU lacks "
                          f"(no {', '.join(missing)}); it runs: {', '.join(here) or 'none of them'}")
    return wanted, f"KVBRIDGE_CPU_ISA={wanted}"


def _cpu_identity() -> str:
    return hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]


def build_dir(isa: str | None = None) -> Path:
    """The folder of one ISA's build (None: the engine's, choose_isa()'s)."""
    name = isa or choose_isa()[0]
    return (default_cache_dir() / "cpu-kernels"
            / f"torch-{torch.__version__}-{_cpu_identity()}-{_source_identity()}-{name}")


def _source_identity() -> str:
    """The kernels' sources, by content and place, and the builds' compiler flags: another version of them builds in its own folder
    rather than rebuilding (and waiting on) this one's, and so does another checkout of the same
    sources (ninja's build file names the sources' paths, so two checkouts sharing one folder
    rebuilt it in turn, each time the other had built it)."""
    digest = hashlib.sha256(repr(sorted(ISA_FLAGS.items())).encode())  # new compiler flags: a new build
    for source in SOURCES + HEADERS:
        digest.update(str(source.resolve()).encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """One builder at a time per folder, on an flock the OS drops when its holder dies. Holding
    it, a `lock` file left by torch's own lock (a file that exists while a build runs) is stale:
    its builder was killed mid-build (Ctrl-C, a timeout), and torch would wait for it forever,
    at every later start."""
    with open(directory / "kvbridge-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a kernel build that was killed", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load(isa: str | None = None, verbose: bool = False) -> None:
    """Compile (if needed) and load one ISA's build into this process (None: choose_isa()'s).
    Raises on failure, CpuIsaError where this CPU cannot run that ISA."""
    from torch.utils import cpp_extension

    name = isa or choose_isa()[0]
    if name not in ISA_FLAGS:
        raise CpuIsaError(f"no build for ISA {name!r}; one of {', '.join(ISA_FLAGS)}")
    if name != "native" and name not in runnable_isas():
        raise CpuIsaError(f"this CPU cannot run the {name} build (it runs: {', '.join(runnable_isas()) or 'none'})")
    if name in _loaded:
        return
    directory = build_dir(name)
    directory.mkdir(parents=True, exist_ok=True)
    with _build_lock(directory):
        cpp_extension.load(name=f"kvbridge_cpu_kernels_{name}", sources=[str(s) for s in SOURCES],
                           build_directory=str(directory), is_python_module=False, verbose=verbose,
                           extra_cflags=["-O3", *ISA_FLAGS[name], "-fopenmp", f"-DKVBRIDGE_OPS=kvbridge_{name}"])
    _loaded.add(name)


def ops(isa: str | None = None) -> Any:
    """The op namespace of one ISA's build (`torch.ops.kvbridge_<isa>`; None: the engine's, the
    one available() loaded). The build must be loaded (load(isa), or available())."""
    name = isa or _active
    if name is None:
        raise RuntimeError("the CPU kernels are not loaded (call available() or load(isa) first)")
    return getattr(torch.ops, f"kvbridge_{name}")


def active_isa() -> str | None:
    """The ISA whose build the engine's calls run (None: the kernels are not loaded)."""
    return _active if available() else None


def available() -> bool:
    """True when the kernels are loaded in this process. The first call decides (it loads
    choose_isa()'s build and logs which and why, or logs why not, or finds KVBRIDGE_CPU_KERNELS=0;
    raises CpuIsaError where KVBRIDGE_CPU_ISA asks for what this CPU lacks); later calls, one per
    op of a step, only read the answer."""
    global _available
    if _available is None:
        with _lock:
            if _available is None:
                _available = _load_or_explain()
    return _available


def _load_or_explain() -> bool:
    global _active
    if os.environ.get("KVBRIDGE_CPU_KERNELS") == "0":
        return False
    isa, why = choose_isa()  # CpuIsaError goes to the caller: a start-up error, not a fallback
    try:
        load(isa)
        _active = isa
        logger.info("kvbridge CPU kernels: the %s build (%s)", isa, why)
        return True
    except Exception as e:  # noqa: BLE001 - any build or load failure means: use the fallback
        logger.warning("kvbridge CPU kernels unavailable (%s: %s); decode attention gathers K/V instead",
                       type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return False


def applies(*tensors: torch.Tensor) -> bool:
    """The kernels take these tensors: every one fp32 on the CPU, and the kernels are loaded."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and available()


ELEMENTWISE_DTYPES = (torch.float32, torch.bfloat16)  # what the one-pass ops of elementwise.cpp take


def elementwise_applies(*tensors: torch.Tensor) -> bool:
    """The one-pass ops (rms_norm, add_rms_norm_, rotary_, write_kv_, silu_and_mul) take these
    tensors: all on the CPU, all of one dtype in ELEMENTWISE_DTYPES, and the kernels are loaded."""
    dtype = tensors[0].dtype
    return (dtype in ELEMENTWISE_DTYPES and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
            and available())


DECODE_DTYPES = (torch.float32, torch.bfloat16)  # what paged_decode_attention takes


def decode_applies(q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """paged_decode_attention takes these: both on the CPU, of one dtype in DECODE_DTYPES, and
    the kernels are loaded."""
    return (q.dtype == kv_layer.dtype and q.dtype in DECODE_DTYPES and q.device.type == "cpu"
            and kv_layer.device.type == "cpu" and available())


def paged_decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor,
                           context_lens: torch.Tensor, sliding_window: int | None, scale: float) -> torch.Tensor:
    """q [B, H, D] fp32 or bf16 CPU, kv_layer (q's dtype) [blocks, 2, block_size, kv_heads, D] (the cache's strided
    layer view), block_table [B, max_blocks] int64, context_lens [B] int64 -> [B, H, D]."""
    out: torch.Tensor = ops().paged_decode_attention(q, kv_layer, block_table, context_lens, sliding_window or 0, scale)
    return out


PREFILL_HEAD_DIMS = range(16, 257, 16)  # head sizes prefill_attention takes


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over the prompt's own keys: q [L, heads, D], k and v [L, kv_heads, D] fp32
    CPU, D contiguous (any row strides), D in PREFILL_HEAD_DIMS -> [L, heads, D]."""
    out: torch.Tensor = ops().prefill_attention(q, k, v, scale)
    return out


BF16_PREFILL_HEAD_DIMS = (64, 128, 192, 256)  # head sizes prefill_attention_bf16_ takes
BF16_PREFILL_ISAS = {"avx512_bf16": 1, "amx": 2}  # the kernel's two products, by the op's isa number
# KVBRIDGE_BF16_PREFILL: "auto" (default) the best product this CPU runs, "amx" or "avx512_bf16" that
# one (where it runs), "sdpa" bf16 prompts on torch's SDPA (A/B runs).
BF16_PREFILL = os.environ.get("KVBRIDGE_BF16_PREFILL", "auto")
_bf16_isa: dict[str, int] = {}  # per build, what its kernel runs here: 2 AMX, 1 AVX-512 BF16, 0 neither


def bf16_prefill_isas(isa: str | None = None) -> list[str]:
    """The products prefill_attention_bf16_ of one build (None: the engine's) runs on this CPU
    (asked once per build): [] (no AVX-512 BF16 in the build or the CPU), ["avx512_bf16"], or
    ["avx512_bf16", "amx"]."""
    name = isa or (_active if available() else None)
    if name is None:
        return []
    if name not in _bf16_isa:
        _bf16_isa[name] = int(ops(name).prefill_attention_bf16_isa())
    return [product for product, number in BF16_PREFILL_ISAS.items() if number <= _bf16_isa[name]]


def bf16_prefill_isa() -> str | None:
    """The product bf16 prompts attend with here: KVBRIDGE_BF16_PREFILL's choice where this CPU runs
    it, else the best it runs ("amx" over "avx512_bf16"); None: torch's SDPA ("sdpa", or neither runs)."""
    here = bf16_prefill_isas()
    if BF16_PREFILL == "sdpa" or not here:
        return None
    return BF16_PREFILL if BF16_PREFILL in here else here[-1]


def bf16_prefill_applies(q: torch.Tensor) -> bool:
    """prefill_attention_bf16_ takes a step of these queries [T, heads, D]: bf16 on the CPU, D in
    BF16_PREFILL_HEAD_DIMS, and bf16_prefill_isa() is not None."""
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.shape[-1] in BF16_PREFILL_HEAD_DIMS
            and bf16_prefill_isa() is not None)


def prefill_attention_bf16_(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            starts: torch.Tensor, lens: torch.Tensor, scale: float, isa: str | None = None) -> None:
    """Causal attention of every prompt j (tokens starts[j] .. starts[j] + lens[j] - 1) over its own
    K/V, into those rows of out [T, heads * D]: q [T, heads, D], k and v [T, kv_heads, D] bf16 CPU
    (D contiguous, any row strides), starts and lens int64 [n]. Other rows of out are untouched.
    isa: "amx" or "avx512_bf16" (one of bf16_prefill_isas()); None: bf16_prefill_isa()'s."""
    name = isa or bf16_prefill_isa() or "avx512_bf16"
    if name not in BF16_PREFILL_ISAS:
        raise ValueError(f"isa must be one of {sorted(BF16_PREFILL_ISAS)}, got {name!r}")
    ops().prefill_attention_bf16_(out, q, k, v, starts, lens, scale, BF16_PREFILL_ISAS[name])


def _main(argv: Sequence[str]) -> None:
    """scripts/install.sh: build the engine's ISA (choose_isa()'s), and each ISA named on the
    command line that this CPU runs ("all": every one), once, loudly."""
    import time

    logging.basicConfig(level=logging.INFO)
    wanted = [choose_isa()[0]]
    for name in argv:
        wanted += runnable_isas() if name == "all" else [name]
    for name in dict.fromkeys(wanted):
        if name != "native" and name not in runnable_isas():
            print(f"kvbridge CPU kernels ({name}): not built, this CPU cannot run it")
            continue
        start = time.monotonic()
        load(name)
        print(f"kvbridge CPU kernels ({name}) ready in {build_dir(name)} ({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
