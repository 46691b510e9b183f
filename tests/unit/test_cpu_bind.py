"""`--cpu-bind`: which CPUs each tensor-parallel rank process runs on (engine/tp/cpu_bind.py, shape/cpu_lists.py), and
the barrier before a step's reads on two or more ranks (rank_agent.reads_start_together)."""

from __future__ import annotations

import pytest

from kvbridge.config import EngineConfig
from kvbridge.engine.tp.cpu_bind import rank_cpus
from kvbridge.kv_transfer.connector.rank_agent import RankCommands, RankReport, ReadOp, reads_start_together
from kvbridge.shape.cpu_lists import CpuBindError, check_spec, format_cpus, parse_cpu_list


@pytest.mark.parametrize("n_cpus", range(1, 9))
@pytest.mark.parametrize("tp", range(1, 9))
def test_auto_splits_the_cpus_in_equal_contiguous_runs_in_rank_order(n_cpus, tp):
    cpus = [3 + 2 * i for i in range(n_cpus)]  # any ids: not 0..n-1, not contiguous
    got = rank_cpus("auto", tp, cpus, ranks_on_cpu=True)
    if tp == 1:
        assert got is None  # the model runs in the engine process
        return
    assert got is not None and len(got) == tp
    if n_cpus >= tp:
        # every CPU exactly once, runs in order, sizes within one of each other
        assert [c for run in got for c in sorted(run)] == cpus
        assert max(map(len, got)) - min(map(len, got)) <= 1
    else:
        assert got == tuple(frozenset({cpus[r % n_cpus]}) for r in range(tp))


def test_auto_binds_nothing_when_the_ranks_run_on_cuda_and_none_never_binds():
    assert rank_cpus("auto", 2, [0, 1], ranks_on_cpu=False) is None
    assert rank_cpus("none", 4, [0, 1], ranks_on_cpu=True) is None


def test_auto_on_this_machines_two_cpus():
    assert rank_cpus("auto", 2, [0, 1], True) == (frozenset({0}), frozenset({1}))
    assert rank_cpus("auto", 3, [0, 1], True) == (frozenset({0}), frozenset({1}), frozenset({0}))
    assert rank_cpus("auto", 2, range(8), True) == (frozenset(range(4)), frozenset(range(4, 8)))


def test_explicit_lists_one_per_rank():
    assert rank_cpus("0-1,4|2,3", 2, range(8), ranks_on_cpu=False) == (frozenset({0, 1, 4}), frozenset({2, 3}))
    assert rank_cpus("1|1", 2, [0, 1], True) == (frozenset({1}), frozenset({1}))  # sharing is allowed


@pytest.mark.parametrize("spec, tp, reason", [
    ("0|1|2", 2, "3 CPU list(s) for 2 ranks"),
    ("0", 2, "1 CPU list(s) for 2 ranks"),
    ("0|1", 1, "--tensor-parallel-size > 1"),
    ("0|x", 2, "'x' is not a CPU id"),
    ("0||1", 2, "'' is not a CPU id"),
    ("3-1|0", 2, "'3-1' is not a CPU id"),
    ("-1|0", 2, "'-1' is not a CPU id"),
    ("auto|0", 2, "'auto' is not a CPU id"),
])
def test_bad_specs_are_refused_with_the_reason(spec, tp, reason):
    with pytest.raises(CpuBindError, match=reason.replace("|", r"\|").replace("(", r"\(").replace(")", r"\)")):
        check_spec(spec, tp)
    with pytest.raises(CpuBindError):
        rank_cpus(spec, tp, range(8), True)
    with pytest.raises(ValueError, match="CPU"):  # the engine's config refuses it too, before anything starts
        EngineConfig(tensor_parallel_size=tp, cpu_bind=spec)


def test_a_cpu_this_process_may_not_run_on_is_refused_by_name():
    with pytest.raises(CpuBindError, match=r"rank 1's CPUs \[5, 7\] are not among those this process may run "
                                           r"on \(0-3\)"):
        rank_cpus("0|5,7", 2, range(4), True)


def test_cpu_lists_parse_and_format_round_trip():
    assert parse_cpu_list("0-3,8, 10-11") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert format_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    for cpus in ({0}, {1, 3}, set(range(16)), {2, 3, 4, 9}):
        assert parse_cpu_list(format_cpus(cpus)) == frozenset(cpus)


def _read(xfer_id: str) -> ReadOp:
    return ReadOp(xfer_id, "peer", b"meta", ((0, 16),), ((0, 16),))


def test_ranks_sync_before_a_step_only_when_two_or_more_of_them_start_reads():
    assert not reads_start_together([])
    assert not reads_start_together([None, None])
    assert not reads_start_together([RankCommands(reads=[_read("a"), _read("b")]), RankCommands()])
    assert not reads_start_together([RankCommands(release=["x"]), RankCommands(drop_peers=["p"])])
    assert reads_start_together([RankCommands(reads=[_read("a")]), RankCommands(reads=[_read("b")])])
    assert reads_start_together([None, RankCommands(reads=[_read("a")]), RankCommands(reads=[_read("b")])])


class _RecordingAgent:
    """Stands in for a rank's RankAgent in ModelRunner (register / apply / poll), logging calls."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def register(self, *args, **kwargs) -> None:
        self.log.append("register")

    def apply(self, commands) -> None:
        self.log.append(f"apply {sorted(op.xfer_id for op in commands.reads) if commands else []}")

    def poll(self) -> RankReport:
        self.log.append("poll")
        return RankReport(0)


@pytest.mark.parametrize("readers", [0, 1, 2])
def test_the_runner_waits_for_the_other_ranks_only_before_a_step_whose_reads_span_ranks(readers):
    from kvbridge.engine.model_runner import ModelRunner
    from kvbridge.engine.scheduler_output import SchedulerOutput
    from kvbridge.shape.model_config import ModelFamily
    from kvbridge.shape.tp_split import rank_shard
    from tests.tiny_models import random_weights, tiny_arch

    arch = tiny_arch(ModelFamily.LLAMA)
    log: list[str] = []
    runner = ModelRunner(arch, random_weights(arch), "float32", "cpu", 16, 8, agent=_RecordingAgent(log),
                         shard=rank_shard(arch.num_heads, arch.num_kv_heads, 2, 1), all_reduce=lambda t: t,
                         samples=False, sync_ranks=lambda: log.append("sync"))
    commands = [RankCommands(reads=[_read(f"r{rank}")] if rank < readers else []) for rank in range(2)]
    log.clear()
    runner.execute(SchedulerOutput([], set(), kv_rank_commands=commands))
    this_rank = "apply ['r1']" if readers == 2 else "apply []"  # the runner is TP rank 1
    assert log == (["sync", this_rank, "poll"] if readers == 2 else [this_rank, "poll"])
