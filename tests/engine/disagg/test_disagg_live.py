"""The living disaggregated engine (engine.driver.disagg) past one engine of each kind: two
prefill engines and one TP2 decode engine (2P1D) and one prefill engine with two decode
engines (1P2D), greedy tokens equal to transformers'; each request's path decided at arrival
from its length, the decode replica's cache and the prefill engines' queue, counted."""

import pytest
from reference import reference_cache

from atoll import LLM, SamplingParams

PROMPTS = [[(7 * i + j) % 300 + 1 for j in range(5 + 6 * i)] for i in range(6)]  # 5 .. 35 tokens
NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_model):
    return reference_cache(tiny_model, {"llama": ("llama", {})}, PROMPTS, NEW)("llama")


@pytest.mark.timeout(300)
def test_two_prefill_engines_feed_one_tp2_decode_engine(llama):
    model_dir, want = llama
    with LLM(model_dir, prefill="TP1", decode="TP2", prefill_replicas=2, block_size=4) as llm:
        outs = llm.generate(PROMPTS, GREEDY, timeout_s=240)
    engines = {o.metrics["prefill_engine"] for o in outs}
    assert [o.token_ids for o in outs] == want
    assert [o.metrics["prefilled_on"] for o in outs] == ["prefill"] * len(PROMPTS)
    assert engines == {0, 1}  # six prompts at once: each prefill engine took some


@pytest.mark.timeout(300)
def test_one_prefill_engine_feeds_two_decode_engines(llama):
    model_dir, want = llama
    with LLM(model_dir, prefill="TP1", decode="TP1", decode_replicas=2, block_size=4) as llm:
        outs = llm.generate(PROMPTS, GREEDY, timeout_s=240)
        stats = llm.start().stats
    assert [o.token_ids for o in outs] == want
    assert [o.metrics["prefilled_on"] for o in outs] == ["prefill"] * len(PROMPTS)
    assert stats["blocks_in_use"] == 0


@pytest.mark.timeout(300)
@pytest.mark.timeout(300)
def test_a_colocated_decode_engine_prefills_its_own_prompts(llama):
    """1P1D plus 1 colocated replica (--decode-replicas 2 --colocated-replicas 1): the six prompts
    sent at once go three to each decode engine; the colocated one's are prefilled there."""
    model_dir, want = llama
    with LLM(model_dir, prefill="TP1", decode="TP1", decode_replicas=2, colocated_replicas=1, block_size=4) as llm:
        outs = llm.generate(PROMPTS, GREEDY, timeout_s=240)
        engine = llm.start()
        routed, table = dict(engine.routed), engine.engine_table()
    assert [o.token_ids for o in outs] == want
    assert sorted(o.metrics["prefilled_on"] for o in outs) == ["decode"] * 3 + ["prefill"] * 3
    assert routed == {"prefill": 3, "decode": 0, "queue": 0, "colocated": 3}
    assert [(e["role"], e["colocated"], e["taken"]) for e in table] == \
        [("prefill", False, 3), ("decode", False, 3), ("decode", True, 3)]


def test_the_length_the_cache_and_the_prefill_queue_decide_the_path(llama):
    """--disagg-min-prompt-tokens 12 and --disagg-max-prefill-queue 1: the 5- and 11-token
    prompts stay on the decode engine; of the four longer ones sent at once, the first goes to
    the prefill engine and at least one more finds its queue full; sent again, once the decode
    engine holds them, every long prompt stays there too (its uncached part is short)."""
    model_dir, want = llama
    with LLM(model_dir, prefill="TP1", decode="TP1", block_size=4, disagg_min_prompt_tokens=12,
             disagg_max_prefill_queue=1) as llm:
        first = llm.generate(PROMPTS, GREEDY, timeout_s=240)
        routed_first = dict(llm.start().routed)
        again = llm.generate(PROMPTS, GREEDY, timeout_s=240)
        routed = llm.start().routed
    assert [o.token_ids for o in first] == want and [o.token_ids for o in again] == want
    paths = [o.metrics["prefilled_on"] for o in first]
    assert paths[:2] == ["decode", "decode"] and paths[2] == "prefill"
    assert routed_first["decode"] == 2 and routed_first["queue"] >= 1
    assert routed_first["prefill"] + routed_first["queue"] == 4
    assert [o.metrics["prefilled_on"] for o in again] == ["decode"] * len(PROMPTS)
    assert routed["decode"] - routed_first["decode"] == len(PROMPTS)
    assert all(o.metrics["cached_tokens"] > 0 for o in again[2:])


