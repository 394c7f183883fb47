"""The CUDA-graph decode step's static buffers (engine.step.graphs), run on the CPU without capture:
the bucket choice, the padding rows and the fixed-width block tables give the eager step's
tokens and KV cache, under TP1, TP2 and PP2. The capture itself needs a GPU
(examples/gpu_check.sh); this proves everything around it."""

import pytest
from graph_fns import eager_then_graphed, graph_buffers
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.launch.local import run_local
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext

# max_num_seqs=4: buckets 1, 2, 4; decode batches of 4, 3 (bucket 4, one padding row), then
# 1 sequence (bucket 1). Under PP2 each lane decodes 2, then 1.
PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [250, 17]]
MAX_TOKENS = [3, 6, 6, 10]


def _runs(model_dir, layout):
    """transformers' tokens, and each rank's _eager_then_graphed for the layout."""
    expected = [t[:n] for t, n in zip(reference_tokens(model_dir, PROMPTS, max(MAX_TOKENS)), MAX_TOKENS)]
    llm = LLM(model_dir, layout=layout, max_num_seqs=4, block_size=4)
    requests = llm.prepare(PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    return expected, run_local(eager_then_graphed, llm.layout.world_size, llm.spec(requests), requests,
                               timeout_s=180)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout,run", [("TP1", [1, 4]), ("TP2", [1, 4]), ("PP2", [1, 2])])
def test_graph_buffers_give_eager_tokens(tiny_model, layout, run):
    expected, ranks = _runs(tiny_model("llama", num_hidden_layers=2), layout)
    for r in ranks:
        assert r["eager"] == expected and r["graphed"] == expected
        assert r["kv_diff"] < 1e-4  # padding rows wrote only the scratch block
        assert r["buckets"] == [1, 2, 4] and r["run"] == run


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["TP1", "TP2"])
def test_moe_graph_buffers_take_the_fixed_shape_exchange(tiny_model, layout):
    """A Qwen3-MoE's decode step through the graph buffers: its MoE layers run the fixed-shape
    exchange (static), with the eager step's and transformers' tokens (TP2: ep 2 over
    replicated tokens)."""
    expected, ranks = _runs(tiny_model("qwen3_moe", num_hidden_layers=2), layout)
    for r in ranks:
        assert r["eager"] == expected and r["graphed"] == expected
        assert r["kv_diff"] < 1e-4 and r["run"] == [1, 4]


def _graphed_verify(rank, world, spec, requests):
    """n-gram speculation with the graph buffers running every decode and verify step."""
    ctx = ParallelContext.create(Layout.parse(spec.layout), rank) if world > 1 else ParallelContext.single()
    runner = ModelRunner(spec, ctx)
    runner.decode_step = graph_buffers(runner, rank)
    results = run_batch(runner, requests)
    return {"tokens": [r["token_ids"] for r in results], "run": runner.decode_step.buckets_run,
            "accepted": sum(r["metrics"]["spec_accepted"] for r in results),
            "drafted": sum(r["metrics"]["spec_drafted"] for r in results), "held": runner.stats["blocks_held"]}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout", ["TP1", "TP2"])
def test_verify_steps_run_through_the_graph_buffers(tiny_model, layout):
    """A verify step of decoding sequences (a row per position) through the graph buffers, at
    buckets up to max_num_seqs x (1 + K) rows: transformers' tokens, drafts kept and rejected."""
    model_dir = tiny_model("llama", num_hidden_layers=2)
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [3, 4] * 7]  # repeats: n-gram drafts are made
    expected = reference_tokens(model_dir, prompts, 12)
    llm = LLM(model_dir, layout=layout, max_num_seqs=3, block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    requests = llm.prepare(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for r in run_local(_graphed_verify, llm.layout.world_size, llm.spec(requests), requests, timeout_s=180):
        assert r["tokens"] == expected
        assert 0 < r["accepted"] < r["drafted"] and r["held"] == 0
        assert max(r["run"]) > 3  # more rows than sequences: verify steps replayed a bucket
