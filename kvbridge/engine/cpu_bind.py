"""Which CPUs each tensor-parallel rank computes on (`--cpu-bind`): pure functions.

vLLM's CPU backend binds each rank's OpenMP threads to its own cores (`VLLM_CPU_OMP_THREADS_BIND`,
"auto" by default, or "0-31|32-63": one CPU list per rank). kvbridge binds each rank's main
thread, and so the torch and transfer-agent threads it starts, the same way, once the rank has
joined its gloo groups: gloo's own threads (socket loop, collective worker) stay free to run on
any CPU. Measured on the 2-core development machine (benchmarks/README.md, tp_step and
pd_transfer):

- Unbound, a D of TP 2 that reads a request's KV on both ranks at once ran the two copies one
  after the other in a quarter of the reads: Linux woke the second rank on the CPU the first
  was copying on and left it there for the rest of that rank's time slice (3-5 ms) while the
  other CPU idled. Bound, each rank's main thread wakes on its own CPU.
- Binding gloo's threads too (the whole process) made a TP 2 decode step at batch 1 20% slower
  than unbound (130 vs 109 ms: the wake-ups of its 60 all_reduces queued on the one busy CPU);
  with them free it took 72 ms.

Spec (`EngineConfig.cpu_bind`):
  auto   on CPU at TP > 1: this process's allowed CPUs in TP equal contiguous runs, in rank
         order (rank i takes CPU i mod n when there are fewer CPUs than ranks); no binding at
         TP 1 or when the ranks run on CUDA
  none   no binding
  LISTS  one CPU list per rank, separated by "|": "0-3|4-7", "0,2|1,3"; a list is CPU ids and
         ranges joined by commas; each CPU must be one this process may run on
"""

from __future__ import annotations

from collections.abc import Iterable

AUTO = "auto"
NONE = "none"


class CpuBindError(ValueError):
    """The spec cannot be read or applied; the message says why."""


def parse_cpu_list(text: str) -> frozenset[int]:
    """"0-3,8" -> {0, 1, 2, 3, 8}. Raises CpuBindError."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise CpuBindError(f"{part!r} is not a CPU id or a range such as 0-3") from None
        if first < 0 or last < first:
            raise CpuBindError(f"{part!r} is not a CPU id or a range such as 0-3")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def check_spec(spec: str, tp_size: int) -> None:
    """Raise CpuBindError unless `spec` is auto, none or one CPU list per rank of `tp_size` (which
    CPUs exist is checked when the ranks start: `rank_cpus`)."""
    if spec not in (AUTO, NONE):
        _rank_lists(spec, tp_size)


def _rank_lists(spec: str, tp_size: int) -> list[frozenset[int]]:
    """The CPU lists of `spec` ("0-3|4-7"), one per rank. Raises CpuBindError."""
    lists = [parse_cpu_list(text) for text in spec.split("|")]
    if tp_size == 1:
        raise CpuBindError("CPU lists bind rank processes: give them with --tensor-parallel-size > 1 "
                           "(at TP 1 the model runs in the engine process)")
    if len(lists) != tp_size:
        raise CpuBindError(f"{len(lists)} CPU list(s) for {tp_size} ranks: give one per rank, separated by '|'")
    return lists


def rank_cpus(spec: str, tp_size: int, available: Iterable[int],
              ranks_on_cpu: bool) -> tuple[frozenset[int], ...] | None:
    """Each rank's CPUs (rank order), or None for no binding. `available`: the CPUs this process
    may run on (os.sched_getaffinity(0)); `ranks_on_cpu`: the model runs on the CPU (auto binds
    only then). Raises CpuBindError."""
    if tp_size < 1:
        raise CpuBindError("the TP size must be at least 1")
    cpus = sorted(set(available))
    if not cpus:
        raise CpuBindError("this process may run on no CPU")
    if spec == NONE:
        return None
    if spec == AUTO:
        if tp_size == 1 or not ranks_on_cpu:
            return None
        n = len(cpus)
        if n < tp_size:
            return tuple(frozenset({cpus[r % n]}) for r in range(tp_size))
        return tuple(frozenset(cpus[r * n // tp_size:(r + 1) * n // tp_size]) for r in range(tp_size))
    lists = _rank_lists(spec, tp_size)
    allowed = set(cpus)
    for rank, chosen in enumerate(lists):
        missing = sorted(chosen - allowed)
        if missing:
            raise CpuBindError(f"rank {rank}'s CPUs {missing} are not among those this process may run on "
                               f"({format_cpus(allowed)})")
    return tuple(lists)


def format_cpus(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
