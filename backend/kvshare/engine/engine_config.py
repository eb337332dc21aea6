"""How an engine is built: model, KV pool and scheduler limits."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None              # .gguf, HF dir, dummy:<name>; None = SmolLM2-135M-Instruct
    device: str = "cpu"
    dtype: str = "float32"                # float32 | float16 | bfloat16
    page_size: int = 16
    num_pages: int | None = None          # None: from kv_cache_memory_gb
    kv_cache_memory_gb: float = 0.5
    # auto (the model's dtype) | fp8_e4m3 (per-tensor scale 1.0) | int8 (a scale per token and KV
    # head): 8-bit pages hold about twice the tokens in the same memory and decode reads half the
    # bytes (docs/operate/tune.md has the accuracy measured against 16-bit pages).
    kv_cache_dtype: str = "auto"
    # CPU, float32, a GGUF model: blocks keeps its quantized linear layers in the file's own blocks
    # (SmolLM2: Q4_1, a Q8_0 lm_head), widened in registers by kvshare's CPU kernel with the very
    # values transformers loads; a decode step reads 96 MB of weights instead of 538 MB (docs/operate/tune.md).
    # fp32 widens them at load, as before. Elsewhere, or where the kernel cannot run, fp32.
    cpu_weights: str = "blocks"
    # Host tier below the GPU pool (pinned host memory on CUDA): cached prefix pages the pool evicts
    # are copied there and loaded back when a prompt needs them again, instead of being recomputed
    # (docs/develop/core.md). 0 = off. Needs prefix caching.
    host_cache_memory_gb: float = 0.0
    # Spill only pages at least this many admissions shared (1: SGLang's selective write-through;
    # 0: every evicted page). The shared-prefix replay favours 1 with a large tier (docs/develop/core.md).
    host_cache_min_hits: int = 1
    # Disk tier below the host tier: every page spilled to the host is also written to a file in this
    # directory (background, checksummed), loaded back through host slots instead of recomputed, and
    # found again after a restart (docs/develop/core.md). "" = off; needs host_cache_memory_gb > 0. One
    # server per directory. disk_cache_gb bounds the files (oldest written or used go first).
    disk_cache_dir: str = ""
    disk_cache_gb: float = 16.0
    max_model_len: int | None = None      # default: the model's max position
    max_running: int = 64
    max_queued_requests: int = 1024       # running + waiting; past it new requests get UNAVAILABLE
    max_step_tokens: int = 2048           # token budget of one step (decodes + prefill chunks)
    max_prefill_chunk: int = 512
    enable_prefix_caching: bool = True
    # Sliding-window page release (kvshare/core/window.py): a model whose every layer attends
    # only its last W keys gives each request's pages that fell wholly out of that window back to the
    # pool while the request runs, so a 32k-token request with a 4k window holds ~257 pages of 16, not
    # 2,048. None: the model's window (ModelConfig.kv_release_window; 0 when a layer attends to all);
    # 0: keep every page (full accounting, to compare); W > 0 must equal the model's window.
    kv_release_window: int | None = None
    eviction: str = "lru"
    # fcfs | cache_aware (cached prefixes first). fcfs by default: on the H200, seed-hot10 in a closed loop
    # ran 13% slower with cache_aware (docs/develop/core.md); cache_aware pays with deep queues of shared prefixes.
    admission: str = "fcfs"
    # While requests decode and no prefill runs, hold new arrivals back for up to N steps so that
    # several are admitted in one mixed step: each mixed step pays the decode rows' attention on
    # the eager path (shared-prefix on the H200: ~100 ms mixed vs ~28 ms decode-only). 8 took
    # shared-prefix from 5,315 to 5,825 tok/s; 0 (admit at once) stays the default, as in vLLM and
    # SGLang, since a small closed loop would idle freed slots (docs/develop/core.md "Admission delay").
    admission_delay_steps: int = 0
    default_max_tokens: int = 128
    # Longest prompt a request may send, in tokens (None: the context less one token to generate).
    # The text models refuse longer texts by bytes before tokenizing them (docs/operate/security.md).
    max_prompt_tokens: int | None = None
    # Largest return_generation_logits / return_context_logits reply, in fp32 values (64 MiB).
    max_logits_elements: int = 16_777_216
    max_beam_width: int = 8               # beam_width and num_return_sequences above this are refused
    # Server only: a stream's deltas go out at most every N tokens (the first delta and the final
    # response at once), as vLLM's and TRT-LLM's stream interval; 1 = every token. Fewer responses
    # leave the engine thread more of the stub's GIL (docs/develop/engine.md).
    stream_interval: int = 1
    debug_checks: bool = False            # check the pool's integrity after every step
    # Server only: while it has work the engine loop logs its step periods by kind this often
    # (engine/step_meter.py), as vLLM logs its throughput every 10 s; 0 = never.
    step_log_interval_s: float = 10.0
    cuda_graphs: bool = True              # CUDA only: replay captured graphs for decode-only steps
    # CUDA only, with cuda_graphs: steps of up to this many tokens that hold a prefill chunk (beside
    # decode rows or not) replay a graph captured for the next size of a token ladder; longer steps
    # run eagerly, as every such step does with 0. Under serving a new prompt joins the decodes every
    # few steps, and eagerly each such step pays ~300 kernel launches from Python, slower still while
    # the stub's response threads hold the GIL (at 128 streams, 2k-token steps took 82 ms eagerly
    # where their GEMMs need ~40). The default covers the step budget (max_step_tokens 4096).
    mixed_graph_max_tokens: int = 4096
    cascade_attention: bool = True        # CUDA only: decode rows sharing prefix pages read them once per group
    # Schedule and post-process step N+1 while step N runs (greedy steps without penalties); the
    # host work between steps leaves the GPU's critical path. None = on for CUDA, off on the CPU:
    # on the H200 decode steps ran 16-20% faster with identical outputs (fixed-64 7.12 -> 6.12 ms,
    # fixed-256 16.05 -> 13.33 ms; docs/develop/engine.md, perf/results/options/2026-11-30/overlap.log);
    # the CPU has no asynchronous device to overlap with. Read overlap_enabled, not this field.
    overlap_schedule: bool | None = None
    # Ranks of one engine, Megatron-style (runtime/tensor_parallel.py): heads by KV-head groups and MLP
    # columns split over devices device, device+1, ...; the scheduler runs once, on rank 0 (docs/develop/engine.md).
    tensor_parallel_size: int = 1
    seed: int = 0

    @property
    def overlap_enabled(self) -> bool:
        """overlap_schedule resolved for this config's device (an explicit True/False wins)."""
        if self.overlap_schedule is not None:
            return self.overlap_schedule
        return self.device.split(":", 1)[0] == "cuda"

    @classmethod
    def from_mapping(cls, values: dict[str, str]) -> "EngineConfig":
        """From string key/values (Triton config parameters, environment); unknown keys are an error."""
        import dataclasses

        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, object] = {}
        for key, raw in values.items():
            if key not in fields:
                raise ValueError(f"unknown engine parameter '{key}'; known: {sorted(fields)}")
            kwargs[key] = _parse(fields[key].type, raw, key)
        return cls(**kwargs)


def _parse(type_name: str, raw: str, key: str) -> object:
    raw = raw.strip()
    if raw.lower() in ("", "none", "null") and "None" in type_name:
        return None
    try:
        if type_name.startswith("bool"):
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        if type_name.startswith("int"):
            return int(raw)
        if type_name.startswith("float"):
            return float(raw)
    except ValueError:
        raise ValueError(f"engine parameter '{key}' must be {type_name}, got '{raw}'") from None
    return raw