def test_the_decode_engines_tokens_wait_for_the_prefill_engines_first_token():
    """The first token of a handed-off request comes in its prefill engine's step, the rest in
    the decode engine's: when the decode engine's message arrives first, its tokens and end are
    held until the first token is out, then follow it."""
    from atoll.engine.driver.disagg import DisaggEngine

    engine = DisaggEngine.__new__(DisaggEngine)  # only the ordering state
    engine._first, engine._early = {7: 151}, {}
    tokens, done = engine._in_order([(7, 293, None), (8, 5, None)], [(7, {"r": 1})], decoded=True)
    assert tokens == [(8, 5, None)] and done == []  # 8 was not handed off: it goes at once
    tokens, done = engine._in_order([(7, 151, None)], [], decoded=False)
    assert tokens == [(7, 151, None), (7, 293, None)] and done == [(7, {"r": 1}, True)]
    assert engine._first == {} and engine._early == {}
    tokens, _ = engine._in_order([(7, 19, None)], [], decoded=True)  # afterwards nothing waits
    assert tokens == [(7, 19, None)]


def test_block_pool_reports_named_and_evicted_blocks():
    from atoll.engine.kv.blocks import BlockPool

    pool = BlockPool(2, 4)
    pool.events = []
    table = []
    assert pool.grow(table, 8)
    pool.name(table[0], b"a")
    pool.name(table[1], b"b")
    pool.release(table)
    other = []
    assert pool.grow(other, 4)  # evicts the least recently used named block
    assert pool.events == [(True, b"a"), (True, b"b"), (False, b"b")]


@pytest.mark.timeout(300)
def test_the_driver_reads_the_decode_engines_cache_events(llama):
    """The driver's view of the decode replica's cache is what the engine reports: a long
    prompt's blocks appear once the engine holds them, and leave when it evicts them (a cache of
    12 blocks of 4, other long prompts after it); sent again, the evicted prompt goes to the
    prefill engine, while one the engine still holds stays on the decode engine."""
    from atoll.engine.kv.blocks import prefix_names

    model_dir, want = llama
    long_prompts = PROMPTS[3:]  # 23, 29 and 35 tokens
    with LLM(model_dir, prefill="TP1", decode="TP1", block_size=4, num_blocks=12, max_num_seqs=1,
             max_model_len=48, disagg_min_prompt_tokens=12) as llm:
        engine = llm.start()
        names = [prefix_names(p, 4, (len(p) - 1) // 4) for p in long_prompts]
        slot = engine._slots.index((1, 0))  # the decode engine's (engine 1) replica 0
        first = llm.generate(long_prompts[:1], GREEDY, timeout_s=240)
        held_after_first = set(names[0]) <= engine._seen[slot]
        later = llm.generate(long_prompts[1:], GREEDY, timeout_s=240)
        evicted = not set(names[0]) <= engine._seen[slot]
        again = llm.generate([long_prompts[0], long_prompts[2]], GREEDY, timeout_s=240)
    assert [o.token_ids for o in first + later] == want[3:]
    assert [o.token_ids for o in again] == [want[3], want[5]]
    assert held_after_first and evicted
    assert [o.metrics["prefilled_on"] for o in again] == ["prefill", "decode"]
