"""The grammar of a `--cpu-bind` value (`EngineConfig.cpu_bind`), checked when the configuration
is made; engine/tp/cpu_bind.py decides from it which CPUs each tensor-parallel rank runs on.

The values:
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
        rank_lists(spec, tp_size)


def rank_lists(spec: str, tp_size: int) -> list[frozenset[int]]:
    """The CPU lists of `spec` ("0-3|4-7"), one per rank. Raises CpuBindError."""
    lists = [parse_cpu_list(text) for text in spec.split("|")]
    if tp_size == 1:
        raise CpuBindError("CPU lists bind rank processes: give them with --tensor-parallel-size > 1 "
                           "(at TP 1 the model runs in the engine process)")
    if len(lists) != tp_size:
        raise CpuBindError(f"{len(lists)} CPU list(s) for {tp_size} ranks: give one per rank, separated by '|'")
    return lists


def format_cpus(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
