"""A client process the soak kills mid-stream (SIGKILL: no cancel, no goodbye, the socket just dies).

    python -m perf.load.soak.abandon_client --url 127.0.0.1:8001 --model llm_bls [--after 2]

Prints one line and then waits to be killed: "streaming" after --after responses, "completed" when the
answer ended first, "overloaded <message>" or "error <message>" when the request was refused.
Its progress (request id, each response, with the time since start) goes to stderr, which the soak
quotes when the process says nothing in time: that tells a client stuck before sending from a
request the server never answered.
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from typing import Sequence

from kvshare_client.errors import ServerError
from kvshare_client.raw_stream import RawStreamSession
from kvshare_client.wire import new_request_id

from . import mix
from .outcomes import is_overload


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True, choices=mix.MODELS)
    ap.add_argument("--after", type=int, default=1)
    args = ap.parse_args(argv)
    started = time.monotonic()

    def progress(what: str) -> None:
        print(f"[{time.monotonic() - started:.1f}s] {what}", file=sys.stderr, flush=True)

    rng = random.Random()
    session = RawStreamSession(args.url, stream_timeout=600)
    request_id = new_request_id()
    seen = 0

    def on_chunk(_chunk: object) -> None:
        nonlocal seen
        seen += 1
        progress(f"response {seen}")
        if seen >= args.after:
            print("streaming", flush=True)
            threading.Event().wait()   # the parent kills this process now, mid-stream

    try:
        tensors = mix.request_tensors(args.model, mix.cancel_shape(args.model), rng)
        progress(f"sending {request_id} to {args.model}")
        session.generate(args.model, tensors, request_id=request_id, on_chunk=on_chunk)
        print("completed", flush=True)
    except ServerError as exc:
        print(("overloaded " if is_overload(exc.message) else "error ") + exc.message.replace("\n", " "), flush=True)
    except Exception as exc:
        print(f"error {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
