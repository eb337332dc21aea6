"""Tensor parallelism through the real Triton server: llm_engine with KVSHARE_DATA_PARALLEL_SIZE=2
and KVSHARE_TENSOR_PARALLEL_SIZE=2 (tiny dummy model, gloo on the CPU) spawns one follower rank per
engine from inside the Python stub, streams the one-rank engine's greedy tokens, and ends its ranks
when the server stops. A server of its own (only llm_engine)."""
from __future__ import annotations

import psutil
import pytest
from server_helpers import own_server, wait_for_idle_pool

from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.sampling_params import SamplingParams
from kvshare_client import GenerationRequest, KvshareClient

pytestmark = pytest.mark.server

PROMPTS = [[(13 * i + k) % 240 + 5 for i in range(20 + 3 * k)] for k in range(3)]
MAX_TOKENS = 6


def follower_ranks(stub_pids) -> list[psutil.Process]:
    """The stub's spawned children (multiprocessing's spawn_main): one follower rank per engine."""
    children = [c for pid in stub_pids for c in psutil.Process(pid).children(recursive=True)]
    return [c for c in children if "spawn_main" in " ".join(c.cmdline())]


def one_rank_tokens() -> list[tuple[int, ...]]:
    engine = LLMEngine(EngineConfig(model="dummy:tiny-llama", num_pages=64))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), ids, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return [tuple(tokens[str(i)]) for i in range(len(PROMPTS))]


def test_two_by_two_ranks_in_the_stub_stream_the_one_rank_tokens() -> None:
    want = one_rank_tokens()
    env = {"KVSHARE_DEBUG_CHECKS": "true", "KVSHARE_MODEL": "dummy:tiny-llama", "KVSHARE_NUM_PAGES": "64",
           "KVSHARE_DATA_PARALLEL_SIZE": "2", "KVSHARE_TENSOR_PARALLEL_SIZE": "2", "KVSHARE_MAX_RUNNING": "8"}
    with own_server(env, "tensor-parallel") as server:
        followers = follower_ranks(server.stub_pids("llm_engine"))
        assert len(followers) == 2, [f.cmdline() for f in followers]
        with KvshareClient(server.addr.grpc_url, stream_timeout=120) as client:
            got = [client.generate(GenerationRequest(input_ids=ids, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                                                     temperature=0.0, stream=True), model="llm_engine").token_ids
                   for ids in PROMPTS]
        assert got == want
        wait_for_idle_pool(server.addr.metrics_url)
        log = server.log()
    gone, alive = psutil.wait_procs(followers, timeout=30)
    assert not alive, f"follower ranks outlived the server: {[p.pid for p in alive]}"
    assert "tensor-parallel ranks ended badly" not in log
