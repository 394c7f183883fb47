"""Context parallelism (cp): the layouts and rank grid, the striped block pool, attention
partials merged by log-sum-exp, greedy tokens identical to transformers at CP2, TP2CP2 and
CP2PP2 on long and short prompts (chunked prefill and prefix caching on), each rank's share of
a long sequence's KV bytes, and a sequence one rank's cache cannot hold."""

import json

import pytest
import torch
import torch.nn.functional as F
from cp_fns import held_kv
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.cli.main import main
from atoll.engine.kv.blocks import BlockPool
from atoll.parallel.layout import resolve_layout
from atoll.errors import InputError, LayoutError
from atoll.launch.local import run_local
from atoll.layers import context_parallel
from atoll.layers.context_parallel import merge, pack, partial_attention
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import coords, group_ranks

# 40 new tokens: decode crosses two block boundaries, so new blocks land on each cp rank in turn
BLOCK, NEW = 16, 40


def _prompt(n, seed):
    return [(37 * i + 11 * seed) % 293 + 5 for i in range(n)]


LONG = _prompt(2900, 1)
# long and short prompts; the third shares the first's first 1,200 tokens (a prefix-cache hit)
PROMPTS = [LONG, _prompt(40, 2), LONG[:1200] + _prompt(300, 3), [9], _prompt(1100, 4)]


def test_layouts_with_cp_parse_round_trip_and_refuse_what_cp_cannot_combine_with():
    for text, world in (("CP2", 2), ("TP2CP2", 4), ("CP2PP2", 4), ("TP2CP2PP2", 8)):
        lay = Layout.parse(text)
        assert str(lay) == text and lay.world_size == world and lay.cp == 2
    assert resolve_layout(None, tp=2, cp=2) == Layout(tp=2, cp=2)
    for bad in ("DP2CP2", "TP2EP2CP2"):
        with pytest.raises(LayoutError, match="does not combine") as e:
            Layout.parse(bad)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("options,error", [
    (["--layout", "CP2EP2"], "cp=2 does not combine with dp or ep yet"),
    (["--layout", "CP2", "-cp", "2"], "give either --layout or the -tp/-pp/-dp/-ep sizes, not both"),
    (["-cp", "0"], "-cp 0 must be a whole number of at least 1"),
])
def test_the_cli_refuses_cp_layouts_it_cannot_run_in_one_line(capsys, tiny_model, options, error):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tiny_model("llama")), "--prompt", "x", *options])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("atoll: error:")]
    assert e.value.code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert error in lines[0], lines[0]


def test_rank_grid_puts_tp_innermost_then_cp_then_pp():
    lay = Layout.parse("TP2CP2PP2")
    g = group_ranks(lay)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["moe_tp"] == g["tp"] and g["stage"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    c = coords(lay, 6)
    assert (c.pp, c.cp, c.tp) == (1, 1, 0)


def test_striped_pool_puts_block_j_on_rank_j_mod_cp_and_counts_blocks_per_rank():
    pool = BlockPool(4, BLOCK, stripes=2, hole=8)  # 4 blocks on each of 2 ranks
    table = []
    assert pool.grow(table, 7 * BLOCK)  # 7 blocks: 4 on rank 0, 3 on rank 1
    assert [b % 2 for b in table] == [0, 1, 0, 1, 0, 1, 0]
    assert len({b // 2 for b in table[0::2]}) == 4  # distinct local blocks on rank 0
    assert pool.free_on(0) == 0 and pool.free_on(1) == 1 and pool.num_free == 1
    assert not pool.grow(table, 9 * BLOCK)  # rank 0 is full though rank 1 has a block
    assert pool.grow(table, 8 * BLOCK) and pool.num_free == 0
    pool.release(table)
    assert pool.num_free == 8 and pool.fits([], 8 * BLOCK) and not pool.fits([], 9 * BLOCK)


@pytest.mark.parametrize("fused", [True, False])
def test_partials_over_split_keys_merge_to_full_attention(monkeypatch, fused):
    monkeypatch.setattr(context_parallel, "FUSED", fused)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)
    pos_q, pos_k = torch.arange(30, 50), torch.arange(50)
    causal = pos_k[None, :] <= pos_q[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
    parts = []
    # three ranks' keys: the even ones before 40, the odd ones before 40, and 40 on (which the
    # queries before 40 do not see at all)
    for keys in (torch.arange(0, 40, 2), torch.arange(1, 40, 2), torch.arange(40, 50)):
        out, lse = partial_attention(q, k[:, :, keys], v[:, :, keys], causal[:, keys][None, None])
        parts.append(pack(out[0].transpose(0, 1), lse[0].transpose(0, 1)))
    got = merge(torch.stack(parts)).transpose(0, 1)[None]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a rank that sees no key of a query weighs nothing
    out, lse = partial_attention(q, k, v, torch.zeros(1, 1, 20, 50, dtype=torch.bool))
    assert torch.isinf(lse).all() and (out == 0).all()


@pytest.fixture(scope="module")
def llama(tiny_model):
    model_dir = tiny_model("llama", num_hidden_layers=2, max_position_embeddings=4096)
    return model_dir, reference_tokens(model_dir, PROMPTS, NEW)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["CP2", "TP2CP2", "CP2PP2"])
def test_greedy_tokens_match_transformers_with_chunked_prefill_and_prefix_caching(llama, layout):
    model_dir, want = llama
    # 512 tokens a step: the long prompts are prefilled in chunks, beside the short ones' decodes
    with LLM(model_dir, layout=layout, block_size=BLOCK, max_num_batched_tokens=512,
             enable_prefix_caching=True) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True), timeout_s=500)
    assert [o.token_ids for o in outs] == want
    assert outs[2].metrics["cached_tokens"] == 1200  # the shared prefix came from the cache


