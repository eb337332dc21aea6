"""``kvshare-client``: generate (streamed to the terminal), health, metrics.

    kvshare-client generate "What is the capital of France?" --chat --max-tokens 32
    kvshare-client generate "1 2 3 4" --model llm_engine --max-tokens 8 --json
    kvshare-client health --url localhost:8001
    kvshare-client metrics --url localhost:8001          # http://localhost:8002/metrics, kvshare_* only

Generated text goes to stdout as it arrives; the one-line summary and errors go to stderr.
Exit codes: 0 ok, 1 server/connection error or not ready, 2 usage error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Optional, Sequence, TextIO

from .errors import KvshareClientError
from .types import CANCELLABLE_TEXT_MODEL, TEXT_MODEL, TOKEN_MODEL, Completion, GenerationRequest

DEFAULT_URL = "localhost:8001"
METRICS_PORT = 8002


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvshare-client", description="kvshare gRPC streaming client")
    sub = p.add_subparsers(dest="command", required=True)

    def add_url(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--url", default=DEFAULT_URL, help=f"gRPC address host:port (default {DEFAULT_URL})")

    g = sub.add_parser("generate", help="stream one completion to the terminal")
    g.add_argument(
        "prompt", help="prompt text ('-' reads stdin); with --model llm_engine: token ids '1 2 3' or '1,2,3'"
    )
    add_url(g)
    g.add_argument("--model", default=TEXT_MODEL, choices=(TEXT_MODEL, CANCELLABLE_TEXT_MODEL, TOKEN_MODEL),
                   help="ensemble: text (TensorRT-LLM dialect); llm_bls: the same, and Ctrl-C frees the request "
                        "on the server at once; llm_engine: token ids")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template (text models only)")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--min-tokens", type=int)
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS (up to --max-tokens)")
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--repetition-penalty", type=float)
    g.add_argument("--presence-penalty", type=float)
    g.add_argument("--frequency-penalty", type=float)
    g.add_argument("--stop", nargs="+", action="extend", metavar="WORD", help="stop word(s); repeatable")
    g.add_argument("--cache-salt", help="share cached prefixes only with requests using the same salt")
    g.add_argument("--include-input", action="store_true", help="exclude_input_in_output=false")
    g.add_argument("--no-stream", action="store_true", help="ask for one response with the whole text")
    g.add_argument("--no-counts", action="store_true", help="do not ask for num_input/output_tokens")
    g.add_argument("--json", action="store_true", help="print the completion as one JSON object instead of text")
    g.add_argument("--timeout", type=float, help="give up after this many seconds")

    h = sub.add_parser("health", help="is the server live/ready, are the models ready")
    add_url(h)
    h.add_argument(
        "--model", dest="models", action="append", help=f"model to check (default {TEXT_MODEL} and {TOKEN_MODEL})"
    )

    m = sub.add_parser("metrics", help="show the server's kvshare_* Prometheus metrics")
    add_url(m)
    m.add_argument("--metrics-url", help=f"metrics endpoint (default: host of --url, port {METRICS_PORT})")
    m.add_argument("--prefix", default="kvshare_", help="metric name prefix to show ('' = all)")
    return p


def parse_token_ids(text: str) -> tuple[int, ...]:
    parts = [s for s in re.split(r"[\s,\[\]]+", text.strip()) if s]
    try:
        ids = tuple(int(s) for s in parts)
    except ValueError:
        raise ValueError("--model llm_engine takes token ids, e.g. '1 2 3' or '1,2,3'") from None
    if not ids:
        raise ValueError("no token ids given")
    return ids


def request_from_args(args: argparse.Namespace, stdin: Optional[TextIO] = None) -> GenerationRequest:
    """Only options given on the command line become inputs; the rest keep server defaults."""
    prompt = (stdin or sys.stdin).read() if args.prompt == "-" else args.prompt
    if args.model == TOKEN_MODEL:
        if args.chat:
            raise ValueError("--chat needs the text model (ensemble): llm_engine takes token ids")
        source: dict[str, Any] = {"input_ids": parse_token_ids(prompt)}
    else:
        source = {"prompt": prompt}
    counts = None if args.no_counts else True
    return GenerationRequest(
        **source,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop_words=tuple(args.stop) if args.stop else None,
        cache_salt=args.cache_salt,
        exclude_input_in_output=False if args.include_input else None,
        apply_chat_template=True if args.chat else None,
        ignore_eos=True if args.ignore_eos else None,
        # The CLI shows deltas as they come, so it asks for streaming unless told not to.
        stream=not args.no_stream,
        return_num_input_tokens=counts,
        return_num_output_tokens=counts,
    )


def completion_dict(c: Completion) -> dict[str, Any]:
    def ms(v: Optional[float]) -> Optional[float]:
        return None if v is None else round(v * 1e3, 3)

    return {
        "model": c.model,
        "request_id": c.request_id,
        "text": c.text,
        "token_ids": list(c.token_ids),
        "finish_reason": c.finish_reason,
        "num_input_tokens": c.num_input_tokens,
        "num_output_tokens": c.output_tokens,
        "cached_tokens": c.cached_tokens,
        "num_responses": c.num_responses,
        "ttft_ms": ms(c.ttft_s),
        "itl_ms": ms(c.itl_s),
        "e2e_ms": ms(c.e2e_s),
        "tokens_per_s": None if c.tokens_per_s is None else round(c.tokens_per_s, 2),
        "cancelled": c.cancelled,
    }


def metrics_url_for(grpc_url: str) -> str:
    host = grpc_url.split("://", 1)[-1].rsplit(":", 1)[0] or "localhost"
    return f"http://{host}:{METRICS_PORT}/metrics"


def cmd_generate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .sync_client import KvshareClient

    try:
        request = request_from_args(args)
    except (ValueError, TypeError) as exc:
        err.write(f"kvshare-client: {exc}\n")
        return 2
    with KvshareClient(args.url, max_streams=1, stream_timeout=args.timeout) as client:
        stream = client.stream(request, model=args.model)
        try:
            for chunk in stream:
                if args.json:
                    continue
                if chunk.text:
                    out.write(chunk.text)
                    out.flush()
                elif chunk.token_ids and args.model == TOKEN_MODEL:
                    out.write(" ".join(map(str, chunk.token_ids)) + " ")
                    out.flush()
        except KeyboardInterrupt:
            stream.cancel()  # tell the server to free the request
            if not args.json:
                out.write("\n")
            err.write(stream.completion().summary() + "\n")
            return 130
        completion = stream.result()
    if args.json:
        out.write(json.dumps(completion_dict(completion), ensure_ascii=False) + "\n")
    else:
        out.write("\n")
        err.write(completion.summary() + "\n")
    return 0


def cmd_health(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .sync_client import KvshareClient

    models = args.models or [TEXT_MODEL, TOKEN_MODEL]
    with KvshareClient(args.url, max_streams=1) as client:
        ok = client.is_server_ready()
        out.write(f"server {args.url}: {'ready' if ok else 'NOT ready'}\n")
        for model in models:
            ready = client.is_model_ready(model)
            ok = ok and ready
            out.write(f"model {model}: {'ready' if ready else 'NOT ready'}\n")
    return 0 if ok else 1


def cmd_metrics(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from .metrics import fetch_metrics, filter_lines

    text = fetch_metrics(args.metrics_url or metrics_url_for(args.url))
    lines = filter_lines(text, args.prefix) if args.prefix else text.splitlines()
    if not lines:
        err.write(f"no metrics named {args.prefix}* on the server\n")
        return 1
    out.write("\n".join(lines) + "\n")
    return 0


def main(argv: Optional[Sequence[str]] = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    args = build_parser().parse_args(argv)
    command = {"generate": cmd_generate, "health": cmd_health, "metrics": cmd_metrics}[args.command]
    try:
        return command(args, out, err)
    except KvshareClientError as exc:
        err.write(f"kvshare-client: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
