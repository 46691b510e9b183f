"""Which CPUs each tensor-parallel rank computes on (`--cpu-bind`): a pure function.

vLLM's CPU backend binds each rank's OpenMP threads to its own cores (`VLLM_CPU_OMP_THREADS_BIND`,
"auto" by default, or "0-31|32-63": one CPU list per rank). kvbridge binds each rank's main
thread, and so the torch and transfer-agent threads it starts, the same way, once the rank has
joined its gloo groups: gloo's own threads (socket loop, collective worker) stay free to run on
any CPU. Measured on the 2-core development machine (benchmarks/README.md, tp_step and
pd_transfer):

- Unbound, a D of TP 2 that reads a request's KV on both ranks at once ran the two copies one
  after the other in a quarter of the reads: Linux woke the second rank on the CPU the first
  was copying on and left it there for the rest of that rank's time slice while the
  other CPU idled. Bound, each rank's main thread wakes on its own CPU.
- Binding gloo's threads too (the whole process) made a TP 2 decode step at batch 1 slower
  than unbound (the wake-ups of its all_reduces queued on the one busy CPU); with them free it
  was fastest.

The grammar of the spec (auto, none, one CPU list per rank) is shape/cpu_lists.py's.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvbridge.shape.cpu_lists import AUTO, NONE, CpuBindError, format_cpus, rank_lists


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
    lists = rank_lists(spec, tp_size)
    allowed = set(cpus)
    for rank, chosen in enumerate(lists):
        missing = sorted(chosen - allowed)
        if missing:
            raise CpuBindError(f"rank {rank}'s CPUs {missing} are not among those this process may run on "
                               f"({format_cpus(allowed)})")
    return tuple(lists)
