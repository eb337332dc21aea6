"""kvshare.launch binds every endpoint to the address it is given, 127.0.0.1 by default."""
from __future__ import annotations

from pathlib import Path

from kvshare import launch


def _addresses(cmd: list[str]) -> dict[str, str]:
    return {a.split("=")[0]: a.split("=", 1)[1] for a in cmd if a.split("=")[0].endswith("-address")}


def test_every_endpoint_listens_where_the_address_says():
    cmd = launch.command(Path("repo"), launch.ServerAddress("127.0.0.1", 1, 2, 3))
    assert _addresses(cmd) == {"--http-address": "127.0.0.1", "--grpc-address": "127.0.0.1",
                               "--metrics-address": "127.0.0.1"}
    anywhere = launch.ServerAddress("0.0.0.0", 1, 2, 3)
    assert set(_addresses(launch.command(Path("repo"), anywhere)).values()) == {"0.0.0.0"}
    assert anywhere.grpc_url == "127.0.0.1:2" and anywhere.metrics_url == "http://127.0.0.1:3/metrics"


def test_the_command_line_binds_loopback_unless_told_otherwise():
    assert launch.parse_args([]).host == "127.0.0.1"
    assert launch.parse_args(["--host", "0.0.0.0"]).host == "0.0.0.0"
