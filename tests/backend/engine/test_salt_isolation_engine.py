"""cache_salt isolation in the engine under concurrent admissions (docs/operate/security.md).

Random waves of requests with prompts from one shared-prefix family under a few salts, several
admitted at once and stepped together on the tiny random Llama. After every step:

  - no physical page is referenced by requests of two different salts at the same time;
  - the full pages a request reused from the prefix cache were last held by a request of its own
    salt (a page is "held" when it appears in a live request's page table);
  - a request's reported cached_tokens is a prefix it shares with a request of its salt added before it.

Then every page is back (active 0, free + cached = total).
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvshare.core.prefix_cache import common_prefix
from kvshare.engine.engine import LLMEngine
from kvshare.engine.engine_config import EngineConfig
from kvshare.sampling_params import SamplingParams

PAGE = 4
BASE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]
SALTS = ("", "tenant-a", "tenant-b")

request_st = st.tuples(st.integers(4, len(BASE)), st.lists(st.integers(30, 40), max_size=3),
                       st.sampled_from(SALTS), st.integers(2, 5))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(waves=st.lists(st.lists(request_st, min_size=1, max_size=6), min_size=1, max_size=4),
       num_pages=st.sampled_from((12, 24, 64)))
def test_a_request_never_reads_a_page_computed_for_another_salt(waves, num_pages):
    engine = LLMEngine(EngineConfig(model="dummy:tiny-llama", num_pages=num_pages, page_size=PAGE, max_running=6,
                                    max_step_tokens=24, max_prefill_chunk=8, debug_checks=True))
    kv = engine.scheduler.kv
    holder: dict[int, str] = {}                 # page -> salt of the last live request seen holding it
    order: list[str] = []                       # request ids in the order they were added
    salt_of: dict[str, str] = {}
    prompts: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    checked: set[str] = set()
    n = 0
    for wave in waves:
        for keep, tail, salt, max_tokens in wave:           # admitted together, before the next step
            rid = f"r{n}"
            n += 1
            prompt = BASE[:keep] + tail
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                               cache_salt=salt)
            salt_of[rid], prompts[rid], outputs[rid] = salt, prompt, []
            order.append(rid)
        for _ in range(500):
            if not engine.has_work:
                break
            for out in engine.step():
                outputs[out.request_id] += list(out.token_ids)
                if out.request_id not in checked and out.token_ids:
                    checked.add(out.request_id)
                    c = out.cached_tokens
                    if c:       # shared with a request of its salt admitted before it (finished or not)
                        me = out.request_id
                        own = [common_prefix(prompts[me], prompts[q] + outputs[q]) for q in order[:order.index(me)]
                               if salt_of[q] == salt_of[me]]
                        assert max(own, default=0) >= c, (me, c, own)
            live: dict[int, str] = {}
            for rid in engine.request_ids():
                state = engine._by_request[rid]     # the engine's request -> sequence map (read only)
                if not kv.has(state.seq_id):
                    continue
                table = kv.page_table(state.seq_id)
                reused = engine.scheduler.num_cached_tokens(state.seq_id) // PAGE
                for i, page in enumerate(table):
                    other = live.setdefault(page, salt_of[rid])
                    assert other == salt_of[rid], f"page {page} held by salts {other!r} and {salt_of[rid]!r}"
                    if i < reused and page in holder:
                        assert holder[page] == salt_of[rid], (rid, page, holder[page])
            holder.update(live)
        assert not engine.has_work
    s = engine.stats().pool
    assert s.active == 0 and s.free + s.cached == s.total
    engine.check_integrity()
