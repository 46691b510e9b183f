"""The `kvbridge` command line: what `up` hands its instances, how it refuses bad instance
options before starting anything, and the help every option carries. `run_cluster` is
replaced by a recorder here; tests/e2e/test_up_command.py starts a real cluster."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from kvbridge import cli
from kvbridge.launcher import cluster
from tests.unit.cli_recorder import run_cli


def auto_dtype() -> list[str]:
    """What `up` adds for the default --dtype auto: the dtype it resolved on this machine."""
    return ["--dtype", cli.dtype_choice(cli.build_parser().parse_args(["serve"])).dtype]


def test_up_passes_its_engine_options_to_every_instance(started: list[dict]) -> None:
    assert run_cli(["up", "model.gguf", "--num-threads", "1", "--kv-backend", "tcp", "--block-size", "32",
                    "--max-model-len", "512", "--no-prefix-caching", "--kv-lease-seconds", "5",
                    "--kv-load-failure-policy", "fail", "--api-key", "sk-up", "--num-decode", "2"]) == 0
    [call] = started
    assert call["extra_serve_args"] == [*auto_dtype(), "--max-model-len", "512", "--block-size", "32", "--no-prefix-caching",
                                        "--kv-lease-seconds", "5.0", "--kv-load-failure-policy", "fail"]
    assert (call["model"], call["num_decode"], call["num_threads"], call["kv_backend"], call["api_key"]) == \
        ("model.gguf", 2, 1, "tcp", "sk-up")  # the key goes in the children's environment, not argv


def test_up_passes_what_follows_double_dash_verbatim_to_each_serve(started: list[dict]) -> None:
    assert run_cli(["up", "--dtype", "bfloat16", "--", "--num-threads", "1", "--max-num-seqs", "8"]) == 0
    [call] = started
    assert call["extra_serve_args"] == ["--dtype", "bfloat16", "--num-threads", "1", "--max-num-seqs", "8"]
    assert call["num_threads"] == 1  # also what OMP_NUM_THREADS says


def test_up_forwards_cpu_bind_to_its_instances(started: list[dict]) -> None:
    assert run_cli(["up", "--decode-tp", "2", "--cpu-bind", "none"]) == 0
    [call] = started
    assert call["extra_serve_args"] == [*auto_dtype(), "--cpu-bind", "none"]


def test_up_forwards_the_drain_timeout_to_its_instances(started: list[dict]) -> None:
    assert run_cli(["up", "--drain-timeout-s", "2.5"]) == 0
    [call] = started
    assert call["extra_serve_args"] == [*auto_dtype(), "--drain-timeout-s", "2.5"]


def test_up_hands_its_proxy_the_routing_policy_and_the_pd_mode(started: list[dict]) -> None:
    assert run_cli(["up", "--routing-policy", "kv_aware", "--pd-mode", "auto"]) == 0
    assert run_cli(["up"]) == 0
    routed, plain = started
    assert routed["proxy_args"] == ["--prefill-policy", "kv_aware", "--decode-policy", "kv_aware", "--pd-mode", "auto"]
    assert plain["proxy_args"] == ["--pd-mode", "always"]  # the proxy's own policies


def test_up_reuses_kv_across_turns_unless_told_not_to(started: list[dict]) -> None:
    assert run_cli(["up"]) == 0
    assert run_cli(["up", "--kv-reuse", "off"]) == 0
    on, off = started
    assert (on["kv_reuse"], off["kv_reuse"]) == (True, False)
    specs = cluster.plan_instances(1, 2, kv_reuse=True)  # every instance reads and serves KV; pools stay apart
    assert [(s.role.value, s.in_prefill_pool) for s in specs] == [("both", True), ("both", False), ("both", False)]
    assert [s.in_prefill_pool for s in cluster.plan_instances(1, 1)] == [True, False]
    assert cluster.LocalCluster("m", kv_reuse=True).proxy_args == ("--kv-reuse", "on")
    # with reuse, answers are retained for their next turn unless the serve args say how long
    spec = specs[1]
    assert "--kv-retention-seconds" not in cluster.LocalCluster("m")._instance_args(spec)
    kept = cluster.LocalCluster("m", kv_reuse=True)._instance_args(spec)
    assert kept[kept.index("--kv-retention-seconds") + 1] == str(cluster.REUSE_RETENTION_S)
    told = cluster.LocalCluster("m", kv_reuse=True, extra_serve_args=["--kv-retention-seconds", "0"])
    assert told._instance_args(spec) == ["--kv-retention-seconds", "0"]
    args = cli.build_parser().parse_args(["proxy", "--decode", "http://d"])
    assert args.kv_reuse == "off"  # a bare proxy may front instances that cannot hold


def test_a_pd_mode_or_policy_the_proxy_does_not_know_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["proxy", "--decode", "http://d", "--pd-mode", "sometimes"],
                 ["proxy", "--decode", "http://d", "--decode-policy", "random"], ["up", "--pd-mode", "x"]):
        with pytest.raises(SystemExit) as exited:
            cli.build_parser().parse_args(argv)
        assert exited.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_up_gives_prefill_and_decode_instances_their_tp_sizes(started: list[dict]) -> None:
    assert run_cli(["up", "--prefill-tp", "2", "--decode-tp", "3"]) == 0
    [call] = started
    assert (call["prefill_tp"], call["decode_tp"]) == (2, 3)
    assert "--tensor-parallel-size" not in call["extra_serve_args"]


@pytest.mark.parametrize(("argv", "message"), [
    (["up", "--", "--bogus"], "unrecognized arguments: --bogus"),
    (["up", "--", "--max-num-seqs", "many"], "argument --max-num-seqs: invalid int value: 'many'"),
    (["up", "--block-size", "3"], "kvbridge up: error: block_size must be a power of two, got 3"),
    (["up", "--", "--port", "9000"], "--port is set by `up` for each instance"),
    (["up", "--", "--kv-role", "consumer"], "--kv-role is set by `up` for each instance"),
    (["up", "--num-prefill", "0"], "must be at least 1, got 0"),
    (["up", "--decode-tp", "0"], "must be at least 1, got 0"),
    (["up", "--", "-tp", "2"], "--tensor-parallel-size is set by `up` for each instance"),
    (["up", "--cpu-bind", "0-x"], "kvbridge up: error: '0-x' is not a CPU id or a range such as 0-3"),
    (["up", "--drain-timeout-s", "-1"], "argument --drain-timeout-s: must be >= 0, got -1"),
    (["up", "--", "--drain-timeout-s", "nan"], "argument --drain-timeout-s: must be >= 0, got nan"),
])
def test_up_refuses_invalid_instance_options_before_starting_anything(
        started: list[dict], capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert run_cli(argv) == 2
    assert message in capsys.readouterr().err
    assert started == []


def test_every_option_of_up_serve_and_proxy_has_help() -> None:
    parser = cli.build_parser()
    # argparse has no public accessor for sub-commands' parsers.
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name in ("up", "serve", "proxy"):
        missing = [a.dest for a in commands[name]._actions if not a.help]
        assert missing == [], f"`kvbridge {name}` options without help: {missing}"


def test_serve_does_not_offer_the_fake_transfer_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["serve", "--help"]) == 0
    assert "fake" not in capsys.readouterr().out
    assert run_cli(["serve", "--kv-role", "producer", "--kv-backend", "fake"]) == 2
    assert "invalid choice: 'fake'" in capsys.readouterr().err


def test_children_get_the_api_key_in_their_environment() -> None:
    env = cluster.child_env({"PATH": "/bin"}, loopback_only=True, num_threads=1, api_key="sk-up")
    assert env["KVBRIDGE_API_KEY"] == "sk-up"
    assert cluster.child_env({"KVBRIDGE_API_KEY": "k"}, loopback_only=True, num_threads=1)["KVBRIDGE_API_KEY"] == "k"
    assert "KVBRIDGE_API_KEY" not in cluster.child_env({"KVBRIDGE_API_KEY": "k"}, loopback_only=True, num_threads=1,
                                                       api_key="")  # `up --api-key ""`: no key


@pytest.mark.parametrize("argv,env,expected", [
    (["serve"], {}, "unset"),  # one engine that owns its cores: OpenMP's default (spin briefly, then sleep)
    (["up"], {}, "PASSIVE"),  # P, D and the proxy share the cores
    (["proxy"], {}, "PASSIVE"),
    (["serve"], {"OMP_WAIT_POLICY": "PASSIVE"}, "PASSIVE"),  # the environment always wins
])
def test_openmp_wait_policy_is_chosen_per_command_before_torch_loads(
        argv: list[str], env: dict[str, str], expected: str) -> None:
    code = ("import sys; sys.argv = ['kvbridge', *sys.argv[1:]]; import kvbridge.cli, os; "
            "print(os.environ.get('OMP_WAIT_POLICY', 'unset'), 'torch' in sys.modules)")
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code, *argv], env={**clean, **env}, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == [expected, "False"]


@pytest.mark.parametrize("given,tp,expected", [(False, 1, "unset"), (False, 2, "PASSIVE"), (True, 2, "ACTIVE")])
def test_serve_with_rank_processes_makes_them_sleep_unless_told(
        monkeypatch: pytest.MonkeyPatch, given: bool, tp: int, expected: str) -> None:
    from kvbridge.server import api_server
    seen: list[str] = []
    if given:
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    else:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(cli, "_WAIT_POLICY_GIVEN", given)
    monkeypatch.setattr(api_server, "run_server", lambda *a, **k: seen.append(os.environ.get("OMP_WAIT_POLICY", "unset")) or 0)
    assert run_cli(["serve", "--tensor-parallel-size", str(tp)]) == 0
    assert seen == [expected]