@pytest.mark.timeout(300)
def test_each_rank_holds_half_the_kv_bytes_of_a_long_sequence_at_cp2(llama):
    model_dir, _ = llama
    prompt = _prompt(2047, 5)  # 128 blocks of 16 once prefilled
    one = run_local(held_kv, 1, str(model_dir), "CP1", prompt, BLOCK, timeout_s=250)[0]
    two = run_local(held_kv, 2, str(model_dir), "CP2", prompt, BLOCK, timeout_s=250)
    assert one["blocks"] == 128 and one["here"] == 128 and one["written"] == 128
    for rank in two:
        assert rank["striped"] and rank["blocks"] == 128
        assert rank["here"] == rank["written"] == 64  # each rank wrote its own share, nothing else
        assert rank["held_bytes"] * 2 == one["held_bytes"]
        assert rank["cache_bytes"] < one["cache_bytes"]  # sized for its share of the sequence


@pytest.mark.timeout(300)
def test_a_sequence_one_rank_cannot_hold_runs_at_cp2_and_is_refused_at_cp1(llama):
    model_dir, want = llama
    # 100 blocks of 16 on each rank (1,600 tokens); the 2,906-token sequence needs 182 blocks, 91 a rank at cp 2
    opts = dict(block_size=BLOCK, num_blocks=100, max_model_len=len(LONG) + NEW)
    with pytest.raises(InputError, match="shard the sequence over context parallel ranks") as e:
        LLM(model_dir, layout="CP1", **opts)
    assert "\n" not in str(e.value)
    with LLM(model_dir, layout="CP2", **opts) as llm:
        outs = llm.generate([LONG], SamplingParams(max_tokens=NEW, ignore_eos=True), timeout_s=250)
    assert outs[0].token_ids == want[0]


@pytest.fixture(scope="module")
def moe(tiny_model):
    model_dir = tiny_model("qwen3_moe", num_hidden_layers=2, max_position_embeddings=4096)
    return model_dir, reference_tokens(model_dir, PROMPTS[:3], NEW)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["CP2", "TP2CP2", "CP2PP2"])
def test_a_tiny_qwen3_moe_matches_transformers(moe, layout):
    model_dir, want = moe
    with LLM(model_dir, layout=layout, block_size=BLOCK, max_num_batched_tokens=512) as llm:
        outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=NEW, ignore_eos=True), timeout_s=500)
    assert [o.token_ids for o in outs] == want


@pytest.mark.timeout(300)
def test_a_sliding_window_model_matches_transformers_at_cp2(tiny_model):
    """Masks by each key's position on its rank; the blocks the window has passed go back to
    both ranks' pools (engine.batch.scheduler._slide over a striped pool)."""
    model_dir = tiny_model("mistral", sliding_window=256, max_position_embeddings=4096, num_hidden_layers=2)
    prompts = [_prompt(700, 6), _prompt(90, 7)]
    want = reference_tokens(model_dir, prompts, 40)
    with LLM(model_dir, layout="CP2", block_size=BLOCK, max_num_batched_tokens=512) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), timeout_s=250)
    assert [o.token_ids for o in outs] == want


@pytest.mark.timeout(300)
def test_generate_with_cp_flag_matches_transformers(llama, tmp_path):
    """`atoll generate -cp 2` end to end: the flag, the local ranks, the results file."""
    model_dir, want = llama
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_token_ids": PROMPTS[i]}) + "\n" for i in (0, 1)))
    out = tmp_path / "out.jsonl"
    try:
        main(["generate", "--model", str(model_dir), "-cp", "2", "--prompts", str(prompts), "--output", str(out),
              "--max-new-tokens", str(NEW), "--ignore-eos", "--no-progress", "--block-size", str(BLOCK)])
    except SystemExit as e:
        assert not e.code
    got = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert got == {0: want[0], 1: want[1]}
