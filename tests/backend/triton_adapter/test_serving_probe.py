"""The serving probe: where tritonserver serves HTTP, read from its command line, and what its
answers mean (a real HTTP server on a free port stands in for Triton's endpoint)."""
from __future__ import annotations

import http.server
import logging
import os
import socket
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvshare.triton_adapter.serving_probe import HttpEndpoint, HttpReadiness, http_endpoint, tritonserver_args


@pytest.mark.parametrize(("args", "expected"), [
    (["tritonserver", "--model-repository=/models"], HttpEndpoint("127.0.0.1", 8000)),
    (["tritonserver", "--http-port=8123", "--http-address=127.0.0.1"], HttpEndpoint("127.0.0.1", 8123)),
    (["tritonserver", "--http-port", "9000", "--http-address", "10.1.2.3"], HttpEndpoint("10.1.2.3", 9000)),
    (["tritonserver", "--http-address=::"], HttpEndpoint("::1", 8000)),
    (["tritonserver", "--http-address=[fe80::1]", "--http-port=1"], HttpEndpoint("fe80::1", 1)),
    (["tritonserver", "--allow-http=false"], None),
    (["tritonserver", "--allow-http", "0", "--http-port=8001"], None),
    (["tritonserver", "--allow-http=True", "--http-port=8001"], HttpEndpoint("127.0.0.1", 8001)),
    (["tritonserver", "--http-port=0"], None),
    (["tritonserver", "--http-port=eighty"], None),
])
def test_the_http_endpoint_comes_from_tritonservers_command_line(args, expected):
    assert http_endpoint(args) == expected


@given(port=st.integers(1, 65535), host=st.sampled_from(["127.0.0.1", "10.0.0.7", "0.0.0.0"]),
       other=st.lists(st.sampled_from(["--log-verbose=1", "--grpc-port=8001", "--strict-readiness=false",
                                       "--exit-timeout-secs", "30"]), max_size=4))
def test_both_option_forms_name_the_same_endpoint(port, host, other):
    joined = ["tritonserver", *other, f"--http-port={port}", f"--http-address={host}"]
    split = ["tritonserver", *other, "--http-port", str(port), "--http-address", host]
    assert http_endpoint(joined) == http_endpoint(split) == HttpEndpoint(
        "127.0.0.1" if host == "0.0.0.0" else host, port)


def test_the_command_line_of_this_process_reads_back():
    args = tritonserver_args(os.getpid())
    assert args and "python" in os.path.basename(args[0])
    assert tritonserver_args(2 ** 22 + 12345) == []


class _Ready(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        code = type(self).status if self.path == "/v2/models/llm_engine/ready" else 404
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_answers_200_then_400_then_a_closed_endpoint_mean_yes_no_no():
    handler = type("Handler", (_Ready,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    probe = HttpReadiness(HttpEndpoint("127.0.0.1", server.server_address[1]), "llm_engine")
    try:
        assert probe() is True
        handler.status = 400            # Triton's answer for an unloaded model or an exiting server
        assert probe() is False
        handler.status = 200
        assert probe() is True
    finally:
        server.shutdown()
        server.server_close()
    assert probe() is False             # Triton 2.51 closes HTTP on SIGTERM


def test_once_the_model_served_a_request_a_closed_endpoint_means_no_even_without_an_answer():
    """SIGTERM before the first poll after the first request: HTTP is already closed."""
    probe = HttpReadiness(HttpEndpoint("127.0.0.1", _free_port()), "llm_engine")
    assert probe() is None
    probe.serving_seen()
    assert probe() is False


def test_a_never_reached_endpoint_or_a_silent_one_cannot_tell():
    assert HttpReadiness(HttpEndpoint("127.0.0.1", _free_port()), "llm_engine")() is None
    with socket.socket() as silent:     # accepts connections (the backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        probe = HttpReadiness(HttpEndpoint("127.0.0.1", silent.getsockname()[1]), "llm_engine", timeout_s=0.2)
        assert probe() is None


def test_an_endpoint_that_answered_then_falls_silent_is_logged_once_per_spell(caplog):
    handler = type("Handler", (_Ready,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    probe = HttpReadiness(HttpEndpoint("127.0.0.1", server.server_address[1]), "llm_engine", timeout_s=0.2)
    try:
        assert probe() is True
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(4)
            probe.endpoint = HttpEndpoint("127.0.0.1", silent.getsockname()[1])
            with caplog.at_level(logging.INFO, logger="kvshare.triton"):
                assert probe() is None and probe() is None
                probe.endpoint = HttpEndpoint("127.0.0.1", server.server_address[1])
                assert probe() is True
    finally:
        server.shutdown()
        server.server_close()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "got no answer" in messages[0] and "answers again (200)" in messages[1]


def test_an_ipv6_endpoint_url_is_bracketed():
    assert HttpEndpoint("::1", 8000).url("/v2/health/ready") == "http://[::1]:8000/v2/health/ready"
