import http.server
import io
import json
import threading

import pytest

from kvshare_client import cli
from kvshare_client.types import Completion


def parse(*argv):
    return cli.build_parser().parse_args(list(argv))


def test_generate_defaults_send_only_stream_and_counts():
    args = parse("generate", "Hello")
    assert (args.url, args.model) == ("localhost:8001", "ensemble")
    r = cli.request_from_args(args)
    assert r.prompt == "Hello" and r.stream is True
    assert r.return_num_input_tokens is True and r.return_num_output_tokens is True
    unset = [
        f
        for f in (
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_tokens",
            "seed",
            "stop_words",
            "cache_salt",
            "apply_chat_template",
            "exclude_input_in_output",
            "repetition_penalty",
            "ignore_eos",
        )
        if getattr(r, f) is not None
    ]
    assert unset == []


def test_generate_options_map_to_request_fields():
    args = parse(
        "generate",
        "Hi",
        "--chat",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--top-p",
        "0.5",
        "--top-k",
        "3",
        "--seed",
        "7",
        "--stop",
        "A",
        "B",
        "--stop",
        "C",
        "--cache-salt",
        "s",
        "--no-stream",
        "--include-input",
        "--no-counts",
        "--url",
        "h:9",
        "--json",
        "--ignore-eos",
    )
    r = cli.request_from_args(args)
    assert (r.apply_chat_template, r.max_tokens, r.temperature, r.top_p, r.top_k, r.seed) == (True, 8, 0.0, 0.5, 3, 7)
    assert r.stop_words == ("A", "B", "C") and r.cache_salt == "s"
    assert r.stream is False and r.exclude_input_in_output is False
    assert r.return_num_input_tokens is None and args.json and args.url == "h:9" and r.ignore_eos is True


def test_prompt_from_stdin():
    r = cli.request_from_args(parse("generate", "-"), stdin=io.StringIO("from stdin"))
    assert r.prompt == "from stdin"


@pytest.mark.parametrize("text, ids", [("1 2 3", (1, 2, 3)), ("[4, 5,6]", (4, 5, 6)), ("7", (7,))])
def test_token_model_takes_ids(text, ids):
    assert cli.request_from_args(parse("generate", text, "--model", "llm_engine")).input_ids == ids


def test_token_model_rejects_text_and_chat_with_usage_exit_code():
    err = io.StringIO()
    assert cli.main(["generate", "hello", "--model", "llm_engine"], out=io.StringIO(), err=err) == 2
    assert "token ids" in err.getvalue()
    with pytest.raises(ValueError, match="chat"):
        cli.request_from_args(parse("generate", "1 2", "--model", "llm_engine", "--chat"))


def test_unknown_model_and_missing_command_are_usage_errors():
    with pytest.raises(SystemExit):
        parse("generate", "x", "--model", "gpt")
    with pytest.raises(SystemExit):
        parse()


def test_health_and_metrics_arguments():
    assert parse("health").models is None
    assert parse("health", "--model", "ensemble").models == ["ensemble"]
    assert cli.metrics_url_for("10.0.0.2:8001") == "http://10.0.0.2:8002/metrics"
    assert cli.metrics_url_for("localhost:18001") == "http://localhost:8002/metrics"


def test_completion_json_fields():
    c = Completion(
        model="ensemble",
        request_id="r",
        text="Paris",
        token_ids=(),
        finish_reason="stop",
        num_input_tokens=9,
        num_output_tokens=2,
        cached_tokens=0,
        num_responses=3,
        sent_at=0.0,
        finished_at=0.2,
        content_times=(0.1, 0.15),
        content_tokens=(1, 1),
    )
    d = cli.completion_dict(c)
    json.dumps(d)
    assert d["text"] == "Paris" and d["ttft_ms"] == 100.0 and d["num_output_tokens"] == 2 and d["tokens_per_s"] == 10.0


METRICS = """# HELP nv_inference_count Number of inferences
# TYPE nv_inference_count counter
nv_inference_count{model="ensemble",version="1"} 3
# HELP kvshare_kv_pages_free free pages
# TYPE kvshare_kv_pages_free gauge
kvshare_kv_pages_free 120
kvshare_kv_pages_total 128
"""


@pytest.fixture
def metrics_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = METRICS.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_metrics_command_shows_only_kvshare_lines(metrics_server):
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["metrics", "--metrics-url", metrics_server], out=out, err=err) == 0
    lines = out.getvalue().splitlines()
    assert "kvshare_kv_pages_free 120" in lines and "kvshare_kv_pages_total 128" in lines
    assert "# TYPE kvshare_kv_pages_free gauge" in lines
    assert not any("nv_inference_count" in line for line in lines)


def test_metrics_command_unreachable_is_exit_code_1():
    err = io.StringIO()
    assert cli.main(["metrics", "--metrics-url", "127.0.0.1:9"], out=io.StringIO(), err=err) == 1
    assert "cannot fetch metrics" in err.getvalue()


def test_module_entry_point_runs_the_cli():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "kvshare_client", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "generate" in p.stdout and "metrics" in p.stdout
