"""The CLI's Ray options: refused without --ray, checked before anything starts."""

from __future__ import annotations

from kvbridge.cli import main, parse_args


def test_pool_options_need_ray(capsys):
    assert main(["up", "--prefill-replicas", "1:2"]) == 2
    assert "need --ray" in capsys.readouterr().err
    assert main(["up", "--scale-from-zero-timeout", "30"]) == 2  # never silently ignored
    assert "need --ray" in capsys.readouterr().err


def test_a_bad_pool_size_is_refused_before_ray_starts(capsys):
    assert main(["up", "--ray", "--decode-replicas", "3:1"]) == 2
    assert "bad pool size" in capsys.readouterr().err


def test_ray_subcommands_parse():
    a = parse_args(["ray", "scale", "--prefill-replicas", "1:4", "--app-name", "x"])
    assert (a.ray_command, a.prefill_replicas, a.decode_replicas, a.app_name, a.ray_address) == (
        "scale", "1:4", None, "x", "auto")
    assert parse_args(["up", "--ray-address", "10.0.0.1:6379"]).ray_address == "10.0.0.1:6379"


def test_the_scale_from_zero_bound_is_checked_before_ray_starts(capsys):
    assert main(["up", "--ray", "--scale-from-zero-timeout", "0"]) == 2
    assert "--scale-from-zero-timeout must be positive" in capsys.readouterr().err
    assert parse_args(["up", "--ray"]).scale_from_zero_timeout is None  # 120 s (SCALE_FROM_ZERO_TIMEOUT_S)
