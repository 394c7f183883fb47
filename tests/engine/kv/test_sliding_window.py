"""Sliding windows free memory: a Mistral whose every layer attends to the last 256 positions
generates 2,000 tokens; the blocks its window has passed go back to the pool as it goes, so
the blocks in use stay near the window's share while the tokens stay transformers' (the
freed blocks are read no more: their table entries point at the scratch block, masked)."""

import pytest
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.kv.blocks import BlockPool

WINDOW, BLOCK, NEW = 256, 16, 2000
PROMPTS = [[(11 * i + 1) % 290 + 7 for i in range(300)]]  # longer than the window already


def test_free_before_lets_go_of_leading_blocks_and_keeps_the_table_length():
    pool = BlockPool(8, 4, hole=99)
    table = []
    assert pool.grow(table, 20)  # 5 blocks
    assert pool.free_before(table, 3) == 3 and table[:3] == [99, 99, 99] and len(table) == 5
    assert pool.num_free == 6 and pool.free_before(table, 3) == 0  # already gone
    pool.release(table)  # holes are skipped
    assert pool.num_free == 8 and table == []


def test_windowed_pool_frees_only_the_sliding_table_and_reuses_a_prefix_whose_early_blocks_are_gone():
    from atoll.engine.kv.blocks import prefix_names
    from atoll.engine.kv.windowed import WindowedPool

    pool = WindowedPool(BlockPool(20, 4, hole=50), BlockPool(6, 4, hole=99), width=8)
    tokens = list(range(100, 124))
    names = prefix_names(tokens, 4)
    a = pool.table()
    assert pool.grow(a, 24) and len(a) == len(a.window) == 6
    for i in range(6):
        pool.name_at(a, i, names[i])
    assert pool.free_before(a, 3) == 3 and a.window[:3] == [99] * 3 and 99 not in a
    other = pool.table()
    assert not pool.grow(other, 16)  # 3 sliding blocks free (evictable), 4 wanted: nothing taken
    assert pool.grow(other, 12) and pool.window.evictions == 3  # a's early sliding blocks, evicted
    pool.release(a)
    hits = pool.lookup(names)
    # the first query after 24 tokens reads positions 17..24: sliding blocks 4 and 5 are enough
    assert len(hits) == 6 and hits.window[:4] == [99] * 4 and None not in hits.window
    b = pool.table()
    assert pool.fits(hits, 25)
    pool.share(b, hits)
    assert pool.grow(b, 25) and b.window[:4] == [99] * 4 and len(b.window) == 7
    pool.trim(b, 24)
    assert len(b) == len(b.window) == 6
    pool.release(b)
    pool.release(other)
    assert pool.window.num_free == 6 and pool.full.num_free == 20


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_window_model_generates_2000_tokens_in_bounded_blocks(tiny_model):
    model_dir = tiny_model("mistral", sliding_window=WINDOW, max_position_embeddings=4096, num_hidden_layers=2)
    want = reference_tokens(model_dir, PROMPTS, NEW)
    peak = [0]  # once decoding (the prompt's own blocks are all held while it is computed)
    with LLM(model_dir, block_size=BLOCK) as llm:
        def on_step(done, tokens):
            if tokens >= 2:
                peak[0] = max(peak[0], llm.start().stats.get("blocks_in_use", 0))

        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True), on_step=on_step,
                            timeout_s=500)
        left = llm.start().stats["blocks_in_use"]
    assert [o.token_ids for o in outs] == want
    # the sequence holds its window's blocks and the one being filled, not its 2,300 tokens' 144
    bound = len(PROMPTS) * (WINDOW // BLOCK + 2)
    assert 0 < peak[0] <= bound, (peak[0], bound)
    assert left == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_per_layer_windows_match_transformers(tiny_model, kind):
    """Qwen2/3 with use_sliding_window: only the layers from max_window_layers on slide (as
    transformers' layer_types say), the others attend to every position; with the window far
    shorter than the sequence, a model applying it to every layer, or to none, gives other
    tokens. (Too short a run for the sliding layers' own cache: test_sliding_layers_* below.)"""
    from atoll.models.config import ModelConfig

    window, prompt = 24, [[(7 * i + 3) % 90 + 5 for i in range(60)], [9, 8, 7]]
    model_dir = tiny_model(kind, use_sliding_window=True, sliding_window=window, max_window_layers=1,
                           num_hidden_layers=2, max_position_embeddings=512)
    cfg = ModelConfig.load(model_dir)
    assert (cfg.sliding_window, cfg.layer_windows) == (None, (None, window))
    want = reference_tokens(model_dir, prompt, 40)
    with LLM(model_dir, block_size=4) as llm:
        outs = llm.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True), timeout_s=200)
    assert [o.token_ids for o in outs] == want


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind,layout", [("qwen2", "TP1"), ("qwen3", "PP2"),
                                         pytest.param("qwen2", "TP2", marks=pytest.mark.slow)])
