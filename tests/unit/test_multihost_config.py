"""Binding and advertising an instance's addresses for P/D across hosts: which interface UCX
uses (kv_transfer/net.py), what a producer advertises, the tcp backend's bind and metadata,
and what `kvbridge serve` / `kvbridge up --host` derive from --host. The namespace tests
(tests/e2e/test_pd_multihost.py) run all of it between real hosts."""

from __future__ import annotations

import pytest

from kvbridge import cli
from kvbridge.config import KVRole, KVTransferConfig
from kvbridge.kv_transfer.backends.tcp import TcpBackend
from kvbridge.kv_transfer.backends.tcp_wire import decode_agent_metadata
from kvbridge.kv_transfer.net import apply_ucx_net_devices, interface_of
from kvbridge.launcher import cluster
from kvbridge.shape.hosts import is_unspecified
from tests.unit.cli_recorder import run_cli


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.53", "::1", "[::1]"])
def test_loopback_addresses_belong_to_lo(address: str) -> None:
    assert interface_of(address) == "lo"


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "192.0.2.254", "example.com", ""])
def test_unspecified_foreign_and_named_addresses_have_no_interface(address: str) -> None:
    assert interface_of(address) is None


def test_ucx_net_devices_is_set_from_the_address_unless_already_set() -> None:
    env: dict[str, str] = {}
    assert apply_ucx_net_devices(env, "127.0.0.1") == "lo" and env == {"UCX_NET_DEVICES": "lo"}
    env = {"UCX_NET_DEVICES": "mlx5_0:1"}
    assert apply_ucx_net_devices(env, "127.0.0.1") == "mlx5_0:1" and env == {"UCX_NET_DEVICES": "mlx5_0:1"}
    env = {}
    assert apply_ucx_net_devices(env, "192.0.2.254") is None and env == {}


def test_binding_every_interface_needs_an_advertised_address() -> None:
    assert is_unspecified("0.0.0.0") and is_unspecified("::") and not is_unspecified("10.0.0.1")
    with pytest.raises(ValueError, match="--kv-advertise-host"):
        KVTransferConfig(role=KVRole.PRODUCER, side_channel_host="0.0.0.0")
    with pytest.raises(ValueError, match="not an address"):
        KVTransferConfig(role=KVRole.PRODUCER, side_channel_host="10.0.0.1", advertise_host="0.0.0.0")
    # A decode instance advertises nothing: no peer connects to it.
    assert KVTransferConfig(role=KVRole.CONSUMER, side_channel_host="0.0.0.0").public_host == "0.0.0.0"
    kv = KVTransferConfig(role=KVRole.PRODUCER, side_channel_host="0.0.0.0", advertise_host="10.0.0.1")
    assert kv.public_host == "10.0.0.1"
    assert KVTransferConfig(role=KVRole.PRODUCER, side_channel_host="10.0.0.2").public_host == "10.0.0.2"


def test_the_tcp_backend_listens_on_the_bind_address_and_names_the_advertised_one() -> None:
    kv = KVTransferConfig(role=KVRole.PRODUCER, backend="tcp", side_channel_host="0.0.0.0",
                          advertise_host="127.0.0.1")
    backend = TcpBackend("p", **kv.backend_options())
    try:
        assert backend.address[0] == "0.0.0.0"
        peer = decode_agent_metadata(backend.agent_metadata())
        assert (peer.host, peer.port) == ("127.0.0.1", backend.address[1])
    finally:
        backend.shutdown()
    assert KVTransferConfig(role=KVRole.PRODUCER, backend="nixl").backend_options() == {}


def _serve_kv(argv: list[str]) -> KVTransferConfig:
    kv = cli.engine_config_from_args(cli.build_parser().parse_args(["serve", *argv])).kv_transfer
    assert kv is not None
    return kv


def test_serve_binds_its_side_channel_to_host_unless_told_otherwise() -> None:
    kv = _serve_kv(["--host", "10.0.0.7", "--kv-role", "producer"])
    assert (kv.side_channel_host, kv.public_host) == ("10.0.0.7", "10.0.0.7")
    kv = _serve_kv(["--host", "0.0.0.0", "--kv-role", "producer", "--kv-advertise-host", "10.0.0.7"])
    assert (kv.side_channel_host, kv.public_host) == ("0.0.0.0", "10.0.0.7")
    kv = _serve_kv(["--host", "10.0.0.7", "--kv-side-channel-host", "10.1.0.7", "--kv-role", "producer"])
    assert (kv.side_channel_host, kv.public_host) == ("10.1.0.7", "10.1.0.7")
    kv = _serve_kv(["--kv-role", "consumer", "--kv-trusted-hosts", "p1.internal,10.0.0.7,10.1.0.0/16"])
    assert kv.trusted_hosts == ("p1.internal", "10.0.0.7", "10.1.0.0/16")


def test_serve_refuses_binding_everything_without_an_advertised_address(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["serve", "--host", "0.0.0.0", "--kv-role", "producer"]) == 2
    assert "--kv-advertise-host" in capsys.readouterr().err


def test_up_host_reaches_the_cluster(started: list[dict]) -> None:  # noqa: F811
    assert run_cli(["up", "--host", "127.0.0.2", "--num-threads", "1"]) == 0
    assert started[0]["host"] == "127.0.0.2"
    assert run_cli(["up", "--host", "0.0.0.0"]) == 2
    assert len(started) == 1


def test_up_makes_its_decode_instances_trust_its_host_only(tmp_path) -> None:
    def args(host: str, extra: tuple[str, ...] = ()) -> dict[str, list[str]]:
        c = cluster.LocalCluster("m", host=host, extra_serve_args=extra, log_dir=tmp_path)
        return {s.name: c._instance_args(s) for s in cluster.plan_instances(1, 1, "127.0.0.1")}
    assert args("10.0.0.7") == {"prefill-0": [], "decode-0": ["--kv-trusted-hosts", "10.0.0.7"]}
    assert args("127.0.0.1") == {"prefill-0": [], "decode-0": []}  # the default trusts this host
    mine = ("--kv-trusted-hosts", "10.0.0.0/24")
    assert args("10.0.0.7", mine) == {"prefill-0": list(mine), "decode-0": list(mine)}

