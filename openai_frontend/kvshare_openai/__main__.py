"""`python -m kvshare_openai` / `kvshare-openai`: serve the OpenAI-compatible API with uvicorn."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from . import tokenizer as tok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--triton-url", default=os.environ.get("KVSHARE_OPENAI_TRITON_URL", "127.0.0.1:8001"),
                    help="Triton's gRPC address (default 127.0.0.1:8001)")
    ap.add_argument("--host", default=os.environ.get("KVSHARE_OPENAI_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("KVSHARE_OPENAI_PORT", "9000")))
    ap.add_argument("--tokenizer", default=None, help="HF folder or .gguf of the served model (default: "
                    "KVSHARE_MODEL, else the embedded SmolLM2)")
    ap.add_argument("--model-name", default=os.environ.get("KVSHARE_OPENAI_MODEL_NAME"),
                    help="the model id clients send (default: the model's folder or GGUF name)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from .app import FrontendConfig, create_app

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[kvshare-openai %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    source = args.tokenizer or tok.model_source()
    config = FrontendConfig(triton_url=args.triton_url, model_name=args.model_name or tok.served_name(source),
                            tokenizer_source=source)
    app = create_app(config, tok.ModelTokenizer(tok.load(source)))
    logging.getLogger("kvshare.openai").info("OpenAI API for model %s at http://%s:%d/v1 (Triton gRPC %s)",
                                             config.model_name, args.host, args.port, args.triton_url)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