def test_sliding_layers_let_go_of_their_blocks_beside_full_attention_layers(tiny_model, kind, layout):
    """Per-layer windows (a 24-token window on the last of three layers): the sliding layer
    keeps its own cache, whose blocks in use stay near the window's share while the sequences
    grow to 400 tokens (the full-attention layers hold every block), and the tokens stay
    transformers'. Two prompts share a prefix, so a cached prefix is reused in both tables.
    Under PP2 the sliding layer is a stage of its own."""
    from atoll.models.config import ModelConfig

    window, block = 24, 4
    shared = [(7 * i + 3) % 90 + 5 for i in range(40)]
    prompts = [shared + [11, 12, 13], shared + [21, 22]]
    model_dir = tiny_model(kind, use_sliding_window=True, sliding_window=window, max_window_layers=2,
                           num_hidden_layers=3, max_position_embeddings=1024)
    assert ModelConfig.load(model_dir).hybrid_window == window
    want = reference_tokens(model_dir, prompts, 360)
    peak = {"window": 0, "full": 0}
    with LLM(model_dir, layout=layout, block_size=block, max_num_seqs=2, max_num_batched_tokens=64,
             enforce_eager=True) as llm:
        def on_step(done, tokens):
            stats = llm.start().stats
            if tokens >= 4 and "window_blocks_in_use" in stats:
                peak["window"] = max(peak["window"], stats["window_blocks_in_use"])
                peak["full"] = max(peak["full"], stats["blocks_in_use"])

        outs = llm.generate(prompts, SamplingParams(max_tokens=360, ignore_eos=True), on_step=on_step,
                            timeout_s=500)
        stats = llm.start().stats
    assert [o.token_ids for o in outs] == want
    if "PP" not in layout:  # (under PP each prompt goes to its own lane, with its own pools)
        assert outs[1].metrics["cached_tokens"] == 40  # the shared prefix, from both pools
    # each sequence holds its window's blocks and two more (decoding), not its 400 tokens' 100
    assert 0 < peak["window"] <= len(prompts) * (window // block + 2), peak
    assert peak["full"] >= 2 * 360 // block, peak  # the full-attention layers keep every block
    assert stats["window_blocks_in_use"] == 0 and stats["window_num_blocks"] < stats["num_blocks"]


@pytest.mark.timeout(300)
def test_sliding_layers_own_cache_with_speculation_and_switched_off(tiny_model):
    """n-gram speculation grows and trims both tables (tokens stay transformers'), and
    --disable-hybrid-kv-cache-manager keeps one table for every layer (no sliding pool)."""
    window, prompt = 24, [[(5 * i) % 7 + 3 for i in range(48)]]  # repetitive: drafts get accepted
    model_dir = tiny_model("qwen2", use_sliding_window=True, sliding_window=window, max_window_layers=1,
                           num_hidden_layers=2, max_position_embeddings=512)
    want = reference_tokens(model_dir, prompt, 120)
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with LLM(model_dir, block_size=4, max_num_seqs=1, max_num_batched_tokens=32, enforce_eager=True,
             speculative_config=speculative) as llm:
        outs = llm.generate(prompt, params, timeout_s=200)
        stats = llm.start().stats
    assert [o.token_ids for o in outs] == want
    assert outs[0].metrics["spec_accepted"] > 0 and stats["window_num_blocks"] < stats["num_blocks"]
    with LLM(model_dir, block_size=4, max_num_seqs=1, max_num_batched_tokens=32, enforce_eager=True,
             disable_hybrid_kv_cache_manager=True) as llm:
        outs = llm.generate(prompt, params, timeout_s=200)
        assert "window_num_blocks" not in llm.start().stats
    assert [o.token_ids for o in outs] == want
