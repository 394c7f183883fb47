"""EPLB in a running engine: transformers' greedy tokens across rebalances mid-generation
(weights moved between ranks while decoding, at EP2, EP4 and DP2EP2), the load reported per
layer, and the balance a rebalance reaches on a router skewed toward a quarter of its experts
(DeepSeek-V3, 16 experts, EP4, 4 redundant: atoll bench eplb's rounds)."""

import pytest
from reference import reference_cache, reference_tokens

from atoll import LLM, SamplingParams
from atoll.bench.eplb import rounds, skewed_moe
from atoll.launch.local import run_local

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8]]
NEW = 16
FAMILIES = {"qwen3_moe": ("qwen3_moe", dict(num_experts=8))}


@pytest.fixture(scope="module")
def references(tiny_model):
    return reference_cache(tiny_model, FAMILIES, PROMPTS, NEW)


def _expert_load(model_dir, expected, **options) -> dict:
    """Generate PROMPTS with these engine options, check transformers' tokens, and return the
    run's expert-load report."""
    llm = LLM(model_dir, **options)
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    try:
        outs = llm.generate_requests(requests, link_stats=True)
    finally:
        llm.close()
    assert [o["token_ids"] for o in outs] == expected
    return llm.links["expert_load"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout,redundant", [("EP2", 2), ("EP4", 4), ("DP2EP2", 2)])
def test_tokens_match_transformers_across_rebalances(references, layout, redundant):
    """A rebalance every 4 steps from a 4-step window: layers switch one a step while the
    sequences decode, every switch on new weights copied from the other ranks."""
    model_dir, expected = references("qwen3_moe")
    report = _expert_load(model_dir, expected, layout=layout, enable_eplb=True, num_redundant_experts=redundant,
                          eplb_step_interval=4, eplb_window_size=4, expert_load_interval=2)
    assert report["rebalances"] >= 3 and report["layers_moved"] >= 3 and report["moved_bytes"] > 0
    assert sorted(report["layers"]) == [0, 1, 2]
    ep = int(layout.split("EP")[1])
    assert all(len(v["tokens"]) == ep for v in report["layers"].values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["EP2", "DP2EP2", "TP4EP2", "EP2PP2"])
def test_every_routed_pair_is_counted_once(references, layout):
    """Without EPLB, the window over the whole run: each layer counted every (token, expert)
    pair the engine routed once, whether ep ranks route their own rows (DP2EP2), the stage's
    replicated rows (EP2 = TP2EP2), with experts split over moe_tp (TP4EP2: tp ranks route the
    same rows) or under PP."""
    model_dir, expected = references("qwen3_moe")
    report = _expert_load(model_dir, expected, layout=layout, expert_load_interval=0)
    pairs = (sum(map(len, PROMPTS)) + len(PROMPTS) * (NEW - 1)) * 2  # top-2
    assert {k: sum(v["tokens"]) for k, v in report["layers"].items()} == {0: pairs, 1: pairs, 2: pairs}
    assert report["rebalances"] == 0


# a tiny DeepSeek-V3 (MLA, sigmoid router, one dense layer then 2 MoE layers) with 16 experts
TINY_V3 = dict(vocab_size=301, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32,
               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256)


@pytest.mark.timeout(400)
def test_a_rebalance_evens_a_skewed_load_at_ep4(tmp_path):
    """Experts 5..8 (rank 1's in the initial placement) favoured by the router's correction
    bias: about 2.5x the mean load on rank 1 before, near even after, the same tokens as
    transformers in both rounds, and a quarter of the dispatch bytes off the busiest rank."""
    model_dir = skewed_moe(tmp_path / "skewed", experts=16, topk=4, skew=0.4, first=5, **TINY_V3)
    prompts = [[(17 * i + 5 * j) % 300 + 1 for j in range(24)] for i in range(6)]
    expected = reference_tokens(model_dir, prompts, 8)
    llm = LLM(model_dir, layout="EP4", enable_eplb=True, num_redundant_experts=4, eplb_step_interval=10**9,
              expert_load_interval=0, enable_prefix_caching=False, moe_exchange="alltoall", max_num_seqs=6)
    requests = llm.prepare(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    ranks = run_local(rounds, 4, llm.spec(requests), requests, timeout_s=300)
    first = ranks[0]
    assert all(r["same_tokens"] for r in ranks) and first["layers_moved"] == 2
    before, after = first["before"]["load"]["layers"], first["after"]["load"]["layers"]
    for layer in (1, 2):
        assert before[layer]["max_mean"] > 2.0 and after[layer]["max_mean"] < 1.15, (layer, before, after)
        assert max(before[layer]["tokens"]) == before[layer]["tokens"][1]
    assert max(first["after"]["dispatch_bytes"]) < 0.85 * max(first["before"]["dispatch_bytes"])
    pairs = (24 * 6 + 6 * 7) * 4  # prompt tokens and 7 decode steps of 6 sequences, top-4
    assert all(sum(v["tokens"]) == pairs for v in after.values())
    assert first["tokens"] == expected


def _counts_eager_then_graphed(rank, world, spec, requests):
    from atoll.engine.rank.loop import run_batch
    from atoll.engine.rank.runner import ModelRunner
    from atoll.engine.step.graphs import GraphedDecode
    from atoll.parallel.layout import Layout
    from atoll.parallel.mesh import ParallelContext

    ctx = ParallelContext.create(Layout.parse(spec.layout), rank) if world > 1 else ParallelContext.single()
    runner = ModelRunner(spec, ctx)
    out = []
    for graphed in (False, True):
        if graphed:
            runner.decode_step = GraphedDecode(runner.model, runner.cache, max_num_seqs=spec.engine.max_num_seqs,
                                               max_model_len=spec.max_model_len, block_size=spec.engine.block_size,
                                               scratch_block=runner.num_blocks, rank=rank, capture=False)
        runner.balancer.reset()
        tokens = [r["token_ids"] for r in run_batch(runner, requests)]
        report = runner.balancer.measure()
        out.append((tokens, report and {k: v["tokens"] for k, v in report["layers"].items()}))
    return {"eager": out[0], "graphed": out[1], "run": runner.decode_step.buckets_run}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["TP1", "TP2"])
def test_graph_buffers_count_real_rows_only(references, layout):
    """The CUDA-graph step's buffers (run without capture on the CPU): decode batches of 3
    sequences run at bucket 4, one padding row, which the counters leave out (static_exchange's
    real rows), so both steps count the same pairs per rank."""
    model_dir, expected = references("qwen3_moe")
    llm = LLM(model_dir, layout=layout, max_num_seqs=4, block_size=4, expert_load_interval=0)
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    first = run_local(_counts_eager_then_graphed, llm.layout.world_size, llm.spec(requests), requests,
                      timeout_s=200)[0]
    assert first["eager"][0] == first["graphed"][0] == expected and 4 in first["run"]
    assert first["graphed"][1] == first["eager"][1]
    pairs = (sum(map(len, PROMPTS)) + len(PROMPTS) * (NEW - 1)) * 2
    assert all(sum(v) == pairs for v in first["graphed"][1].values())
