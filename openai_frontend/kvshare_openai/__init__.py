"""kvshare_openai: an OpenAI-compatible HTTP service (FastAPI) in front of kvshare's Triton server.

It speaks `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health` and `/metrics`, and
streams each request over gRPC to the `llm_bls` model (TensorRT-LLM's contract, which carries
kvshare's `cache_salt` and `cached_tokens` and forwards a cancel to the engine). No torch.
"""
