"""Sliding windows free memory: a Mistral whose every layer attends to the last 256 positions
generates 2,000 tokens; the blocks its window has passed go back to the pool as it goes, so
the blocks in use stay near the window's share while the tokens stay transformers' (the
freed blocks are read no more: their table entries point at the scratch block, masked)."""

import pytest
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.blocks import BlockPool

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
    tokens. Blocks are not freed: the full-attention layers still read them."""
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
