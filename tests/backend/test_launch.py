"""kvshare.launch binds every endpoint to the address it is given, 127.0.0.1 by default; its signal
handling stops the server once and never interrupts that stop."""
from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

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


def test_stop_signals_stop_once_then_log_and_a_third_ctrl_c_kills_the_group():
    group = subprocess.Popen(["sleep", "60"], start_new_session=True)     # stands in for tritonserver
    try:
        signals = launch.StopSignals(group)
        with pytest.raises(KeyboardInterrupt):
            signals.on_signal(signal.SIGTERM, None)
        assert signals.stopping
        signals.on_signal(signal.SIGTERM, None)          # logged: the stop must go on
        signals.on_signal(signal.SIGINT, None)
        signals.on_signal(signal.SIGINT, None)
        assert group.poll() is None                      # two Ctrl-C so far
        signals.on_signal(signal.SIGINT, None)
        assert group.wait(10) == -signal.SIGKILL
    finally:
        if group.poll() is None:
            group.kill()
            group.wait()
